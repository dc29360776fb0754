#!/usr/bin/env bash
# Builds the GPU-host bundle: everything deploy/gpu/check.sh needs on a host
# with CUDA 13, nvcc, compute-sanitizer and PyTorch but no Bazel and no gRPC.
#
#   bazel build -c opt $(deploy/gpu/make_bundle.sh --print_targets)
#   deploy/gpu/make_bundle.sh [--tar] [--data=auto|yes|no] OUTDIR
#
# OUTDIR gets what deploy/gather_runtime.sh --no-cuda-libs gathers for the
# binaries below (bin/, lib/, run, MANIFEST; the host's own CUDA runtime and
# cuBLAS are used), plus check.sh, launch.sh (deploy/local), the PyTorch
# reference script, what the pstrain wheel is made of (python/: check.sh
# assembles it) and install_smoke.py, the Python tests, examples and
# torch_cuda_bench.py (check.sh's torch_cuda step),
# BUNDLE_INFO, and with --data the Fashion-MNIST .gz files
# of Debian's dataset-fashion-mnist under data/fashion-mnist (auto: when they
# are installed here). --tar also writes OUTDIR.tar.gz, the form to carry
# (the libraries compress ~3x; the .gz data does not).
#
# What is carried must stay under 60 MiB (the device tool carries at most
# 64 MiB per call): the tarball with --tar, else the folder. Over that, this
# fails with the sizes.
#
# Options for tests: --bin_root=DIR (where the built binaries are, default
# this repository's bazel-bin), --src_root=DIR (where the scripts are,
# default this repository).
#
# Exit status: 0 bundle written; 1 something missing or too large; 2 usage.
set -euo pipefail

readonly PROG=make_bundle.sh
readonly MAX_BUNDLE_MIB=60
# Built outputs, relative to bazel-bin. A leading "?" marks an optional one
# (taken when it was built: tests of layers that may not exist yet).
readonly BINARIES=(
  kernels/cuda_backend_test
  kernels/device_selection_test
  worker/embedding_bag_test
  worker/mlp_gpu_test
  ?worker/layers_test
  ?kernels/layer_ops_test
  bench/kernel_bench
  bench/step_bench
  bench/transport/ps_bench
  ps_server/ps_server
  worker/worker
)
readonly FASHION_MNIST_DIR=/usr/share/datasets/fashion-mnist

die() {
  printf '%s: %s\n' "$PROG" "$*" >&2
  exit 1
}
usage() {
  printf '%s: %s\nusage: %s [--tar] [--data=auto|yes|no] [--bin_root=DIR] [--src_root=DIR] OUTDIR\n       %s --print_targets\n' \
    "$PROG" "$1" "$PROG" "$PROG" >&2
  exit 2
}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin_root=$repo/bazel-bin
src_root=$repo
data=auto
tar=0
outdir=""
for arg in "$@"; do
  case "$arg" in
    --print_targets)
      for b in "${BINARIES[@]}"; do
        [[ $b == \?* ]] && continue
        printf '//%s:%s ' "$(dirname "$b")" "$(basename "$b")"
      done
      echo //worker/python:pstrain/_lib/libpstrain.so
      exit 0
      ;;
    --tar) tar=1 ;;
    --data=auto | --data=yes | --data=no) data=${arg#--data=} ;;
    --data=*) usage "--data must be auto, yes or no, got '${arg#--data=}'" ;;
    --bin_root=*) bin_root=${arg#--bin_root=} ;;
    --src_root=*) src_root=${arg#--src_root=} ;;
    -*) usage "unknown option $arg" ;;
    *)
      [[ -z $outdir ]] || usage "one OUTDIR only (got '$outdir' and '$arg')"
      outdir=$arg
      ;;
  esac
done
[[ -n $outdir ]] || usage "OUTDIR is missing"

