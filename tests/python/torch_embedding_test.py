"""Sparse embeddings from PyTorch: pstrain.torch.EmbeddingBag, whose rows
live on the servers and are updated there, trains exactly like a local
nn.EmbeddingBag with the same optimizer on one worker (to 1e-5)."""

import unittest
import warnings

import numpy as np
import torch

# First: the installed package (cluster re-runs this test in its venv).
from tests.python import cluster
import pstrain
import pstrain.data
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
        # One mode: the collection pools both tables in one embedding_bag
        # (2-D ids beside 1-D ids with offsets); two modes: one call each.
        for modes in (("sum", "sum"), ("sum", "mean")):
            with self.subTest(modes=modes):
                self.check_collection(modes)

    def check_collection(self, modes):
        offsets = torch.arange(0, 2 * BATCH, 2)

        class Pair(torch.nn.Module):
            def __init__(self, fields, local):
                super().__init__()
                self.fields, self.local = fields, local
                torch.manual_seed(4)
                self.out = torch.nn.Linear(2 * DIM, 1)

            def forward(self, ids):
                bags = [(ids[:, :2], None),
                        (ids[:, 1:].reshape(-1), offsets)]
                if self.local:
                    pooled = [t(i, o) for t, (i, o) in zip(self.fields, bags)]
                else:
                    pooled = self.fields(bags)
                return self.out(torch.cat(pooled, dim=1)).squeeze(1)

        with cluster.Cluster(num_shards=2, num_workers=1,
                             flags=["--optimizer=sgd",
                                    f"--learning_rate={LR}"]) as c:
            model = Pair(pstrain.torch.EmbeddingBagCollection(
                pstrain.torch.EmbeddingBag(VOCAB, DIM, mode=mode,
                                           optimizer="sgd", lr=LR)
                for mode in modes), local=False)
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            every_id = np.arange(VOCAB, dtype=np.uint64)
            local = Pair(torch.nn.ModuleList(
                torch.nn.EmbeddingBag(VOCAB, DIM, mode=mode)
                for mode in modes), local=True)
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

    def test_a_collection_checks_what_it_is_given(self):
        with self.assertRaisesRegex(TypeError, "holds pstrain.torch"):
            pstrain.torch.EmbeddingBagCollection([torch.nn.Linear(2, 2)])

    def test_prefetched_rows_are_one_step_older_and_pulled_once(self):
        # An async table whose next batch's rows are pulled while this one
        # trains (EmbeddingBagCollection.prefetch): batch n trains on the
        # rows after n - 1 updates (the lane pulls them before step n - 1's
        # rows go out), batch 0 on the initial ones. A local model run with
        # exactly that lag ends on the same rows and layer (to 1e-5); each
        # batch's ids are pulled once (the forward takes the prefetch).
        class Bags(torch.nn.Module):
            def __init__(self, fields):
                super().__init__()
                self.fields = fields
                torch.manual_seed(4)
                self.out = torch.nn.Linear(DIM, 1)

            def forward(self, ids):
                return self.out(self.fields([(ids, None)])[0]).squeeze(1)

        data = list(batches())
        with cluster.Cluster(num_shards=2, num_workers=1,
                             flags=["--optimizer=sgd",
                                    f"--learning_rate={LR}"]) as c:
            model = Bags(pstrain.torch.EmbeddingBagCollection([
                pstrain.torch.EmbeddingBag(VOCAB, DIM, optimizer="sgd", lr=LR,
                                           consistency="async")]))
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            every_id = np.arange(VOCAB, dtype=np.uint64)
            initial = np.zeros((VOCAB, DIM), np.float32)
            ps.client.pull_sparse(0, 0, every_id, initial)
            pulled_before = int(c.stats()[0]["sparse"][0]["rows_pulled"]) + \
                int(c.stats()[1]["sparse"][0]["rows_pulled"])
            loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
            for n, (ids, labels) in enumerate(data):
                if n + 1 < len(data):
                    model.fields.prefetch([(data[n + 1][0], None)])
                loss_fn(model(ids), labels).backward()
                ps.step()
            self.assertEqual(ps.finish(), "sync_step")
            busy_s, _ = ps.table_lane_seconds()
            self.assertGreater(busy_s, 0)
            pulled = sum(int(s["sparse"][0]["rows_pulled"])
                         for s in c.stats()) - pulled_before
            observer = pstrain.Client(c.hosts)
            observer.register(ps.schema, 1, -1)
            rows = np.zeros((VOCAB, DIM), np.float32)
            observer.pull_sparse(0, STEPS, every_id, rows)
        self.assertEqual(pulled, sum(len(np.unique(ids.numpy()))
                                     for ids, _ in data))

        weights = [torch.from_numpy(initial.copy())]  # after 0, 1, ... updates
        out = Bags(None).out
        dense = torch.optim.SGD(out.parameters(), lr=LR)
        for n, (ids, labels) in enumerate(data):
            rows_used = weights[max(n - 1, 0)].clone().requires_grad_(True)
            pooled = torch.nn.functional.embedding_bag(ids, rows_used,
                                                       mode="mean")
            loss_fn(out(pooled).squeeze(1), labels).backward()
            weights.append(weights[-1] - LR * rows_used.grad)
            dense.step()
            dense.zero_grad()
        self.assertLessEqual(
            (torch.from_numpy(rows) - weights[-1]).abs().max().item(), 1e-5)
        self.assertGreater(
            (weights[-1] - weights[0]).abs().max().item(), 1e-3)
        for name in ("weight", "bias"):
            self.assertLessEqual((getattr(model.out, name) - getattr(out, name))
                                 .abs().max().item(), 1e-5)

    def test_prefetch_refuses_what_it_cannot_pull_ahead(self):
        with cluster.Cluster(num_shards=2, num_workers=1) as c:
            sync_fields = pstrain.torch.EmbeddingBagCollection(
                [pstrain.torch.EmbeddingBag(VOCAB, DIM)])
            async_fields = pstrain.torch.EmbeddingBagCollection(
                [pstrain.torch.EmbeddingBag(VOCAB, DIM, consistency="async")])
            model = torch.nn.ModuleDict({"s": sync_fields, "a": async_fields,
                                         "out": torch.nn.Linear(DIM, 1)})
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            ids = [torch.tensor([[1, 2], [3, 4 + i]]) for i in range(4)]
            with self.assertRaisesRegex(ValueError, "is sync, and its pulls "
                                        "wait for the step"):
                sync_fields.prefetch([(ids[0], None)])
            with self.assertRaisesRegex(ValueError,
                                        "2 .ids, offsets. pairs for 1 tables"):
                async_fields.prefetch([(ids[0], None)] * 2)
            before = sum(int(s["sparse"][1]["rows_pulled"]) for s in c.stats())
            async_fields.prefetch([(ids[0], None)])
            async_fields.prefetch([(ids[1], None)])
            with self.assertRaisesRegex(RuntimeError, "two batches are pulled "
                                        "ahead already"):
                async_fields.prefetch([(ids[2], None)])
            # Bags not pulled ahead: pulled by the forward (after the lane's
            # pulls), the others kept.
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                async_fields([(ids[3], None)])
            after = sum(int(s["sparse"][1]["rows_pulled"]) for s in c.stats())
            self.assertEqual(after - before, 4 + 4 + 4)  # ids 0, 1, 3
            # The second batch pulled ahead: the first, skipped, is dropped.
            with self.assertWarnsRegex(RuntimeWarning, "1 batch"):
                pooled = async_fields([(ids[1], None)])
            self.assertEqual(list(pooled[0].shape), [2, DIM])
            # Ids written to after their prefetch: pulled again.
            async_fields.prefetch([(ids[2], None)])
            ids[2][0, 0] = 7
            with self.assertWarnsRegex(RuntimeWarning, "written to since"):
                async_fields([(ids[2], None)])
            ps.finish()
            with self.assertRaisesRegex(RuntimeError, "after finish"):
                async_fields.prefetch([(ids[0], None)])

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


