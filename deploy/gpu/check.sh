#!/usr/bin/env bash
# shellcheck disable=SC2317  # the steps are functions called as "step_$name"
# The GPU path, checked and measured in one go, from an unpacked bundle
# (deploy/gpu/make_bundle.sh) on a host with CUDA 13, compute-sanitizer and
# PyTorch; no Bazel, no gRPC needed. See deploy/gpu/README.md.
#
#   BUNDLE/check.sh [--results=DIR] [--quick] [--require_gpu]
#                   [--steps=STEP,...] [--deadline_s=N]
#                   [--data=auto|synthetic|fashion_mnist]
#
# Steps (each a row of the summary table; GPU steps are SKIPPED, with the
# reason, on a machine without a GPU, which is the dry run):
#   1. parity: every test binary of the bundle (GPU tests against the CPU
#      backend). With a GPU present PSTRAIN_REQUIRE_GPU=1 is set, so a GPU
#      test that cannot use the GPU fails instead of skipping.
#   2. the GPU tests again under compute-sanitizer memcheck, racecheck and
#      synccheck (0 errors required).
#   3. kernel_bench: each op against the device's D2D copy bandwidth and
#      cuBLAS rate (goals: memory-bound ops >= 0.8 of D2D, GEMM ~ cuBLAS).
#   4. step_bench: the MLP training step, compute alone, CPU vs cuda:0 (fp32
#      and bf16), and the GPU's time to a target accuracy.
#   5. the same training job through CPU parameter servers on this host:
#      workers on the CPU, one worker on cuda:0, two workers sharing cuda:0,
#      two workers on two GPUs (where present); fp32 and bf16; samples/s,
#      accuracy, speed-up over the CPU job (goal: 1 GPU >= 10x). Then the
#      CTR model (sparse tables on the servers) on the CPU and on cuda:0:
#      the same sync job, so held-out AUC and loss must agree.
#   6. pytorch_reference.py on the same GPU, same model/batch/optimizer/
#      precision: the worker's GPU step time as a ratio to PyTorch's (goal
#      <= 1.5).
#   7. pstrain_torch: pip install of the bundle's wheel into the host's
#      PyTorch environment ($TORCH_PYTHON, default /opt/torch/.venv/bin/python;
#      nothing downloaded), its import (a failure is loud: FAIL, with pip's and
#      Python's words), and a pstrain.torch training step against a ps_server
#      of the bundle, on cuda:0 where there is a GPU.
#   8. exchange: ps_bench's PushPull of the MLP's bytes through the servers,
#      the 1-GPU job's step against it (goal <= 1.15x).
#   9. torch_cuda: the Python suite's torch tests (TORCH_CUDA_TESTS) against
#      the installed wheel with their models on cuda:0, and
#      torch_cuda_bench.py: pstrain.torch's MLP against the C++ GPU worker's
#      job (goal >= 0.9x) and its CNN with BatchNorm against one torch process
#      on the same GPU (goal >= 0.8x). Needs pstrain_torch before it.
#  10. replication: a sync job with every shard held twice (--replicas=2)
#      against once, on this host's loopback, rounds interleaved, with each
#      job's CPU (goal: step <= 1.15x). No GPU needed: what it measures is
#      the host's cores (REPLICATION_ROUNDS, default 3).
#
# Results: DIR (default ./gpu-check-<UTC time>) holds every step's output,
# summary.txt (the table) and summary.tsv. Exit status: 0 when every check
# passed (performance goals are reported as MET/MISSED and do not change it);
# 1 when a check failed; 2 bad usage. --require_gpu makes "no GPU found" a
# failure (use it on a GPU host: a broken driver must not pass as a dry run).
# --steps runs only the named steps (parity sanitizer kernel_bench step_bench
# jobs pytorch pstrain_torch exchange torch_cuda replication); --deadline_s=N stops starting work so that the whole run,
# summary included, ends within N seconds (for a device call with a limit).
#
# Knobs (environment): MODEL_HIDDEN (2048,2048), BATCH (512), CPU_STEPS,
# GPU_STEPS, JOB_SERVERS (2), JOB_MODE (sync), TARGET_ACCURACY (0.9),
# SANITIZE_TESTS (GPU test binaries run under compute-sanitizer),
# SANITIZE_FILTER (their --gtest_filter),
# STEP_TIMEOUT_S (300: the limit of any one step), PSTRAIN_CUDA_LIB_DIR,
# TORCH_PYTHON, TORCH_CUDA_TESTS (empty: none), TORCH_TEST_DEVICE (cuda),
# REPLICATION_ROUNDS (3), JOBS (the jobs step runs only these, by name),
# EXCHANGES (the exchange step only these, as gradients:parameters).
set -uo pipefail

readonly PROG=check.sh
readonly START_S=$SECONDS
BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly BUNDLE

usage() {
  printf '%s: %s\nusage: %s [--results=DIR] [--quick] [--require_gpu] [--steps=STEP,...] [--deadline_s=N] [--data=auto|synthetic|fashion_mnist]\n' \
    "$PROG" "$1" "$PROG" >&2
  exit 2
}

readonly ALL_STEPS="parity sanitizer kernel_bench step_bench jobs pytorch pstrain_torch exchange torch_cuda replication"
read -ra STEPS <<<"$ALL_STEPS"
results=""
DEADLINE_S=0
quick=0
require_gpu=0
data=auto
for arg in "$@"; do
  case "$arg" in
    --results=*) results=${arg#--results=} ;;
    --quick) quick=1 ;;
    --require_gpu) require_gpu=1 ;;
    --deadline_s=*)
      DEADLINE_S=${arg#--deadline_s=}
      [[ $DEADLINE_S =~ ^[0-9]+$ ]] || usage "--deadline_s must be a whole number of seconds, got '$DEADLINE_S'"
      ;;
    --steps=*)
      IFS=, read -ra STEPS <<<"${arg#--steps=}"
      for step in "${STEPS[@]}"; do
        [[ " $ALL_STEPS " == *" $step "* ]] || usage "--steps: unknown step '$step' (steps: $ALL_STEPS)"
      done
      ;;
    --data=auto | --data=synthetic | --data=fashion_mnist) data=${arg#--data=} ;;
    --data=*) usage "--data must be auto, synthetic or fashion_mnist, got '${arg#--data=}'" ;;
    -h | --help)
      awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "${BASH_SOURCE[0]}"
      exit 0
      ;;
    *) usage "unknown argument '$arg'" ;;
  esac
done
[[ -x $BUNDLE/bin/worker && -x $BUNDLE/launch.sh ]] ||
  usage "$BUNDLE is not a bundle (no bin/worker or launch.sh): run the check.sh inside one"
