#!/usr/bin/env bash
# The GPU check's dry run, as the suite's test: make the bundle the way the
# README says (make_bundle.sh --tar), unpack the tarball somewhere else, run
# check.sh --quick from it, and check the summary. On this CPU-only machine
# the GPU steps must read SKIP with a plain "no GPU" reason, the CPU steps
# PASS, and the exit status 0.
#
#   bazel test //deploy/gpu:dry_run_test
set -euo pipefail

fail() {
  echo "dry_run_test: FAIL: $*" >&2
  exit 1
}

root=${RUNFILES_DIR:-${TEST_SRCDIR:?run under bazel test}}/pstrain
work=${TEST_TMPDIR:-$(mktemp -d)}
bundle=$work/out/gpu-bundle

# The runfiles tree is the bazel-bin of the real flow.
"$root/deploy/gpu/make_bundle.sh" --tar --bin_root="$root" --src_root="$root" \
  "$bundle" >"$work/make_bundle.txt" 2>&1 ||
  fail "make_bundle.sh failed: $(tail -5 "$work/make_bundle.txt")"
grep -q 'limit 60 MiB' "$work/make_bundle.txt" ||
  fail "make_bundle.sh did not report the size: $(cat "$work/make_bundle.txt")"
[[ -f $bundle.tar.gz ]] || fail "no $bundle.tar.gz"

# Unpacked elsewhere, with the build's folder gone: the bundle must be
# self-contained.
mkdir -p "$work/host"
tar -xzf "$bundle.tar.gz" -C "$work/host"
rm -rf "$bundle"
unpacked=$work/host/gpu-bundle
for f in check.sh launch.sh pytorch_reference.py README.md BUNDLE_INFO run \
  bin/worker bin/ps_server bin/cuda_backend_test bin/kernel_bench bin/step_bench; do
  [[ -e $unpacked/$f ]] || fail "the bundle has no $f"
done
for lib in "$unpacked"/lib/libcudart.so* "$unpacked"/lib/libcublas*.so*; do
  [[ -e $lib ]] && fail "the bundle carries $lib (it must use the GPU host's own CUDA libraries)"
done

status=0
(cd "$work/host" && ./gpu-bundle/check.sh --quick --results="$work/results") \
  >"$work/check.txt" 2>&1 || status=$?
summary=$work/results/summary.txt
[[ -f $summary ]] || fail "no summary.txt; output: $(tail -20 "$work/check.txt")"
cat "$summary"
((status == 0)) || fail "check.sh exited $status"

expect() {
  grep -E -q "$1" "$summary" || fail "no line matching '$1' in the summary"
}
expect '^parity device_selection_test +PASS'
expect '^step_bench cpu fp32 +PASS'
expect '^job cpu_1worker +PASS +[0-9.]+ samples/s'
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "dry_run_test: this machine has a GPU: the GPU steps ran for real"
else
  expect '^gpu present +SKIP +no GPU'
  expect '^parity cuda_backend_test +SKIP .*no GPU'
  expect '^kernel_bench +SKIP .*no GPU'
  expect '^jobs on 1 and 2 GPUs .* SKIP .*no GPU'
  expect '^pytorch reference.* SKIP'
  expect '^RESULT: PASSED .*dry run: no GPU, GPU steps skipped'
  # A "skip" must never be a test that ran into a GPU and broke.
  if grep -E '^(parity|job|step_bench).* FAIL' "$summary"; then
    fail "a CPU step failed"
  fi
fi

# --require_gpu on a machine without one is a failure, not a pass.
if ! command -v nvidia-smi >/dev/null; then
  status=0
  (cd "$work/host" && ./gpu-bundle/check.sh --quick --require_gpu \
    --results="$work/results_required") >/dev/null 2>&1 || status=$?
  ((status == 1)) || fail "--require_gpu without a GPU exited $status, not 1"
fi
echo "dry_run_test: PASS"
