#!/usr/bin/env bash
# Issue 40, memory: the CTR job (6 embedding tables of Zipf-distributed ids
# from a --vocab-id space per field, 2 servers x 2 workers, sync) trained
# three ways in one run, each server's peak resident memory measured
# (getrusage through bench/sparse/maxrss_wrapper.py):
#   base       1 step: what a server holds with its tables (nearly) empty;
#   unbounded  --steps, no budget: the tables grow with the ids they see;
#   budget     --steps, --embedding_max_bytes=B for every table (per server).
# Prints each run's peak RSS per server, the rows' bound the servers logged,
# the rows each server held and had evicted at the end (its final stats),
# held-out AUC; then whether the budgeted servers stayed within base +
# 6 x B, the AUC the budget cost against the unbounded run, and the goal's
# verdicts (MET or MISSED): that AUC cost within --auc_tolerance and, with
# --server_budget_mib=M, every budgeted server's peak RSS <= M MiB (and
# whether the unbounded servers' went past M: if not, the budget never bound).
#
#   bench/sparse/table_budget.sh [--steps=3000] [--vocab=100000000]
#       [--dim=32] [--budget_bytes=2097152] [--server_budget_mib=M]
#       [--train_examples=N] [--auc_tolerance=0.003] [--timeout_s=600]
#       [--record[=FILE]]
#
# --server_budget_mib=M: a budget for each whole server process; unless
#   --budget_bytes is given too, B = (M MiB - the base run's larger peak
#   RSS) / 6, rounded down to a KiB.
# --train_examples=N: the job's synthetic training examples
#   (--ctr_train_examples; default the worker's 65536, cycled); with
#   N = steps x 1024 every example is seen once and the tables keep growing.
# --timeout_s: the deadline of each of the three runs (launch.sh's).
# --record writes bench/results/table_budget.txt, --record=FILE writes FILE.
# The runs use copies of the binaries built at the start. Exit status: 0, or
# 1 when a run failed; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/../.."

steps=3000 vocab=100000000 dim=32 budget=2097152 budget_given=0 record=""
server_budget=0 train_examples=0 auc_tolerance=0.003 timeout_s=600
for arg in "$@"; do
  case "$arg" in
    --steps=*) steps=${arg#*=} ;;
    --vocab=*) vocab=${arg#*=} ;;
    --dim=*) dim=${arg#*=} ;;
    --budget_bytes=*) budget=${arg#*=} budget_given=1 ;;
    --server_budget_mib=*) server_budget=${arg#*=} ;;
    --train_examples=*) train_examples=${arg#*=} ;;
    --auc_tolerance=*) auc_tolerance=${arg#*=} ;;
    --timeout_s=*) timeout_s=${arg#*=} ;;
    --record) record=bench/results/table_budget.txt ;;
    --record=?*) record=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "table_budget.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in steps vocab dim budget timeout_s; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "table_budget.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
for v in server_budget train_examples; do
  [[ "${!v}" =~ ^(0|[1-9][0-9]*)$ ]] || { echo "table_budget.sh: --$v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
[[ "$auc_tolerance" =~ ^[0-9]*\.?[0-9]+$ ]] ||
  { echo "table_budget.sh: --auc_tolerance must be a non-negative number, got '$auc_tolerance'" >&2; exit 2; }
# The command as given, for the results file.
command="bench/sparse/table_budget.sh --steps=$steps --vocab=$vocab --dim=$dim"
((budget_given || !server_budget)) && command+=" --budget_bytes=$budget"
((server_budget)) && command+=" --server_budget_mib=$server_budget"
((train_examples)) && command+=" --train_examples=$train_examples"
[[ "$auc_tolerance" == 0.003 ]] || command+=" --auc_tolerance=$auc_tolerance"
((timeout_s == 600)) || command+=" --timeout_s=$timeout_s"

bazel build //ps_server:ps_server //worker:worker >/dev/null
source bench/lib.sh
bench_trial_processes table_budget
mkdir -p "$run_dir/bin"
cp "$(readlink -f bazel-bin/ps_server/ps_server)" "$run_dir/ps_server"
printf '#!/usr/bin/env bash\nexec %q %q "$@"\n' "$PWD/bench/sparse/maxrss_wrapper.py" \
  "$run_dir/ps_server" >"$run_dir/bin/ps_server"
chmod +x "$run_dir/bin/ps_server"
cp "$(readlink -f bazel-bin/worker/worker)" "$run_dir/bin/worker"
extra=()
((train_examples)) && extra+=(--ctr_train_examples="$train_examples")

readonly FIELDS=6
# stat_sum LOG KEY: KEY summed over the tables of the server's final stats.
stat_sum() {
  awk -v key="$2:" '/final stats: / { line = $0 } END {
    n = split(line, w, " "); s = 0
    for (i = 1; i < n; ++i) if (w[i] == key) s += w[i + 1]
    printf "%d", s }' "$1"
}
# run NAME STEPS [WORKER FLAGS...]: prints "rss0_kib rss1_kib auc samples/s
# rows0 rows1 evicted0 evicted1 wall_s bound"
run() {
  local name=$1 n=$2 out start
  shift 2
  out=$run_dir/$name
  start=$SECONDS
  deploy/local/launch.sh --bin_dir="$run_dir/bin" --run_dir="$out" --servers=2 --workers=2 \
    --mode=sync --timeout_s="$timeout_s" -- --model=ctr --ctr_fields=$FIELDS --ctr_vocab="$vocab" \
    --embedding_dim="$dim" --batch_size=512 --steps="$n" --log_every=0 "${extra[@]}" "$@" \
    >"$out.out" 2>"$out.err" ||
    { echo "table_budget.sh: the $name run failed: $(tail -n 5 "$out.err")" >&2; exit 1; }
  local line bound
  line=$(grep '^{"event":"final"' "$out.out" | head -n 1)
  bound=$(grep -o "table 'field0' [^;]*" "$out/ps0.log" | head -n 1)
  echo "$(cat "$out/ps0.port.maxrss") $(cat "$out/ps1.port.maxrss") $(json_field auc "$line")" \
    "$(json_field samples_per_sec "$line") $(stat_sum "$out/ps0.log" rows) $(stat_sum "$out/ps1.log" rows)" \
    "$(stat_sum "$out/ps0.log" rows_evicted) $(stat_sum "$out/ps1.log" rows_evicted) $((SECONDS - start))" \
    "${bound#table \'field0\' }"
}