binaries=()
for b in "${BINARIES[@]}"; do
  if [[ $b == \?* ]]; then
    b=${b#\?}
    [[ -x $bin_root/$b ]] || continue
  elif [[ ! -x $bin_root/$b ]]; then
    die "$bin_root/$b is not built: bazel build -c opt \$($0 --print_targets)"
  fi
  binaries+=("$bin_root/$b")
done

rm -rf "$outdir"
"$src_root/deploy/gather_runtime.sh" --no-cuda-libs "$outdir" "${binaries[@]}" >&2
install -m 0755 "$src_root/deploy/gpu/check.sh" "$outdir/check.sh"
install -m 0755 "$src_root/deploy/local/launch.sh" "$outdir/launch.sh"
install -m 0755 "$src_root/deploy/local/job_report.sh" "$outdir/job_report.sh"
install -m 0755 "$src_root/deploy/local/free_ports.py" "$outdir/free_ports.py"
install -m 0755 "$src_root/bench/gpu/pytorch_reference.py" "$outdir/pytorch_reference.py"
# What the pstrain wheel is made of, and the script that makes it: check.sh's
# pstrain_torch step assembles the wheel there (its libraries are lib/'s
# files, so carrying the wheel would carry them twice) and pip installs it
# into the host's PyTorch environment; install_smoke.py tries it.
install -m 0755 "$src_root/tests/python/install_smoke.py" "$outdir/install_smoke.py"
# check.sh's torch_cuda step: the Python suite's tests and the examples, run
# on cuda against the installed wheel, and the pstrain.torch GPU benchmark.
mkdir -p "$outdir/tests/python" "$outdir/python/examples"
install -m 0644 "$src_root"/tests/python/*.py "$outdir/tests/python/"
install -m 0644 "$src_root"/worker/python/examples/*.py "$outdir/python/examples/"
install -m 0755 "$src_root/bench/gpu/torch_cuda_bench.py" "$outdir/torch_cuda_bench.py"
mkdir -p "$outdir/python/pstrain"
install -m 0755 "$src_root/worker/python/make_wheel.py" "$outdir/python/make_wheel.py"
install -m 0644 "$src_root"/worker/python/pstrain/*.py "$outdir/python/pstrain/"
[[ -f $bin_root/worker/python/pstrain/_lib/libpstrain.so ]] ||
  die "$bin_root/worker/python/pstrain/_lib/libpstrain.so is not built: bazel build -c opt \$($0 --print_targets)"
install -m 0755 "$bin_root/worker/python/pstrain/_lib/libpstrain.so" "$outdir/python/libpstrain.so"
sed -n 's/^PSTRAIN_VERSION = "\(.*\)"$/\1/p' "$src_root/worker/python/version.bzl" >"$outdir/python/VERSION"
install -m 0644 "$src_root/deploy/gpu/README.md" "$outdir/README.md"

if [[ $data == yes || ($data == auto && -d $FASHION_MNIST_DIR) ]]; then
  [[ -d $FASHION_MNIST_DIR ]] ||
    die "--data=yes but $FASHION_MNIST_DIR is missing (apt-get install dataset-fashion-mnist)"
  mkdir -p "$outdir/data/fashion-mnist"
  cp "$FASHION_MNIST_DIR"/*-ubyte.gz "$outdir/data/fashion-mnist/"
fi

commit=$(git -C "$src_root" rev-parse --short HEAD 2>/dev/null || echo unknown)
{
  echo "commit: $commit"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  echo "binaries: ${binaries[*]##*/}"
  echo "data: $(ls "$outdir/data" 2>/dev/null || echo none)"
} >"$outdir/BUNDLE_INFO"

mib() { echo $((($1 + (1 << 20) - 1) >> 20)); }
folder_bytes=$(du -sb "$outdir" | cut -f1)
carried=$outdir
carried_bytes=$folder_bytes
if ((tar)); then
  tar -czf "$outdir.tar.gz" -C "$(dirname "$outdir")" "$(basename "$outdir")"
  carried=$outdir.tar.gz
  carried_bytes=$(stat -c %s "$carried")
fi
if ((carried_bytes >= MAX_BUNDLE_MIB << 20)); then
  die "$carried is $(mib "$carried_bytes") MiB, over the $MAX_BUNDLE_MIB MiB limit" \
    "(folder $(mib "$folder_bytes") MiB; --tar compresses it, --data=no leaves the data out)"
fi
echo "$PROG: $carried: $(mib "$carried_bytes") MiB (folder $(mib "$folder_bytes") MiB, limit $MAX_BUNDLE_MIB MiB), commit $commit"
