"""The sync contract from PyTorch: W Python workers with batch b, on servers
running SGD or Adam, end with the parameters of one torch process with batch
W*b and the same optimizer (torch.optim) on the same samples, to 1e-5."""

import os
import unittest

import torch

# First: the installed package (cluster re-runs this test in its venv).
from tests.python import cluster
import pstrain.data
from tests.python import train_worker

STEPS, BATCH = 40, 16
WORKER = os.path.join(cluster.HERE, "train_worker.py")


def single_process(optimizer, global_batch, lr):
    model = train_worker.make_model("mlp", seed=3)
    batches = pstrain.data.Batches(train_worker.examples(), global_batch, 0, 1,
                                   seed=5)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(STEPS):
        x, y = train_worker.batch(batches, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def max_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


class TorchSyncEquivalenceTest(unittest.TestCase):

    def check(self, workers, optimizer, lr):
        flags = [f"--optimizer={optimizer}", f"--learning_rate={lr}"]
        with cluster.Cluster(num_shards=2, num_workers=workers,
                             flags=flags) as c:
            finals = c.run_workers(WORKER, lambda k: [
                f"--steps={STEPS}", f"--batch={BATCH}", f"--out={c.dir}",
                # Each worker's own model differs: the job's is worker 0's.
                f"--seed={3 + k}"])
            job = torch.load(os.path.join(c.dir, "worker0.pt"))
            other = torch.load(os.path.join(c.dir, f"worker{workers - 1}.pt"))
        for final in finals:
            self.assertEqual(final["steps_run"], STEPS)
        reference = single_process(optimizer, workers * BATCH, lr)
        difference = max_difference(job, reference)
        print(f"{optimizer}, {workers} workers on {train_worker.device()}: "
              f"max |difference| {difference:.2e}")
        self.assertLessEqual(difference, 1e-5)
        self.assertEqual(max_difference(job, other), 0)  # one final model
        # Not vacuous: training moved the weights far beyond the tolerance.
        initial = train_worker.make_model("mlp", seed=3).state_dict()
        self.assertGreater(max_difference(reference, initial), 1e-2)

    def test_two_workers_sgd(self):
        self.check(2, "sgd", 0.2)

    def test_three_workers_adam(self):
        self.check(3, "adam", 0.01)

    def test_two_workers_adam(self):
        self.check(2, "adam", 0.01)

    def test_three_workers_sgd(self):
        self.check(3, "sgd", 0.2)


if __name__ == "__main__":
    cluster.main()