results=${results:-$PWD/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$results" || usage "cannot create --results=$results"
results=$(cd "$results" && pwd)
printf 'check\tstatus\tfigure\tnote\n' >"$results/summary.tsv"

# Sizes: the MLP big enough for the 10x goal (issue 13), or a smoke run.
if ((quick)); then
  : "${MODEL_HIDDEN:=256,256}" "${BATCH:=128}" "${CPU_STEPS:=10}" "${GPU_STEPS:=50}"
else
  : "${MODEL_HIDDEN:=2048,2048}" "${BATCH:=512}" "${CPU_STEPS:=20}" "${GPU_STEPS:=300}"
fi
: "${JOB_SERVERS:=2}" "${JOB_MODE:=sync}" "${TARGET_ACCURACY:=0.9}" "${STEP_TIMEOUT_S:=300}"
: "${SANITIZE_TESTS:=cuda_backend_test embedding_bag_test mlp_gpu_test layers_test layer_ops_test}"
# Left out under the sanitizers: filling the whole device (the sanitizer
# needs memory of its own), a death test (re-executes the binary), and the
# 16M-element exactness test (slow instrumented, and the same kernels run in
# the other tests).
: "${SANITIZE_FILTER:=-*AllocationRetriesAfterReleasingTheCache*:*DestroyingABackendWithLiveAllocations*:*BitExact*}"

# The bundle's libraries first, then the host's CUDA 13 runtime and cuBLAS.
cuda_lib_dir=${PSTRAIN_CUDA_LIB_DIR:-/usr/local/cuda/lib64}
export LD_LIBRARY_PATH="$BUNDLE/lib:$cuda_lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$PATH:/usr/local/cuda/bin"

log() { printf '%s [%4ds] %s\n' "$PROG" "$((SECONDS - START_S))" "$*" >&2; }

# --- The summary ------------------------------------------------------------

ROWS=()
FAILED=0
# row CHECK STATUS FIGURE NOTE; STATUS is PASS, FAIL, SKIP, MET, MISSED or
# INFO. Only FAIL changes the exit status.
row() {
  ROWS+=("$1"$'\t'"$2"$'\t'"$3"$'\t'"$4")
  # Written as it goes, so a run cut short still leaves its rows.
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$results/summary.tsv"
  [[ $2 == FAIL ]] && FAILED=1
  log "$2 $1: $3${4:+ ($4)}"
}

# Runs "$@" with the step time limit, stdout+stderr to FILE; returns its
# status (124: timed out).
run_to() {
  local file=$1 limit=$STEP_TIMEOUT_S
  shift
  # Under --deadline_s, stop early enough to write the summary: a device
  # call that is killed at its limit leaves no table behind.
  if ((DEADLINE_S > 0)); then
    local left=$((DEADLINE_S - (SECONDS - START_S) - 15))
    if ((left <= 0)); then
      echo "$PROG: not run: --deadline_s=$DEADLINE_S reached" >"$file"
      return 124
    fi
    ((left < limit)) && limit=$left
  fi
  timeout --kill-after=10 "$limit" "$@" >"$file" 2>&1
}

# How a step's exit status reads in the table.
exit_text() {
  case "$1" in
    124 | 137) echo "stopped at its time limit (STEP_TIMEOUT_S or --deadline_s)" ;;
    *) echo "exit $1" ;;
  esac
}

# json_field FILE KEY=VALUE... FIELD: FIELD of the last JSON line of FILE
# whose string fields KEY equal VALUE. The lines are our own programs' flat
# one-line JSON, so grep and sed do (python3 starts too slowly on a busy
# machine to call it per figure).
json_field() {
  local file=$1 field=${*: -1} lines filter
  lines=$(grep '^{' "$file")
  for filter in "${@:2:$#-2}"; do
    lines=$(grep -F "\"${filter%%=*}\":\"${filter#*=}\"" <<<"$lines")
  done
  tail -n 1 <<<"$lines" | sed -n "s/.*\"$field\":\(\"[^\"]*\"\|[^,}]*\).*/\1/p" | tr -d '"'
}

# ratio A B: A / B to two decimals ("n/a" when B is not positive).
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f\n", a / b; else print "n/a" }'; }
# at_least A B: succeeds when A >= B (numbers).
at_least() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 >= b + 0) }'; }
# goal_row CHECK RATIO at_least|at_most GOAL NOTE: a MET or MISSED row for
# "RATIOx" against the goal.
goal_row() {
  local met
  if [[ $3 == at_least ]]; then at_least "$2" "$4" && met=1; else at_least "$4" "$2" && met=1; fi
  row "goal: $1" "$([[ -n ${met:-} ]] && echo MET || echo MISSED)" "${2}x" "$5"
}

# Prints the table (and writes summary.txt / summary.tsv), then exits 1
# when a check failed, else 0.
finish() {
  {
    cat "$results/host.txt"
    echo
    printf '%-48s %-7s %-32s %s\n' CHECK STATUS FIGURE NOTE
    local r c s f n
    for r in "${ROWS[@]}"; do
      IFS=$'\t' read -r c s f n <<<"$r"
      printf '%-48s %-7s %-32s %s\n' "$c" "$s" "$f" "$n"
    done
    echo
    if ((FAILED)); then
      echo "RESULT: FAILED (a check above failed) after $((SECONDS - START_S)) s"
    elif ((gpu_count > 0)); then
      echo "RESULT: PASSED after $((SECONDS - START_S)) s on $gpu_count GPU(s)"
    else
      echo "RESULT: PASSED after $((SECONDS - START_S)) s (dry run: no GPU, GPU steps skipped)"
    fi
    echo "results: $results"
  } | tee "$results/summary.txt"
  exit "$FAILED"
}

# --- What this host has -------------------------------------------------------

gpu_count=0
why_no_gpu=""
if ! command -v nvidia-smi >/dev/null; then
  why_no_gpu="nvidia-smi not found, so no NVIDIA driver on this machine"
else
  gpu_count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  ((gpu_count > 0)) || why_no_gpu="nvidia-smi lists no GPU"
fi
{
  echo "check.sh on $(uname -n), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  cat "$BUNDLE/BUNDLE_INFO" 2>/dev/null
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  if ((gpu_count > 0)); then
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  else
    echo "gpu: none ($why_no_gpu)"
  fi
  echo "sizes: hidden $MODEL_HIDDEN, batch $BATCH, cpu steps $CPU_STEPS, gpu steps $GPU_STEPS, quick $quick"
} >"$results/host.txt"
cat "$results/host.txt" >&2

if ((gpu_count == 0)); then
  if ((require_gpu)); then
    row "gpu present" FAIL "no GPU" "$why_no_gpu; --require_gpu was given"
    finish
  else
    row "gpu present" SKIP "no GPU" "$why_no_gpu: every GPU step below is skipped (dry run)"
  fi
else
  row "gpu present" PASS "$gpu_count GPU(s)" "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  export PSTRAIN_REQUIRE_GPU=1
fi
skip_gpu() { row "$1" SKIP "-" "no GPU: $why_no_gpu"; }

