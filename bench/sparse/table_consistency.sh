#!/usr/bin/env bash
# Issue 40, per-table consistency: sync dense layers with async embedding
# tables (SparseTableSpec.mode "async", PERSIA's split) against the all-sync
# job and what a PyTorch user would run instead, in one run, 2 servers x 2
# workers, the same data everywhere:
#   C++ CTR worker (--model=ctr, Zipf ids):
#     sync        every tensor and table in the sync step;
#     mixed       sync servers, --embedding_mode=async: the table lane
#                 pushes a step's rows and pulls the next batch's beside
#                 the dense exchange (--embedding_prefetch, the default);
#     mixed_inline  the same with --embedding_prefetch=false: rows pulled
#                 after the dense barrier and pushed before the dense
#                 gradient, one after the other;
#     async       --mode=async: no barrier anywhere (the table lane on);
#   PyTorch (worker/python/examples/ctr.py, pstrain.torch.EmbeddingBag):
#     torch_sync, torch_mixed (--table_consistency=async: the next batch's
#                 rows pulled while this one trains, EmbeddingBagCollection.
#                 prefetch, and the rows pushed beside the dense exchange);
#     torch_mixed_inline  the same with --no_prefetch (each forward pulls,
#                 each step pushes the rows before the dense gradient);
#     ddp         DistributedDataParallel over gloo, 2 ranks, the tables
#                 replicated (nn.EmbeddingBag(sparse=True), sparse Adagrad),
#                 OMP_NUM_THREADS=1 as torchrun sets it for 2 ranks a host
#                 (launch.sh does the same for pstrain's Python workers);
#     ddp_omp_unset  the same without OMP_NUM_THREADS (BLAS on 2 threads);
#     local       one torch process at the global batch (BLAS on 2 threads);
#     dlrm_mixed, dlrm_ddp, dlrm_ddp_omp_unset, dlrm_local  the issue's
#                 benchmark model: DLRM on Criteo-shaped data (26 tables of
#                 Criteo Kaggle's cardinalities, 13 dense features).
# Job samples/s (the slowest worker's rate x workers) and held-out AUC,
# medians of --repeats interleaved runs; ratios mixed/sync (goal >= 1.3x, AUC
# within 0.002) and torch_mixed and dlrm_mixed against the faster DDP (goal
# >= 3x; medians of the rounds' ratios).
#
#   bench/sparse/table_consistency.sh [--repeats=3] [--steps=1500]
#       [--torch_steps=300] [--torch_only | --dlrm_only] [--record]
#
# --torch_only runs the PyTorch variants alone (the C++ rows then read "-"),
# --dlrm_only the dlrm_* ones (with --torch_steps: how the ratio moves with
# the run's length; rows are made on first use on the servers, within the
# timed steps, where DDP builds its tables before them).
# --record writes bench/results/table_consistency.txt. Exit status: 0, or 1
# when a run failed; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/../.."

repeats=3 steps=1500 torch_steps=300 record=0 torch_only=0 dlrm_only=0
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    --steps=*) steps=${arg#*=} ;;
    --torch_steps=*) torch_steps=${arg#*=} ;;
    --record) record=1 ;;
    --torch_only) torch_only=1 ;;
    --dlrm_only) dlrm_only=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "table_consistency.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in repeats steps torch_steps; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "table_consistency.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
((record && dlrm_only)) && { echo "table_consistency.sh: --record writes the whole comparison; a --dlrm_only run is not one" >&2; exit 2; }
((torch_only && dlrm_only)) && { echo "table_consistency.sh: --torch_only and --dlrm_only choose different variants; give one" >&2; exit 2; }

python=/usr/bin/python3
bazel build //ps_server:ps_server //worker:worker >/dev/null
worker/python/install.sh >/dev/null
source bench/lib.sh
bench_trial_processes table_consistency
mkdir -p "$run_dir/bin"
ln -s "$(readlink -f bazel-bin/ps_server/ps_server)" "$run_dir/bin/ps_server"
ln -s "$(readlink -f bazel-bin/worker/worker)" "$run_dir/bin/worker"

