"""A PyTorch CNN with BatchNorm and Dropout on Fashion-MNIST, trained on
pstrain's parameter servers.

As a pstrain worker (2 servers, 2 workers, on this machine):

    deploy/local/launch.sh --servers=2 --workers=2 --mode=sync \
        --python=worker/python/examples/fashion_mnist_cnn.py -- --epochs=2

As one plain PyTorch process, with the same model, data order and optimizer
(torch.optim.Adam, lr 0.001, which the servers run in the job), the
baseline the job is compared with:

    /usr/bin/python3 worker/python/examples/fashion_mnist_cnn.py --local --epochs=2

The lines that differ are marked "pstrain:" below. Prints a final JSON
line ({"event": "final", ...}) with the held-out accuracy of the job's final
model.
"""

import argparse
import time

import torch
from torch import nn

import pstrain
import pstrain.data
import pstrain.torch


class Net(nn.Module):
    def __init__(self, dropout=0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(64 * 7 * 7, 128),
            nn.ReLU(), nn.Dropout(dropout), nn.Linear(128, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def label_smoothed_loss(logits, labels, smoothing=0.05):
    """A custom loss: cross-entropy with label smoothing, by hand."""
    log_probs = torch.log_softmax(logits, dim=1)
    nll = -log_probs.gather(1, labels[:, None]).squeeze(1)
    return ((1 - smoothing) * nll - smoothing * log_probs.mean(1)).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--global_batch_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process")
    parser.add_argument("--local", action="store_true",
                        help="one plain PyTorch process")
    parser.add_argument("--lr", type=float, default=0.001, help="Adam's")
    parser.add_argument("--test_examples", type=int, default=10000,
                        help="held-out images evaluated (the first ones)")
    parser.add_argument("--device", default="auto",
                        help="where the model trains: cpu, cuda, cuda:N, or "
                        "auto (cuda when torch sees a GPU)")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Net().to(device)  # before ParameterServer: it registers in place

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.local:
        worker_id, num_workers = 0, 1
        mode, start_step = "local", 0
    else:
        # pstrain: join the job; the servers run this optimizer
        ps = pstrain.torch.ParameterServer(model, optimizer=optimizer)
        worker_id, num_workers = ps.worker_id, ps.num_workers
        mode, start_step = ps.mode, ps.step_count

    batches = pstrain.data.Batches(
        pstrain.data.fashion_mnist(), args.global_batch_size // num_workers,
        worker_id, num_workers, seed=args.seed, shape=(1, 28, 28))
    steps = int(args.epochs * batches.steps_per_epoch)
    model.train()
    start = time.time()
    loss = None  # a job resumed after its last step runs none
    for step in range(start_step, steps):
        # Dropout's masks a function of (worker, step): a job resumed from
        # the servers' checkpoints, or a worker restarted, draws what the
        # uninterrupted job drew.
        torch.manual_seed((args.seed * 1000003 + step) * num_workers
                          + worker_id)
        x, y = batches.batch(step)
        loss = label_smoothed_loss(model(x.to(device)), y.to(device))
        loss.backward()
        if args.local:
            optimizer.step()
            optimizer.zero_grad()
        else:
            ps.step()  # pstrain: push the gradients, pull the new model
    wall = time.time() - start
    final_model = "local" if args.local else ps.finish()  # pstrain: done

    test_loss, test_accuracy = pstrain.data.evaluate(
        model, pstrain.data.fashion_mnist(train=False), shape=(1, 28, 28),
        limit=args.test_examples)
    pstrain.print_final(
        model="cnn", device=str(device), mode=mode, worker_id=worker_id, num_workers=num_workers,
        steps=steps, steps_run=steps - start_step, start_step=start_step,
        epochs=round(steps / batches.steps_per_epoch, 3),
        final_loss=None if loss is None else round(loss.item(), 6),
        test_loss=round(test_loss, 6),
        test_accuracy=round(test_accuracy, 4),
        test_examples=min(args.test_examples, 10000),
        final_model=final_model,
        samples_per_sec=round((steps - start_step) * batches.batch_size
                              / max(wall, 1e-9), 1),
        wall_time_s=round(wall, 3),
        steps_short=0 if args.local or ps.mode != "sync" else ps.steps_short())


if __name__ == "__main__":
    main()
