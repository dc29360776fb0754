#!/usr/bin/env bash
# What distribution costs a training step, measured in one run: the same
# model and per-worker batch (Fashion-MNIST shapes: 784 features, 10
# classes)
#   local     one process, no servers: //bench:step_bench (forward,
#             backward, a local SGD step), the baseline;
#   1x1       one server, one worker, sync (deploy/local/launch.sh);
#   2x2       two servers, two workers, sync, global batch 2 x batch,
#             with one push after backward (the default) and with each
#             layer pushed as backward produces it (--overlap_push);
# for the MLP 784-256-128-10 and the CNN
# conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,relu,dense:10.
# Every process multiplies on one thread (--cpu_threads=1). Per row: the
# samples/s of one worker and of the job, the share of a worker's step it
# spent blocked on the network, its compute per step, and worker samples/s
# over the local baseline's.
#
#   bench/distribution_cost.sh [--batch=64] [--epochs=1] [--only=mlp,cnn]
#
# Writes bench/results/distribution_cost.txt (table, commands, machine).
set -euo pipefail
cd "$(dirname "$0")/.."

batch=64
epochs=1
only="mlp,cnn"
for arg in "$@"; do
  case "$arg" in
    --batch=*) batch=${arg#*=} ;;
    --epochs=*) epochs=${arg#*=} ;;
    --only=*) only=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "distribution_cost.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

bazel build //ps_server:ps_server //worker:worker //bench:step_bench
bin_dir=$(mktemp -d /tmp/distribution_cost_bin.XXXXXX)
ln -s "$PWD/bazel-bin/ps_server/ps_server" "$PWD/bazel-bin/worker/worker" "$bin_dir/"
out=bench/results/distribution_cost.txt
source bench/lib.sh
readonly CNN=conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,relu,dense:10


rows=()
commands=$(mktemp /tmp/distribution_cost_commands.XXXXXX)
# local_rate MODEL_FLAGS...: step_bench's examples/s on the CPU backend, the
# best of three runs (a shared machine slows some runs; none speeds one up).
local_rate() {
  local -a cmd=(bazel-bin/bench/step_bench --devices=cpu --cpu_threads=1
    --num_features=784 --num_classes=10 --batch_size="$batch" --steps=200
    --warmup_steps=20 --target_accuracy=0 "$@")
  echo "${cmd[*]}  (best of 3)" >>"$commands"
  local best=0 json rate
  for _ in 1 2 3; do
    json=$("${cmd[@]}" 2>/dev/null | grep '^{"bench":"step"')
    rate=$(json_field examples_per_s "$json")
    best=$(awk -v a="$best" -v b="$rate" 'BEGIN {print (b > a ? b : a)}')
  done
  echo "$best"
}

# job SERVERS WORKERS MODEL_FLAGS...: prints worker 0's final JSON.
job() {
  local servers=$1 workers=$2
  shift 2
  local dir
  dir=$(mktemp -d /tmp/distribution_cost_job.XXXXXX)
  local -a cmd=(deploy/local/launch.sh --servers="$servers" --workers="$workers"
    --mode=sync --bin_dir="$bin_dir" --run_dir="$dir" --timeout_s=1800 --
    --server.optimizer=adam --server.learning_rate=0.001 --data=fashion_mnist
    --global_batch_size=$((batch * workers)) --epochs="$epochs" --log_every=0
    --cpu_threads=1 "$@")
  echo "${cmd[*]}" >>"$commands"
  "${cmd[@]}" | grep '^{"event":"final","mode":"sync","worker_id":0,'
}

# add_row MODEL SETUP WORKERS SAMPLES_PER_S WAIT_SHARE COMPUTE_MS BASE
add_row() {
  local job_rate ratio
  job_rate=$(awk -v r="$4" -v w="$3" 'BEGIN {printf "%.0f", r * w}')
  ratio=$(awk -v r="$4" -v b="$7" 'BEGIN {printf "%.2f", r / b}')
  rows+=("$(printf '%-5s %-20s %13.0f %11s %13s %11s %9s' "$1" "$2" "$4" "$job_rate" "$5" "$6" "$ratio")")
}
# A job's compute per step (batch, forward, backward), from its final JSON.
compute_ms() {
  awk -v c="$(json_field compute_s "$1")" -v n="$(json_field steps_run "$1")" \
    'BEGIN {printf "%.2f", 1000 * c / n}'
}

for model in ${only//,/ }; do
  case "$model" in
    mlp) flags=(--model=mlp --hidden=256,128) ;;
    cnn) flags=(--model=layers --layers="$CNN") ;;
    *) echo "distribution_cost.sh: unknown model '$model'" >&2; exit 2 ;;
  esac
  if [[ $model == mlp ]]; then
    base=$(local_rate --model=mlp --hidden=256,128)
  else
    base=$(local_rate --model=layers --layers="$CNN")
  fi
  add_row "$model" "local (no servers)" 1 "$base" - \
    "$(awk -v r="$base" -v b="$batch" 'BEGIN {printf "%.2f", 1000 * b / r}')" "$base"
  final=$(job 1 1 "${flags[@]}")
  add_row "$model" "1x1 sync" 1 "$(json_field samples_per_sec "$final")" \
    "$(json_field network_wait_share "$final")" "$(compute_ms "$final")" "$base"
  final=$(job 2 2 "${flags[@]}" --overlap_push=true)
  add_row "$model" "2x2 sync, overlap" 2 "$(json_field samples_per_sec "$final")" \
    "$(json_field network_wait_share "$final")" "$(compute_ms "$final")" "$base"
  final=$(job 2 2 "${flags[@]}")
  add_row "$model" "2x2 sync" 2 "$(json_field samples_per_sec "$final")" \
    "$(json_field network_wait_share "$final")" "$(compute_ms "$final")" "$base"
done

{
  echo "# distribution_cost: the same step with and without parameter servers ($epochs epoch(s), batch $batch per worker)"
  echo "commit: $BENCH_COMMIT"
  echo "machine: $BENCH_MACHINE; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "every process shares the same cores: a 2x2 job runs 4 processes (and gRPC's threads) on them"
  echo
  echo "samples/s: per worker and for the job; network_wait: share of a worker's step blocked on"
  echo "the pull and on pushes still in flight; compute_ms: batch, forward and backward per step;"
  echo "vs_local: worker samples/s over the local baseline's"
  printf '%-5s %-20s %13s %11s %13s %11s %9s\n' model setup worker_samp/s job_samp/s network_wait compute_ms vs_local
  printf '%s\n' "${rows[@]}"
  echo
  echo "commands:"
  sed 's/^/  /' "$commands"
} | tee "$out"
rm -rf "$bin_dir" "$commands"
