"""A click-through-rate model in PyTorch whose embedding tables live on
pstrain's servers: one EmbeddingBag per categorical field (rows sharded over
the servers, created on first use, updated there with torch's sparse
Adagrad), concatenated with the dense features into a small MLP trained by
torch.optim.Adam, which the servers run too.

As pstrain workers (2 servers, 2 workers, on this machine):

    deploy/local/launch.sh --servers=2 --workers=2 --mode=sync \
        --python=worker/python/examples/ctr.py -- --steps=400

As one plain PyTorch process, the script a user starts from (nn.EmbeddingBag
with sparse gradients and torch.optim.Adagrad, the same global batch, data
and optimizers), the baseline the job is compared with:

    /usr/bin/python3 worker/python/examples/ctr.py --local --steps=400

With sync dense layers and async tables (each worker's rows applied on
arrival, the tables' pulls never waiting for the step), add
--table_consistency=async to the pstrain job: then the next batch's rows
are pulled while this one trains (EmbeddingBagCollection.prefetch; one step
older than a forward's own pull; --no_prefetch turns it off). As one rank of
DistributedDataParallel over gloo (the tables replicated on every rank, their
sparse gradients all-reduced), what a PyTorch user scales out with instead
(OMP_NUM_THREADS=1 as torchrun sets it for several ranks a host):

    OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 \
        WORLD_SIZE=2 /usr/bin/python3 worker/python/examples/ctr.py --ddp &
    OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=1 \
        WORLD_SIZE=2 /usr/bin/python3 worker/python/examples/ctr.py --ddp

DLRM (the model recommendation benchmarks run) on Criteo-shaped data, dense
layers sync and tables async, as pstrain workers:

    deploy/local/launch.sh --servers=2 --workers=2 --mode=sync \
        --python=worker/python/examples/ctr.py -- --model=dlrm \
        --criteo_shape --table_consistency=async --dim=16 --steps=400

The lines that differ are marked "pstrain:". Data: the C++ CTR worker's
synthetic stream, whose hidden ground truth says what AUC a perfect model
reaches. Prints a final JSON line with the held-out AUC beside it.
"""

import argparse
import time

import numpy as np
import torch
from torch import nn

import pstrain
import pstrain.data
import pstrain.torch


class Tables(nn.ModuleList):
    """One nn.EmbeddingBag per field, called with every field's bags at once
    (the interface of pstrain.torch.EmbeddingBagCollection)."""

    def forward(self, bags):
        return [table(ids, offsets) for table, (ids, offsets) in zip(self, bags)]


class CtrNet(nn.Module):
    def __init__(self, fields, num_fields, num_dense, dim):
        super().__init__()
        self.fields = fields
        self.mlp = nn.Sequential(nn.Linear(num_fields * dim + num_dense, 64),
                                 nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, bags):
        embedded = self.fields(bags)
        return self.mlp(torch.cat(embedded + [dense], dim=1)).squeeze(1)


