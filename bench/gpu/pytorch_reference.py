#!/usr/bin/env python3
"""PyTorch's time for the worker's MLP training step, on the same GPU.

The yardstick for bench/step_bench.cc: the same model (MLP with ReLU,
softmax cross-entropy), batch, optimizer (plain SGD) and precision, and the
same work per step: upload the batch from pageable host memory, forward,
backward, update, and read the loss back to the host (the worker's one wait
for the GPU per step). fp32 runs with TF32 off, as the CUDA backend's cuBLAS
does; bf16 runs the matrix products in bfloat16 with fp32 accumulation
(torch.autocast), as the backend's bf16 GEMMs do.

Run with the GPU host's own python3 (not part of the Bazel build):
  python3 bench/gpu/pytorch_reference.py --hidden=2048,2048 --batch_size=512

Prints one JSON line ({"bench":"pytorch_reference",...,"ms_per_step":...}).
Exit status: 0 measured; 2 bad arguments; 3 skipped (no PyTorch, or no CUDA
device visible to it), with one line saying why.
"""
import argparse
import json
import statistics
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_features", type=int, default=784)
    parser.add_argument("--hidden", default="2048,2048",
                        help="hidden layer sizes, comma-separated")
    parser.add_argument("--num_classes", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    try:
        hidden = [int(h) for h in args.hidden.split(",") if h]
    except ValueError:
        print(f"pytorch_reference: --hidden must be comma-separated integers, "
              f"got '{args.hidden}'", file=sys.stderr)
        return 2
    if min([args.num_features, args.num_classes, args.batch_size, args.steps]
           + hidden) <= 0:
        print("pytorch_reference: sizes and --steps must be positive",
              file=sys.stderr)
        return 2

    try:
        import torch
    except ImportError as error:
        print(f"pytorch_reference: skipped: no PyTorch here ({error})")
        return 3
    if not torch.cuda.is_available():
        print("pytorch_reference: skipped: PyTorch sees no CUDA device")
        return 3

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(1)

    sizes = [args.num_features] + hidden + [args.num_classes]
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    loss_fn = torch.nn.CrossEntropyLoss()

    # A few distinct host batches, cycled, so no step reuses a device copy.
    batches = [(torch.randn(args.batch_size, args.num_features),
                torch.randint(0, args.num_classes, (args.batch_size,)))
               for _ in range(4)]

    def step(i):
        x_host, y_host = batches[i % len(batches)]
        x = x_host.to(device)
        y = y_host.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16,
                            enabled=args.precision == "bf16"):
            logits = model(x)
        loss = loss_fn(logits.float(), y)
        loss.backward()
        optimizer.step()
        return loss.item()  # the one host wait per step

    for i in range(args.warmup_steps):
        step(i)
    torch.cuda.synchronize(device)
    times_ms = []
    loss = float("nan")
    for i in range(args.steps):
        start = time.perf_counter()
        loss = step(i)
        times_ms.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times_ms)
    print(json.dumps({
        "bench": "pytorch_reference",
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "model": "mlp",
        "sizes": sizes,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "optimizer": f"sgd lr {args.learning_rate}",
        "steps": args.steps,
        "ms_per_step": round(ms, 4),
        "examples_per_s": round(args.batch_size / ms * 1e3, 1),
        "final_loss": round(loss, 6),
    }, separators=(",", ":")))  # compact, as check.sh's json_field reads it
    return 0


if __name__ == "__main__":
    sys.exit(main())
