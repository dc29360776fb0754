"""Async from PyTorch: two Python workers training an MLP on Fashion-MNIST
against servers in async mode reach the accuracy of one torch process
within 1 point, in the same epochs."""

import os
import subprocess
import sys
import unittest

from tests.python import cluster

EPOCHS, GLOBAL_BATCH, LR = 2, 128, 0.001
SCRIPT = os.path.join(cluster.HERE, "fashion_mlp.py")


class TorchAsyncTest(unittest.TestCase):

    def test_async_reaches_the_single_process_accuracy(self):
        with cluster.Cluster(num_shards=2, num_workers=2, mode="async",
                             flags=["--optimizer=adam",
                                    f"--learning_rate={LR}"]) as c:
            finals = c.run_workers(SCRIPT, lambda k: [
                f"--epochs={EPOCHS}", f"--global_batch={GLOBAL_BATCH}"])
        local = subprocess.run(
            [sys.executable, SCRIPT, "--local", f"--epochs={EPOCHS}",
             f"--global_batch={GLOBAL_BATCH}", f"--lr={LR}"],
            env=c.cluster_env(0), capture_output=True, text=True, check=True)
        single = cluster.final_line(local.stdout)
        accuracies = {f["test_accuracy"] for f in finals}
        self.assertEqual(len(accuracies), 1)  # one final model
        self.assertEqual({f["final_model"] for f in finals}, {"all_done"})
        self.assertGreater(single["test_accuracy"], 0.8)
        self.assertGreaterEqual(finals[0]["test_accuracy"],
                                single["test_accuracy"] - 0.01)


if __name__ == "__main__":
    cluster.main()
