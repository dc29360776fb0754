#!/usr/bin/env bash
# How much of a sync step any transport must spend waiting on the network
# on this machine, measured next to what this system spends, in one run:
#   floor     bench/transport/sync_floor: the step's exchange (each worker
#             pushes the model's bytes to the shards and pulls them back,
#             the shards wait for every worker) over raw blocking TCP, with
#             no compute, no protocol and no optimizer state;
#   PS probe  the same exchange through ps_server and the worker, with no
#             compute to speak of (--model=probe, the MLP's element count,
#             Adam on the servers);
#   PS MLP    the job itself: MLP 784-256-128-10 on Fashion-MNIST, global
#             batch 128.
# All 2 servers x 2 workers, sync, one thread per process for BLAS. A sync
# step cannot start its compute before its pull, so with the exchange at
# the floor and compute as measured, the least share of the step spent on
# the network is floor / (floor + compute); on few shared cores the
# exchange also cannot hide under compute, since it needs the same cores.
#
#   bench/sync_wait_floor.sh [--repeats=3]
#
# Writes bench/results/sync_wait_floor.txt (medians of interleaved runs).
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=3
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sync_wait_floor.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "sync_wait_floor.sh: --repeats must be a positive integer, got '$repeats'" >&2; exit 2; }

bazel build //ps_server:ps_server //worker:worker //bench/transport:sync_floor
source bench/lib.sh
readonly ELEMENTS=235146  # MLP 784-256-128-10
out=bench/results/sync_wait_floor.txt
launch=(deploy/local/launch.sh --servers=2 --workers=2 --mode=sync --
  --server.optimizer=adam --server.learning_rate=0.001 --cpu_threads=1 --log_every=0)
probe_args=(--model=probe --probe_elements=$ELEMENTS --steps=2000)
mlp_args=(--data=fashion_mnist --global_batch_size=128 --epochs=4 --model=mlp --hidden=256,128)

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
# job_field KEY LOG: KEY of worker 0's final JSON line.
job_field() { json_field "$1" "$(grep '^{"event":"final".*"worker_id":0' "$2")"; }

floor_ms=() probe_ms=() mlp_ms=() mlp_compute_ms=() mlp_share=()
log=$(mktemp /tmp/sync_wait_floor.XXXXXX)
for ((r = 1; r <= repeats; r++)); do
  json=$(bazel-bin/bench/transport/sync_floor --servers=2 --workers=2 --elements=$ELEMENTS --steps=2000 | grep '^{')
  floor_ms+=("$(json_field step_ms "$json")")
  "${launch[@]}" "${probe_args[@]}" >"$log" 2>&1
  probe_ms+=("$(awk -v w="$(job_field wall_time_s "$log")" -v s="$(job_field steps_run "$log")" 'BEGIN {print 1e3 * w / s}')")
  "${launch[@]}" "${mlp_args[@]}" >"$log" 2>&1
  steps=$(job_field steps_run "$log")
  mlp_ms+=("$(awk -v w="$(job_field wall_time_s "$log")" -v s="$steps" 'BEGIN {print 1e3 * w / s}')")
  mlp_compute_ms+=("$(awk -v c="$(job_field compute_s "$log")" -v s="$steps" 'BEGIN {print 1e3 * c / s}')")
  mlp_share+=("$(job_field network_wait_share "$log")")
  echo "round $r: floor ${floor_ms[-1]} ms, PS probe ${probe_ms[-1]} ms, MLP ${mlp_ms[-1]} ms (compute ${mlp_compute_ms[-1]} ms, wait share ${mlp_share[-1]})" >&2
done
rm -f "$log"

floor=$(printf '%s\n' "${floor_ms[@]}" | median)
probe=$(printf '%s\n' "${probe_ms[@]}" | median)
mlp=$(printf '%s\n' "${mlp_ms[@]}" | median)
compute=$(printf '%s\n' "${mlp_compute_ms[@]}" | median)
share=$(printf '%s\n' "${mlp_share[@]}" | median)
{
  echo "# sync_wait_floor: the 2x2 sync step's exchange at the raw-TCP floor, through the PS, and in the MLP job (medians of $repeats interleaved rounds)"
  echo "command: bench/sync_wait_floor.sh --repeats=$repeats"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "model bytes: $ELEMENTS float32 pushed and pulled by each worker per step"
  echo
  printf '%-38s %10s\n' row "ms/step"
  printf '%-38s %10.3f\n' "floor: raw TCP exchange, no compute" "$floor"
  printf '%-38s %10.3f   (%.2fx the floor)\n' "PS probe: the exchange, no compute" "$probe" "$(awk -v a="$probe" -v b="$floor" 'BEGIN {print a / b}')"
  printf '%-38s %10.3f   (compute %.3f ms, network wait share %.3f)\n' "PS MLP job, global batch 128" "$mlp" "$compute" "$share"
  echo
  printf 'least network wait share at this compute: floor / (floor + compute) = %.3f\n' \
    "$(awk -v f="$floor" -v c="$compute" 'BEGIN {print f / (f + c)}')"
  echo "per-round values: floor ${floor_ms[*]}; probe ${probe_ms[*]}; MLP ${mlp_ms[*]}; compute ${mlp_compute_ms[*]}; share ${mlp_share[*]}"
} | tee "$out"
