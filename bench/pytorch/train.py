"""One process of the PyTorch benchmark (bench/pytorch_vs_ddp.sh): the same
model, data order, optimizer and global batch, trained three ways.

  --backend=pstrain  a pstrain.torch worker (launched by launch.sh --python;
                     the optimizer runs on the servers: the script's
                     torch.optim.Adam handed to them, or with
                     --optimizer_from=servers their own --optimizer=adam)
  --backend=ddp      one rank of torch.nn.parallel.DistributedDataParallel
                     over gloo (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
  --backend=local    one process, the whole global batch (--global_batch)

Every backend takes worker k's slice of each global batch in the job's
order (pstrain.data.Batches), uses Adam (lr 0.001), and ends with a final
JSON line: wall time, steps, and the final model's held-out accuracy.
"""

import argparse
import os
import time

import torch
from torch import nn

import pstrain
import pstrain.data
import pstrain.torch


def make_model(name):
    torch.manual_seed(1)
    if name == "mlp":  # the C++ worker's --model=mlp --hidden=256,128
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(),
                             nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "cnn":  # conv32-conv64-dense128, as issue 23's figures
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
            nn.Linear(128, 10))
    raise ValueError(name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["pstrain", "ddp", "local"])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--optimizer_from", choices=["script", "servers"],
                        default="script",
                        help="pstrain: hand the servers this script's Adam "
                        "(its rate travels with every step), or run theirs")
    parser.add_argument("--pipeline", choices=["auto", "on", "off"],
                        default="auto",
                        help="pstrain: ParameterServer(pipeline=...): the "
                        "exchange started during backward (on), or not")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.backend == "pstrain":
        ps = pstrain.torch.ParameterServer(
            model,
            optimizer=optimizer if args.optimizer_from == "script" else None,
            pipeline={"auto": "auto", "on": True, "off": False}[args.pipeline])
        rank, world = ps.worker_id, ps.num_workers
    elif args.backend == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(model)
    else:
        rank, world = 0, 1
    shape = (1, 28, 28) if args.model == "cnn" else (784,)
    batches = pstrain.data.Batches(pstrain.data.fashion_mnist(),
                                   args.global_batch // world, rank, world,
                                   shape=shape)
    steps = int(args.epochs * batches.steps_per_epoch)
    # Where a step's time goes: forward and backward (DDP's all-reduce runs
    # inside backward), then the update (ps.step's PushPull, or the local
    # optimizer).
    compute = update = 0.0
    start = time.time()
    for step in range(steps):
        x, y = batches.batch(step)
        began = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        computed = time.perf_counter()
        if args.backend == "pstrain":
            ps.step()
        else:
            optimizer.step()
            optimizer.zero_grad()
        compute += computed - began
        update += time.perf_counter() - computed
    wall = time.time() - start
    pipelined = 0
    if args.backend == "pstrain":
        pipelined = ps.pipelined_steps
        ps.finish()
    _, accuracy = pstrain.data.evaluate(
        model, pstrain.data.fashion_mnist(train=False), shape=shape)
    pstrain.print_final(backend=args.backend, model=args.model, worker_id=rank,
                        optimizer_from=args.optimizer_from,
                        num_workers=world, steps=steps, wall_time_s=wall,
                        compute_s=round(compute, 3), update_s=round(update, 3),
                        job_samples_per_sec=steps * args.global_batch / wall,
                        pipelined_steps=pipelined,
                        test_accuracy=round(accuracy, 4))
    if args.backend == "ddp":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
