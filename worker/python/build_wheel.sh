#!/usr/bin/env bash
# Builds the pstrain wheel (//worker/python:wheel) into dist/ and prints its
# path: a wheel for any CPython 3 on x86-64 Linux with glibc >= 2.34, the C++
# client and the shared libraries it needs inside (worker/python/make_wheel.py).
# Install it into the environment that runs your training script:
#
#   python3 -m venv --system-site-packages ~/venv   # or your conda env
#   ~/venv/bin/pip install "$(worker/python/build_wheel.sh)"
#
# Nothing is downloaded: the wheel declares no dependencies (numpy and torch
# are the user's), so pip never touches the torch you have.
set -euo pipefail
cd "$(dirname "$0")/../.."

bazel build //worker/python:wheel >&2
wheel=$(ls bazel-bin/worker/python/pstrain-*.whl)
mkdir -p dist
cp -f "$wheel" dist/
chmod 644 "dist/$(basename "$wheel")"
echo "$PWD/dist/$(basename "$wheel")"
