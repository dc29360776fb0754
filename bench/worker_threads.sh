#!/usr/bin/env bash
# What launch.sh's share of the cores per C++ worker (--cpu_threads =
# cores / workers) gives against every worker using every core (the
# worker's own default, --cpu_threads=0), in one run: the README's MLP job
# (784-256-128-10 on Fashion-MNIST, sync, 2 servers, global batch 128,
# 2 epochs) through deploy/local/launch.sh, rounds interleaved and the order
# alternating, for each worker count.
#
# Figures: worker 0's samples_per_sec, and the whole job's CPU seconds
# (user + sys of launch.sh and everything it started).
#
#   bench/worker_threads.sh [--repeats=3] [--workers=2,4]
#
# Writes bench/results/worker_threads.txt (medians over the rounds, and the
# per-round ratios share / every core).
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=3
workers=2,4
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    --workers=*) workers=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "worker_threads.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "worker_threads.sh: --repeats must be a positive integer, got '$repeats'" >&2; exit 2; }
[[ "$workers" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "worker_threads.sh: --workers must be a list of positive integers, got '$workers'" >&2; exit 2; }

bazel build //ps_server:ps_server //worker:worker >/dev/null
source bench/lib.sh

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# run WORKERS HOW (share | all): prints "samples_per_sec cpu_seconds".
run() {
  local run_dir threads=()
  run_dir=$(mktemp -d /tmp/worker_threads.XXXXXX)
  [[ $2 == all ]] && threads=(--cpu_threads=0)
  local cpu TIMEFORMAT='%U %S'
  cpu=$({ time deploy/local/launch.sh --mode=sync --servers=2 --workers="$1" --run_dir="$run_dir" -- \
    --server.optimizer=adam --server.learning_rate=0.001 --data=fashion_mnist --model=mlp \
    --hidden=256,128 --global_batch_size=128 --epochs=2 --log_every=0 ${threads[@]+"${threads[@]}"} \
    >"$run_dir/stdout" 2>"$run_dir/stderr"; } 2>&1) ||
    { echo "worker_threads.sh: the job (W=$1, $2) failed; logs in $run_dir" >&2; exit 1; }
  local line
  line=$(grep '^{"event":"final".*"worker_id":0' "$run_dir/stdout")
  echo "$(json_field samples_per_sec "$line") $(awk '{print $1 + $2}' <<<"$cpu")"
  rm -rf "$run_dir"
}

out=bench/results/worker_threads.txt
{
  echo "# worker_threads: launch.sh's --cpu_threads share (cores / workers) vs every core per worker"
  echo "command: bench/worker_threads.sh --repeats=$repeats --workers=$workers"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE ($(nproc) cores)"
  echo
  printf '%-3s %12s %12s %8s %10s %10s %8s  %s\n' W "samples/s" "samples/s" ratio "CPU s" "CPU s" ratio "per-round samples/s ratios"
  printf '%-3s %12s %12s %8s %10s %10s %8s\n' "" "all cores" share "" "all cores" share ""
} >"$out.tmp"
for w in ${workers//,/ }; do
  all_rate=() share_rate=() all_cpu=() share_cpu=() ratios=() cpu_ratios=()
  for ((r = 1; r <= repeats; r++)); do
    if ((r % 2)); then order="all share"; else order="share all"; fi
    for how in $order; do
      read -r rate cpu < <(run "$w" "$how")
      if [[ $how == all ]]; then all_rate+=("$rate") all_cpu+=("$cpu"); else share_rate+=("$rate") share_cpu+=("$cpu"); fi
    done
    ratios+=("$(awk -v a="${all_rate[-1]}" -v s="${share_rate[-1]}" 'BEGIN {printf "%.3f", s / a}')")
    cpu_ratios+=("$(awk -v a="${all_cpu[-1]}" -v s="${share_cpu[-1]}" 'BEGIN {printf "%.3f", s / a}')")
    echo "W=$w round $r: every core ${all_rate[-1]} samples/s ${all_cpu[-1]} CPU s; share ${share_rate[-1]} samples/s ${share_cpu[-1]} CPU s" >&2
  done
  printf '%-3s %12.0f %12.0f %8.3f %10.2f %10.2f %8.3f  %s\n' "$w" \
    "$(printf '%s\n' "${all_rate[@]}" | median)" "$(printf '%s\n' "${share_rate[@]}" | median)" \
    "$(printf '%s\n' "${ratios[@]}" | median)" \
    "$(printf '%s\n' "${all_cpu[@]}" | median)" "$(printf '%s\n' "${share_cpu[@]}" | median)" \
    "$(printf '%s\n' "${cpu_ratios[@]}" | median)" "${ratios[*]}" >>"$out.tmp"
done
{
  echo
  echo "ratio: the median of the per-round ratios share / every core (samples/s: above 1 is faster; CPU: below 1 is cheaper)."
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