class CtrDataTest(unittest.TestCase):
    """pstrain.data.CtrData's arrays are the generator's own memory, handed
    over without a copy: they must stay valid as long as any of them is
    referenced, and hold what the generator made."""

    def test_the_arrays_outlive_the_call_and_everything_else(self):
        shape = dict(num_dense=13, num_fields=26,
                     field_vocab=pstrain.data.CRITEO_KAGGLE_CARDINALITIES)
        data = pstrain.data.CtrData(3000, first_index=7, **shape)
        ids = data.ids
        expected = ids.copy()
        offsets = data.offsets.copy()
        self.assertEqual(len(ids), offsets[-1])
        del data
        # Memory freed too early would be reused by these.
        filler = [np.full(len(expected), 7, np.int64) for _ in range(20)]
        np.testing.assert_array_equal(ids, expected)
        del filler
        # Another call for the same examples makes the same bits; the
        # probabilities are the truth's (in (0, 1)), one per example.
        again = pstrain.data.CtrData(3000, first_index=7, **shape)
        np.testing.assert_array_equal(again.ids, expected)
        np.testing.assert_array_equal(again.offsets, offsets)
        self.assertEqual(again.true_probabilities.shape, (3000,))
        self.assertTrue(((again.true_probabilities > 0) &
                         (again.true_probabilities < 1)).all())
        self.assertEqual(again.dense.shape, (3000, 13))
        # A batch's bags are the examples' own ids.
        dense, labels, bags = again.batch(np.array([5, 0, 2999]))
        for f, (field_ids, field_offsets) in enumerate(bags):
            first = offsets[5 * 26 + f]
            np.testing.assert_array_equal(
                field_ids[:field_offsets[1]].numpy(),
                expected[first:offsets[5 * 26 + f + 1]])
        empty = pstrain.data.CtrData(0, **shape)
        self.assertEqual(len(empty.ids), 0)
        self.assertEqual(list(empty.offsets), [0])


if __name__ == "__main__":
    cluster.main()
