#!/usr/bin/env bash
# What a second replica of every shard costs a sync job (issue 38's goal:
# a step with --replicas=2 <= 1.15x one with --replicas=1 on loopback), in
# one run: the same jobs through deploy/local/launch.sh, rounds interleaved,
# the order of the two alternating from round to round so that drift on
# this shared machine falls on both.
#
#   mlp_2x2   MLP 784-256-128-10 on Fashion-MNIST, 2 servers x 2 workers,
#             global batch 128, 1 epoch (the README's job; 0.94 MB model)
#   mlp_1x1   the same MLP, 1 server x 1 worker: three processes on this
#             machine's cores, so the replication's round trips show rather
#             than the backups' CPU (as on a host with cores to spare)
#   mlp_2x2_offcpu  mlp_2x2 with 2 ms of each worker's step spent off the
#             cores (--inject_step_delay_ms=2), as a GPU worker's compute
#             is: the replication's cost where the job leaves cores idle
#   big_2x4   MLP 32-4096-4096-4 (16.8M parameters, 67 MB), synthetic data,
#             2 servers x 4 workers, batch 32 a worker, 40 steps
#
# Step time is worker 0's wall time over its steps (evaluation excluded).
# With replicas, every push is applied by the primary, forwarded to the
# backup (gRPC, the request's bytes) and applied there before the answer:
# on one machine the backups' applies share its cores with everything else.
#
#   bench/replication_overhead.sh [--repeats=3]
#       [--jobs=mlp_2x2,big_2x4,mlp_1x1,mlp_2x2_offcpu]
#
# Writes bench/results/replication_overhead.txt (medians over the rounds).
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=3
jobs=mlp_2x2,big_2x4
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    --jobs=*) jobs=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "replication_overhead.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "replication_overhead.sh: --repeats must be a positive integer, got '$repeats'" >&2; exit 2; }

bazel build //ps_server:ps_server //worker:worker >/dev/null
source bench/lib.sh

common=(--server.optimizer=adam --server.learning_rate=0.001 --cpu_threads=1 --log_every=0)
job_args() {
  case "$1" in
    mlp_2x2) echo "--servers=2 --workers=2 -- --data=fashion_mnist --model=mlp --hidden=256,128 --global_batch_size=128 --epochs=1" ;;
    mlp_2x2_offcpu) echo "--servers=2 --workers=2 -- --data=fashion_mnist --model=mlp --hidden=256,128 --global_batch_size=128 --epochs=1 --inject_step_delay_ms=2" ;;
    mlp_1x1) echo "--servers=1 --workers=1 -- --data=fashion_mnist --model=mlp --hidden=256,128 --global_batch_size=128 --epochs=1" ;;
    big_2x4) echo "--servers=2 --workers=4 -- --data=synthetic --num_features=32 --num_classes=4 --model=mlp --hidden=4096,4096 --batch_size=32 --steps=40 --train_examples=4096 --test_examples=256" ;;
    *) echo "replication_overhead.sh: unknown job '$1'" >&2; exit 2 ;;
  esac
}

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
worker0() { grep '^{"event":"final".*"worker_id":0' "$1"; }

# run JOB REPLICAS: one job; prints its step time in ms.
run() {
  local run_dir out
  run_dir=$(mktemp -d /tmp/replication_overhead.XXXXXX)
  out="$run_dir/stdout"
  # shellcheck disable=SC2046
  deploy/local/launch.sh --mode=sync --replicas="$2" --run_dir="$run_dir" $(job_args "$1" | sed 's/ -- .*//') -- \
    "${common[@]}" $(job_args "$1" | sed 's/.* -- //') >"$out" 2>"$run_dir/stderr" ||
    { echo "replication_overhead.sh: $1 (--replicas=$2) failed; logs in $run_dir" >&2; exit 1; }
  local line wall eval steps
  line=$(worker0 "$out")
  wall=$(json_field wall_time_s "$line")
  eval=$(json_field evaluation_s "$line")
  steps=$(json_field steps_run "$line")
  awk -v w="$wall" -v e="$eval" -v s="$steps" 'BEGIN {printf "%.4f\n", 1e3 * (w - e) / s}'
  rm -rf "$run_dir"
}

out=bench/results/replication_overhead.txt
{
  echo "# replication_overhead: sync step time with --replicas=2 vs --replicas=1 (loopback, one machine)"
  echo "command: bench/replication_overhead.sh --repeats=$repeats --jobs=$jobs"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo
  printf '%-14s %10s %10s %9s %s\n' job "R=1 ms" "R=2 ms" ratio "per-round ratios"
} >"$out.tmp"
for job in ${jobs//,/ }; do
  one=() two=() ratios=()
  for ((r = 1; r <= repeats; r++)); do
    if ((r % 2)); then first=1 second=2; else first=2 second=1; fi
    a=$(run "$job" $first)
    b=$(run "$job" $second)
    if ((first == 1)); then o=$a t=$b; else o=$b t=$a; fi
    one+=("$o") two+=("$t")
    ratios+=("$(awk -v o="$o" -v t="$t" 'BEGIN {printf "%.3f", t / o}')")
    echo "$job round $r: R=1 $o ms, R=2 $t ms (x${ratios[-1]})" >&2
  done
  printf '%-14s %10.3f %10.3f %9.3f %s\n' "$job" "$(printf '%s\n' "${one[@]}" | median)" \
    "$(printf '%s\n' "${two[@]}" | median)" "$(printf '%s\n' "${ratios[@]}" | median)" "${ratios[*]}" >>"$out.tmp"
done
{
  echo
  echo "ratio: the median of the per-round ratios R=2 / R=1 (<= 1.15 on loopback is issue 38's goal)."
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
