"""A Python pstrain worker for the tests: trains a small model on the
synthetic task with pstrain.torch and saves what the test checks.

  train_worker.py --model=mlp --steps=N --batch=b --out=DIR
      [--pipeline=auto|on|off]
      [--edit=none|accumulate|torch_clip|ps_clip|extra_forward|stats]
      [--edit_from=STEP] [--sigterm_at_step=STEP]
      [--sigint_and_go_on_at_steps=STEP,...]

The model's initial values come from --seed (worker 0's are the job's).
Writes DIR/worker{k}.pt (the final state_dict) and prints a final JSON line.
"""

import argparse
import os
import signal
import time

import torch

import pstrain
import pstrain.data
import pstrain.torch

FEATURES, CLASSES = 12, 3


def device():
    """Where the tests' models train: $PSTRAIN_TEST_DEVICE, the CPU unless
    the GPU host's check (deploy/gpu/check.sh) runs them on cuda."""
    return torch.device(os.environ.get("PSTRAIN_TEST_DEVICE", "cpu"))


def make_model(name, seed):
    return _make_model(name, seed).to(device())


def batch(batches, step):
    x, y = batches.batch(step)
    return x.to(device()), y.to(device())


def _make_model(name, seed):
    torch.manual_seed(seed)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16),
                                   torch.nn.ReLU(),
                                   torch.nn.Linear(16, CLASSES))
    if name == "probe":  # every element = minus the updates applied
        model = torch.nn.Module()
        model.p = torch.nn.Parameter(torch.zeros(1000))
        return model
    if name == "mixed":  # a frozen layer, and one forward never calls
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16),
                                    torch.nn.ReLU(),
                                    torch.nn.Linear(16, CLASSES))
        model[0].weight.requires_grad_(False)
        model.unused = torch.nn.Linear(CLASSES, CLASSES)
        return model
    if name == "bn":  # with buffers and dropout
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16),
                                   torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Dropout(0.1),
                                   torch.nn.Linear(16, CLASSES))
    raise ValueError(name)


def examples():
    return pstrain.data.synthetic(1000, num_features=FEATURES,
                                  num_classes=CLASSES, seed=11)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--step_delay_ms", type=float, default=0)
    parser.add_argument("--out", default=".")
    # ParameterServer(pipeline=...), and what the script does to the
    # gradients between backward() and step() from step --edit_from on:
    # two backward passes of half batches (accumulation), torch's clip,
    # pstrain's, or a forward pass (a buffer changed); or a call to the
    # servers there (stats).
    parser.add_argument("--pipeline", choices=["auto", "on", "off"],
                        default="auto")
    parser.add_argument("--edit", default="none",
                        choices=["none", "accumulate", "torch_clip",
                                 "ps_clip", "extra_forward", "stats"])
    parser.add_argument("--edit_from", type=int, default=0)
    # model.zero_grad(set_to_none=True) after each step (torch 2's
    # optimizer.zero_grad() default): backward then makes new tensors.
    parser.add_argument("--zero_grad_to_none", action="store_true")
    # A client option: the gradients' wire type (bf16: converted by the
    # client, so a pipelined step falls back to the plain PushPull).
    parser.add_argument("--gradient_wire_type", default="")
    # Sends itself SIGTERM after backward of this step (as a launcher's
    # stop would reach it mid-step).
    parser.add_argument("--sigterm_at_step", type=int, default=-1)
    # Sends itself SIGINT (Ctrl-C) after backward of each of these steps,
    # catches the KeyboardInterrupt the stop raises, and trains on in the
    # same process with a new ParameterServer (a notebook's cell run again).
    parser.add_argument("--sigint_and_go_on_at_steps", default="",
                        help="comma-separated steps")
    args = parser.parse_args()
    args.sigint_steps = {int(s) for s in
                         args.sigint_and_go_on_at_steps.split(",") if s}
    torch.set_num_threads(1)
    model = make_model(args.model, args.seed)
    options = {}
    if args.gradient_wire_type:
        options["gradient_wire_type"] = args.gradient_wire_type
    pipeline = {"auto": "auto", "on": True, "off": False}[args.pipeline]
    ps = pstrain.torch.ParameterServer(model, pipeline=pipeline, **options)
    batches = pstrain.data.Batches(examples(), args.batch, ps.worker_id,
                                   ps.num_workers, seed=5)
    while True:
        try:
            loss = train(args, model, ps, batches)
            break
        except KeyboardInterrupt:
            if not args.sigint_and_go_on_at_steps:
                raise
            print("interrupted; training on", flush=True)
            model.zero_grad()
            ps = pstrain.torch.ParameterServer(model, pipeline=pipeline,
                                               **options)
    how = ps.finish()
    torch.save(model.state_dict(),
               os.path.join(args.out, f"worker{ps.worker_id}.pt"))
    pstrain.print_final(worker_id=ps.worker_id, mode=ps.mode,
                        start_step=ps.start_step,
                        steps_run=args.steps - ps.start_step,
                        final_model=how,
                        pipelined_steps=ps.pipelined_steps,
                        pipelined_calls=ps.pipelined_calls,
                        loss=None if loss is None else loss.item())


def train(args, model, ps, batches):
    """Trains from the job's step to --steps; returns the last loss."""
    loss = None
    for step in range(ps.step_count, args.steps):
        # Dropout's masks a function of the step: a resumed job draws what
        # the undisturbed one drew.
        torch.manual_seed(args.seed * 100003 + step)
        x, y = batch(batches, step)
        edit = args.edit if step >= args.edit_from else "none"
        if args.model == "probe":  # the gradient is 1 everywhere
            loss = model.p.sum()
            loss.backward()
        elif edit == "accumulate":
            half = len(x) // 2
            for part in (slice(0, half), slice(half, None)):
                loss = torch.nn.functional.cross_entropy(
                    model(x[part]), y[part]) / 2
                loss.backward()
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        if edit == "torch_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif edit == "ps_clip":
            ps.clip_grad_norm_(0.5)
        elif edit == "extra_forward":  # BatchNorm's statistics move again
            with torch.no_grad():
                model(x)
        elif edit == "stats":  # not an edit: a call to the servers
            ps.stats()
        if step == args.sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if step in args.sigint_steps:
            args.sigint_steps.remove(step)  # once
            os.kill(os.getpid(), signal.SIGINT)
        if args.step_delay_ms:
            time.sleep(args.step_delay_ms / 1000)  # a slow worker, on purpose
        ps.step()
        if args.zero_grad_to_none:
            model.zero_grad(set_to_none=True)
        print(f"step {step + 1}", flush=True)
    return loss


if __name__ == "__main__":
    main()
