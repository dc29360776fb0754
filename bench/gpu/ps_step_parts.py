"""What pstrain.torch's ps.step() costs for torch_cuda_bench.py's CNN on the
CPU, with SGD and then Adam run by the servers: the whole step() and, inside
it, the client's push_pull call (the exchange and the servers' update), in
two interleaved rounds.

  ps_step_parts.py PS_SERVER_BINARY [--steps=150]

Needs pstrain (worker/python) and its _lib/libpstrain.so on PYTHONPATH.
Hold the push_pull figure against ps_bench's exchange alone of the same bytes
(--sizes=1690000) to see what the client and servers add to the exchange.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_cuda_bench  # noqa: E402  (its model and server launcher)
import pstrain.torch  # noqa: E402,F401


def measure(ps_server, optimizer_name, steps, warmup=20):
    servers, hosts = torch_cuda_bench.start_servers(ps_server, 2,
                                                    tempfile.mkdtemp())
    try:
        model = torch_cuda_bench.make_model("cnn")
        optimizer = (torch.optim.SGD(model.parameters(), lr=0.01)
                     if optimizer_name == "sgd" else
                     torch.optim.Adam(model.parameters(), lr=0.001))
        ps = pstrain.torch.ParameterServer(model, hosts=hosts, worker_id=0,
                                           num_workers=1, optimizer=optimizer)
        x = torch.randn(128, 1, 28, 28)
        y = torch.randint(0, 10, (128,))
        push_pull = ps.client.push_pull
        in_call = [0.0]

        def timed_push_pull(*args, **kwargs):
            start = time.perf_counter()
            result = push_pull(*args, **kwargs)
            in_call[0] += time.perf_counter() - start
            return result

        ps.client.push_pull = timed_push_pull
        in_step = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                in_step, in_call[0] = 0.0, 0.0
            torch.nn.functional.cross_entropy(model(x), y).backward()
            start = time.perf_counter()
            ps.step()
            in_step += time.perf_counter() - start
        print(f"{optimizer_name}: ps.step {1e3 * in_step / steps:.3f} ms, "
              f"push_pull call {1e3 * in_call[0] / steps:.3f} ms, "
              f"tensors {len(ps._tensors)}, "
              f"elements {sum(t.numel for t in ps._tensors)}", flush=True)
        ps.finish()
    finally:
        for server in servers:
            server.terminate()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ps_server")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    for optimizer_name in ("sgd", "adam", "sgd", "adam"):
        measure(args.ps_server, optimizer_name, args.steps)


if __name__ == "__main__":
    main()
