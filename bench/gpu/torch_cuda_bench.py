"""pstrain.torch on a GPU against one torch process on the same GPU, in one
run: the same model, batch, optimizer and batches, trained (a) as a pstrain
worker through --servers ps_server processes this script starts on loopback,
and (b) as a plain torch process with its optimizer, no servers.

  torch_cuda_bench.py --ps_server=BUNDLE/bin/ps_server [--model=mlp|cnn]
      [--device=cuda] [--servers=2] [--batch=512] [--steps=300] [--warmup=20]
      [--fashion_mnist=DIR] [--pipeline=both|on|off]

mlp: 784-2048-2048-10 with SGD (the C++ GPU worker's job in check.sh); cnn:
the README's two-conv CNN with BatchNorm and Dropout (worker/python/examples/
fashion_mnist_cnn.py's Net) with Adam. Data: Fashion-MNIST from DIR, else
the synthetic task with 784 features and 10 classes. Batches come from host
memory each step, as a user's DataLoader gives them.

pstrain runs pipelined (ParameterServer(pipeline=True): the exchange starts
during backward) and plain (pipeline=False), fresh servers for each: --pipeline
picks one or both. pstrain_* fields are the pipelined run's where it ran,
pstrain_plain_* the plain one's.

Prints one JSON line: samples/s of each, their ratios, and each step split
into forward+backward and the update (ps.step(): the copies out and in and
the exchange; or optimizer.step()). On a GPU, forward+backward counts the
host's time to queue its kernels: ps.step() waits for them, so their
running time shows in pstrain's update.
Exit 1 when a run fails, 2 on bad usage.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import pstrain.data
import pstrain.torch


def make_model(name):
    torch.manual_seed(1)
    if name == "mlp":
        return torch.nn.Sequential(
            torch.nn.Linear(784, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 10))
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.25),
        nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(128, 10))


def make_optimizer(name, model):
    if name == "mlp":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.Adam(model.parameters(), lr=0.001)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_servers(binary, count, directory):
    servers, hosts = [], []
    for shard in range(count):
        port_file = os.path.join(directory, f"ps{shard}.port")
        log = open(os.path.join(directory, f"ps{shard}.log"), "w")
        servers.append(subprocess.Popen(
            [binary, "--host=127.0.0.1", "--port=0",
             f"--port_file={port_file}", f"--shard_id={shard}",
             f"--num_shards={count}", "--num_workers=1", "--mode=sync"],
            stdout=log, stderr=log))
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and os.path.getsize(port_file)):
            if time.monotonic() > deadline or servers[-1].poll() is not None:
                raise RuntimeError(f"ps_server {shard} wrote no port; see "
                                   f"{directory}/ps{shard}.log")
            time.sleep(0.05)
        with open(port_file) as f:
            hosts.append(f"127.0.0.1:{f.read().strip()}")
    return servers, ",".join(hosts)


def train(args, examples, hosts, pipeline=False):
    """Samples/s of one run, and its mean forward+backward and update ms."""
    device = torch.device(args.device)
    model = make_model(args.model).to(device)
    optimizer = make_optimizer(args.model, model)
    ps = None
    if hosts:
        ps = pstrain.torch.ParameterServer(model, hosts=hosts, worker_id=0,
                                           num_workers=1, optimizer=optimizer,
                                           pipeline=pipeline)
    shape = (1, 28, 28) if args.model == "cnn" else None
    batches = pstrain.data.Batches(examples, args.batch, 0, 1, seed=5,
                                   shape=shape)
    compute_s = update_s = 0.0
    start = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize(device)
            start = time.perf_counter()
            compute_s = update_s = 0.0
        t0 = time.perf_counter()
        x, y = batches.batch(step)
        x, y = x.to(device), y.to(device)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        if ps is not None:
            ps.step()
        else:
            optimizer.step()
            optimizer.zero_grad()
        update_s += time.perf_counter() - t1
        compute_s += t1 - t0
    synchronize(device)
    wall = time.perf_counter() - start
    if ps is not None:
        # The first step is watched (plain), every later one pipelined.
        if pipeline and (ps.pipelined_steps != args.warmup + args.steps - 1
                         or ps.pipelined_calls == 0):
            raise RuntimeError(f"{ps.pipelined_steps} steps pipelined of "
                               f"{args.warmup + args.steps}, "
                               f"{ps.pipelined_calls} calls streamed")
        ps.finish()
    return (args.steps * args.batch / wall, 1e3 * compute_s / args.steps,
            1e3 * update_s / args.steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps_server", required=True)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--fashion_mnist", default="")
    parser.add_argument("--pipeline", choices=["both", "on", "off"],
                        default="both")
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("torch_cuda_bench.py: no CUDA device visible to torch "
              "(--device=cpu measures the same on the CPU)", file=sys.stderr)
        sys.exit(1)
    examples = (pstrain.data.fashion_mnist(directory=args.fashion_mnist)
                if args.fashion_mnist else
                pstrain.data.synthetic(60000, num_features=784,
                                       num_classes=10, seed=11))
    runs = {"both": [True, False], "on": [True], "off": [False]}[args.pipeline]
    measured = {}
    for pipeline in runs:
        directory = tempfile.mkdtemp(prefix="torch_cuda_bench.")
        servers, hosts = start_servers(args.ps_server, args.servers, directory)
        try:
            measured[pipeline] = train(args, examples, hosts, pipeline)
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                server.wait(timeout=30)
    local_sps, local_compute, local_update = train(args, examples, None)
    out = {
        "bench": "torch_cuda", "model": args.model, "device": args.device,
        "gpu": (torch.cuda.get_device_name(torch.device(args.device))
                if torch.device(args.device).type == "cuda" else "none"),
        "torch": torch.__version__, "servers": args.servers,
        "batch": args.batch, "steps": args.steps}
    for pipeline, prefix in ((True, "pstrain"), (False, "pstrain_plain")):
        if pipeline not in measured:
            continue
        if prefix == "pstrain_plain" and True not in measured:
            prefix = "pstrain"
        sps, compute, update = measured[pipeline]
        out.update({
            f"{prefix}_samples_per_s": round(sps, 1),
            f"{prefix}_compute_ms": round(compute, 3),
            f"{prefix}_step_ms": round(update, 3),
            f"ratio_{prefix}_vs_local": round(sps / local_sps, 3)})
    out.update({
        "pipelined": True in measured,
        "local_samples_per_s": round(local_sps, 1),
        "local_compute_ms": round(local_compute, 3),
        "local_update_ms": round(local_update, 3)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
