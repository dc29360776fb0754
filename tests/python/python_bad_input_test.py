"""Bad input from Python gets a clear exception naming the tensor, table or
option, and leaves the servers as they were (every case against real
servers, whose Stats are compared before and after)."""

import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
import warnings

import numpy as np
import torch

# First: the installed package (cluster re-runs this test in its venv).
from tests.python import cluster
import pstrain
import pstrain.torch


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                               torch.nn.Linear(3, 2))


def fingerprint(stats):
    """What a refused request must not change."""
    return [(int(s["version"]), int(s["blocks_applied"]),
             int(s["blocks_duplicate"]), int(s["num_elements"])) for s in stats]


class BadInputTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.cluster = cluster.Cluster(num_shards=2, num_workers=1,
                                      flags=["--optimizer=sgd",
                                             "--learning_rate=0.1"])
        cls.model = mlp()
        cls.ps = pstrain.torch.ParameterServer(
            cls.model, hosts=cls.cluster.hosts, worker_id=0, num_workers=1)
        x = torch.ones(2, 4)
        cls.model(x).sum().backward()
        cls.ps.step()  # one real step, so the state compared is not empty

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()

    def setUp(self):
        self.before = fingerprint(self.cluster.stats())

    def tearDown(self):
        self.assertEqual(fingerprint(self.cluster.stats()), self.before)

    def values(self):
        return [t.values_view for t in self.ps._tensors]

    def test_wrong_dtype(self):
        values = self.values()
        values[1] = np.zeros(values[1].shape, np.float64)
        with self.assertRaisesRegex(TypeError, "'0.bias': dtype must be float32"):
            self.ps.client.pull(1, values)
        with self.assertRaisesRegex(TypeError, "'weight' is torch.float64"):
            pstrain.torch.ParameterServer(
                torch.nn.Linear(4, 3).double(), hosts=self.cluster.hosts,
                worker_id=0, num_workers=1)

    def test_wrong_shape(self):
        values = self.values()
        values[2] = np.zeros(7, np.float32)
        with self.assertRaisesRegex(ValueError, "'2.weight': has 7 elements, "
                                    "the model's tensor has 6"):
            self.ps.client.push(1, values)
        with self.assertRaisesRegex(ValueError, "3 tensors, the model has 4"):
            self.ps.client.pull(1, values[:3])

    def test_not_contiguous(self):
        values = self.values()
        values[0] = np.zeros((4, 3), np.float32).T
        with self.assertRaisesRegex(ValueError, "'0.weight': must be contiguous"):
            self.ps.client.push(1, values)

    def test_wrong_device(self):
        model = torch.nn.Linear(4, 3, device="meta")
        with self.assertRaisesRegex(ValueError, "'weight' is on device meta"):
            pstrain.torch.ParameterServer(model, hosts=self.cluster.hosts,
                                          worker_id=0, num_workers=1)

    def test_a_model_the_servers_do_not_hold(self):
        other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                                    torch.nn.Linear(3, 2))
        other.add_module("extra", torch.nn.Linear(2, 2))
        renamed = torch.nn.Sequential()
        renamed.add_module("first", torch.nn.Linear(4, 3))
        for model, difference in [(other, "tensor count 4 vs 6"),
                                  (renamed, "name '0.weight' vs 'first.weight'")]:
            with self.assertRaises(pstrain.Error) as raised:
                pstrain.torch.ParameterServer(model, hosts=self.cluster.hosts,
                                              worker_id=0, num_workers=1)
            self.assertEqual(raised.exception.code, "FAILED_PRECONDITION")
            self.assertIn(difference, str(raised.exception))

    def test_a_model_changed_after_registration(self):
        saved = self.model[2].weight.data
        self.model[2].weight.data = torch.zeros(3, 3)
        try:
            with self.assertRaisesRegex(ValueError,
                                        "'2.weight' changed after registration"):
                self.ps.step()
        finally:
            self.model[2].weight.data = saved

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
    def test_a_cuda_model_moved_to_the_cpu_after_registration(self):
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = mlp().cuda()
            ps = pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                               worker_id=0, num_workers=1)
            model.cpu()
            model(torch.ones(2, 4)).sum().backward()
            with self.assertRaisesRegex(ValueError,
                                        "'0.weight' moved from cuda:0 to cpu"):
                ps.step()

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
    def test_a_model_split_over_devices(self):
        model = mlp()
        model[2].cuda()
        with self.assertRaisesRegex(
                ValueError, "split over devices: '0.weight' is on cpu, "
                "'2.weight' on cuda:0"):
            pstrain.torch.ParameterServer(model, hosts=self.cluster.hosts,
                                          worker_id=0, num_workers=1)

    def test_worker_id_out_of_range(self):
        with self.assertRaisesRegex(ValueError, r"worker_id must be in \[0, 1\)"):
            pstrain.torch.ParameterServer(mlp(), hosts=self.cluster.hosts,
                                          worker_id=1, num_workers=1)
        client = pstrain.Client(self.cluster.hosts)
        with self.assertRaises(pstrain.Error) as raised:
            client.register(self.ps.schema, 1, 5)
        self.assertIn("worker_id must be in [0, 1)", str(raised.exception))

    def connect(self, model, **kwargs):
        return pstrain.torch.ParameterServer(
            model, hosts=self.cluster.hosts, worker_id=0, num_workers=1,
            **kwargs)

    def test_optimizer_options_the_servers_cannot_honour(self):
        model = mlp()
        for optimizer, option in [
                (torch.optim.Adam(model.parameters(), amsgrad=True), "amsgrad"),
                (torch.optim.SGD(model.parameters(), lr=0.1, maximize=True),
                 "maximize")]:
            with self.assertRaisesRegex(ValueError, f"{option}=True: the "
                                        "servers do not run it"):
                self.connect(model, optimizer=optimizer)

    def test_an_optimizer_the_servers_do_not_run(self):
        model = mlp()
        with self.assertRaisesRegex(ValueError, "torch.optim.Adamax is not an "
                                    "optimizer the servers run .*AdamW"):
            self.connect(model, optimizer=torch.optim.Adamax(
                model.parameters()))

    def test_param_groups_that_do_not_cover_the_model(self):
        model = mlp()
        partial = torch.optim.SGD(model[0].parameters(), lr=0.1)
        with self.assertRaisesRegex(ValueError, "leave out 2.weight, 2.bias"):
            self.connect(model, optimizer=partial)
        stranger = torch.optim.SGD(
            list(model.parameters()) + [torch.nn.Parameter(torch.ones(7))],
            lr=0.1)
        with self.assertRaisesRegex(ValueError, r"shape \[7\] that is not a "
                                    "parameter of the model"):
            self.connect(model, optimizer=stranger)

    def test_workers_with_different_optimizers(self):
        # The servers hold the job's first registration (this class's, with
        # the servers' own SGD): a worker that brings another optimizer is
        # refused, naming the first tensor whose rule differs.
        model = mlp()
        with self.assertRaises(pstrain.Error) as raised:
            self.connect(model, optimizer=torch.optim.AdamW(
                model.parameters(), lr=1e-3))
        self.assertEqual(raised.exception.code, "FAILED_PRECONDITION")
        self.assertIn("tensor 0 ('0.weight'): optimizer", str(raised.exception))
        self.assertIn("adamw", str(raised.exception))

    def test_a_scheduler_stepped_after_finish(self):
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
            ps = pstrain.torch.ParameterServer(
                model, optimizer=optimizer, scheduler=scheduler,
                hosts=c.hosts, worker_id=0, num_workers=1)
            model(torch.ones(2, 4)).sum().backward()
            ps.step()
            scheduler.step()
            ps.finish()
            with self.assertRaisesRegex(RuntimeError, r"scheduler.step\(\) "
                                        r"after ParameterServer.finish\(\)"):
                scheduler.step()

    def test_a_scheduler_of_another_optimizer(self):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD(model.parameters(), lr=0.1)
        with self.assertRaisesRegex(ValueError, "another optimizer"):
            self.connect(model, optimizer=optimizer,
                         scheduler=torch.optim.lr_scheduler.StepLR(other, 1))

    def test_unknown_option(self):
        with self.assertRaisesRegex(ValueError, "unknown client option 'rpc_timeout'"):
            pstrain.Client(self.cluster.hosts, rpc_timeout=3)

    def test_servers_that_cannot_be_reached(self):
        # A port nobody listens on: refused at once, reported after the
        # connect timeout with the shard and the likely cause.
        start = time.monotonic()
        with self.assertRaises(pstrain.Error) as raised:
            pstrain.torch.ParameterServer(
                mlp(), hosts="127.0.0.1:1", worker_id=0, num_workers=1,
                connect_timeout_s=2, retry_window_s=0)
        self.assertLess(time.monotonic() - start, 20)
        message = str(raised.exception)
        self.assertIn("shard 0 (127.0.0.1:1)", message)
        self.assertIn("Connection refused", message)


    def test_a_wait_for_servers_is_said_while_it_lasts(self):
        # As the worker binary says it: every 3 s, the shard, its address,
        # the time left and why, on stderr (the library's log), not 60 s
        # of silence before the error.
        code = ("import torch, pstrain.torch\n"
                "pstrain.torch.ParameterServer(torch.nn.Linear(2, 2), "
                "hosts='127.0.0.1:1', worker_id=0, num_workers=1, "
                "connect_timeout_s=4, retry_window_s=0)\n")
        done = subprocess.run([sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=60)
        self.assertNotEqual(done.returncode, 0)
        self.assertRegex(
            done.stderr, r"waiting to reach shard 0 \(127\.0\.0\.1:1\) to "
            r"register, \d+ s left \(--connect_timeout_s\): .*"
            r"Connection refused")


class StepWithoutBackwardTest(unittest.TestCase):
    """torch's optimizer.step() skips parameters without a gradient;
    ps.step() pushes zeros (a sync step needs every worker's push), and the
    servers' optimizer still steps: it is said once, as a RuntimeWarning
    pointing at the caller's line."""

    def test_a_step_no_backward_reached_is_said_once(self):
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = mlp()
            ps = pstrain.torch.ParameterServer(
                model, hosts=c.hosts, worker_id=0, num_workers=1,
                optimizer=torch.optim.AdamW(model.parameters(), lr=0.1,
                                            weight_decay=0.5))
            x = torch.ones(2, 4)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):  # with backward: nothing said
                    model(x).sum().backward()
                    ps.step()
                said = [w for w in caught if "no gradient" in str(w.message)]
                self.assertEqual(said, [])
                ps.step()  # no backward since the last step
                ps.step()
                said = [w for w in caught if "no gradient" in str(w.message)]
            ps.finish()
        self.assertEqual(len(said), 1)
        self.assertIs(said[0].category, RuntimeWarning)
        self.assertIn("at step 2 ", str(said[0].message))
        self.assertEqual(os.path.basename(said[0].filename),
                         "python_bad_input_test.py")

    def test_gradients_zeroed_in_place_and_no_backward_are_said(self):
        # zero_grad() without set_to_none (torch 1.x's default) moves every
        # gradient as a backward would; only a backward leaves values.
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1,
                                        momentum=0.9)
            ps = pstrain.torch.ParameterServer(
                model, hosts=c.hosts, worker_id=0, num_workers=1,
                optimizer=optimizer)
            x = torch.ones(2, 4)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for zeroed in (True, False, True):  # with backward
                    if zeroed:
                        optimizer.zero_grad(set_to_none=False)
                    model(x).sum().backward()
                    ps.step()
                said = [w for w in caught if "no gradient" in str(w.message)]
                self.assertEqual(said, [])
                optimizer.zero_grad(set_to_none=False)
                ps.step()  # zeroed, and no backward since
                said = [w for w in caught if "no gradient" in str(w.message)]
            ps.finish()
        self.assertEqual(len(said), 1)
        self.assertIn("at step 3 ", str(said[0].message))


