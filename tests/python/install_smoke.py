"""What a new install must do, in any CPython 3 with only the standard
library (no numpy, no torch): import pstrain, register a model with real
servers, pull it, push a gradient and pull the update. With --torch, a
pstrain.torch training step too.

  install_smoke.py --hosts=HOST:PORT [--torch [--device=cuda]]
"""

import argparse
import array
import sys

import pstrain


def core(hosts):
    client = pstrain.Client(hosts, rpc_timeout_s=20, retry_window_s=5)
    schema = {"dense": [{"name": "w", "shape": ["4"],
                         "init": {"kind": "CONSTANT", "value": 1.0}}],
              "seed": "1", "block_elements": "4"}
    assert client.register(schema, 1, 0) == "sync"
    client.await_job_start()
    w = array.array("f", [0.0] * 4)
    assert client.pull(0, [w]) == 0 and list(w) == [1.0] * 4, list(w)
    grad = array.array("f", [2.0] * 4)
    client.push_pull(0, [grad], 1, [w])
    # The servers run SGD at 0.25: 1 - 0.25 * 2.
    assert list(w) == [0.5] * 4, list(w)
    try:
        client.pull(0, [array.array("f", [0.0] * 3)])
        raise AssertionError("a tensor of the wrong size was taken")
    except ValueError as e:
        assert "has 3 elements" in str(e), e
    client.leave()


def torch_step(hosts, device):
    import torch
    import pstrain.torch
    model = torch.nn.Linear(3, 1).to(device)
    ps = pstrain.torch.ParameterServer(model, hosts=hosts, worker_id=0,
                                       num_workers=1)
    before = model.weight.detach().clone()
    model(torch.ones(2, 3, device=device)).sum().backward()
    expected = before - 0.25 * model.weight.grad  # SGD at 0.25 on the servers
    ps.step()
    assert torch.allclose(model.weight.detach(), expected), (
        model.weight, expected)
    ps.finish()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.torch:
        torch_step(args.hosts, args.device)
    else:
        core(args.hosts)
    print(f"ok: CPython {sys.version.split()[0]}, pstrain {pstrain.__version__} "
          f"from {pstrain.__file__}")


if __name__ == "__main__":
    main()
