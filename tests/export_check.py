#!/usr/bin/python3
"""Checks a pstrain model file the way a user outside pstrain would read it.

Usage: export_check.py MODEL.safetensors DATA.csv LOGITS.csv|LOGITS.npy...

Parses the safetensors file with nothing but json, struct and numpy (no
safetensors package), computes the MLP's logits for the CSV's examples
(label first, then features) in numpy, and compares them with each logits
file the worker wrote. Exits 0 when every element agrees within 1e-4,
1 otherwise; prints the largest difference either way.
"""
import json
import struct
import sys

try:
    import numpy as np
except ImportError:
    sys.exit("export_check.py needs Debian's python3-numpy for /usr/bin/python3 "
             "(deploy/setup.sh installs it)")

TOLERANCE = 1e-4
DTYPES = {"F32": "<f4", "I64": "<i8", "U64": "<u8"}


def load_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (header_length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_length].decode("utf-8"))
    data = blob[8 + header_length:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(data[begin:end], dtype=DTYPES[entry["dtype"]])
        tensors[name] = array.reshape(entry["shape"])
    return tensors, metadata


def mlp_logits(tensors, features):
    """input -> [Linear -> ReLU] per hidden layer -> Linear (worker/model.h)."""
    layers = sorted(int(name[2:-len("/weight")]) for name in tensors
                    if name.startswith("fc") and name.endswith("/weight"))
    x = features.astype(np.float64)
    for i, layer in enumerate(layers):
        weight = tensors["fc%d/weight" % layer].astype(np.float64)  # [in, out]
        bias = tensors["fc%d/bias" % layer].astype(np.float64)
        x = x @ weight + bias
        if i + 1 < len(layers):
            x = np.maximum(x, 0)
    return x


def main(argv):
    if len(argv) < 4:
        print(__doc__)
        return 2
    tensors, metadata = load_safetensors(argv[1])
    print("model: %s, step %s" % (
        ", ".join("%s %s" % (n, list(t.shape)) for n, t in tensors.items()),
        metadata.get("step")))
    rows = np.loadtxt(argv[2], delimiter=",", ndmin=2)
    expected = mlp_logits(tensors, rows[:, 1:])
    worst = 0.0
    for path in argv[3:]:
        if path.endswith(".npy"):
            got = np.load(path)
        else:
            got = np.loadtxt(path, delimiter=",", ndmin=2)
        if got.shape != expected.shape:
            print("%s: shape %s, numpy computed %s" %
                  (path, got.shape, expected.shape))
            return 1
        difference = float(np.max(np.abs(got - expected)))
        print("%s: max |worker - numpy| = %.3g over %d logits" %
              (path, difference, got.size))
        worst = max(worst, difference)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
