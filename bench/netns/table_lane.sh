#!/usr/bin/env bash
# The table lane between hosts (issue 40): a CTR job with sync dense layers
# and async tables (--embedding_mode=async) on the netns lab, 2 shards and 2
# workers each on its own host with a shaped full-duplex link, with the
# lane (--embedding_prefetch, the default: a step's rows pushed and the next
# batch's pulled on a second thread while the dense exchange runs) and
# without it (rows pulled after the dense barrier, pushed before the dense
# gradient), interleaved, and the all-sync job beside them. On loopback the
# rows' cost is the servers' CPU, which a lane cannot hide; between hosts it
# is also the link's time.
#
#   bazel build //ps_server //worker
#   bench/netns/table_lane.sh [--rate=1gbit] [--repeats=3] [--steps=600]
#       [--report=FILE]
#
# Prints, per variant, the median over repeats of the job's samples/s (the
# slower worker's x 2), held-out AUC and worker 0's table_lane_s /
# table_lane_wait_s; then lane / in-line and mixed / sync.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
source tests/netns/lab.sh
source bench/lib.sh

command_line="$*"
rate=1gbit repeats=3 steps=600 report=""
for arg in "$@"; do
  case $arg in
    --rate=*) rate=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    --steps=*) steps=${arg#*=} ;;
    --report=*) report=${arg#*=} ;;
    *) echo "table_lane.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in repeats steps; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "table_lane.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
lab_require || exit 0
bin=$repo/bazel-bin
for b in ps_server/ps_server worker/worker; do
  [[ -x $bin/$b ]] || { echo "table_lane.sh: missing $bin/$b; bazel build //ps_server //worker" >&2; exit 2; }
done
run=$(mktemp -d /tmp/table_lane.XXXXXX)
mkdir -p "$run/bin"
cp $bin/ps_server/ps_server $bin/worker/worker "$run/bin/"

readonly CTR_FLAGS=(--model=ctr --ctr_fields=8 --ctr_vocab=1000000 --embedding_dim=16
  --batch_size=512 --log_every=0 --device=cpu)

# run_job NAME [worker flags]: prints "samples/s auc lane_s lane_wait_s"
run_job() {
  local name=$1
  shift
  local dir="$run/$name-$((++job_count))"
  mkdir -p "$dir"
  LAB_PREFIX="pstlab$$-j$job_count"
  lab_create 4 "$rate"
  local hosts s w pids=()
  hosts="$(lab_addr 0):7000,$(lab_addr 1):7000"
  for s in 0 1; do
    lab_exec $s "$run/bin/ps_server" --host="$(lab_addr $s)" --port=7000 \
      --data_port=7001 --shard_id=$s --num_shards=2 --num_workers=2 \
      --mode=sync --optimizer=adam >"$dir/ps$s.out" 2>"$dir/ps$s.log" &
  done
  for w in 0 1; do
    lab_exec $((2 + w)) timeout 600 "$run/bin/worker" --ps_hosts="$hosts" \
      --worker_id=$w --num_workers=2 "${CTR_FLAGS[@]}" --steps="$steps" "$@" \
      >"$dir/worker$w.out" 2>"$dir/worker$w.log" &
    pids+=($!)
  done
  local ok=1 pid
  for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
  lab_destroy
  local f0 f1
  f0=$(grep '"event":"final"' "$dir/worker0.out" || true)
  f1=$(grep '"event":"final"' "$dir/worker1.out" || true)
  if ((!ok)) || [[ -z $f0 || -z $f1 ]]; then
    echo "table_lane.sh: $name failed; logs in $dir" >&2
    echo "nan nan nan nan"
    return
  fi
  awk -v a="$(json_field samples_per_sec "$f0")" -v b="$(json_field samples_per_sec "$f1")" \
    -v auc="$(json_field auc "$f0")" -v l="$(json_field table_lane_s "$f0")" \
    -v lw="$(json_field table_lane_wait_s "$f0")" \
    'BEGIN {printf "%.0f %s %s %s\n", (a < b ? a : b) * 2, auc, l, lw}'
}

job_count=0
variants=(sync mixed mixed_inline)
declare -A results
for ((r = 1; r <= repeats; ++r)); do
  for v in "${variants[@]}"; do
    case $v in
      sync) line=$(run_job sync) ;;
      mixed) line=$(run_job mixed --embedding_mode=async) ;;
      mixed_inline) line=$(run_job mixed_inline --embedding_mode=async --embedding_prefetch=false) ;;
    esac
    echo "repeat $r $v: $line" >&2
    results[$v]+="$line"$'\n'
  done
done

median() { grep -v nan | sort -g | awk '{a[NR] = $1} END {print (NR ? a[int((NR + 1) / 2)] : "nan")}'; }
column() { awk -v c="$2" 'NF {print $c}' <<<"${results[$1]}" | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
declare -A rate_of
{
  echo "# table_lane: async tables' rows beside the dense exchange, between hosts (issue 40)"
  echo "command: bench/netns/table_lane.sh $command_line"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE; links: $rate each host, full duplex (tbf)"
  echo "2 shards x 2 workers, each on its own lab host; ps_server --mode=sync --optimizer=adam;"
  echo "worker ${CTR_FLAGS[*]} --steps=$steps; medians of $repeats interleaved runs"
  echo
  printf '%-13s %10s %7s %8s %12s\n' variant samples/s auc lane_s lane_wait_s
  for v in "${variants[@]}"; do
    rate_of[$v]=$(column "$v" 1)
    printf '%-13s %10s %7s %8s %12s\n' "$v" "${rate_of[$v]}" "$(column "$v" 2)" "$(column "$v" 3)" "$(column "$v" 4)"
  done
  echo
  echo "mixed / mixed_inline: $(ratio "${rate_of[mixed]}" "${rate_of[mixed_inline]}")x (the lane's gain)"
  echo "mixed / sync:         $(ratio "${rate_of[mixed]}" "${rate_of[sync]}")x (issue 40 goal >= 1.3x)"
  echo "mixed_inline / sync:  $(ratio "${rate_of[mixed_inline]}" "${rate_of[sync]}")x"
} | if [[ -n $report ]]; then tee "$report"; else cat; fi
rm -rf "$run"
