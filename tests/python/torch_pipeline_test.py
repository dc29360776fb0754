"""pstrain.torch's pipelined step (ParameterServer(pipeline=...)): the
exchange starts during backward, and a pipelined job ends with the plain
job's model to the bit. The first step is watched: a job that changes its
gradients after backward (accumulation, clipping) keeps plain steps; one
that starts doing so after its steps were pipelined is refused, naming what
changed. "auto" keeps a CPU job with its servers on this host plain."""

import os
import unittest

import torch

# First: the installed package (cluster re-runs this test in its venv).
from tests.python import cluster
import pstrain.torch
from tests.python import train_worker

WORKER = os.path.join(cluster.HERE, "train_worker.py")


def run_job(workers, pipeline, extra=(), flags=(), steps=20, model="bn"):
    """The final JSON lines of a sync job's workers and worker 0's model."""
    with cluster.Cluster(num_shards=2, num_workers=workers,
                         flags=list(flags)) as c:
        finals = c.run_workers(WORKER, lambda k: [
            f"--model={model}", f"--steps={steps}", "--batch=16",
            f"--out={c.dir}", f"--seed={3 + k}", f"--pipeline={pipeline}"]
            + list(extra))
        return finals, torch.load(os.path.join(c.dir, "worker0.pt"))


def identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class TorchPipelineTest(unittest.TestCase):

    def test_a_pipelined_sync_job_ends_with_the_plain_jobs_model(self):
        # BatchNorm's buffers leave first, the parameters as backward makes
        # them; Adam on the servers.
        flags = ["--optimizer=adam", "--learning_rate=0.01"]
        plain, plain_model = run_job(3, "off", flags=flags)
        piped, piped_model = run_job(3, "on", flags=flags)
        self.assertEqual([f["pipelined_steps"] for f in plain], [0, 0, 0])
        # The first step is watched, every later one pipelined.
        self.assertEqual([f["pipelined_steps"] for f in piped], [19, 19, 19])
        # Calls left as the gradients were made (not the plain PushPull a
        # stream falls back to).
        for final in piped:
            self.assertGreater(final["pipelined_calls"], 0)
        self.assertTrue(identical(plain_model, piped_model))
        initial = train_model_state("bn")
        self.assertFalse(identical(initial, piped_model))  # it trained

    def test_frozen_unused_and_new_gradient_tensors(self):
        # A frozen weight (state: its values pushed), a layer forward never
        # calls (zeros pushed), and .grad set to None after every step, so
        # that backward makes new gradient tensors each time.
        for extra in ([], ["--zero_grad_to_none"]):
            with self.subTest(extra=extra):
                plain, plain_model = run_job(2, "off", extra, model="mixed",
                                             steps=10)
                piped, piped_model = run_job(2, "on", extra, model="mixed",
                                             steps=10)
                self.assertEqual([f["pipelined_steps"] for f in piped], [9, 9])
                self.assertTrue(identical(plain_model, piped_model))
                initial = train_model_state("mixed")
                self.assertTrue(torch.equal(initial["0.weight"],
                                            piped_model["0.weight"]))
                self.assertFalse(torch.equal(initial["2.weight"],
                                             piped_model["2.weight"]))

    def test_a_wire_the_stream_cannot_send_falls_back_to_the_plain_exchange(
            self):
        # bf16 gradients are converted by the client from float32 when the
        # call is made: nothing leaves during backward, and the step is the
        # plain PushPull once backward is done.
        args = ["--gradient_wire_type=bf16"]
        plain, plain_model = run_job(2, "off", args, model="mlp", steps=8)
        piped, piped_model = run_job(2, "on", args, model="mlp", steps=8)
        self.assertEqual([f["pipelined_steps"] for f in piped], [7, 7])
        self.assertEqual([f["pipelined_calls"] for f in piped], [0, 0])
        self.assertTrue(identical(plain_model, piped_model))

    @unittest.skipIf(train_worker.device().type == "cuda",
                     "auto: a CUDA model pipelines with pipeline=True only")
    def test_auto_keeps_a_cpu_job_on_one_host_plain(self):
        finals, _ = run_job(2, "auto", model="mlp", steps=5)
        self.assertEqual([f["pipelined_steps"] for f in finals], [0, 0])

    def test_jobs_that_change_their_gradients_keep_plain_steps(self):
        for edit in ("accumulate", "torch_clip", "ps_clip", "extra_forward",
                     "stats"):
            with self.subTest(edit=edit):
                args = [f"--edit={edit}"]
                plain, plain_model = run_job(2, "off", args, steps=8)
                piped, piped_model = run_job(2, "on", args, steps=8)
                self.assertEqual([f["pipelined_steps"] for f in piped], [0, 0])
                self.assertTrue(identical(plain_model, piped_model))

    def test_a_change_after_pipelined_steps_is_refused_naming_it(self):
        cases = {
            "accumulate": ("mlp", "2 backward passes into one step's "
                           "gradients"),
            "torch_clip": ("mlp", "changed between backward() and step()"),
            "ps_clip": ("mlp", "clip_grad_norm_ after a pipelined backward"),
            # BatchNorm's kernel moves its statistics without a version
            # bump; num_batches_tracked's add_ shows.
            "extra_forward": ("bn", "1.num_batches_tracked changed between "
                              "the start of backward and step()"),
            "stats": ("mlp", "a call to the servers while a pipelined "
                      "step's exchange runs"),
        }
        for edit, (model, message) in cases.items():
            with self.subTest(edit=edit), cluster.Cluster(
                    num_shards=1, num_workers=1) as c:
                w = c.start_worker(WORKER, 0, [
                    f"--model={model}", "--steps=10", f"--out={c.dir}",
                    "--pipeline=on",
                    f"--edit={edit}", "--edit_from=3"])
                self.assertNotEqual(c.wait(w, 120), 0)
                errors = c.errors(w)
                self.assertIn(message, errors)
                self.assertIn("pipeline=False", errors)
                self.assertIn("step 3\n", c.output(w))  # steps 0-2 ran
                self.assertNotIn("step 4\n", c.output(w))

    def test_a_shard_killed_during_pipelined_steps(self):
        # The probe: gradient 1 everywhere, SGD with rate 1, so every element
        # is minus the updates applied. Shard 0 holds its one block; killed
        # with SIGKILL and restarted from its last checkpoint, it loses the
        # updates since (counted) and applies none twice.
        steps = 60
        flags = ["--optimizer=sgd", "--learning_rate=1",
                 "--checkpoint_every_steps=5"]
        with cluster.Cluster(num_shards=2, num_workers=2, flags=flags,
                             checkpoint=True) as c:
            args = ["--model=probe", f"--steps={steps}", f"--out={c.dir}",
                    "--step_delay_ms=50", "--pipeline=on"]
            workers = [c.start_worker(WORKER, k, args) for k in range(2)]
            cluster.wait_for(lambda: "step 20\n" in c.output(workers[0]), 60,
                             "worker 0's twentieth step")
            c.kill_server(0)
            c.servers[0] = c._start_server(0, c.ports[0])
            for w in workers:
                self.assertEqual(c.wait(w), 0, c.errors(w)[-3000:])
            finals = [cluster.final_line(c.output(w)) for w in workers]
            model = torch.load(os.path.join(c.dir, "worker0.pt"))
            other = torch.load(os.path.join(c.dir, "worker1.pt"))
            stats = c.stats()
        self.assertTrue(identical(model, other))
        for final in finals:
            self.assertGreater(final["pipelined_steps"], 20)
        applied = -model["p"][0].item()
        self.assertTrue(torch.equal(model["p"],
                                    torch.full((1000,), -applied)))
        lost = (int(stats[0]["updates_lost"])
                + int(stats[0].get("gradients_lost", 0)))
        print(f"probe: {applied} of {steps} updates applied, {lost} counted "
              f"lost; pipelined steps {[f['pipelined_steps'] for f in finals]}")
        self.assertLessEqual(applied, steps)  # none twice
        self.assertGreaterEqual(applied, steps - lost)  # none lost uncounted
        self.assertEqual([int(s["internal_errors"]) for s in stats], [0, 0])

    def test_an_async_pipelined_job_applies_every_update_once(self):
        # The probe (SGD, rate 1): every element is minus the updates
        # applied, and async applies each worker's every push.
        steps = 30
        flags = ["--optimizer=sgd", "--learning_rate=1"]
        with cluster.Cluster(num_shards=2, num_workers=2, mode="async",
                             flags=flags) as c:
            finals = c.run_workers(WORKER, lambda k: [
                "--model=probe", f"--steps={steps}", f"--out={c.dir}",
                "--pipeline=on"])
            stats = c.stats()
            model = torch.load(os.path.join(c.dir, "worker0.pt"))
        self.assertEqual([f["pipelined_steps"] for f in finals],
                         [steps - 1, steps - 1])
        self.assertEqual(model["p"].tolist(), [-2.0 * steps] * 1000)
        self.assertEqual(int(stats[0]["version"]), 2 * steps)
        self.assertEqual([int(s["internal_errors"]) for s in stats], [0, 0])

    def test_a_pipeline_setting_that_is_not_one(self):
        model = torch.nn.Linear(2, 2)
        with self.assertRaisesRegex(ValueError, "pipeline must be 'auto', "
                                    "True or False, got 'yes'"):
            pstrain.torch.ParameterServer(
                model, hosts=["127.0.0.1:1"], worker_id=0, num_workers=1,
                pipeline="yes")


def train_model_state(name):
    return train_worker.make_model(name, seed=3).state_dict()


if __name__ == "__main__":
    cluster.main()
