"""A user's training script as users write them: a model, a loop, nothing
printed that pstrain asks for. With --fail_at=N it exits 1 at step N, as a
script that crashes does. --print_client_options: worker 0 prints the
client options its cluster description gave it, as a JSON line."""

import argparse
import json
import sys

import torch

import pstrain
import pstrain.torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fail_at", type=int, default=-1)
    parser.add_argument("--print_client_options", action="store_true")
    args = parser.parse_args()
    if args.print_client_options:
        spec = pstrain.cluster_spec()
        if spec.worker_id == 0:
            print(json.dumps({"client_options": spec.client_options}),
                  flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 1))
    ps = pstrain.torch.ParameterServer(model)
    generator = torch.Generator().manual_seed(ps.worker_id)
    for step in range(ps.step_count, args.steps):
        if step == args.fail_at:
            sys.exit("the user's script failed")
        x = torch.randn(16, 4, generator=generator)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        ps.step()
    ps.finish()
    print("done")


if __name__ == "__main__":
    main()
