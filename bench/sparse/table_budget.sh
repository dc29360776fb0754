#!/usr/bin/env bash
# Issue 40, memory: the CTR job (6 embedding tables of Zipf-distributed ids
# from a --vocab-id space per field, 2 servers x 2 workers, sync) trained
# three ways in one run, each server's peak resident memory measured
# (getrusage through bench/sparse/maxrss_wrapper.py):
#   base       1 step: what a server holds with its tables (nearly) empty;
#   unbounded  --steps, no budget: the tables grow with the ids they see;
#   budget     --steps, --embedding_max_bytes=B for every table (per server).
# Prints each run's peak RSS per server, the rows' bound the servers logged,
# held-out AUC; then whether the budgeted servers stayed within base +
# 6 x B, and the AUC the budget cost against the unbounded run.
#
#   bench/sparse/table_budget.sh [--steps=3000] [--vocab=100000000]
#       [--dim=32] [--budget_bytes=2097152] [--record]
#
# --record writes bench/results/table_budget.txt. Exit status: 0, or 1 when
# a run failed; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/../.."

steps=3000 vocab=100000000 dim=32 budget=2097152 record=0
for arg in "$@"; do
  case "$arg" in
    --steps=*) steps=${arg#*=} ;;
    --vocab=*) vocab=${arg#*=} ;;
    --dim=*) dim=${arg#*=} ;;
    --budget_bytes=*) budget=${arg#*=} ;;
    --record) record=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "table_budget.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in steps vocab dim budget; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "table_budget.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker >/dev/null
source bench/lib.sh
bench_trial_processes table_budget
mkdir -p "$run_dir/bin"
printf '#!/usr/bin/env bash\nexec %q %q "$@"\n' "$PWD/bench/sparse/maxrss_wrapper.py" \
  "$(readlink -f bazel-bin/ps_server/ps_server)" >"$run_dir/bin/ps_server"
chmod +x "$run_dir/bin/ps_server"
ln -s "$(readlink -f bazel-bin/worker/worker)" "$run_dir/bin/worker"

readonly FIELDS=6
# run NAME STEPS [WORKER FLAGS...]: prints "rss0_kib rss1_kib auc samples/s bound"
run() {
  local name=$1 n=$2 out
  shift 2
  out=$run_dir/$name
  deploy/local/launch.sh --bin_dir="$run_dir/bin" --run_dir="$out" --servers=2 --workers=2 \
    --mode=sync -- --model=ctr --ctr_fields=$FIELDS --ctr_vocab="$vocab" --embedding_dim="$dim" \
    --batch_size=512 --steps="$n" --log_every=0 "$@" >"$out.out" 2>"$out.err" ||
    { echo "table_budget.sh: the $name run failed: $(tail -n 5 "$out.err")" >&2; exit 1; }
  local line bound
  line=$(grep '^{"event":"final"' "$out.out" | head -n 1)
  bound=$(grep -o "table 'field0' [^;]*" "$out/ps0.log" | head -n 1)
  echo "$(cat "$out/ps0.port.maxrss") $(cat "$out/ps1.port.maxrss") $(json_field auc "$line") $(json_field samples_per_sec "$line") ${bound#table \'field0\' }"
}

read -r base0 base1 _ _ _ < <(run base 1)
read -r un0 un1 un_auc un_rate _ < <(run unbounded "$steps")
read -r b0 b1 b_auc b_rate b_bound < <(run budget "$steps" --embedding_max_bytes="$budget")
mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
limit_kib=$((FIELDS * budget / 1024))
{
  echo "# table_budget: the CTR job's servers' peak RSS with and without a byte budget per table (issue 40)"
  echo "command: bench/sparse/table_budget.sh --steps=$steps --vocab=$vocab --dim=$dim --budget_bytes=$budget"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE; 2 servers x 2 workers sync, $FIELDS tables of dim $dim (adagrad), Zipf 1.1 ids from $vocab a field, global batch 1024"
  echo
  printf '%-10s %6s %12s %12s %8s %10s\n' run steps ps0_MiB ps1_MiB auc samples/s
  printf '%-10s %6s %12s %12s %8s %10s\n' base 1 "$(mib "$base0")" "$(mib "$base1")" - -
  printf '%-10s %6s %12s %12s %8s %10s\n' unbounded "$steps" "$(mib "$un0")" "$(mib "$un1")" "$un_auc" "$un_rate"
  printf '%-10s %6s %12s %12s %8s %10s\n' budget "$steps" "$(mib "$b0")" "$(mib "$b1")" "$b_auc" "$b_rate"
  echo
  echo "each table's bound on a server (its log): $b_bound"
  for s in 0 1; do
    base_var=base$s b_var=b$s un_var=un$s
    grown=$((${!b_var} - ${!base_var}))
    verdict=within
    ((grown <= limit_kib)) || verdict=OVER
    echo "server $s: tables grew $(mib "$grown") MiB with the budget ($verdict $FIELDS x $((budget >> 10)) KiB = $(mib "$limit_kib") MiB), $(mib $((${!un_var} - ${!base_var}))) MiB without"
  done
  echo "AUC with the budget minus without: $(awk -v a="$b_auc" -v b="$un_auc" 'BEGIN { printf "%+.4f", a - b }')"
} | tee "$run_dir/result"
((record)) && cp "$run_dir/result" bench/results/table_budget.txt
exit 0
