"""A click-through-rate model in PyTorch whose embedding tables live on
pstrain's servers: one EmbeddingBag per categorical field (rows sharded over
the servers, created on first use, updated by the servers' sparse
optimizer), concatenated with the dense features into a small MLP.

    deploy/local/launch.sh --servers=2 --workers=2 --mode=async \
        --python=worker/python/examples/ctr.py -- \
        --server.optimizer=adam --server.learning_rate=0.01 --steps=400

Data: the C++ CTR worker's synthetic stream, whose hidden ground truth says
what AUC a perfect model reaches. Prints a final JSON line with the
held-out AUC beside it.
"""

import argparse
import time

import numpy as np
import torch
from torch import nn

import pstrain
import pstrain.data
import pstrain.torch


class CtrNet(nn.Module):
    def __init__(self, num_fields, num_dense, dim, lr):
        super().__init__()
        self.fields = nn.ModuleList(
            pstrain.torch.EmbeddingBag(None, dim, mode="mean",
                                       optimizer="adagrad", lr=lr,
                                       init_std=0.01)
            for _ in range(num_fields))
        self.mlp = nn.Sequential(nn.Linear(num_fields * dim + num_dense, 64),
                                 nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, bags):
        embedded = [table(ids, offsets)
                    for table, (ids, offsets) in zip(self.fields, bags)]
        return self.mlp(torch.cat(embedded + [dense], dim=1)).squeeze(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch_size", type=int, default=128,
                        help="per worker")
    parser.add_argument("--fields", type=int, default=4)
    parser.add_argument("--dense", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--sparse_lr", type=float, default=0.1)
    parser.add_argument("--test_examples", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = CtrNet(args.fields, args.dense, args.dim, args.sparse_lr)
    ps = pstrain.torch.ParameterServer(model)

    # Worker k takes the k-th slice of each global batch of the stream.
    global_batch = args.batch_size * ps.num_workers
    train = pstrain.data.CtrData(args.steps * global_batch,
                                 num_dense=args.dense, num_fields=args.fields,
                                 vocab_per_field=args.vocab)
    start = time.time()
    for step in range(ps.step_count, args.steps):
        first = step * global_batch + ps.worker_id * args.batch_size
        dense, labels, bags = train.batch(
            np.arange(first, first + args.batch_size))
        loss = nn.functional.binary_cross_entropy_with_logits(
            model(dense, bags), labels)
        loss.backward()
        ps.step()
    wall = time.time() - start
    how = ps.finish()

    test = pstrain.data.CtrData(args.test_examples,
                                first_index=args.steps * global_batch,
                                num_dense=args.dense, num_fields=args.fields,
                                vocab_per_field=args.vocab)
    model.eval()
    with torch.no_grad():
        scores = torch.cat([
            model(*(lambda d, _, b: (d, b))(*test.batch(
                np.arange(i, min(i + 1000, test.size)))))
            for i in range(0, test.size, 1000)]).numpy()
    pstrain.print_final(
        model="ctr", mode=ps.mode, worker_id=ps.worker_id,
        num_workers=ps.num_workers, steps=args.steps,
        steps_run=args.steps - ps.start_step, final_model=how,
        auc=round(pstrain.data.auc(test.labels, scores), 4),
        true_auc=round(pstrain.data.auc(test.labels,
                                        test.true_probabilities), 4),
        final_loss=round(loss.item(), 6), test_examples=test.size,
        samples_per_sec=round((args.steps - ps.start_step) * args.batch_size
                              / max(wall, 1e-9), 1))


if __name__ == "__main__":
    main()