readonly CPP_FLAGS=(--model=ctr --ctr_fields=8 --ctr_vocab=1000000 --embedding_dim=16
  --batch_size=512 --log_every=0)
readonly TORCH_FLAGS=(--fields=8 --vocab=100000 --dim=16 --global_batch_size=1024)
# The issue's benchmark model: DLRM on Criteo-shaped data (26 tables).
readonly DLRM_FLAGS=(--model=dlrm --criteo_shape --dim=16 --global_batch_size=1024)
flags=("${TORCH_FLAGS[@]}")  # the PyTorch model of the run_* below
readonly CTR_PY=worker/python/examples/ctr.py

# job_rate FILE WORKERS: "samples/s auc" from the final JSON lines in FILE
# (each worker's samples_per_sec is its own batch's; the job goes at the
# slowest worker's rate).
job_rate() {
  local lines
  lines=$(grep '^{"event":"final"' "$1") || { echo "table_consistency.sh: no final line in $1" >&2; return 1; }
  awk -v w="$2" -v auc="$(json_field auc "$(head -n 1 <<<"$lines")")" '
    { match($0, /"samples_per_sec":[0-9.]+/); r = substr($0, RSTART + 18, RLENGTH - 18) + 0
      if (NR == 1 || r < min) min = r }
    END { printf "%.0f %s\n", min * w, auc }' <<<"$lines"
}

run_cpp() {  # name mode [worker flags]
  local name=$1 mode=$2
  shift 2
  deploy/local/launch.sh --bin_dir="$run_dir/bin" --run_dir="$run_dir/$name" --servers=2 --workers=2 \
    --mode="$mode" -- "${CPP_FLAGS[@]}" --steps="$steps" "$@" >"$run_dir/out" 2>"$run_dir/err" ||
    { echo "table_consistency.sh: $name failed: $(tail -n 5 "$run_dir/err")" >&2; exit 1; }
  rm -rf "${run_dir:?}/$name"
  job_rate "$run_dir/out" 2
}

run_torch() {  # name [script flags]
  local name=$1
  shift
  PSTRAIN_PYTHON=$python deploy/local/launch.sh --bin_dir="$run_dir/bin" --run_dir="$run_dir/$name" \
    --servers=2 --workers=2 --mode=sync --python="$CTR_PY" -- "${flags[@]}" \
    --steps="$torch_steps" "$@" >"$run_dir/out" 2>"$run_dir/err" ||
    { echo "table_consistency.sh: $name failed: $(tail -n 5 "$run_dir/err")" >&2; exit 1; }
  rm -rf "${run_dir:?}/$name"
  job_rate "$run_dir/out" 2
}

run_ddp() {  # OMP_NUM_THREADS value ("": unset)
  local port rank ddp_pids=() omp=$1
  port=$(free_ports 1)
  : >"$run_dir/out"
  for rank in 0 1; do
    env ${omp:+OMP_NUM_THREADS=$omp} MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank WORLD_SIZE=2 \
      timeout 900 "$python" "$CTR_PY" --ddp "${flags[@]}" --steps="$torch_steps" \
      >>"$run_dir/out" 2>"$run_dir/err$rank" &
    ddp_pids+=($!)
    pids+=($!)
  done
  for rank in 0 1; do
    wait "${ddp_pids[rank]}" || { echo "table_consistency.sh: ddp rank $rank failed: $(tail -n 5 "$run_dir/err$rank")" >&2; exit 1; }
  done
  pids=()
  job_rate "$run_dir/out" 2
}

run_local() {
  timeout 900 "$python" "$CTR_PY" --local "${flags[@]}" --steps="$torch_steps" \
    >"$run_dir/out" 2>"$run_dir/err" ||
    { echo "table_consistency.sh: local failed: $(tail -n 5 "$run_dir/err")" >&2; exit 1; }
  job_rate "$run_dir/out" 1
}

