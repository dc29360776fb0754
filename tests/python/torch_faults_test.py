"""Faults from PyTorch: a Python worker killed with SIGKILL and restarted
with the same id rejoins the job at its step, and nothing is applied twice;
a job stopped by SIGTERM mid-step resumes as if undisturbed; Ctrl-C
interrupts a worker blocked in a call within about a second."""

import os
import signal
import time
import unittest

import torch

from tests.python import cluster

WORKER = os.path.join(cluster.HERE, "train_worker.py")
# The stopped-and-resumed jobs: BatchNorm, Adam on the servers.
STOP_FLAGS = ["--optimizer=adam", "--learning_rate=0.01"]
STOP_JOB = ["--model=bn", "--steps=20"]


class TorchFaultsTest(unittest.TestCase):

    def test_a_killed_worker_restarts_and_nothing_is_applied_twice(self):
        # The probe: gradient 1 everywhere, SGD with rate 1, so every element
        # is minus the number of updates applied: one applied twice, or one
        # lost, shows.
        steps = 100
        flags = ["--optimizer=sgd", "--learning_rate=1", "--worker_lease_s=1"]
        with cluster.Cluster(num_shards=2, num_workers=2, flags=flags) as c:
            args = [f"--model=probe", f"--steps={steps}", f"--out={c.dir}",
                    # Slow enough that the restarted worker (a Python
                    # start-up, seconds) comes back before the end.
                    "--step_delay_ms=100"]
            w0 = c.start_worker(WORKER, 0, args)
            w1 = c.start_worker(WORKER, 1, args)
            cluster.wait_for(lambda: "step 10\n" in c.output(w1), 60,
                             "worker 1's tenth step")
            w1.send_signal(signal.SIGKILL)
            w1.wait()
            again = c.start_worker(WORKER, 1, args, name="worker1_again")
            for p in (w0, again):
                self.assertEqual(c.wait(p), 0, c.errors(p)[-3000:])
            restarted = cluster.final_line(c.output(again))
            self.assertGreater(restarted["start_step"], 0)  # joined late
            self.assertEqual(restarted["steps_run"],
                             steps - restarted["start_step"])
            model = torch.load(os.path.join(c.dir, "worker0.pt"))
            stats = c.stats()
        self.assertEqual(model["p"].tolist(), [-float(steps)] * 1000)
        # The probe's one block lives on shard 0 (protobuf's JSON writes
        # 64-bit integers as strings).
        self.assertEqual(int(stats[0]["version"]), steps)
        self.assertEqual([int(s["internal_errors"]) for s in stats], [0, 0])

    def test_a_job_stopped_by_signals_resumes_as_if_undisturbed(self):
        # SIGTERM reaches the workers mid-step (after backward of step 9):
        # each pushes that step whole, leaves as stopping and exits 143;
        # every shard ends at step 10, and the job resumed from the
        # servers' checkpoints ends with the undisturbed job's model, bit
        # for bit. "staggered": workers 1 and 2 train on, push step 10 and
        # wait for worker 0, which holds it; they are SIGTERMed there.
        undisturbed = self.undisturbed_model(num_workers=3)
        for case, pipeline in (("together", "off"), ("together", "on"),
                               ("staggered", "off")):
            with self.subTest(case=case, pipeline=pipeline):
                resumed = self.stop_by_signals_and_resume(
                    STOP_FLAGS, STOP_JOB + [f"--pipeline={pipeline}"], case)
                self.assert_same_model(resumed, undisturbed)

    def undisturbed_model(self, num_workers):
        """Worker 0's final state_dict of the stop tests' job, undisturbed."""
        with cluster.Cluster(num_shards=2, num_workers=num_workers,
                             flags=STOP_FLAGS) as c:
            c.run_workers(WORKER, lambda k: STOP_JOB + [f"--out={c.dir}"])
            return torch.load(os.path.join(c.dir, "worker0.pt"))

    def assert_same_model(self, model, reference):
        for name, value in reference.items():
            self.assertTrue(torch.equal(model[name], value), name)

    def stop_by_signals_and_resume(self, flags, common, case):
        with cluster.Cluster(num_shards=2, num_workers=3, flags=flags,
                             checkpoint=True) as c:
            args = common + [f"--out={c.dir}"]
            w0 = c.start_worker(WORKER, 0, args + ["--sigterm_at_step=9"])
            others = [c.start_worker(WORKER, k, args + (
                ["--sigterm_at_step=9"] if case == "together" else []))
                for k in (1, 2)]
            self.assertEqual(c.wait(w0), 128 + signal.SIGTERM,
                             c.errors(w0)[-3000:])
            if case == "staggered":
                for w in others:
                    w.send_signal(signal.SIGTERM)
            for w in [w0] + others:
                self.assertEqual(c.wait(w), 128 + signal.SIGTERM,
                                 c.errors(w)[-3000:])
                self.assertIn("stopped by SIGTERM at step 10", c.errors(w))
            # No step short, none half done: every shard at step 10.
            stats = c.stats()
            self.assertEqual([int(s["version"]) for s in stats], [10, 10])
            self.assertEqual([int(s.get("steps_short", 0)) for s in stats],
                             [0, 0])
            c.restart_all_servers()
            finals = c.run_workers(WORKER, lambda k: args)
            self.assertEqual([f["start_step"] for f in finals], [10] * 3)
            stats = c.stats()
            self.assertEqual([int(s.get("steps_lost", 0)) for s in stats],
                             [0, 0])
            return torch.load(os.path.join(c.dir, "worker0.pt"))

    def test_after_a_caught_ctrl_c_the_same_process_trains_on(self):
        # A notebook's Ctrl-C: the step in hand goes in whole and
        # KeyboardInterrupt reaches the script, which catches it and trains
        # on with a new ParameterServer against the same servers, twice.
        # Each new job's steps run (not stopped by the old Ctrl-C), the
        # later Ctrl-C is graceful again (not an interrupt mid-push), and
        # the job ends as the undisturbed one, bit for bit.
        undisturbed = self.undisturbed_model(num_workers=2)
        with cluster.Cluster(num_shards=2, num_workers=2,
                             flags=STOP_FLAGS) as c:
            finals = c.run_workers(WORKER, lambda k: STOP_JOB + [
                f"--out={c.dir}", "--sigint_and_go_on_at_steps=9,14"])
            for final, w in zip(finals, c.workers):
                self.assertEqual(final["start_step"], 15, final)
                # Each Ctrl-C stopped the job once, after its step.
                self.assertEqual(
                    c.output(w).count("interrupted; training on"), 2)
                for step in (10, 15):
                    self.assertEqual(c.errors(w).count(
                        f"stopped by SIGINT at step {step} and left"), 1)
                self.assertEqual(final["final_model"], "sync_step", final)
            resumed = torch.load(os.path.join(c.dir, "worker0.pt"))
            stats = c.stats()
        self.assert_same_model(resumed, undisturbed)
        self.assertEqual([int(s.get("steps_short", 0)) for s in stats],
                         [0, 0])

    def test_ctrl_c_interrupts_a_waiting_worker_within_a_second(self):
        # Worker 1 never comes: worker 0 waits for the job's start.
        with cluster.Cluster(num_shards=1, num_workers=2) as c:
            w0 = c.start_worker(WORKER, 0, [f"--out={c.dir}"])
            cluster.wait_for(
                lambda: "waiting for workers 1" in c.errors(w0), 30,
                "worker 0 waiting for worker 1")
            start = time.monotonic()
            w0.send_signal(signal.SIGINT)
            code = c.wait(w0, 10)
            elapsed = time.monotonic() - start
            self.assertNotEqual(code, 0)
            self.assertIn("KeyboardInterrupt", c.errors(w0))
            self.assertLess(elapsed, 1.5)

    def test_ctrl_c_interrupts_a_blocked_sync_step(self):
        self.ctrl_c_a_blocked_step([])

    def test_ctrl_c_interrupts_a_blocked_pipelined_step(self):
        # The exchange started during backward; step() waits for the rest.
        self.ctrl_c_a_blocked_step(["--pipeline=on"])

    def ctrl_c_a_blocked_step(self, extra):
        # Worker 1 stops stepping: worker 0's PushPull waits for its step.
        with cluster.Cluster(num_shards=2, num_workers=2) as c:
            args = [f"--out={c.dir}", "--steps=1000"] + extra
            w0 = c.start_worker(WORKER, 0, args)
            w1 = c.start_worker(WORKER, 1, args)
            cluster.wait_for(lambda: "step 5\n" in c.output(w0), 60,
                             "worker 0's fifth step")
            w1.send_signal(signal.SIGSTOP)
            try:
                # Its lease (10 s) holds: worker 0 is blocked in a step.
                time.sleep(1)
                start = time.monotonic()
                w0.send_signal(signal.SIGINT)
                code = c.wait(w0, 10)
                elapsed = time.monotonic() - start
            finally:
                w1.send_signal(signal.SIGCONT)
            self.assertNotEqual(code, 0)
            self.assertIn("KeyboardInterrupt", c.errors(w0))
            self.assertLess(elapsed, 1.5)


if __name__ == "__main__":
    cluster.main()
