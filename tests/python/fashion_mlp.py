"""An MLP on Fashion-MNIST as a pstrain worker, or with --local as one
plain torch process (Adam): the tests compare the two."""

import argparse

import torch

import pstrain
import pstrain.data
import pstrain.torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    if args.local:
        worker_id, num_workers, start = 0, 1, 0
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        ps = pstrain.torch.ParameterServer(model)
        worker_id, num_workers, start = ps.worker_id, ps.num_workers, ps.step_count
    batches = pstrain.data.Batches(pstrain.data.fashion_mnist(),
                                   args.global_batch // num_workers, worker_id,
                                   num_workers)
    steps = int(args.epochs * batches.steps_per_epoch)
    for step in range(start, steps):
        x, y = batches.batch(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if args.local:
            optimizer.step()
            optimizer.zero_grad()
        else:
            ps.step()
    how = "local" if args.local else ps.finish()
    _, accuracy = pstrain.data.evaluate(model,
                                        pstrain.data.fashion_mnist(train=False))
    pstrain.print_final(worker_id=worker_id, test_accuracy=round(accuracy, 4),
                        final_model=how, steps=steps)


if __name__ == "__main__":
    main()