torch_variants=(torch_sync torch_mixed torch_mixed_inline ddp ddp_omp_unset local
  dlrm_mixed dlrm_ddp dlrm_ddp_omp_unset dlrm_local)
variants=(sync mixed mixed_inline async "${torch_variants[@]}")
((torch_only)) && variants=("${torch_variants[@]}")
((dlrm_only)) && variants=(dlrm_mixed dlrm_ddp dlrm_ddp_omp_unset dlrm_local)
declare -A rates aucs
for ((r = 1; r <= repeats; r++)); do
  for v in "${variants[@]}"; do
    flags=("${TORCH_FLAGS[@]}")
    [[ $v == dlrm_* ]] && flags=("${DLRM_FLAGS[@]}")
    case $v in
      sync) result=$(run_cpp sync sync) ;;
      mixed) result=$(run_cpp mixed sync --embedding_mode=async) ;;
      mixed_inline) result=$(run_cpp mixed_inline sync --embedding_mode=async --embedding_prefetch=false) ;;
      async) result=$(run_cpp async async) ;;
      torch_sync) result=$(run_torch torch_sync) ;;
      torch_mixed) result=$(run_torch torch_mixed --table_consistency=async) ;;
      torch_mixed_inline) result=$(run_torch torch_mixed_inline --table_consistency=async --no_prefetch) ;;
      ddp) result=$(run_ddp 1) ;;
      ddp_omp_unset) result=$(run_ddp "") ;;
      local) result=$(run_local) ;;
      dlrm_mixed) result=$(run_torch dlrm_mixed --table_consistency=async) ;;
      dlrm_ddp) result=$(run_ddp 1) ;;
      dlrm_ddp_omp_unset) result=$(run_ddp "") ;;
      dlrm_local) result=$(run_local) ;;
    esac
    read -r rate auc <<<"$result"
    rates[$v]+="$rate "
    aucs[$v]+="$auc "
    echo "repeat $r $v: $rate samples/s, auc $auc" >&2
  done
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
declare -A rate auc
for v in sync mixed mixed_inline async "${torch_variants[@]}"; do rate[$v]=- auc[$v]=-; done
for v in "${variants[@]}"; do
  rate[$v]=$(median <<<"${rates[$v]}")
  auc[$v]=$(median <<<"${aucs[$v]}")
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-") print "-"; else printf "%.2f", a / b }'; }
goal() { awk -v x="$1" -v g="$2" 'BEGIN { print (x == "-") ? "not run" : (x >= g) ? "MET" : "MISSED" }'; }
best_ddp=$(awk -v a="${rate[ddp]}" -v b="${rate[ddp_omp_unset]}" 'BEGIN { print (a >= b) ? a : b }')
# The same ratio per round (the variants of a round run minutes apart; this
# VM's speed drifts between rounds): pstrain over that round's faster DDP.
paired() {  # pstrain_variant ddp_variant ddp_unset_variant
  paste -d' ' <(tr ' ' '\n' <<<"${rates[$1]}" | grep .) \
    <(tr ' ' '\n' <<<"${rates[$2]}" | grep .) <(tr ' ' '\n' <<<"${rates[$3]}" | grep .) |
    awk '{ d = ($2 >= $3) ? $2 : $3; printf "%.2f ", $1 / d }'
}
# "-" where the variants did not run.
paired_ratio() { [[ -z "$1" ]] && { echo -; return; }; awk -v x="$(median <<<"$1")" 'BEGIN { printf "%.2f", x }'; }
paired=$(paired torch_mixed ddp ddp_omp_unset)
dlrm_paired=$(paired dlrm_mixed dlrm_ddp dlrm_ddp_omp_unset)
dlrm_vs_ddp=$(paired_ratio "$dlrm_paired")
mixed_vs_sync=$(ratio "${rate[mixed]}" "${rate[sync]}")
async_vs_sync=$(ratio "${rate[async]}" "${rate[sync]}")
lane_gain=$(ratio "${rate[mixed]}" "${rate[mixed_inline]}")
inline_vs_sync=$(ratio "${rate[mixed_inline]}" "${rate[sync]}")
torch_mixed_vs_ddp=$(paired_ratio "$paired")
auc_cost=$(awk -v a="${auc[mixed]}" -v b="${auc[sync]}" 'BEGIN { if (a == "-") print "-"; else printf "%+.4f", a - b }')
auc_ok=$(awk -v a="${auc[mixed]}" -v b="${auc[sync]}" 'BEGIN { print (a == "-") ? "not run" : (a >= b - 0.002) ? "MET" : "MISSED" }')
{
  echo "# table_consistency: sync dense layers with async tables vs all-sync, DDP and one process (issue 40)"
  echo "command: bench/sparse/table_consistency.sh --repeats=$repeats --steps=$steps --torch_steps=$torch_steps$( ((torch_only)) && echo " --torch_only")$( ((dlrm_only)) && echo " --dlrm_only")"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo "C++: 2 servers x 2 workers, ${CPP_FLAGS[*]} --steps=$steps"
  echo "torch: 2 servers x 2 workers (ddp: 2 ranks), $CTR_PY ${TORCH_FLAGS[*]} --steps=$torch_steps"
  echo "dlrm_*: the same with ${DLRM_FLAGS[*]}"
  echo "medians of $repeats interleaved runs; job samples/s = slowest worker's x workers"
  echo
  printf '%-19s %12s %8s\n' variant samples/s auc
  for v in "${variants[@]}"; do printf '%-19s %12s %8s\n' "$v" "${rate[$v]}" "${auc[$v]}"; done
  echo
  echo "mixed / sync (C++):        ${mixed_vs_sync}x  goal >= 1.3x: $(goal "$mixed_vs_sync" 1.3)"
  echo "mixed AUC - sync AUC:      $auc_cost  goal >= -0.002: $auc_ok"
  echo "mixed / mixed_inline:      ${lane_gain}x  (the table lane's gain; mixed_inline / sync: ${inline_vs_sync}x)"
  echo "async / sync (C++, no dense barrier either): ${async_vs_sync}x"
  echo "torch_mixed / torch_sync:  $(ratio "${rate[torch_mixed]}" "${rate[torch_sync]}")x"
  echo "torch_mixed / torch_mixed_inline: $(ratio "${rate[torch_mixed]}" "${rate[torch_mixed_inline]}")x  (prefetch and the rows' lane)"
  echo "ddp / ddp_omp_unset:       $(ratio "${rate[ddp]}" "${rate[ddp_omp_unset]}")x  (OMP_NUM_THREADS=1, as torchrun sets it)"
  echo "torch_mixed / faster ddp:  ${torch_mixed_vs_ddp}x  goal >= 3x: $(goal "$torch_mixed_vs_ddp" 3)"
  echo "  (median of the rounds' ratios: ${paired% }; of the medians above: $(ratio "${rate[torch_mixed]}" "$best_ddp")x)"
  echo "torch_mixed / local:       $(ratio "${rate[torch_mixed]}" "${rate[local]}")x"
  echo "dlrm_mixed / faster dlrm_ddp: ${dlrm_vs_ddp}x  goal >= 3x: $(goal "$dlrm_vs_ddp" 3)"
  echo "  (median of the rounds' ratios: ${dlrm_paired% }; dlrm_ddp / dlrm_ddp_omp_unset: $(ratio "${rate[dlrm_ddp]}" "${rate[dlrm_ddp_omp_unset]}")x)"
  echo "dlrm_mixed / dlrm_local: $(ratio "${rate[dlrm_mixed]}" "${rate[dlrm_local]}")x"
} | if ((record)); then tee bench/results/table_consistency.txt; else cat; fi