class Dlrm(nn.Module):
    """DLRM (Naumov et al., 2019, arXiv:1906.00091): a bottom MLP takes the
    dense features to the embeddings' width; that vector and each field's
    pooled embedding interact pairwise by dot products; a top MLP scores the
    products beside the bottom vector."""

    def __init__(self, fields, num_fields, num_dense, dim):
        super().__init__()
        self.fields = fields
        self.bottom = nn.Sequential(nn.Linear(num_dense, 64), nn.ReLU(),
                                    nn.Linear(64, dim), nn.ReLU())
        n = num_fields + 1
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 128),
                                 nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                 nn.Linear(64, 1))
        self._pairs = torch.triu_indices(n, n, offset=1)  # not a buffer

    def forward(self, dense, bags):
        x = self.bottom(dense)
        vectors = torch.stack([x] + self.fields(bags), dim=1)  # [B, n, dim]
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        pairs = products[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


class Rows:
    """The one process's hashed ids -> table rows (nn.EmbeddingBag needs
    rows 0..N-1; pstrain's tables take the 64-bit ids as they are)."""

    def __init__(self, *datasets):
        self.ids = torch.from_numpy(np.unique(np.concatenate(
            [d.ids for d in datasets])))

    def __len__(self):
        return len(self.ids)

    def __call__(self, bags):
        return [(torch.searchsorted(self.ids, ids), offsets)
                for ids, offsets in bags]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["ctr", "dlrm"], default="ctr",
                        help="ctr: embeddings beside the dense features into "
                        "an MLP; dlrm: DLRM's dot-product interactions")
    parser.add_argument("--criteo_shape", action="store_true",
                        help="26 fields with the Criteo Kaggle set's numbers "
                        "of values (3 to 10 million) and 13 dense features, "
                        "in place of --fields, --vocab and --dense")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--global_batch_size", type=int, default=256,
                        help="the job's, shared by the workers")
    parser.add_argument("--fields", type=int, default=4)
    parser.add_argument("--dense", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--sparse_lr", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--test_examples", type=int, default=20000)
    parser.add_argument("--local", action="store_true",
                        help="one plain PyTorch process")
    parser.add_argument("--ddp", action="store_true",
                        help="one rank of DistributedDataParallel over gloo "
                        "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    parser.add_argument("--table_consistency", choices=["async"],
                        default=None,
                        help="pstrain: the tables' mode (default: the "
                        "servers' --mode)")
    parser.add_argument("--no_prefetch", action="store_true",
                        help="pstrain, async tables: each forward pulls its "
                        "own rows (by default the next batch's are pulled "
                        "while this one trains)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)

    field_vocab = None
    if args.criteo_shape:
        field_vocab = pstrain.data.CRITEO_KAGGLE_CARDINALITIES
        args.fields, args.dense = len(field_vocab), 13
    shape = dict(num_dense=args.dense, num_fields=args.fields,
                 vocab_per_field=args.vocab, field_vocab=field_vocab)
    train = pstrain.data.CtrData(args.steps * args.global_batch_size, **shape)
    test = pstrain.data.CtrData(
        args.test_examples, first_index=args.steps * args.global_batch_size,
        **shape)
    if args.local and args.ddp:
        parser.error("--local and --ddp are two different baselines")
    plain_torch = args.local or args.ddp
    if plain_torch:
        rows = Rows(train, test)
        tables = Tables(nn.EmbeddingBag(len(rows), args.dim, mode="mean",
                                        sparse=True) for _ in range(args.fields))
        for table in tables:
            nn.init.normal_(table.weight, std=0.01)
        sparse_optimizer = torch.optim.Adagrad(
            [t.weight for t in tables], lr=args.sparse_lr)
    else:
        rows = lambda bags: bags  # noqa: E731 (pstrain: ids as they are)
        # pstrain: rows on the servers, every table's pulled in one round trip
        tables = pstrain.torch.EmbeddingBagCollection(
            pstrain.torch.EmbeddingBag(
                None, args.dim, mode="mean", optimizer="adagrad",
                lr=args.sparse_lr, init_std=0.01,
                consistency=args.table_consistency)
            for _ in range(args.fields))
    network = Dlrm if args.model == "dlrm" else CtrNet
    model = network(tables, args.fields, args.dense, args.dim)
    optimizer = torch.optim.Adam(
        [p for name, p in model.named_parameters()
         if not name.startswith("fields.")], lr=args.lr)
    net = model
    if args.local:
        worker_id, num_workers, mode, start_step = 0, 1, "local", 0
    elif args.ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        worker_id, num_workers = dist.get_rank(), dist.get_world_size()
        mode, start_step = "ddp", 0
        net = nn.parallel.DistributedDataParallel(model)
    else:
        # pstrain: join the job; the servers run this optimizer
        ps = pstrain.torch.ParameterServer(model, optimizer=optimizer)
        worker_id, num_workers = ps.worker_id, ps.num_workers
        mode, start_step = ps.mode, ps.step_count

    # Worker k takes the k-th slice of each global batch of the stream.
    batch_size = args.global_batch_size // num_workers

    def load(step):
        first = step * args.global_batch_size + worker_id * batch_size
        return train.batch(np.arange(first, first + batch_size))

    # pstrain: async tables' rows for the next batch come while this one
    # trains (a table whose pulls wait for the step cannot be pulled ahead)
    prefetch = not plain_torch and not args.no_prefetch and (
        (args.table_consistency or mode) == "async")
    start = time.time()
    batch = load(start_step) if start_step < args.steps else None
    loss = None  # a job resumed after its last step runs none
    for step in range(start_step, args.steps):
        dense, labels, bags = batch
        if step + 1 < args.steps:
            batch = load(step + 1)
            if prefetch:
                tables.prefetch(batch[2])  # pstrain: the next batch's rows
        loss = nn.functional.binary_cross_entropy_with_logits(
            net(dense, rows(bags)), labels)
        loss.backward()
        if plain_torch:
            optimizer.step()
            sparse_optimizer.step()
            optimizer.zero_grad()
            sparse_optimizer.zero_grad()
        else:
            ps.step()  # pstrain: push the gradients, pull the new model
    wall = time.time() - start
    final_model = mode if plain_torch else ps.finish()  # pstrain: done
    lane_s, lane_wait_s = (0.0, 0.0) if plain_torch else \
        ps.table_lane_seconds()

    model.eval()
    with torch.no_grad():
        scores = torch.cat([
            model(dense, rows(bags)) for dense, _, bags in (
                test.batch(np.arange(i, min(i + 1000, test.size)))
                for i in range(0, test.size, 1000))]).numpy()
    pstrain.print_final(
        model=args.model, mode=mode, worker_id=worker_id, num_workers=num_workers,
        steps=args.steps, steps_run=args.steps - start_step,
        final_model=final_model,
        auc=round(pstrain.data.auc(test.labels, scores), 4),
        true_auc=round(pstrain.data.auc(test.labels,
                                        test.true_probabilities), 4),
        final_loss=None if loss is None else round(loss.item(), 6),
        test_examples=test.size,
        samples_per_sec=round((args.steps - start_step) * batch_size
                              / max(wall, 1e-9), 1),
        table_lane_s=round(lane_s, 3), table_lane_wait_s=round(lane_wait_s, 3),
        wall_time_s=round(wall, 3))
    if args.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
