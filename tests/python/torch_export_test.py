"""The final model of a PyTorch job, exported by pstrain_export, loads into
the same torch module with model.load_state_dict(strict=True), no renaming:
parameters and buffers (BatchNorm's running statistics, averaged over the
workers every step) are the job's."""

import json
import os
import subprocess
import unittest

import numpy as np
import torch

from tests.python import cluster
from tests.python import train_worker

WORKER = os.path.join(cluster.HERE, "train_worker.py")


def read_safetensors(path):
    """A safetensors file as a dict of torch tensors (the format is small
    enough to read by hand: a length, a JSON header, the raw data)."""
    with open(path, "rb") as f:
        blob = f.read()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + length])
    data = blob[8 + length:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        self_type = {"F32": np.float32, "I64": np.int64}[entry["dtype"]]
        begin, end = entry["data_offsets"]
        array = np.frombuffer(data[begin:end], dtype=self_type)
        out[name] = torch.from_numpy(array.reshape(entry["shape"]).copy())
    return out


class TorchExportTest(unittest.TestCase):

    def test_the_exported_model_loads_into_the_module(self):
        with cluster.Cluster(num_shards=2, num_workers=2,
                             flags=["--optimizer=adam",
                                    "--learning_rate=0.01"]) as c:
            c.run_workers(WORKER, lambda k: ["--model=bn", "--steps=30",
                                             f"--out={c.dir}"])
            output = os.path.join(c.dir, "model.safetensors")
            subprocess.run([cluster.runfile("worker/pstrain_export"),
                            f"--ps_hosts={c.hosts}", f"--output={output}"],
                           check=True, capture_output=True)
            job = torch.load(os.path.join(c.dir, "worker0.pt"))
            other = torch.load(os.path.join(c.dir, "worker1.pt"))
        exported = read_safetensors(output)
        model = train_worker.make_model("bn", seed=99)
        model.load_state_dict(exported, strict=True)
        loaded = model.state_dict()
        self.assertEqual(set(loaded), set(job))
        for name, value in job.items():
            self.assertTrue(torch.equal(loaded[name].to(value.dtype), value),
                            name)
            self.assertTrue(torch.equal(other[name], value), name)
        # The buffers were shared, trained state: averaged running
        # statistics, and the step count.
        self.assertEqual(int(loaded["1.num_batches_tracked"]), 30)
        self.assertFalse(torch.equal(loaded["1.running_var"],
                                     torch.ones(16)))


if __name__ == "__main__":
    cluster.main()