class ClusterSpecClientOptionsTest(unittest.TestCase):
    """A cluster description's worker_flags reach a Python worker's client
    as the worker binary reads them: the client options typed, model flags
    left out, a bad value refused naming the flag."""

    def spec(self, worker_flags):
        with tempfile.NamedTemporaryFile("w", suffix=".json",
                                         delete=False) as f:
            json.dump({"ps": ["127.0.0.1:1"], "workers": 2,
                       "task": {"type": "worker", "index": 1},
                       "worker_flags": worker_flags}, f)
        self.addCleanup(os.unlink, f.name)
        return pstrain.cluster_spec(f.name)

    def test_client_flags_typed_and_model_flags_left_out(self):
        spec = self.spec({"rpc_timeout_s": 7.5, "call_streams": False,
                          "connections_per_shard": "3",
                          "gradient_wire_type": "bf16", "model": "mlp",
                          "learning_rate": 0.5})
        self.assertEqual(spec.worker_id, 1)
        self.assertEqual(spec.client_options,
                         {"rpc_timeout_s": 7.5, "call_streams": False,
                          "connections_per_shard": 3,
                          "gradient_wire_type": "bf16"})

    def test_a_value_the_flag_cannot_take(self):
        with self.assertRaisesRegex(pstrain.Error,
                                    "worker_flags.connections_per_shard=four"):
            self.spec({"connections_per_shard": "four"})