# --- 1. Parity tests --------------------------------------------------------
step_parity() {
  mkdir -p "$results/parity"
  tests=()
  for t in "$BUNDLE"/bin/*_test; do [[ -x $t ]] && tests+=("$(basename "$t")"); done
  for t in "${tests[@]}"; do
    out=$results/parity/$t.txt
    run_to "$out" "$BUNDLE/bin/$t" --gtest_output="xml:$results/parity/$t.xml"
    status=$?
    passed=$(grep -c '^\[       OK \]' "$out")
    skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z].*(' "$out")
    failed=$(grep -c '^\[  FAILED  \] [A-Za-z].*(' "$out")
    figure="$passed passed, $skipped skipped, $failed failed"
    if ((status != 0)); then
      row "parity $t" FAIL "$figure" "$(exit_text "$status"); see parity/$t.txt"
    elif ((skipped > 0 && passed == 0)); then
      row "parity $t" SKIP "$figure" "$(grep -m1 -o 'no GPU[^"]*' "$out" | head -c 100)"
    else
      row "parity $t" PASS "$figure" ""
    fi
  done
}

# --- 2. compute-sanitizer ---------------------------------------------------
step_sanitizer() {
  sanitizer=$(command -v compute-sanitizer || true)
  if ((gpu_count == 0)); then
    skip_gpu "compute-sanitizer"
  elif [[ -z $sanitizer ]]; then
    row "compute-sanitizer" FAIL "-" "compute-sanitizer not found on PATH or in /usr/local/cuda/bin"
  else
    mkdir -p "$results/sanitizer"
    for tool in memcheck racecheck synccheck; do
      for t in $SANITIZE_TESTS; do
        [[ -x $BUNDLE/bin/$t ]] || continue
        out=$results/sanitizer/$tool-$t.txt
        run_to "$out" "$sanitizer" --tool "$tool" --error-exitcode 99 \
        "$BUNDLE/bin/$t" --gtest_filter="$SANITIZE_FILTER"
        status=$?
        errors=$(grep -o 'ERROR SUMMARY: [0-9]*' "$out" | tail -1 | grep -o '[0-9]*$')
        if grep -q 'terminated before first instrumented API call' "$out"; then
          # A test binary whose GPU tests all skipped, or that has none
          # (layers_test on a build without CUDA layers): nothing to check.
          row "sanitizer $tool $t" SKIP "-" "made no CUDA call"
        elif ((status == 0)); then
          row "sanitizer $tool $t" PASS "${errors:-0} errors" ""
        elif ((status == 124 || status == 137)); then
          row "sanitizer $tool $t" FAIL "timed out" "over STEP_TIMEOUT_S=${STEP_TIMEOUT_S}s"
        else
          row "sanitizer $tool $t" FAIL "${errors:-?} errors" "$(exit_text "$status"); see sanitizer/$tool-$t.txt"
        fi
      done
    done
    # The pipelined step's copies in a real job (a parameter copied in by
    # pieces as its values land, each gradient cast and copied out a few
    # blocks at a time): one worker under the tool, bf16 both ways.
    job_setup
    local bin run
    for tool in memcheck synccheck; do
      bin=$results/sanitizer/bin-$tool
      run=$results/sanitizer/$tool-pipelined_job.run
      out=$results/sanitizer/$tool-pipelined_job.txt
      mkdir -p "$bin"
      cp "$wrappers/ps_server" "$bin/ps_server"
      printf '#!/usr/bin/env bash\nexec %q --tool %q --error-exitcode 99 %q "$@"\n' \
        "$sanitizer" "$tool" "$BUNDLE/bin/worker" >"$bin/worker"
      chmod +x "$bin/worker"
      run_to "$out" "$BUNDLE/launch.sh" --servers=2 --workers=1 --mode=sync \
        --bin_dir="$bin" --run_dir="$run" --timeout_s="$STEP_TIMEOUT_S" -- \
        --server.optimizer=sgd --server.learning_rate=0.1 --model=mlp --hidden=256,256 \
        --batch_size=128 --steps=20 --log_every=20 --device=cuda:0 \
        --gradient_wire_type=bf16 --parameter_wire_type=bf16 "${data_flags[@]}"
      status=$?
      errors=$(cat "$out" "$run/worker0.out" 2>/dev/null | grep -o 'ERROR SUMMARY: [0-9]*' | tail -1 | grep -o '[0-9]*$')
      pipelined=$(json_field "$out" event=final pipelined)
      if ((status == 0)) && [[ $pipelined == true ]]; then
        row "sanitizer $tool pipelined job" PASS "${errors:-0} errors" "1 worker on cuda:0, bf16 both ways, 20 steps"
      else
        row "sanitizer $tool pipelined job" FAIL "${errors:-?} errors" "$(exit_text "$status"), pipelined ${pipelined:-?}; see sanitizer/$tool-pipelined_job.txt and its .run/"
      fi
    done
  fi
}

# --- 3. kernel_bench ----------------------------------------------------------
step_kernel_bench() {
  out=$results/kernel_bench.txt
  if ((gpu_count == 0)); then
    # Still run: it must say plainly that there is no GPU, and exit 0.
    run_to "$out" "$BUNDLE/bin/kernel_bench" --quick
    status=$?
    if ((status == 0)) && grep -q 'no GPU' "$out"; then
      row "kernel_bench" SKIP "-" "$(head -c 100 "$out")"
    else
      row "kernel_bench" FAIL "-" "$(exit_text "$status") without a GPU; see kernel_bench.txt"
    fi
  else
    bench_flags=(--min_ms=20)
    ((quick)) && bench_flags+=(--quick)
    run_to "$out" "$BUNDLE/bin/kernel_bench" "${bench_flags[@]}"
    status=$?
    if ((status == 0)); then
      row "kernel_bench" PASS "$(grep -c '^{"bench":"kernel"' "$out") rows" "kernel_bench.txt"
      python3 - "$out" >"$results/kernel_goals.tsv" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"bench":"kernel"')]
mem = [r for r in rows if "ratio_to_d2d" in r and "baseline" not in r["op"]]
if mem:
    worst = min(mem, key=lambda r: r["ratio_to_d2d"])
    print(f"elementwise/memory-bound ops vs D2D (worst)\t{worst['ratio_to_d2d']:.2f}x\t{worst['op']} {worst['shape']}\t0.8")
for name in ("sgemm", "bf16_gemm"):
    gemms = [r for r in rows if f"ratio_to_{name}" in r and "baseline" not in r["op"]]
    if gemms:
        big = max(gemms, key=lambda r: r["tflops"])
        print(f"Gemm {'fp32' if name == 'sgemm' else 'bf16'} vs cuBLAS (best shape)\t{big[f'ratio_to_{name}']:.2f}x\t{big['shape']}, {big['tflops']:.1f} TF/s\t0.9")
PY
      while IFS=$'\t' read -r what value detail goal; do
        goal_row "$what" "${value%x}" at_least "$goal" "$detail; goal >= $goal"
      done <"$results/kernel_goals.tsv"
    else
      row "kernel_bench" FAIL "-" "$(exit_text "$status"); see kernel_bench.txt"
    fi
  fi
}

# --- 4. step_bench: the training step, compute alone ----------------------------
step_step_bench() {
  step_flags=(--hidden="$MODEL_HIDDEN" --num_features=784 --num_classes=10
    --batch_size="$BATCH" --warmup_steps=2)
  ((quick)) && step_flags+=(--train_examples=8192 --test_examples=1024)
  out=$results/step_bench_fp32.txt
  devices=cpu
  ((gpu_count > 0)) && devices=cpu,cuda:0
  if run_to "$out" "$BUNDLE/bin/step_bench" "${step_flags[@]}" --devices="$devices" \
    --steps="$CPU_STEPS" --target_accuracy=0; then
    cpu_ms=$(json_field "$out" bench=step device=cpu ms_per_step)
    row "step_bench cpu fp32" PASS "${cpu_ms} ms/step" "compute alone, batch $BATCH"
  else
    row "step_bench cpu fp32" FAIL "-" "see step_bench_fp32.txt"
    cpu_ms=""
  fi
  gpu_ms_fp32=""
  gpu_ms_bf16=""
  if ((gpu_count == 0)); then
    skip_gpu "step_bench cuda:0"
  else
    gpu_ms_fp32=$(json_field "$out" bench=step device=cuda:0 ms_per_step)
    if [[ -n $gpu_ms_fp32 && -n $cpu_ms ]]; then
      row "step_bench cuda:0 fp32" PASS "${gpu_ms_fp32} ms/step" "$(ratio "$cpu_ms" "$gpu_ms_fp32")x the CPU step"
    else
      row "step_bench cuda:0 fp32" FAIL "-" "no cuda:0 row; see step_bench_fp32.txt"
    fi
    out=$results/step_bench_bf16.txt
    if run_to "$out" "$BUNDLE/bin/step_bench" "${step_flags[@]}" --devices=cuda:0 \
      --precision=bf16 --steps="$GPU_STEPS" --target_accuracy=0; then
      gpu_ms_bf16=$(json_field "$out" bench=step device=cuda:0 ms_per_step)
      row "step_bench cuda:0 bf16" PASS "${gpu_ms_bf16} ms/step" "$(ratio "${cpu_ms:-0}" "$gpu_ms_bf16")x the CPU step"
    else
      row "step_bench cuda:0 bf16" FAIL "-" "see step_bench_bf16.txt"
    fi
    out=$results/step_bench_target.txt
    if run_to "$out" "$BUNDLE/bin/step_bench" "${step_flags[@]}" --devices=cuda:0 \
      --steps=10 --target_accuracy="$TARGET_ACCURACY"; then
      seconds=$(json_field "$out" bench=step device=cuda:0 seconds_to_target)
      steps=$(json_field "$out" bench=step device=cuda:0 steps_to_target)
      if [[ ${steps:--1} -gt 0 ]]; then
        cpu_estimate=$(awk -v s="$steps" -v ms="${cpu_ms:-0}" 'BEGIN { printf "%.1f", s * ms / 1e3 }')
        row "time to accuracy $TARGET_ACCURACY (step_bench)" INFO "cuda:0 ${seconds} s" \
          "$steps steps; the CPU would need ~${cpu_estimate} s at its step time (estimate, not run)"
      else
        row "time to accuracy $TARGET_ACCURACY (step_bench)" INFO "not reached" "see step_bench_target.txt"
      fi
    else
      row "time to accuracy $TARGET_ACCURACY (step_bench)" FAIL "-" "see step_bench_target.txt"
    fi
  fi
}

# What the jobs of steps 5 and 10 share, set up once: their data (Fashion-MNIST
# when the worker knows it, and, for the bundle's copy of the files, a flag
# to point at them; else synthetic data of the same shape: 784 features, 10
# classes) and the wrappers launch.sh runs as --bin_dir.
jobs_ready=0
job_setup() {
  ((jobs_ready)) && return
  jobs_ready=1
  worker_help=$("$BUNDLE/bin/worker" --helpfull 2>&1 || true)
  data_flags=(--num_features=784 --num_classes=10)
  data_name="synthetic 784 features, 10 classes"
  if [[ $data != synthetic ]] && grep -q 'fashion_mnist' <<<"$worker_help"; then
    data_flags=(--data=fashion_mnist)
    data_name="Fashion-MNIST"
    if [[ -d $BUNDLE/data/fashion-mnist ]] && grep -q -- '--dataset_dir' <<<"$worker_help"; then
      data_flags+=(--dataset_dir="$BUNDLE/data/fashion-mnist")
    fi
  elif [[ $data == fashion_mnist ]]; then
    row "job data" FAIL "-" "--data=fashion_mnist, but this worker has no --data=fashion_mnist"
  fi
  target_flags=()
  grep -q -- '--target_accuracy' <<<"$worker_help" && target_flags=(--target_accuracy="$TARGET_ACCURACY")
  row "job data" INFO "$data_name" "${data_flags[*]}"

  # Wrappers as launch.sh's --bin_dir: the worker wrapper gives worker K the
  # K-th GPU of PSTRAIN_WORKER_GPUS (as its only visible device) when set.
  wrappers=$results/bin
  mkdir -p "$wrappers"
  printf '#!/usr/bin/env bash\nCUDA_VISIBLE_DEVICES= exec %q "$@"\n' "$BUNDLE/bin/ps_server" >"$wrappers/ps_server"
  cat >"$wrappers/worker" <<WRAPPER
#!/usr/bin/env bash
if [[ -n \${PSTRAIN_WORKER_GPUS:-} ]]; then
  IFS=, read -ra gpus <<<"\$PSTRAIN_WORKER_GPUS"
  for arg in "\$@"; do
    [[ \$arg == --worker_id=* ]] && export CUDA_VISIBLE_DEVICES=\${gpus[\${arg#--worker_id=} % \${#gpus[@]}]}
  done
fi
exec $(printf %q "$BUNDLE/bin/worker") "\$@"
WRAPPER
  chmod +x "$wrappers"/*
  mkdir -p "$results/jobs"
}

# --- 5. The same job through the parameter servers, on 0, 1 and 2 GPUs ------
step_jobs() {
  job_setup
  cpu_job_rate=""
  declare -A JOB_RATE=()
  # job NAME WORKERS DEVICE PRECISION GPUS STEPS [WORKER_FLAGS...] (later
  # flags override the MLP's: --model=layers --layers=...)
  job() {
    local name=$1 workers=$2 device=$3 precision=$4 gpus=$5 steps=$6
    local -a extra=("${@:7}")
    local out=$results/jobs/$name.txt
    # JOBS: only the jobs named there (a short device call).
    [[ -z ${JOBS:-} || " $JOBS " == *" $name "* ]] || return 0
    PSTRAIN_WORKER_GPUS=$gpus run_to "$out" "$BUNDLE/launch.sh" \
      --servers="$JOB_SERVERS" --workers="$workers" --mode="$JOB_MODE" \
      --bin_dir="$wrappers" --run_dir="$results/jobs/$name.run" --timeout_s="$STEP_TIMEOUT_S" -- \
      --server.optimizer=sgd --server.learning_rate=0.1 \
      --model=mlp --hidden="$MODEL_HIDDEN" --batch_size="$BATCH" --steps="$steps" \
      --log_every="$steps" --device="$device" --precision="$precision" \
      "${data_flags[@]}" "${target_flags[@]}" "${extra[@]}"
    local status=$?
    if ((status != 0)); then
      row "job $name" FAIL "-" "launch.sh: $(exit_text "$status"); see jobs/$name.txt and jobs/$name.run/"
      return
    fi
    # Job throughput: the sum over workers; accuracy: worker 0's.
    local summary
    summary=$(python3 - "$out" <<'PY'
import json, re, sys
finals = []
for line in open(sys.argv[1], errors="replace"):
    if line.startswith('{"event":"final"'):
        finals.append(json.loads(line))
rate = sum(f.get("samples_per_sec", 0) for f in finals)
acc = finals[0].get("test_accuracy", "n/a") if finals else "n/a"
target = ""
for f in finals[:1]:
    for key, value in f.items():
        if re.match(r"(time|seconds|s)_to_target", key):
            target = f", {key} {value}"
print(f"{rate:.1f}\t{acc}{target}\t{len(finals)}")
PY
    )
    local rate accuracy finals
    IFS=$'\t' read -r rate accuracy finals <<<"$summary"
    JOB_RATE[$name]=$rate
    local speedup=""
    # Against the CPU MLP job only for the MLP jobs (no flags that change it).
    [[ -n $cpu_job_rate && ${#extra[@]} -eq 0 ]] &&
      speedup="; $(ratio "$rate" "$cpu_job_rate")x the CPU job"
    row "job $name" PASS "$rate samples/s" "$finals worker(s), test accuracy $accuracy$speedup"
  }

  job cpu_1worker 1 cpu fp32 "" "$CPU_STEPS"
  cpu_job_rate=${JOB_RATE[cpu_1worker]:-}
  if ((gpu_count == 0)); then
    skip_gpu "jobs on 1 and 2 GPUs (fp32, bf16)"
  else
    # --trace_steps: the 1-worker jobs print the timeline of 3 pipelined
    # steps (jobs/NAME.txt, "event":"step_trace").
    for precision in fp32 bf16; do
      job "gpu1_1worker_$precision" 1 cuda:0 "$precision" "" "$GPU_STEPS" --trace_steps=3
      job "gpu1_2workers_$precision" 2 cuda:0 "$precision" "" "$GPU_STEPS"
      if ((gpu_count >= 2)); then
        job "gpu2_2workers_$precision" 2 cuda:0 "$precision" 0,1 "$GPU_STEPS"
      fi
    done
    ((gpu_count >= 2)) || row "jobs on 2 GPUs" SKIP "-" "this host has 1 GPU"
    # Each layer's gradient pushed as backward produces it: off by default
    # because it costs on a few shared CPU cores; on a GPU worker the host
    # cores are free while the GPU computes, which is where it should pay.
    job gpu1_1worker_fp32_overlap 1 cuda:0 fp32 "" "$GPU_STEPS" --overlap_push=true
    with=${JOB_RATE[gpu1_1worker_fp32_overlap]:-}
    without=${JOB_RATE[gpu1_1worker_fp32]:-}
    if [[ -n $with && -n $without ]]; then
      row "overlap_push on 1 GPU worker" INFO "$(ratio "$with" "$without")x" "samples/s with --overlap_push over without"
    fi
    # Low precision both ways: gradients cast to bf16 on the GPU before the
    # copy to the host, parameters pulled as bf16 and widened on the GPU;
    # the servers keep fp32 master weights and optimizer state.
    bf16_wire=(--gradient_wire_type=bf16 --parameter_wire_type=bf16)
    job gpu1_1worker_fp32_bf16wire 1 cuda:0 fp32 "" "$GPU_STEPS" "${bf16_wire[@]}" --trace_steps=3
    job gpu1_1worker_bf16_bf16wire 1 cuda:0 bf16 "" "$GPU_STEPS" "${bf16_wire[@]}"
    job gpu1_2workers_fp32_bf16wire 2 cuda:0 fp32 "" "$GPU_STEPS" "${bf16_wire[@]}"
    # fp16 both ways, cast on the GPU as bf16 is.
    job gpu1_1worker_fp32_fp16wire 1 cuda:0 fp32 "" "$GPU_STEPS" --gradient_wire_type=fp16 --parameter_wire_type=fp16
    with=${JOB_RATE[gpu1_1worker_fp32_bf16wire]:-}
    if [[ -n $with && -n $without ]]; then
      row "bf16 both ways on 1 GPU worker" INFO "$(ratio "$with" "$without")x" "samples/s over fp32 on the wire (same run); issue 37 asks >= 3.5x its 26,600 samples/s"
      local acc_fp32 acc wire gap
      acc_fp32=$(json_field "$results/jobs/gpu1_1worker_fp32.txt" event=final test_accuracy)
      for wire in bf16 fp16; do
        out=$results/jobs/gpu1_1worker_fp32_${wire}wire.txt
        [[ -f $out ]] || continue
        acc=$(json_field "$out" event=final test_accuracy)
        [[ -n $acc_fp32 && -n $acc ]] || continue
        gap=$(awk -v a="$acc" -v b="$acc_fp32" 'BEGIN { d = (a - b) * 100; printf "%.2f", d < 0 ? -d : d }')
        row "goal: accuracy, $wire both ways vs fp32" "$(at_least 0.3 "$gap" && echo MET || echo MISSED)" \
          "$gap points" "held-out $acc against $acc_fp32 after $GPU_STEPS steps; goal <= 0.3"
      done
    fi
    # The pipelined step, a GPU worker's default (--pipeline_step=by_host
    # pipelines a worker that stages through a device): each gradient
    # copied out and sent as backward issues it, each parameter copied in
    # as its values land, so that the exchange hides staging and compute.
    # Against the plain step, one after the other.
    job gpu1_1worker_fp32_plain 1 cuda:0 fp32 "" "$GPU_STEPS" --pipeline_step=never
    job gpu1_1worker_fp32_bf16wire_plain 1 cuda:0 fp32 "" "$GPU_STEPS" "${bf16_wire[@]}" --pipeline_step=never
    local piped plain
    for piped in gpu1_1worker_fp32 gpu1_1worker_fp32_bf16wire; do
      plain=${JOB_RATE[${piped}_plain]:-}
      [[ -n $plain && -n ${JOB_RATE[$piped]:-} ]] &&
        row "pipelined step: $piped" INFO "$(ratio "${JOB_RATE[$piped]}" "$plain")x" "samples/s of the default (pipelined) over --pipeline_step=never"
    done
    piped=${JOB_RATE[gpu1_1worker_fp32_bf16wire]:-}
    if [[ -n $piped ]]; then
      goal_row "bf16 both ways vs issue 37's 26,600" "$(ratio "$piped" 26600)" at_least 3.5 \
        "$piped samples/s (job gpu1_1worker_fp32_bf16wire, its $GPU_STEPS steps from the first); goal >= 3.5x"
      local steady
      steady=$(json_field "$results/jobs/gpu1_1worker_fp32_bf16wire.txt" event=final steady_step_ms)
      if [[ -n $steady && $steady != 0.000 ]]; then
        row "bf16 both ways at its steady step" INFO \
          "$(awk -v b="$BATCH" -v ms="$steady" 'BEGIN { printf "%.1f", b / ms * 1e3 }') samples/s" \
          "$(awk -v b="$BATCH" -v ms="$steady" 'BEGIN { printf "%.2f", b / ms * 1e3 / 26600 }')x issue 37's 26,600: batch over the mean step past the first ten ($steady ms)"
      fi
    fi
    # The image model the system exists for: the two-conv CNN of the README
    # on the CPU and on one GPU, the same job through the servers.
    cnn=(--model=layers --layers=conv:32:3,relu,maxpool:2,conv:64:3,relu,maxpool:2,flatten,dense:128,relu,dense:10)
    job cnn_cpu_1worker 1 cpu fp32 "" "$CPU_STEPS" "${cnn[@]}"
    job cnn_gpu1_1worker_fp32 1 cuda:0 fp32 "" "$GPU_STEPS" "${cnn[@]}"
    cnn_cpu=${JOB_RATE[cnn_cpu_1worker]:-}
    cnn_gpu=${JOB_RATE[cnn_gpu1_1worker_fp32]:-}
    if [[ -n $cnn_cpu && -n $cnn_gpu ]]; then
      row "CNN: 1 GPU worker vs CPU worker (job)" INFO "$(ratio "$cnn_gpu" "$cnn_cpu")x" "samples/s through the servers"
    fi
    one=${JOB_RATE[gpu1_1worker_fp32]:-}
    if [[ -n $one && -n $cpu_job_rate ]]; then
      goal_row "1 GPU worker vs CPU worker (job)" "$(ratio "$one" "$cpu_job_rate")" at_least 10 \
        "samples/s through the servers; goal >= 10x"
    fi
  fi

  # The CTR model (sparse embedding tables on the servers, embedding bags
  # and GEMMs with beta = 1 on the worker) as a whole-model check: one sync
  # worker sees the same batches on either device, so the GPU's held-out AUC
  # and loss must match the CPU's closely.
  ctr_job() {
    local name=$1 device=$2 out=$results/jobs/$1.txt
    [[ -z ${JOBS:-} || " $JOBS " == *" $name "* ]] || return 1
    run_to "$out" "$BUNDLE/launch.sh" --servers="$JOB_SERVERS" --workers=1 --mode=sync \
      --bin_dir="$wrappers" --run_dir="$results/jobs/$name.run" --timeout_s="$STEP_TIMEOUT_S" -- \
      --server.optimizer=adam --server.learning_rate=0.01 \
      --model=ctr --ctr_fields=4 --ctr_dense=2 --ctr_vocab=2000 \
      --sparse_optimizer=adagrad --sparse_learning_rate=0.1 \
      --steps=200 --batch_size=128 --log_every=200 --device="$device"
    local status=$?
    if ((status != 0)); then
      row "job $name" FAIL "-" "launch.sh: $(exit_text "$status"); see jobs/$name.txt and jobs/$name.run/"
      return 1
    fi
    CTR_AUC[$name]=$(json_field "$out" event=final auc)
    CTR_LOSS[$name]=$(json_field "$out" event=final final_loss)
    row "job $name" PASS "AUC ${CTR_AUC[$name]}" "final training loss ${CTR_LOSS[$name]}"
  }
  declare -A CTR_AUC=() CTR_LOSS=()
  ctr_job ctr_cpu cpu
  if ((gpu_count == 0)); then
    skip_gpu "ctr on cuda:0 vs the CPU"
  elif ctr_job ctr_gpu cuda:0 && [[ -n ${CTR_AUC[ctr_cpu]:-} ]]; then
    local auc_gap loss_gap
    auc_gap=$(awk -v a="${CTR_AUC[ctr_gpu]}" -v b="${CTR_AUC[ctr_cpu]}" 'BEGIN { d = a - b; printf "%.4f", d < 0 ? -d : d }')
    loss_gap=$(awk -v a="${CTR_LOSS[ctr_gpu]}" -v b="${CTR_LOSS[ctr_cpu]}" 'BEGIN { d = (a - b) / (b == 0 ? 1 : b); printf "%.4f", d < 0 ? -d : d }')
    if at_least 0.01 "$auc_gap" && at_least 0.03 "$loss_gap"; then
      row "ctr on cuda:0 vs the CPU" PASS "AUC gap $auc_gap" "relative loss gap $loss_gap (limits 0.01, 0.03)"
    else
      row "ctr on cuda:0 vs the CPU" FAIL "AUC gap $auc_gap" "relative loss gap $loss_gap (limits 0.01, 0.03): the GPU trains a different model"
    fi
  fi
}

# --- 6. PyTorch on the same GPU ---------------------------------------------
step_pytorch() {
  # Run even without a GPU: the script must then say why it skips.
  precisions=(fp32 bf16)
  ((gpu_count == 0)) && precisions=(fp32)
  for precision in "${precisions[@]}"; do
    out=$results/pytorch_$precision.txt
    run_to "$out" python3 "$BUNDLE/pytorch_reference.py" --hidden="$MODEL_HIDDEN" \
      --batch_size="$BATCH" --precision="$precision" --steps="$GPU_STEPS"
    status=$?
    if ((status == 3)); then
      row "pytorch reference $precision" SKIP "-" "$(tail -1 "$out")"
      continue
    elif ((status != 0)); then
      row "pytorch reference $precision" FAIL "-" "$(exit_text "$status"); see pytorch_$precision.txt"
      continue
    fi
    torch_ms=$(json_field "$out" bench=pytorch_reference ms_per_step)
    ours=$gpu_ms_fp32
    [[ $precision == bf16 ]] && ours=$gpu_ms_bf16
    if [[ -n $ours && -n $torch_ms ]]; then
      goal_row "worker step / PyTorch step, $precision" "$(ratio "$ours" "$torch_ms")" at_most 1.5 \
        "ours $ours ms, PyTorch $torch_ms ms; goal <= 1.5x"
    else
      row "pytorch reference $precision" INFO "${torch_ms} ms/step" "no step_bench figure to compare"
    fi
  done
}

# The wheel users pip install, into the host's PyTorch environment, then one
# pstrain.torch step against a ps_server of the bundle (on cuda:0 where there
# is a GPU).
step_pstrain_torch() {
  local python=${TORCH_PYTHON:-/opt/torch/.venv/bin/python} wheel device=cpu
  local log=$results/pstrain_install.txt out=$results/pstrain_torch_step.txt
  if [[ ! -x $python ]]; then
    # No PyTorch venv here (a dry run): a venv that sees the system's torch.
    python=$results/venv/bin/python
    /usr/bin/python3 -m venv --system-site-packages "$results/venv" >"$log" 2>&1 ||
      { row "pstrain.torch install" FAIL "-" "python3 -m venv failed: $(tail -n 1 "$log")"; return; }
  fi
  # The wheel, made here as the build makes it (make_wheel.py: the
  # bundle's libraries beside libpstrain.so).
  if ! wheel=$(python3 "$BUNDLE/python/make_wheel.py" --version="$(cat "$BUNDLE/python/VERSION")" \
      --lib="$BUNDLE/python/libpstrain.so" --out_dir="$results/wheel" \
      "$BUNDLE"/python/pstrain/*.py 2>"$results/pstrain_wheel.txt"); then
    row "pstrain.torch install" FAIL "-" "make_wheel.py failed: $(tail -n 1 "$results/pstrain_wheel.txt")"
    return
  fi
  if ! run_to "$log" "$python" -m pip install --no-index --no-deps --force-reinstall \
      --ignore-installed --disable-pip-version-check "$wheel"; then
    row "pstrain.torch install" FAIL "-" "pip install into $python failed: $(tail -n 1 "$log")"
    return
  fi
  if ! (cd / && "$python" -c 'import pstrain.torch') >>"$log" 2>&1; then
    row "pstrain.torch install" FAIL "-" "import failed in $python: $(tail -n 1 "$log")"
    return
  fi
  row "pstrain.torch install" PASS "$(cd / && "$python" -c 'import sys, torch, pstrain; print("CPython %d.%d, torch %s, pstrain %s" % (sys.version_info[:2] + (torch.__version__, pstrain.__version__)))')" "$(basename "$wheel")"
  (cd / && "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())') && device=cuda
  local port_file=$results/pstrain_torch_ps.port
  rm -f "$port_file"
  "$BUNDLE/bin/ps_server" --host=127.0.0.1 --port=0 --port_file="$port_file" --num_workers=1 \
    --mode=sync --optimizer=sgd --learning_rate=0.25 >"$results/pstrain_torch_ps.log" 2>&1 &
  local server=$! waited=0
  while [[ ! -s $port_file ]] && ((waited < 300)); do sleep 0.1; waited=$((waited + 1)); done
  if [[ ! -s $port_file ]]; then
    kill "$server" 2>/dev/null
    row "pstrain.torch $device step" FAIL "-" "the ps_server wrote no port; see pstrain_torch_ps.log"
    return
  fi
  local status=0
  run_to "$out" "$python" "$BUNDLE/install_smoke.py" --hosts="127.0.0.1:$(cat "$port_file")" \
    --torch --device="$device" || status=$?
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  if ((status == 0)); then
    row "pstrain.torch $device step" PASS "-" "$(tail -n 1 "$out")"
  else
    row "pstrain.torch $device step" FAIL "-" "$(exit_text "$status"): $(tail -n 1 "$out")"
  fi
}

# The figure of an earlier row of this run (summary.tsv), or "".
figure_of() { awk -F'\t' -v c="$1" '$1 == c { f = $3 } END { print f }' "$results/summary.tsv"; }

# --- 8. The exchange alone --------------------------------------------------
# ps_bench's PushPull of the MLP's bytes through JOB_SERVERS servers on this
# host: what a step of the 1-GPU job would cost if staging and compute hid
# behind the exchange (issue 37's goal: the job's step <= 1.15x this).
step_exchange() {
  [[ -x $BUNDLE/bin/ps_bench ]] || { row "exchange alone" SKIP "-" "no ps_bench in this bundle"; return; }
  # The MLP's parameters: 784 inputs, MODEL_HIDDEN, 10 classes.
  local floats bytes
  floats=$(awk -v h="$MODEL_HIDDEN" 'BEGIN { n = split(h, w, ","); a = 784; t = 0;
    for (i = 1; i <= n; i++) { t += a * w[i] + w[i]; a = w[i] } print t + a * 10 + 10 }')
  bytes=$((floats * 4))
  # Gradients and parameters on the wire: fp32 both ways (the job
  # gpu1_1worker_fp32's exchange), bf16 one way and the other (where the
  # time of bf16 goes), bf16 both ways (gpu1_1worker_fp32_bf16wire's).
  # ps_bench hands the client bf16 as bits, as the GPU worker does after
  # casting on its device.
  local variant gradients parameters jobs job name out gbps status exchange_ms job_rate step_ms
  for variant in fp32:fp32:gpu1_1worker_fp32+gpu1_1worker_fp32_plain \
    bf16:fp32: fp32:bf16: \
    bf16:bf16:gpu1_1worker_fp32_bf16wire+gpu1_1worker_fp32_bf16wire_plain; do
    IFS=: read -r gradients parameters jobs <<<"$variant"
    # EXCHANGES: only these (gradients:parameters, e.g. "fp32:fp32 bf16:bf16").
    [[ -z ${EXCHANGES:-} || " $EXCHANGES " == *" $gradients:$parameters "* ]] || continue
    name="exchange alone"
    out=$results/exchange.txt
    if [[ $gradients$parameters != fp32fp32 ]]; then
      name="exchange alone, gradients $gradients, parameters $parameters"
      out=$results/exchange_${gradients}_${parameters}.txt
    fi
    status=0
    CUDA_VISIBLE_DEVICES='' run_to "$out" "$BUNDLE/bin/ps_bench" --ps_server="$BUNDLE/bin/ps_server" \
      --servers="$JOB_SERVERS" --sizes="$bytes" --repeats=3 \
      --gradient_wire_type="$gradients" --parameter_wire_type="$parameters" || status=$?
    gbps=$(json_field "$out" ps_one_call_gbps)
    if ((status != 0)) || [[ -z $gbps ]]; then
      row "$name" FAIL "-" "ps_bench: $(exit_text "$status"); see ${out##*/}"
      continue
    fi
    # ps_bench's goodput counts float32 bytes whatever the wire carries.
    exchange_ms=$(awk -v b="$bytes" -v g="$gbps" 'BEGIN { printf "%.2f", 2 * b / (g * 1e9) * 1e3 }')
    row "$name" INFO "$exchange_ms ms" "ps_bench PushPull of the MLP ($bytes bytes as fp32), $JOB_SERVERS servers, $gbps GB/s fp32-equivalent both ways"
    # The job's steady step (the mean past its first ten, as ps_bench
    # times its exchanges past a warm-up), else batch over its samples/s.
    for job in ${jobs//+/ }; do
      [[ -f $results/jobs/$job.txt ]] || continue
      step_ms=$(json_field "$results/jobs/$job.txt" event=final steady_step_ms)
      local how="steady step"
      if [[ -z $step_ms || $step_ms == 0.000 ]]; then
        job_rate=$(figure_of "job $job")
        job_rate=${job_rate%% *}
        [[ -n $job_rate ]] || continue
        step_ms=$(awk -v b="$BATCH" -v r="$job_rate" 'BEGIN { printf "%.2f", b / r * 1e3 }')
        how="step (batch / samples/s)"
      fi
      goal_row "$job step vs its exchange alone" "$(ratio "$step_ms" "$exchange_ms")" at_most 1.15 \
        "$how $step_ms ms (job $job), exchange $exchange_ms ms; goal <= 1.15x"
    done
  done
}

