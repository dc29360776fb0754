#!/usr/bin/env bash
# How soon a sync job's first step completes once its last worker has
# registered (issue 27's goal: within 100 ms), next to what one ordinary
# step of the same job takes, in the same run. The servers log both ends:
# "the job starts after ..." when the last expected worker registers, and
# "the first step completed X after the job started". launch.sh starts the
# workers one after another, so the servers wait for the last of them; on 2
# cores the 32- and 64-worker jobs are also the slow-start case of the issue
# (the last worker registers tens of seconds after the servers came up).
# The baseline is the job's own median step: wall time / steps of each
# worker's final JSON line.
#
#   bench/job_start.sh [--repeats=3] [--workers=2,32,64]
#
# Writes bench/results/job_start.txt (every run, then medians per size).
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=3
sizes=2,32,64
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    --workers=*) sizes=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "job_start.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "job_start.sh: --repeats must be a positive integer, got '$repeats'" >&2; exit 2; }
[[ "$sizes" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "job_start.sh: --workers must be a list of positive integers, got '$sizes'" >&2; exit 2; }

bazel build //ps_server:ps_server //worker:worker
source bench/lib.sh
out=bench/results/job_start.txt
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

rows=()
summary=()
run_dir=$(mktemp -d /tmp/job_start.XXXXXX)
trap 'rm -rf "$run_dir"' EXIT
IFS=, read -r -a worker_counts <<<"$sizes"
for workers in "${worker_counts[@]}"; do
  first=() step=() wait=()
  for ((r = 1; r <= repeats; r++)); do
    rm -rf "$run_dir/run"
    deploy/local/launch.sh --servers=2 --workers="$workers" --mode=sync \
      --run_dir="$run_dir/run" -- --model=mlp --hidden=64 --steps=100 \
      --batch_size=16 --cpu_threads=1 --log_every=0 >"$run_dir/out" 2>&1 ||
      { tail -n 30 "$run_dir/out" >&2; exit 1; }
    # The later shard to see its first step bounds the job's.
    first_s=0 wait_s=0
    for log in "$run_dir"/run/ps*.log; do
      d=$(sed -n 's/.*the first step completed \([0-9.]*\) ms after.*/\1/p' "$log")
      w=$(sed -n 's/.*the job starts after \([0-9.]*\) s$/\1/p' "$log")
      [[ -n "$d" && -n "$w" ]] || { echo "job_start.sh: no start lines in $log" >&2; exit 1; }
      first_s=$(awk -v a="$first_s" -v b="$d" 'BEGIN {print (b / 1e3 > a) ? b / 1e3 : a}')
      wait_s=$(awk -v a="$wait_s" -v b="$w" 'BEGIN {print (b > a) ? b : a}')
    done
    steps_ms=$(grep '^{"event":"final"' "$run_dir/out" | while read -r line; do
      awk -v w="$(json_field wall_time_s "$line")" -v s="$(json_field steps_run "$line")" 'BEGIN {print 1e3 * w / s}'
    done | median)
    short=$(grep -o '"steps_short":[0-9]*' "$run_dir/out" | sort -u | tr '\n' ' ')
    first+=("$(awk -v f="$first_s" 'BEGIN {print 1e3 * f}')")
    step+=("$steps_ms")
    wait+=("$wait_s")
    rows+=("$(printf '%7d %5d %12.1f %12.2f %14.2f %8.1f   %s' "$workers" "$r" "$wait_s" "${first[-1]}" "$steps_ms" "$(awk -v a="${first[-1]}" -v b="$steps_ms" 'BEGIN {print a / b}')" "$short")")
    echo "${rows[-1]}" >&2
  done
  f=$(printf '%s\n' "${first[@]}" | median)
  s=$(printf '%s\n' "${step[@]}" | median)
  summary+=("$(printf '%7d %12.2f %14.2f %8.1f %s' "$workers" "$f" "$s" "$(awk -v a="$f" -v b="$s" 'BEGIN {print a / b}')" "$(awk -v f="$f" 'BEGIN {print (f <= 100) ? "yes" : "NO"}')")")
done

{
  echo "# bench/job_start.sh --repeats=$repeats --workers=$sizes"
  echo "# commit $BENCH_COMMIT; $BENCH_MACHINE; $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "# load average at the end: $(cut -d" " -f1-3 /proc/loadavg) (the job's own processes)"
  echo "# 2 servers, W workers, sync, MLP 64 hidden on synthetic data, 100 steps"
  echo "# of batch 16, launched by deploy/local/launch.sh (workers started one"
  echo "# after another). start_wait: servers' start to the last registration;"
  echo "# first_step: last registration to the first completed step (the later"
  echo "# shard); step: the job's median step (wall / steps, over workers)."
  echo "#"
  echo "# workers  run  start_wait_s first_step_ms        step_ms    ratio   steps_short"
  printf '%s\n' "${rows[@]}"
  echo "#"
  echo "# medians                                    goal: first step <= 100 ms"
  echo "# workers first_step_ms        step_ms    ratio  met"
  printf '%s\n' "${summary[@]}"
} | tee "$out"