class BadEmbeddingInputTest(unittest.TestCase):

    def test_ids_out_of_range_and_of_the_wrong_dtype(self):
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = torch.nn.Sequential()
            model.add_module("emb", pstrain.torch.EmbeddingBag(100, 4))
            model.add_module("out", torch.nn.Linear(4, 1))
            pstrain.torch.ParameterServer(model, hosts=c.hosts, worker_id=0,
                                          num_workers=1)
            before = [s["sparse"] for s in c.stats()]
            with self.assertRaisesRegex(ValueError,
                                        r"'emb.weight': ids must be in \[0, 100\)"):
                model.emb(torch.tensor([[3, 100]]))
            with self.assertRaisesRegex(ValueError, "got -1..3"):
                model.emb(torch.tensor([[3, -1]]))
            with self.assertRaisesRegex(TypeError,
                                        "'emb.weight': ids must be int64"):
                model.emb(torch.tensor([[0.5, 1.0]]))
            self.assertEqual([s["sparse"] for s in c.stats()], before)
            # Ids in strided memory are read as the values they show.
            strided = torch.tensor([5, 99, 7, 99, 5, 99])[::2]
            self.assertFalse(strided.is_contiguous())
            with torch.no_grad():
                self.assertTrue(torch.equal(
                    model.emb(strided, torch.tensor([0])),
                    model.emb(torch.tensor([5, 7, 5]), torch.tensor([0]))))

    def test_a_collection_names_the_table_whose_ids_are_out_of_range(self):
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = torch.nn.Module()
            model.add_module("bags", pstrain.torch.EmbeddingBagCollection(
                [pstrain.torch.EmbeddingBag(None, 4),
                 pstrain.torch.EmbeddingBag(10, 4),
                 pstrain.torch.EmbeddingBag(100, 4)]))
            model.add_module("out", torch.nn.Linear(12, 1))
            pstrain.torch.ParameterServer(model, hosts=c.hosts, worker_id=0,
                                          num_workers=1)
            before = [s["sparse"] for s in c.stats()]
            hashed = torch.tensor([-5, 2**62, -5])  # any id: no bound
            with self.assertRaisesRegex(
                    ValueError,
                    r"'bags.tables.1.weight': ids must be in \[0, 10\), "
                    "got 0..10"):
                model.bags([(hashed, None), (torch.tensor([[0, 10]]), None),
                            (torch.tensor([[1000]]), None)])
            with self.assertRaisesRegex(ValueError,
                                        r"'bags.tables.2.weight'.*\[0, 100\)"):
                model.bags([(hashed, None), (torch.tensor([[9]]), None),
                            (torch.tensor([[100]], dtype=torch.int32), None)])
            self.assertEqual([s["sparse"] for s in c.stats()], before)
            pooled = model.bags([(hashed.reshape(1, 3), None),
                                 (torch.tensor([[9, 9]]), None),
                                 (torch.tensor([[99]], dtype=torch.int32),
                                  None)])
            self.assertEqual([tuple(p.shape) for p in pooled], [(1, 4)] * 3)

    def test_table_modes_the_servers_do_not_run(self):
        with self.assertRaisesRegex(ValueError, "consistency must be None"):
            pstrain.torch.EmbeddingBag(100, 4, consistency="bsp")
        with cluster.Cluster(num_shards=1, num_workers=1, mode="async") as c:
            model = torch.nn.Module()
            model.add_module("emb", pstrain.torch.EmbeddingBag(
                100, 4, consistency="sync"))
            model.add_module("out", torch.nn.Linear(4, 1))
            with self.assertRaisesRegex(
                    pstrain.Error, "sparse table 'emb.weight' asks for mode "
                    "'sync' but the servers run --mode=async"):
                pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                              worker_id=0, num_workers=1)
            self.assertEqual(
                [int(s["num_elements"]) for s in c.stats()], [0])

    def test_table_budgets_that_cannot_be_held(self):
        with self.assertRaisesRegex(ValueError, "max_bytes must be an int >= 0"):
            pstrain.torch.EmbeddingBag(100, 4, max_bytes=-1)
        with cluster.Cluster(num_shards=1, num_workers=1) as c:
            model = torch.nn.Module()
            model.add_module("emb", pstrain.torch.EmbeddingBag(
                100, 4, max_bytes=10))
            model.add_module("out", torch.nn.Linear(4, 1))
            with self.assertRaisesRegex(pstrain.Error,
                                        "max_bytes 10 holds no row"):
                pstrain.torch.ParameterServer(model, hosts=c.hosts,
                                              worker_id=0, num_workers=1)
            self.assertEqual(
                [int(s["num_elements"]) for s in c.stats()], [0])


if __name__ == "__main__":
    cluster.main()