# --- 9. pstrain.torch on cuda -------------------------------------------------
# The Python suite's torch tests against the wheel installed by the
# pstrain_torch step, with their models on cuda:0 (PSTRAIN_TEST_DEVICE), from
# a tree laid out as Bazel's runfiles; then torch_cuda_bench.py: the MLP and
# the CNN with BatchNorm through the servers against one torch process on the
# same GPU.
: "${TORCH_CUDA_TESTS=python_bad_input_test torch_sync_equivalence_test torch_pipeline_test torch_optimizers_test torch_faults_test examples_test}"
# TORCH_TEST_DEVICE=cpu runs the same tests on the CPU (no benchmark): how
# this step is tried on a machine without a GPU.
: "${TORCH_TEST_DEVICE:=cuda}"
step_torch_cuda() {
  local python=${TORCH_PYTHON:-/opt/torch/.venv/bin/python}
  [[ -x $python ]] || python=$results/venv/bin/python  # pstrain_torch's dry-run venv
  if [[ $TORCH_TEST_DEVICE == cuda* ]] && ((gpu_count == 0)); then
    skip_gpu "pstrain.torch tests on cuda"
    return
  fi
  if ! (cd / && "$python" -c 'import pstrain.torch') >/dev/null 2>&1; then
    row "pstrain.torch tests on cuda" FAIL "-" "pstrain is not installed in $python: run the pstrain_torch step first"
    return
  fi
  local dir=$results/torch_cuda venv status
  local tree=$dir/runfiles/pstrain
  venv=$(cd / && "$python" -c 'import sys; print(sys.prefix)')
  rm -rf "$dir"
  mkdir -p "$tree"/{ps_server,worker/python/examples,tests/python,deploy/local} "$dir/tmp"
  ln -s "$BUNDLE/bin/ps_server" "$tree/ps_server/ps_server"
  ln -s "$BUNDLE/bin/worker" "$tree/worker/worker"
  cp "$BUNDLE/launch.sh" "$BUNDLE/job_report.sh" "$BUNDLE/free_ports.py" "$tree/deploy/local/"
  cp "$BUNDLE"/tests/python/*.py "$tree/tests/python/"
  cp "$BUNDLE"/python/examples/*.py "$tree/worker/python/examples/"
  touch "$tree/tests/__init__.py"
  local fashion=/usr/share/datasets/fashion-mnist
  [[ -d $BUNDLE/data/fashion-mnist ]] && fashion=$BUNDLE/data/fashion-mnist
  if [[ $TORCH_TEST_DEVICE == cuda* ]]; then
    local data_flag=()
    [[ -d $BUNDLE/data/fashion-mnist ]] && data_flag=(--fashion_mnist="$BUNDLE/data/fashion-mnist")
    local model out sps local_sps
    for model in mlp cnn; do
      out=$dir/bench_$model.txt
      status=0
      (cd / && run_to "$out" "$python" "$BUNDLE/torch_cuda_bench.py" --ps_server="$BUNDLE/bin/ps_server" \
        --model="$model" --servers="$JOB_SERVERS" --batch="$([[ $model == mlp ]] && echo "$BATCH" || echo 128)" \
        --steps=$((GPU_STEPS > 50 ? GPU_STEPS : 50)) "${data_flag[@]}") || status=$?
      sps=$(json_field "$out" pstrain_samples_per_s)
      local_sps=$(json_field "$out" local_samples_per_s)
      if ((status != 0)) || [[ -z $sps ]]; then
        row "pstrain.torch $model on cuda" FAIL "-" "torch_cuda_bench.py: $(exit_text "$status"); see torch_cuda/bench_$model.txt"
        continue
      fi
      row "pstrain.torch $model on cuda" INFO "$sps samples/s" "pipelined; one torch process on the GPU: $local_sps; ps.step $(json_field "$out" pstrain_step_ms) ms, forward+backward queued in $(json_field "$out" pstrain_compute_ms) ms"
      row "pstrain.torch $model on cuda, plain" INFO "$(json_field "$out" pstrain_plain_samples_per_s) samples/s" "pipeline=False; ps.step $(json_field "$out" pstrain_plain_step_ms) ms, forward+backward queued in $(json_field "$out" pstrain_plain_compute_ms) ms"
      local cpp
      cpp=$(figure_of "job gpu1_1worker_fp32")
      cpp=${cpp%% *}
      if [[ $model == cnn ]]; then
        goal_row "pstrain.torch CNN vs one torch process" "$(ratio "$sps" "$local_sps")" at_least 0.8 \
          "same GPU, batch 128, Adam; goal >= 0.8x"
      elif [[ -n $cpp ]]; then
        goal_row "pstrain.torch MLP vs C++ GPU worker" "$(ratio "$sps" "$cpp")" at_least 0.9 \
          "$sps vs $cpp samples/s (job gpu1_1worker_fp32); goal >= 0.9x"
      fi
    done
  fi
  local t summary
  for t in $TORCH_CUDA_TESTS; do
    mkdir -p "$dir/tmp/$t"
    status=0
    (cd "$tree" && TEST_SRCDIR=$dir/runfiles TEST_TMPDIR=$dir/tmp/$t PSTRAIN_TEST_VENV=$venv \
      PSTRAIN_TEST_DEVICE=$TORCH_TEST_DEVICE PSTRAIN_FASHION_MNIST=$fashion PYTHONPATH=$tree \
      run_to "$dir/$t.txt" "$python" -u "tests/python/$t.py") || status=$?
    summary="$(grep -m1 '^Ran ' "$dir/$t.txt"), $(grep -E '^(OK|FAILED)' "$dir/$t.txt" | tail -n 1)"
    if ((status == 0)); then
      row "torch $TORCH_TEST_DEVICE $t" PASS "${summary%% in *}" "${summary#*, }"
    else
      row "torch $TORCH_TEST_DEVICE $t" FAIL "${summary%% in *}" "$(exit_text "$status"): ${summary#*, }; see torch_cuda/$t.txt"
    fi
  done
}

# --- 10. Replicated shards on this host --------------------------------------
# Issue 38: the sync step with every shard held by two server processes
# (--replicas=2) against one, on loopback: bench/replication_overhead.sh's
# mlp_2x2 (MLP 784-256-128-10, Adam, 2 servers x 2 workers, global batch 128,
# one BLAS thread a worker), rounds interleaved, the order alternating. Each
# job's CPU (every process of it, from the shell's child times) comes with it:
# where the cores are fewer than the processes, the step follows the CPU the
# backups spend (a 2-vCPU VM: bench/results/replication_overhead.txt); a
# host with cores to spare, as the GPU hosts are, measures the replication.
: "${REPLICATION_ROUNDS:=3}"
step_replication() {
  job_setup
  mkdir -p "$results/replication"
  local steps=1000
  ((quick)) && steps=100
  # replica_job R ROUND: "step_ms cpu_ms_per_step" of one job, or "FAIL why"
  # (it runs in a command substitution, where a row would be lost).
  replica_job() {
    local name=r$1_round$2 out=$results/replication/r$1_round$2.txt status
    (
      run_to "$out" "$BUNDLE/launch.sh" --servers=2 --workers=2 --mode=sync --replicas="$1" \
        --bin_dir="$wrappers" --run_dir="$results/replication/$name.run" --timeout_s="$STEP_TIMEOUT_S" -- \
        --server.optimizer=adam --server.learning_rate=0.001 --cpu_threads=1 --log_every=0 \
        --device=cpu --model=mlp --hidden=256,128 --global_batch_size=128 --steps="$steps" \
        "${data_flags[@]}"
      status=$?
      times >"$results/replication/$name.times"
      exit "$status"
    )
    status=$?
    if ((status != 0)); then
      echo "FAIL launch.sh: $(exit_text "$status"); see replication/$name.txt"
      return
    fi
    # Worker 0's final line (json_field filters string fields only).
    local final=$results/replication/$name.final
    grep '^{"event":"final"' "$out" | grep '"worker_id":0[,}]' | tail -n 1 >"$final"
    # The children's user and system time: the second line of `times`.
    awk -v wall="$(json_field "$final" wall_time_s)" -v eval="$(json_field "$final" evaluation_s)" \
      -v n="$(json_field "$final" steps_run)" -v wait="$(json_field "$final" network_wait_s)" '
      function seconds(t) { split(t, p, "m"); return p[1] * 60 + p[2] }
      NR == 2 { cpu = seconds($1) + seconds($2) }
      END { if (n > 0) printf "%.3f %.3f %.3f\n", 1e3 * (wall - eval) / n, 1e3 * cpu / n, 1e3 * wait / n }' \
      "$results/replication/$name.times"
  }
  local round first second a b one=() two=() ratios=() cpu_one=() cpu_two=() wait_one=() wait_two=()
  local a_step a_cpu a_wait b_step b_cpu b_wait
  for ((round = 1; round <= REPLICATION_ROUNDS; round++)); do
    if ((round % 2)); then first=1 second=2; else first=2 second=1; fi
    a=$(replica_job "$first" "$round")
    b=$(replica_job "$second" "$round")
    local r=$first result
    for result in "$a" "$b"; do
      if [[ ! $result =~ ^[0-9.]+\ [0-9.]+\ [0-9.]+$ ]]; then
        result=${result#FAIL }
        row "replication job R=$r round $round" FAIL "-" "${result:-no step time in its output}"
        return
      fi
      r=$second
    done
    ((first == 1)) || { local swap=$a; a=$b; b=$swap; }
    read -r a_step a_cpu a_wait <<<"$a"
    read -r b_step b_cpu b_wait <<<"$b"
    one+=("$a_step") two+=("$b_step") cpu_one+=("$a_cpu") cpu_two+=("$b_cpu")
    wait_one+=("$a_wait") wait_two+=("$b_wait")
    ratios+=("$(ratio "$b_step" "$a_step")")
  done
  median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
  local cpu_ratio
  cpu_ratio=$(ratio "$(median "${cpu_two[@]}")" "$(median "${cpu_one[@]}")")
  row "replication R=1 / R=2 step" INFO "$(median "${one[@]}") / $(median "${two[@]}") ms" \
    "medians of $REPLICATION_ROUNDS interleaved rounds, $steps steps each; per-round R=2/R=1: ${ratios[*]}"
  row "replication CPU a step, R=1 / R=2" INFO "$(median "${cpu_one[@]}") / $(median "${cpu_two[@]}") ms" \
    "every process of the job, $(nproc) cores here; R=2 spends ${cpu_ratio}x the CPU of R=1"
  row "replication network wait a step, R=1 / R=2" INFO "$(median "${wait_one[@]}") / $(median "${wait_two[@]}") ms" \
    "worker 0's wait for the exchange (its network_wait_s), medians"
  goal_row "sync step R=2 vs R=1 (loopback)" "$(median "${ratios[@]}")" at_most 1.15 \
    "median of the per-round ratios; issue 38's goal <= 1.15x"
  # Where the R=2 step's extra goes: what the servers said of their step
  # records at exit (ps_server's shard_final line), medians over the rounds'
  # shards. confirm: from a message's newest record to every backup holding
  # it (what a step's last pulls wait for); send: the call alone; apply: the
  # backup's part of the call.
  local record_path
  record_path=$(cat "$results"/replication/r2_round*.run/ps*.log 2>/dev/null | grep '^{"event":"shard_final"' | awk '
    function field(name,   m) { return match($0, "\"" name "\":[0-9.]+") ? substr($0, RSTART + length(name) + 3, RLENGTH - length(name) - 3) : "" }
    function median(a, n,   i, j, t) {
      for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    field("step_record_confirm_ms") != "" { c[++nc] = field("step_record_confirm_ms") + 0; s[nc] = field("step_record_send_ms") + 0 }
    field("step_record_apply_ms") != "" { a[++na] = field("step_record_apply_ms") + 0 }
    END { if (nc && na) printf "confirm %.3f ms, send %.3f ms, backup apply %.3f ms", median(c, nc), median(s, nc), median(a, na) }')
  row "replication record path (R=2)" INFO "${record_path:-none reported}" \
    "per step-record message, medians over the primaries and backups of every round"
}

# --- Run them ------------------------------------------------------------------

for step in "${STEPS[@]}"; do
  "step_$step"
done
finish
