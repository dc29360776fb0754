#!/usr/bin/env bash
# Issue 40, worker row cache: the CTR job on Criteo-shaped synthetic data
# (13 dense features, 26 fields with the Criteo Kaggle cardinalities, Zipf
# ids; 2 servers x 2 workers, sync) with --sparse_cache_steps=0 (every pull goes to the servers) and with
# the cache at 1, 2, 4 and 16 steps, in one run: the embedding rows a worker
# pulled from the servers per step (and the bytes), the cache's hit rate,
# held-out AUC and samples/s. Goal (2 steps): pulled row bytes per step down
# >= 50%, AUC within 0.002 of the run without.
#
#   bench/sparse/row_cache.sh [--steps=1500] [--record]
#
# --record writes bench/results/row_cache.txt. Exit status: 0, or 1 when a
# run failed; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/../.."

steps=1500 record=0
for arg in "$@"; do
  case "$arg" in
    --steps=*) steps=${arg#*=} ;;
    --record) record=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "row_cache.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "row_cache.sh: --steps must be a positive integer, got '$steps'" >&2; exit 2; }

bazel build //ps_server:ps_server //worker:worker >/dev/null
source bench/lib.sh
bench_trial_processes row_cache
mkdir -p "$run_dir/bin"
ln -s "$(readlink -f bazel-bin/ps_server/ps_server)" "$run_dir/bin/ps_server"
ln -s "$(readlink -f bazel-bin/worker/worker)" "$run_dir/bin/worker"

readonly DIM=16
readonly FLAGS=(--model=ctr --ctr_fields=26 --ctr_dense=13 --ctr_cardinalities=criteo
  "--embedding_dim=$DIM" --ctr_train_examples=262144 --batch_size=512 --log_every=0)

# run CACHE_STEPS: "rows_from_servers hits auc samples/s" of worker 0.
run() {
  deploy/local/launch.sh --bin_dir="$run_dir/bin" --run_dir="$run_dir/cache$1" --servers=2 --workers=2 \
    --mode=sync -- "${FLAGS[@]}" --steps="$steps" --sparse_cache_steps="$1" --sparse_cache_mb=4096 \
    >"$run_dir/out" 2>"$run_dir/err" ||
    { echo "row_cache.sh: the run with --sparse_cache_steps=$1 failed: $(tail -n 5 "$run_dir/err")" >&2; exit 1; }
  rm -rf "${run_dir:?}/cache$1"
  local line
  line=$(grep -m1 '^{"event":"final"' "$run_dir/out")
  echo "$(json_field sparse_rows_from_servers "$line") $(json_field sparse_cache_hits "$line") $(json_field auc "$line") $(json_field samples_per_sec "$line")"
}

declare -A pulled hits auc rate
for k in 0 1 2 4 16; do
  read -r pulled[$k] hits[$k] auc[$k] rate[$k] < <(run "$k")
  echo "cache $k: ${pulled[$k]} rows from the servers, ${hits[$k]} hits, auc ${auc[$k]}" >&2
done
{
  echo "# row_cache: embedding rows a CTR worker pulls, with and without the worker's row cache (issue 40)"
  echo "command: bench/sparse/row_cache.sh --steps=$steps"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo "2 servers x 2 workers sync, ${FLAGS[*]} --steps=$steps; worker 0's counts"
  echo
  printf '%-12s %14s %14s %9s %8s %10s\n' cache_steps rows/step KiB/step hit_rate auc samples/s
  for k in 0 1 2 4 16; do
    awk -v k="$k" -v p="${pulled[$k]}" -v h="${hits[$k]}" -v s="$steps" -v d=$DIM -v a="${auc[$k]}" -v r="${rate[$k]}" \
      'BEGIN { printf "%-12s %14.1f %14.1f %9.3f %8s %10s\n", k, p / s, p * d * 4 / s / 1024, h / (h + p), a, r }'
  done
  echo
  cut=$(awk -v a="${pulled[2]}" -v b="${pulled[0]}" 'BEGIN { printf "%.1f", 100 * (1 - a / b) }')
  auc_cost=$(awk -v a="${auc[2]}" -v b="${auc[0]}" 'BEGIN { printf "%+.4f", a - b }')
  echo "2-step cache: pulled row bytes per step down ${cut}%  goal >= 50%: $(awk -v c="$cut" 'BEGIN { print (c >= 50) ? "MET" : "MISSED" }')"
  echo "2-step cache: AUC $auc_cost  goal no worse than -0.002: $(awk -v c="$auc_cost" 'BEGIN { print (c >= -0.002) ? "MET" : "MISSED" }')"
} | if ((record)); then tee bench/results/row_cache.txt; else cat; fi