read -r base0 base1 _ _ _ _ _ _ base_s _ < <(run base 1)
if ((server_budget && !budget_given)); then
  budget=$(((server_budget * 1048576 - 1024 * (base0 > base1 ? base0 : base1)) / FIELDS / 1024 * 1024))
  ((budget > 0)) || { echo "table_budget.sh: the base run's servers alone take over $server_budget MiB" >&2; exit 1; }
fi
read -r un0 un1 un_auc un_rate un_rows0 un_rows1 _ _ un_s _ < <(run unbounded "$steps")
read -r b0 b1 b_auc b_rate b_rows0 b_rows1 b_ev0 b_ev1 b_s b_bound < <(run budget "$steps" --embedding_max_bytes="$budget")
mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
limit_kib=$((FIELDS * budget / 1024))
auc_cost=$(awk -v a="$b_auc" -v b="$un_auc" 'BEGIN { printf "%+.4f", a - b }')
{
  echo "# table_budget: the CTR job's servers' peak RSS with and without a byte budget per table (issue 40)"
  echo "command: $command"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE; 2 servers x 2 workers sync, $FIELDS tables of dim $dim (adagrad), Zipf 1.1 ids from $vocab a field, global batch 1024"
  if ((train_examples)); then
    echo "training examples: $train_examples ($(awk -v e="$train_examples" -v n="$((steps * 1024))" 'BEGIN { printf "%.2f", n / e }') passes over them in $steps steps)"
  else
    echo "training examples: the worker's default, 65536, cycled"
  fi
  ((server_budget)) && echo "server budget: $server_budget MiB a server; each table's budget $budget bytes ($(mib $((budget / 1024))) MiB)$( ((budget_given)) || echo ": ($server_budget MiB - the base's larger peak) / $FIELDS")"
  echo "wall time: base ${base_s} s, unbounded ${un_s} s, budget ${b_s} s"
  echo
  printf '%-10s %6s %12s %12s %8s %10s %20s\n' run steps ps0_MiB ps1_MiB auc samples/s rows_at_end_ps0/ps1
  printf '%-10s %6s %12s %12s %8s %10s %20s\n' base 1 "$(mib "$base0")" "$(mib "$base1")" - - -
  printf '%-10s %6s %12s %12s %8s %10s %20s\n' unbounded "$steps" "$(mib "$un0")" "$(mib "$un1")" "$un_auc" "$un_rate" "$un_rows0/$un_rows1"
  printf '%-10s %6s %12s %12s %8s %10s %20s\n' budget "$steps" "$(mib "$b0")" "$(mib "$b1")" "$b_auc" "$b_rate" "$b_rows0/$b_rows1"
  echo
  echo "each table's bound on a server (its log): $b_bound"
  echo "rows evicted with the budget (final stats, all tables): server 0 $b_ev0, server 1 $b_ev1"
  for s in 0 1; do
    base_var=base$s b_var=b$s un_var=un$s
    grown=$((${!b_var} - ${!base_var}))
    verdict=within
    ((grown <= limit_kib)) || verdict=OVER
    echo "server $s: tables grew $(mib "$grown") MiB with the budget ($verdict $FIELDS x $((budget >> 10)) KiB = $(mib "$limit_kib") MiB), $(mib $((${!un_var} - ${!base_var}))) MiB without"
  done
  echo "AUC with the budget minus without: $auc_cost"
  if ((server_budget)); then
    limit=$((server_budget * 1024)) met=MET past=yes
    ((b0 <= limit && b1 <= limit)) || met=MISSED
    ((un0 > limit && un1 > limit)) || past="no: the budget never bound"
    echo "unbounded servers' peak RSS past $server_budget MiB: $past"
    echo "goal: budgeted servers' peak RSS <= $server_budget MiB: $met ($(mib "$b0") and $(mib "$b1") MiB)"
  fi
  met=$(awk -v c="$auc_cost" -v t="$auc_tolerance" 'BEGIN { print (c <= t && -c <= t) ? "MET" : "MISSED" }')
  echo "goal: AUC within $auc_tolerance of the unbounded run: $met ($auc_cost)"
} | tee "$run_dir/result"
[[ -z "$record" ]] || cp "$run_dir/result" "$record"
exit 0
