"""A pstrain worker that trains with a recipe of optim_recipes.py: the
user's optimizer, scheduler and clipping handed to pstrain.torch as a user's
script would.

  optim_worker.py --recipe=NAME --steps=N --batch=b --out=DIR [--start_at=S]

Writes DIR/worker{k}.pt (the final state_dict), the rate of each step to
DIR/rates{k}.txt and, for a clipped recipe, ps.last_grad_norm after each
step to DIR/norms{k}.txt, and prints a final JSON line.
"""

import argparse
import os

import torch

import pstrain
import pstrain.data
import pstrain.torch
from tests.python import optim_recipes
from tests.python import train_worker


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=optim_recipes.STEPS)
    parser.add_argument("--stop_after", type=int, default=-1,
                        help="leave after this many steps (a job stopped "
                        "mid-schedule)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = train_worker.make_model(args.model, args.seed)
    optimizer, scheduler, max_norm = optim_recipes.build(args.recipe, model,
                                                         args.steps)
    ps = pstrain.torch.ParameterServer(model, optimizer=optimizer,
                                       scheduler=scheduler)
    batches = pstrain.data.Batches(train_worker.examples(), args.batch,
                                   ps.worker_id, ps.num_workers, seed=5)
    rates = []
    norms = []
    end = args.steps if args.stop_after < 0 else args.stop_after
    for step in range(ps.step_count, end):
        # Dropout's masks a function of the step, so that a resumed job
        # draws what the uninterrupted one drew.
        torch.manual_seed(args.seed * 100003 + step)
        x, y = train_worker.batch(batches, step)
        if args.model == "probe":  # the gradient is 1 everywhere
            model.p.sum().backward()
        else:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if max_norm is not None:
            ps.clip_grad_norm_(max_norm)
        rates.append(optimizer.param_groups[0]["lr"])
        ps.step()
        if max_norm is not None:
            norms.append(ps.last_grad_norm)
        if scheduler is not None:
            scheduler.step()
    how = ps.finish()
    torch.save(model.state_dict(),
               os.path.join(args.out, f"worker{ps.worker_id}.pt"))
    with open(os.path.join(args.out, f"rates{ps.worker_id}.txt"), "a") as f:
        f.writelines(f"{r!r}\n" for r in rates)
    if norms:
        with open(os.path.join(args.out, f"norms{ps.worker_id}.txt"),
                  "a") as f:
            f.writelines(f"{n!r}\n" for n in norms)
    pstrain.print_final(worker_id=ps.worker_id, mode=ps.mode,
                        start_step=ps.start_step, final_model=how,
                        steps_run=end - ps.start_step,
                        final_state=ps.final_state)


if __name__ == "__main__":
    main()
