"""The user's optimizer on the servers, with torch.optim's semantics: W
Python workers with batch b, each handing pstrain.torch its own torch
optimizer (two param groups with their own rates and weight decay) and
scheduler, end with the parameters of one torch process with batch W*b and
the same recipe on the same samples, to 1e-5, for SGD (momentum, dampening,
nesterov), Adam, AdamW, Adagrad and RMSprop under warmup + cosine, StepLR and
OneCycleLR (which cycles Adam's betas[0] and SGD's momentum too), and with
clip_grad_norm_ of the job's gradient."""

import os
import unittest

import torch

# First: the installed package (cluster re-runs this test in its venv).
from tests.python import cluster
import pstrain.data
from tests.python import optim_recipes
from tests.python import train_worker

BATCH = 16
WORKER = os.path.join(cluster.HERE, "optim_worker.py")


def single_process(recipe, global_batch, steps=optim_recipes.STEPS,
                   clip=True, norms=None):
    """The recipe in one process; `norms`, a list, gets each clipped step's
    gradient norm (what torch's clip_grad_norm_ returns)."""
    torch.set_num_threads(1)
    model = train_worker.make_model("mlp", seed=3)
    optimizer, scheduler, max_norm = optim_recipes.build(recipe, model, steps)
    batches = pstrain.data.Batches(train_worker.examples(), global_batch, 0, 1,
                                   seed=5)
    rates = []
    for step in range(steps):
        x, y = train_worker.batch(batches, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if max_norm is not None and clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if norms is not None:
                norms.append(float(norm))
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return model.state_dict(), rates


def max_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run_job(c, workers, recipe, extra=(), final_state="in_memory"):
    finals = c.run_workers(WORKER, lambda k: [
        f"--recipe={recipe}", f"--batch={BATCH}", f"--out={c.dir}",
        f"--seed={3 + k}"] + list(extra))
    # The servers' copy of the model each worker ended with: checkpointed
    # by the servers with a --checkpoint_dir, else in their memory.
    for final in finals:
        assert final["final_state"]["summary"] == final_state, final
        assert final["final_state"]["shards_behind"] == [], final
    return torch.load(os.path.join(c.dir, "worker0.pt"))


class TorchOptimizersTest(unittest.TestCase):

    def check(self, workers, recipe):
        with cluster.Cluster(num_shards=2, num_workers=workers) as c:
            job = run_job(c, workers, recipe)
            with open(os.path.join(c.dir, "rates0.txt")) as f:
                job_rates = [float(line) for line in f]
            for w in c.workers:  # ps.step() is the optimizer's step
                self.assertNotIn("before `optimizer.step()`", c.errors(w))
            # The servers' log says the flags' optimizer is not the one
            # training (their first lines still name it).
            for shard in range(2):
                self.assertRegex(
                    c.server_log(shard),
                    r"model installed; (\d+) of \1 trained dense tensors "
                    r"by the workers' torch optimizer "
                    r".*--learning_rate=\S+ applies to none")
            job_norms = []
            for k in range(workers):
                path = os.path.join(c.dir, f"norms{k}.txt")
                if os.path.exists(path):
                    with open(path) as f:
                        job_norms.append([float(line) for line in f])
        reference_norms = []
        reference, rates = single_process(recipe, workers * BATCH,
                                          norms=reference_norms)
        difference = max_difference(job, reference)
        print(f"{recipe}, {workers} workers: max |difference| {difference:.2e}")
        self.assertLessEqual(difference, 1e-5, recipe)
        self.assertEqual(job_rates, rates)  # the schedule moved as torch's
        # Not vacuous: the rates changed, training moved the weights far
        # beyond the tolerance, and the recipe is not the servers' default.
        if recipe != "sgd_constant":
            self.assertGreater(len(set(rates)), 1)
        initial = train_worker.make_model("mlp", seed=3).state_dict()
        self.assertGreater(max_difference(reference, initial), 1e-2)
        plain, _ = single_process("sgd_constant", workers * BATCH)
        self.assertGreater(max_difference(reference, plain), 1e-3)
        if recipe.endswith("_clipped"):  # the clip did clip
            unclipped, _ = single_process(recipe, workers * BATCH, clip=False)
            self.assertGreater(max_difference(reference, unclipped), 1e-4)
            # Every worker's ps.last_grad_norm is the job's norm of the step,
            # torch's for the whole batch: the one that gathered it and
            # the others alike.
            self.assertEqual(len(job_norms), workers)
            for k, norms in enumerate(job_norms):
                self.assertEqual(len(norms), len(reference_norms))
                for step, (got, want) in enumerate(zip(norms,
                                                       reference_norms)):
                    self.assertAlmostEqual(
                        got, want, delta=1e-4 * want,
                        msg=f"worker {k}, step {step}")

    def test_every_recipe_with_two_workers(self):
        for recipe in optim_recipes.RECIPES:
            with self.subTest(recipe=recipe):
                self.check(2, recipe)

    def test_every_recipe_with_three_workers(self):
        for recipe in optim_recipes.RECIPES:
            with self.subTest(recipe=recipe):
                self.check(3, recipe)

    def test_async_updates_use_the_rate_of_their_step(self):
        # Every gradient is 1: each applied update moves every element by
        # exactly its rate, so the final value is minus the sum of the rates
        # the schedule gave each worker's steps (0.1 / (1 + t)).
        steps, workers = 20, 2
        with cluster.Cluster(num_shards=1, num_workers=workers,
                             mode="async") as c:
            c.run_workers(WORKER, lambda k: [
                "--recipe=sgd_decay", "--model=probe", f"--steps={steps}",
                f"--out={c.dir}"])
            final = torch.load(os.path.join(c.dir, "worker0.pt"))["p"]
        schedule = sum(0.1 / (1 + t) for t in range(steps))
        expected = torch.full_like(final, -workers * schedule)
        self.assertLessEqual((final - expected).abs().max().item(), 1e-5)
        # Not the registered rate, 0.1 for every update.
        self.assertGreater(abs(-workers * steps * 0.1 - final[0].item()), 1)

    def test_a_job_resumed_mid_schedule_follows_the_same_rates(self):
        # Stopped after 12 of 30 steps (servers stopped: final checkpoint),
        # restarted from the checkpoint: the workers' schedulers continue at
        # step 12, and the model is the uninterrupted job's.
        recipe, workers = "adamw", 2
        uninterrupted, resumed, rates = self.stop_and_resume(recipe, workers)
        _, reference_rates = single_process(recipe, workers * BATCH)
        self.assertEqual(rates, reference_rates)  # 12 before, 18 after
        self.assertLessEqual(max_difference(resumed, uninterrupted), 1e-6)

    def test_a_model_with_buffers_resumes_from_its_checkpoint(self):
        # BatchNorm's statistics (servers' STATE tensors, no optimizer
        # state) beside Adam's parameters (two state floats each): the
        # shards' checkpoints hold both, and the resumed job is the
        # uninterrupted one, statistics included.
        uninterrupted, resumed, _ = self.stop_and_resume("adam", 3,
                                                         ["--model=bn"])
        self.assertIn("1.running_mean", resumed)
        self.assertLessEqual(max_difference(resumed, uninterrupted), 1e-6)
        initial = train_worker.make_model("bn", seed=3).state_dict()
        self.assertGreater(
            max_difference({"m": resumed["1.running_mean"]},
                           {"m": initial["1.running_mean"]}), 1e-2)

    def stop_and_resume(self, recipe, workers, extra=()):
        """The model of an uninterrupted job, that of the same job stopped
        after 12 steps and resumed from its checkpoints, and the rates
        worker 0 used in the two parts."""
        extra = list(extra)
        with cluster.Cluster(num_shards=2, num_workers=workers) as c:
            uninterrupted = run_job(c, workers, recipe, extra)
        with cluster.Cluster(num_shards=2, num_workers=workers,
                             checkpoint=True) as c:
            run_job(c, workers, recipe, extra + ["--stop_after=12"],
                    final_state="durable")
            c.restart_all_servers()
            resumed = run_job(c, workers, recipe, extra,
                              final_state="durable")
            with open(os.path.join(c.dir, "rates0.txt")) as f:
                rates = [float(line) for line in f]
        return uninterrupted, resumed, rates


if __name__ == "__main__":
    cluster.main()
