"""Sparse embeddings from PyTorch: pstrain.torch.EmbeddingBag, whose rows
live on the servers and are updated there, trains exactly like a local
nn.EmbeddingBag with the same optimizer on one worker (to 1e-5)."""

import unittest

import numpy as np
import torch

# First: the installed package (cluster re-runs this test in its venv).
from tests.python import cluster
import pstrain
import pstrain.torch

VOCAB, DIM, BAG, BATCH, STEPS, LR = 50, 4, 3, 16, 20, 0.1


class Net(torch.nn.Module):
    """`twice`: the table is called on two overlapping slices of each bag,
    so a step's rows come from two forwards and share ids."""

    def __init__(self, table, twice=False):
        super().__init__()
        self.table = table
        self.twice = twice
        torch.manual_seed(4)
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        if self.twice:
            return self.out(self.table(ids[:, :2]) +
                            self.table(ids[:, 1:])).squeeze(1)
        return self.out(self.table(ids)).squeeze(1)


def batches():
    random = np.random.RandomState(9)
    for _ in range(STEPS):
        ids = torch.from_numpy(random.randint(0, VOCAB, (BATCH, BAG)))
        labels = torch.from_numpy(random.randint(0, 2, BATCH).astype(np.float32))
        yield ids, labels


class TorchEmbeddingTest(unittest.TestCase):

    def check(self, sparse_optimizer, consistency=None, twice=False):
        with cluster.Cluster(num_shards=2, num_workers=1,
                             flags=["--optimizer=sgd",
                                    f"--learning_rate={LR}"]) as c:
            model = Net(pstrain.torch.EmbeddingBag(
                VOCAB, DIM, mode="mean", optimizer=sparse_optimizer, lr=LR,
                initial_accumulator=0.1, consistency=consistency), twice)
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            every_id = np.arange(VOCAB, dtype=np.uint64)
            initial = np.zeros((VOCAB, DIM), np.float32)
            ps.client.pull_sparse(0, 0, every_id, initial)

            # The same model held locally, from the same initial values.
            local = Net(torch.nn.EmbeddingBag(VOCAB, DIM, mode="mean"), twice)
            local.table.weight.data.copy_(torch.from_numpy(initial))
            if sparse_optimizer == "sgd":
                sparse = torch.optim.SGD(local.table.parameters(), lr=LR)
            else:
                sparse = torch.optim.Adagrad(local.table.parameters(), lr=LR,
                                             initial_accumulator_value=0.1,
                                             eps=0)
            dense = torch.optim.SGD(local.out.parameters(), lr=LR)

            for ids, labels in batches():
                loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
                loss_fn(model(ids), labels).backward()
                ps.step()
                loss_fn(local(ids), labels).backward()
                for opt in (sparse, dense):
                    opt.step()
                    opt.zero_grad()

            rows = np.zeros((VOCAB, DIM), np.float32)
            ps.client.pull_sparse(0, STEPS, every_id, rows)
            tables = [s["sparse"][0] for s in c.stats()]
        trained = torch.from_numpy(rows)
        self.assertLessEqual(
            (trained - local.table.weight.data).abs().max().item(), 1e-5)
        self.assertGreater(
            (trained - torch.from_numpy(initial)).abs().max().item(), 1e-3)
        for name in ("weight", "bias"):
            self.assertLessEqual(
                (getattr(model.out, name) - getattr(local.out, name))
                .abs().max().item(), 1e-5)
        return tables

    def test_sgd(self):
        self.check("sgd")

    def test_adagrad(self):
        self.check("adagrad")

    def test_a_table_called_twice_in_a_step_pushes_the_summed_gradient(self):
        self.check("adagrad", twice=True)

    def test_an_async_table_under_sync_servers(self):
        # One worker: async rows are the sync ones, so the same equivalence
        # holds; the servers run the table async, outside the dense step.
        for table in self.check("adagrad", consistency="async"):
            self.assertEqual(table["mode"], "async")
            self.assertEqual(int(table.get("version", 0)), 0)
            self.assertGreater(int(table["rows_pushed"]), 0)

    def test_a_collection_pulls_every_table_as_each_would_alone(self):
        # Two tables in an EmbeddingBagCollection (one round trip) against
        # two local nn.EmbeddingBag tables: the same model after training.
        class Pair(torch.nn.Module):
            def __init__(self, fields, local):
                super().__init__()
                self.fields, self.local = fields, local
                torch.manual_seed(4)
                self.out = torch.nn.Linear(2 * DIM, 1)

            def forward(self, ids):
                bags = [(ids[:, :2], None), (ids[:, 1:], None)]
                if self.local:
                    pooled = [t(i) for t, (i, _) in zip(self.fields, bags)]
                else:
                    pooled = self.fields(bags)
                return self.out(torch.cat(pooled, dim=1)).squeeze(1)

        with cluster.Cluster(num_shards=2, num_workers=1,
                             flags=["--optimizer=sgd",
                                    f"--learning_rate={LR}"]) as c:
            model = Pair(pstrain.torch.EmbeddingBagCollection(
                pstrain.torch.EmbeddingBag(VOCAB, DIM, mode="sum",
                                           optimizer="sgd", lr=LR)
                for _ in range(2)), local=False)
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            every_id = np.arange(VOCAB, dtype=np.uint64)
            local = Pair(torch.nn.ModuleList(
                torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum")
                for _ in range(2)), local=True)
            for t, table in enumerate(local.fields):
                initial = np.zeros((VOCAB, DIM), np.float32)
                ps.client.pull_sparse(t, 0, every_id, initial)
                table.weight.data.copy_(torch.from_numpy(initial))
            opt = torch.optim.SGD(local.parameters(), lr=LR)
            loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
            for ids, labels in batches():
                loss_fn(model(ids), labels).backward()
                ps.step()
                loss_fn(local(ids), labels).backward()
                opt.step()
                opt.zero_grad()
            for t, table in enumerate(local.fields):
                rows = np.zeros((VOCAB, DIM), np.float32)
                ps.client.pull_sparse(t, STEPS, every_id, rows)
                self.assertLessEqual(
                    (torch.from_numpy(rows) - table.weight.data)
                    .abs().max().item(), 1e-5)
        with self.assertRaisesRegex(TypeError, "holds pstrain.torch"):
            pstrain.torch.EmbeddingBagCollection([torch.nn.Linear(2, 2)])

    def test_a_byte_budget_bounds_the_rows_each_server_holds(self):
        # 2000 bytes a server holds a dozen rows of dim 4 with Adagrad (the
        # servers log the exact count); the batches touch every one of the
        # 50 ids, 25 a server.
        with cluster.Cluster(num_shards=2, num_workers=1) as c:
            model = Net(pstrain.torch.EmbeddingBag(VOCAB, DIM,
                                                   max_bytes=2000))
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            for ids, labels in batches():
                torch.nn.functional.binary_cross_entropy_with_logits(
                    model(ids), labels).backward()
                ps.step()
            ps.finish()
            tables = [s["sparse"][0] for s in c.stats()]
            logs = [c.server_log(shard) for shard in range(2)]
        for table, log in zip(tables, logs):
            rows = int(table["rows"])
            self.assertRegex(log, r"memory: dense .*; table 'table.weight' "
                             r"up to 0.0 MiB \(\d+ rows of up to \d+ bytes\)")
            self.assertGreater(rows, 0)
            self.assertLess(rows, 25)  # bounded: not every id it saw
            self.assertGreater(int(table["rows_evicted"]), 0)
            self.assertLessEqual(int(table["memory_bytes"]), 2000 + 8192)


if __name__ == "__main__":
    cluster.main()
