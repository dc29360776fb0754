#!/usr/bin/env bash
# Gathers built binaries and the shared libraries they load into one folder
# that runs on a host with no build toolchain, no Bazel and no -dev packages
# (gRPC, protobuf, Abseil, glog, the CUDA runtime and cuBLAS come along).
#
#   deploy/gather_runtime.sh [--no-cuda-libs] OUTDIR BINARY...
#
#   OUTDIR/bin/<binary>      the binaries, as built
#   OUTDIR/lib/              every shared library they need (ldd, recursively)
#                            except the C library's own and the GPU driver's
#   OUTDIR/run               a wrapper: OUTDIR/run <binary> [args...]
#   OUTDIR/MANIFEST          where each library came from
#
# Run them with `OUTDIR/run worker --help`, or
# `LD_LIBRARY_PATH=OUTDIR/lib OUTDIR/bin/worker --help`.
#
# Left out on purpose:
#  - glibc (libc, libm, libpthread, libdl, librt, ld-linux, ...): it must be
#    the target host's own, and must be at least as new as this build host's.
#  - libcuda.so / libnvidia-*: the GPU driver's user-space half has to match
#    the host's kernel driver, so it always comes from the target host.
#    (libcudart loads it at run time; a host without one runs on the CPU.)
# Everything else is copied, libstdc++ included, so an older target
# distribution still runs these binaries.
#
# --no-cuda-libs also leaves out the CUDA runtime and cuBLAS (libcudart,
# libcublas, libcublasLt: ~570 MB of the total) for GPU hosts that have the
# same CUDA major version installed; `run` then looks for them in
# $PSTRAIN_CUDA_LIB_DIR, else /usr/local/cuda/lib64 (the binaries' own
# RUNPATH also names the build host's toolkit directory).
#
# For the GPU-host check, deploy/gpu/make_bundle.sh calls this with the
# right binaries and adds the scripts (see deploy/gpu/README.md).
#
# Example, for running the tests and benchmarks on a GPU host by hand:
#   bazel build -c opt //kernels:cuda_backend_test //bench:kernel_bench \
#       //bench:step_bench //worker:worker
#   deploy/gather_runtime.sh /tmp/pstrain-gpu bazel-bin/kernels/cuda_backend_test \
#       bazel-bin/bench/kernel_bench bazel-bin/bench/step_bench bazel-bin/worker/worker
#   scp -r /tmp/pstrain-gpu gpuhost: && ssh gpuhost pstrain-gpu/run cuda_backend_test
set -euo pipefail

usage() {
  echo "usage: $0 [--no-cuda-libs] OUTDIR BINARY..." >&2
  exit 2
}
cuda_libs=1
if [[ ${1:-} == --no-cuda-libs ]]; then
  cuda_libs=0
  shift
fi
(($# >= 2)) || usage
outdir=$1
shift

# Libraries that must come from the target host (see above).
is_host_library() {
  case "$1" in
    linux-vdso.so* | linux-gate.so* | ld-linux*.so* | ld64.so*) return 0 ;;
    libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so*) return 0 ;;
    libresolv.so* | libutil.so* | libnsl.so* | libanl.so* | libcrypt.so.1*) return 0 ;;
    libmvec.so* | libBrokenLocale.so* | libnss_*.so*) return 0 ;;
    libcuda.so* | libnvidia-*.so* | libcudadebugger.so*) return 0 ;;
  esac
  return 1
}

mkdir -p "$outdir/bin" "$outdir/lib"
manifest="$outdir/MANIFEST"
: >"$manifest"

for binary in "$@"; do
  if [[ ! -f "$binary" || ! -x "$binary" ]]; then
    echo "gather_runtime: $binary is not an executable file" >&2
    exit 1
  fi
  # bazel-bin paths are links into the output base; copy what they point to.
  install -m 0755 "$(readlink -f "$binary")" "$outdir/bin/$(basename "$binary")"
  # ldd resolves the whole dependency tree (with the binary's RUNPATH, so
  # Bazel's per-target _solib_* libraries of dynamically linked tests too).
  # "not found" means the binary would not run here either: stop.
  if ldd "$binary" | grep -q "not found"; then
    echo "gather_runtime: $binary has unresolved libraries:" >&2
    ldd "$binary" | grep "not found" >&2
    exit 1
  fi
  while read -r name path; do
    is_host_library "$name" && continue
    if ((!cuda_libs)); then
      case "$name" in libcudart.so* | libcublas.so* | libcublasLt.so*) continue ;; esac
    fi
    [[ -e "$outdir/lib/$name" ]] && continue
    # Copy the file itself under the name the loader asks for (the SONAME),
    # not the development symlink chain.
    install -m 0644 "$(readlink -f "$path")" "$outdir/lib/$name"
    echo "$name <- $(readlink -f "$path")" >>"$manifest"
  done < <(ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }')
done

cat >"$outdir/run" <<'WRAPPER'
#!/usr/bin/env bash
# Runs one of the gathered binaries with the gathered libraries first on the
# loader's path: run BINARY [ARGS...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
(($# >= 1)) || { echo "usage: $0 BINARY [ARGS...]; binaries: $(ls "$here/bin")" >&2; exit 2; }
binary=$1
shift
# After the gathered libraries: a CUDA toolkit's, for a --no-cuda-libs
# gathering (harmless otherwise: the gathered ones come first).
cuda_lib_dir=${PSTRAIN_CUDA_LIB_DIR:-/usr/local/cuda/lib64}
export LD_LIBRARY_PATH="$here/lib:$cuda_lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/$binary" "$@"
WRAPPER
chmod 0755 "$outdir/run"

sort -u -o "$manifest" "$manifest"
echo "gather_runtime: $# binaries and $(find "$outdir/lib" -type f | wc -l) libraries" \
  "($(du -sh "$outdir" | cut -f1)) in $outdir"
