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
expect '^job ctr_cpu +PASS +AUC 0\.[0-9]+'
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "dry_run_test: this machine has a GPU: the GPU steps ran for real"
else
  expect '^gpu present +SKIP +no GPU'
  expect '^parity cuda_backend_test +SKIP .*no GPU'
  expect '^kernel_bench +SKIP .*no GPU'
  expect '^jobs on 1 and 2 GPUs .* SKIP .*no GPU'
  expect '^pytorch reference.* SKIP'
  # The wheel, assembled from the bundle and pip installed, runs a step.
  expect '^pstrain.torch install +PASS +CPython 3'
  expect '^pstrain.torch cpu step +PASS'
  expect '^exchange alone +INFO +[0-9.]+ ms'
  expect '^pstrain.torch tests on cuda +SKIP .*no GPU'
  # Replicated shards need no GPU: the jobs run, with their CPU.
  expect '^replication CPU a step, R=1 / R=2 +INFO +[0-9.]+ / [0-9.]+ ms'
  expect '^goal: sync step R=2 vs R=1 \(loopback\) +(MET|MISSED) +[0-9.]+x'
  expect '^replication network wait a step, R=1 / R=2 +INFO +[0-9.]+ / [0-9.]+ ms'
  expect '^replication record path \(R=2\) +INFO +confirm [0-9.]+ ms, send [0-9.]+ ms, backup apply [0-9.]+ ms'
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
# The GPU-only branches (sanitizer counts, kernel_bench goals, step_bench and
# PyTorch ratios) with stand-ins for nvidia-smi, compute-sanitizer and the
# GPU programs, so a bash or parsing slip there shows here and not on a
# rented GPU. The figures are made up; only the arithmetic is checked.
fake=$work/fake
mkdir -p "$fake/path"
cp -r "$unpacked" "$fake/bundle"
cat >"$fake/path/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "$*" in
  -L) echo "GPU 0: Stand-in GPU (UUID: GPU-0)" ;;
  *memory*) echo "Stand-in GPU, 81559 MiB, 580.00, 9.0" ;;
  *) echo "Stand-in GPU" ;;
esac
EOF
# Runs the bundle's worker (its cuda:0 stood in by cpu_staged, which stages
# as a GPU worker does), so the sanitized pipelined job runs end to end;
# other programs not at all.
cat >"$fake/path/compute-sanitizer" <<'EOF'
#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift 2; done
program=$1
shift
status=0
if [[ $program == */worker ]]; then
  args=()
  for arg in "$@"; do
    [[ $arg == --device=cuda:0 ]] && arg=--device=cpu_staged
    args+=("$arg")
  done
  "$program" "${args[@]}" || status=$?
fi
echo "========= ERROR SUMMARY: 0 errors"
exit "$status"
EOF
cat >"$fake/bundle/bin/kernel_bench" <<'EOF'
#!/usr/bin/env bash
echo '{"bench":"kernel","op":"cudaMemcpy D2D (baseline)","shape":"s","gbps":3000,"ratio_to_d2d":1.0}'
echo '{"bench":"kernel","op":"Relu","shape":"s","gbps":2700,"ratio_to_d2d":0.9}'
echo '{"bench":"kernel","op":"Gather","shape":"s","gbps":1500,"ratio_to_d2d":0.5}'
echo '{"bench":"kernel","op":"Gemm fp32","shape":"s","tflops":45,"ratio_to_sgemm":0.95}'
EOF
cat >"$fake/bundle/bin/step_bench" <<'EOF'
#!/usr/bin/env bash
case "$*" in
  *--devices=cpu,cuda:0*)
    echo '{"bench":"step","device":"cpu","backend":"cpu","ms_per_step":900.0}'
    echo '{"bench":"step","device":"cuda:0","backend":"cuda:0 (x)","ms_per_step":3.0}' ;;
  *bf16*) echo '{"bench":"step","device":"cuda:0","backend":"cuda:0 (x) bf16","ms_per_step":2.0}' ;;
  *) echo '{"bench":"step","device":"cuda:0","backend":"cuda:0 (x)","ms_per_step":3.0,"seconds_to_target":4.5,"steps_to_target":800}' ;;
esac
EOF
cat >"$fake/bundle/pytorch_reference.py" <<'EOF'
import sys
bf16 = "--precision=bf16" in sys.argv
print('{"bench":"pytorch_reference","ms_per_step":%s}' % ("1.0" if bf16 else "2.5"))
EOF
chmod +x "$fake/path"/* "$fake/bundle/bin/kernel_bench" "$fake/bundle/bin/step_bench"
status=0
PATH=$fake/path:$PATH "$fake/bundle/check.sh" --quick \
  --steps=sanitizer,kernel_bench,step_bench,pytorch --results="$fake/results" \
  >"$fake/check.txt" 2>&1 || status=$?
summary=$fake/results/summary.txt
[[ -f $summary ]] || fail "stand-in GPU run: no summary; $(tail -20 "$fake/check.txt")"
cat "$summary"
((status == 0)) || fail "stand-in GPU run exited $status"
expect '^gpu present +PASS +1 GPU'
expect '^sanitizer memcheck cuda_backend_test +PASS +0 errors'
expect '^sanitizer memcheck pipelined job +PASS +0 errors'
expect '^sanitizer synccheck pipelined job +PASS +0 errors'
expect '^goal: elementwise/memory-bound ops vs D2D \(worst\) +MISSED +0.50x +Gather'
expect '^goal: Gemm fp32 vs cuBLAS \(best shape\) +MET +0.95x'
expect '^step_bench cuda:0 fp32 +PASS +3.0 ms/step +300.00x the CPU step'
expect '^step_bench cuda:0 bf16 +PASS +2.0 ms/step +450.00x'
expect '^time to accuracy 0.9 \(step_bench\) +INFO +cuda:0 4.5 s +800 steps; the CPU would need ~720.0 s'
expect '^goal: worker step / PyTorch step, fp32 +MET +1.20x'
expect '^goal: worker step / PyTorch step, bf16 +MISSED +2.00x'
expect '^RESULT: PASSED .* on 1 GPU'
echo "dry_run_test: PASS"
