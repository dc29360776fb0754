#!/usr/bin/env bash
# What summing each sync step's gradients in worker-id order costs (issue 41:
# the same job gives the same model bit for bit), against summing them as
# they arrive, the servers' behaviour before it (--sync_sum_order=arrival),
# in one run: the same jobs, rounds interleaved, the order of the two
# alternating from round to round so that drift on this shared machine
# falls on both.
#
#   mlp_2x2   MLP 784-256-128-10 on Fashion-MNIST, 2 servers x 2 workers,
#             global batch 128, 1 epoch (the README's job)
#   mlp_2x8   the same with 8 workers, global batch 512
#   big_2x4   MLP 32-4096-4096-4 (16.8M parameters, 67 MB), synthetic data,
#             2 servers x 4 workers, batch 32 a worker, 40 steps
#
# Step time is worker 0's wall time over its steps (evaluation excluded, as
# its samples/s). Memory: the most gradient bytes a server held at once
# because they came before a lower worker id's (its final stats,
# early_gradient_bytes_peak), against the bytes it holds for the model.
#
#   bench/sum_order_cost.sh [--repeats=3] [--jobs=mlp_2x2,mlp_2x8,big_2x4]
#
# Writes bench/results/sum_order_cost.txt (medians over the rounds).
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=3
jobs=mlp_2x2,mlp_2x8,big_2x4
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    --jobs=*) jobs=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sum_order_cost.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "sum_order_cost.sh: --repeats must be a positive integer, got '$repeats'" >&2; exit 2; }

bazel build //ps_server:ps_server //worker:worker
source bench/lib.sh

common=(--server.optimizer=adam --server.learning_rate=0.001 --cpu_threads=1 --log_every=0)
job_args() {
  case "$1" in
    mlp_2x2) echo "--servers=2 --workers=2 -- --data=fashion_mnist --model=mlp --hidden=256,128 --global_batch_size=128 --epochs=1" ;;
    mlp_2x8) echo "--servers=2 --workers=8 -- --data=fashion_mnist --model=mlp --hidden=256,128 --global_batch_size=512 --epochs=1" ;;
    big_2x4) echo "--servers=2 --workers=4 -- --data=synthetic --num_features=32 --num_classes=4 --model=mlp --hidden=4096,4096 --batch_size=32 --steps=40 --train_examples=4096 --test_examples=256" ;;
    *) echo "sum_order_cost.sh: unknown job '$1'" >&2; exit 2 ;;
  esac
}
model_bytes() {
  case "$1" in
    mlp_*) echo $(( (784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10) * 4 )) ;;
    big_*) echo $(( (32 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 4 + 4) * 4 )) ;;
  esac
}

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
worker0() { grep '^{"event":"final".*"worker_id":0' "$1"; }

# run JOB ORDER: one job; prints "step_ms early_peak_bytes".
run() {
  local run_dir out
  run_dir=$(mktemp -d /tmp/sum_order_cost.XXXXXX)
  out="$run_dir/stdout"
  # shellcheck disable=SC2046
  deploy/local/launch.sh --mode=sync --run_dir="$run_dir" $(job_args "$1" | sed 's/ -- .*//') -- \
    "${common[@]}" --server.sync_sum_order="$2" $(job_args "$1" | sed 's/.* -- //') >"$out" 2>"$run_dir/stderr" ||
    { echo "sum_order_cost.sh: $1 ($2) failed; logs in $run_dir" >&2; exit 1; }
  local line wall eval steps peak=0 p
  line=$(worker0 "$out")
  wall=$(json_field wall_time_s "$line")
  eval=$(json_field evaluation_s "$line")
  steps=$(json_field steps_run "$line")
  for p in $(sed -n 's/.*final stats:.*early_gradient_bytes_peak: \([0-9]*\).*/\1/p' "$run_dir"/ps*.log); do
    ((p > peak)) && peak=$p
  done
  awk -v w="$wall" -v e="$eval" -v s="$steps" -v p="$peak" 'BEGIN {printf "%.4f %d\n", 1e3 * (w - e) / s, p}'
  rm -rf "$run_dir"
}

out=bench/results/sum_order_cost.txt
{
  echo "# sum_order_cost: sync step time with gradients summed in worker-id order (default) vs as they arrive"
  echo "command: bench/sum_order_cost.sh --repeats=$repeats --jobs=$jobs"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo
  printf '%-9s %12s %12s %9s %16s %14s %s\n' job "worker_id ms" "arrival ms" ratio "early peak MiB" "model MiB" "per-round ratios"
} >"$out.tmp"
for job in ${jobs//,/ }; do
  ordered=() arrival=() ratios=() peaks=()
  for ((r = 1; r <= repeats; r++)); do
    if ((r % 2)); then first=worker_id second=arrival; else first=arrival second=worker_id; fi
    read -r ms_a peak_a < <(run "$job" "$first")
    read -r ms_b peak_b < <(run "$job" "$second")
    if [[ $first == worker_id ]]; then o=$ms_a a=$ms_b peak=$peak_a; else o=$ms_b a=$ms_a peak=$peak_b; fi
    ordered+=("$o") arrival+=("$a") peaks+=("$peak")
    ratios+=("$(awk -v o="$o" -v a="$a" 'BEGIN {printf "%.3f", o / a}')")
    echo "$job round $r: worker_id $o ms, arrival $a ms (x${ratios[-1]}), early peak $peak bytes" >&2
  done
  o=$(printf '%s\n' "${ordered[@]}" | median)
  a=$(printf '%s\n' "${arrival[@]}" | median)
  peak=$(printf '%s\n' "${peaks[@]}" | sort -g | tail -n 1)
  printf '%-9s %12.3f %12.3f %9.3f %16.2f %14.2f %s\n' "$job" "$o" "$a" \
    "$(printf '%s\n' "${ratios[@]}" | median)" "$(awk -v p="$peak" 'BEGIN {print p / 1048576}')" \
    "$(awk -v b="$(model_bytes "$job")" 'BEGIN {print b / 1048576}')" "${ratios[*]}" >>"$out.tmp"
done
{
  echo
  echo "ratio: the median of the per-round ratios worker_id / arrival (<= 1.05 is issue 41's goal)."
  echo "early peak: the most gradient bytes one server held at once, over the rounds (the model's"
  echo "bytes are spread over 2 servers; the bound is num_workers - 1 gradients of each block in flight)."
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
