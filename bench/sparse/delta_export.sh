#!/usr/bin/env bash
# Issue 40, changed rows for serving: a CTR job (2 servers, 1 worker, sync)
# trains --steps, its model is exported in full (the serving copy's base),
# the same job trains --more_steps, and then the model is exported from the
# running servers: in full, as the delta since the base from the servers'
# change marks (pstrain_export --since, the base's marks beside it), and as
# the same delta by comparing whole models (the base copied without its
# marks: what --since did before the servers kept marks). Each export
# --repeats times, its median wall time (process start to exit) shown.
# Prints times and bytes, the share of rows the delta carries, and checks
# that base + delta (pstrain_export --apply) is the full export byte for
# byte. Goal: a delta of ~1% changed rows costs <= 5% of a full export's
# time and bytes.
#
#   bench/sparse/delta_export.sh [--steps=400] [--more_steps=2]
#       [--fields=8] [--vocab=1000000] [--repeats=5] [--record[=NAME]]
#
# --fields and --vocab shape the tables (--ctr_fields, --ctr_vocab): more
# fields and steps give a larger model, where an export's fixed cost (the
# process, its connections, the dense tensors) weighs less.
#
# --record writes bench/results/delta_export.txt (--record=NAME:
# bench/results/NAME.txt). Exit status: 0, or 1 when
# a run failed or base + delta differs from the full export; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/../.."

steps=400 more=2 fields=8 vocab=1000000 repeats=5 record=0 name=delta_export
for arg in "$@"; do
  case "$arg" in
    --steps=*) steps=${arg#*=} ;;
    --more_steps=*) more=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    --fields=*) fields=${arg#*=} ;;
    --vocab=*) vocab=${arg#*=} ;;
    --record) record=1 ;;
    --record=*) record=1 name=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "delta_export.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "delta_export.sh: --record=NAME must be a plain file name, got '$name'" >&2; exit 2; }
for v in steps more fields vocab repeats; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "delta_export.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker //worker:pstrain_export >/dev/null
source bench/lib.sh
bench_trial_processes delta_export
exporter=$(readlink -f bazel-bin/worker/pstrain_export)
mapfile -t ports < <(free_ports 2)
hosts="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]}"
for s in 0 1; do
  bazel-bin/ps_server/ps_server --port="${ports[s]}" --shard_id=$s --num_shards=2 --num_workers=1 \
    --mode=sync --checkpoint_dir="$run_dir/ckpt" --checkpoint_every_steps=0 \
    >"$run_dir/ps$s.log" 2>&1 &
  pids+=($!)
done
readonly FLAGS=(--model=ctr --ctr_fields="$fields" --ctr_vocab="$vocab" --embedding_dim=16
  --ctr_train_examples=262144 --batch_size=512 --log_every=0 --ps_hosts="$hosts"
  --worker_id=0 --num_workers=1)
train_to() {
  bazel-bin/worker/worker "${FLAGS[@]}" --steps="$1" >"$run_dir/worker.out" 2>"$run_dir/worker.err" ||
    { echo "delta_export.sh: training to step $1 failed: $(tail -n 5 "$run_dir/worker.err")" >&2; exit 1; }
}
# export NAME [FLAGS]: prints "seconds bytes" and keeps the tool's line.
# Exports `name` --repeats times; prints the median seconds and the bytes.
export_as() {
  local name=$1 start end r times=()
  shift
  for ((r = 0; r < repeats; r++)); do
    start=$(date +%s.%N)
    "$exporter" --ps_hosts="$hosts" --output="$run_dir/$name" "$@" >"$run_dir/$name.out" 2>"$run_dir/$name.err" ||
      { echo "delta_export.sh: export $name failed: $(tail -n 5 "$run_dir/$name.err")" >&2; exit 1; }
    end=$(date +%s.%N)
    times+=("$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.4f", b - a }')")
  done
  echo "$(printf '%s\n' "${times[@]}" | sort -g | awk '{ t[NR] = $1 } END { print t[int((NR + 1) / 2)] }') $(stat -c %s "$run_dir/$name")"
}

train_to "$steps"
repeats=1 export_as base >/dev/null
cp "$run_dir/base" "$run_dir/base_without_marks"
train_to $((steps + more))
read -r full_s full_bytes < <(export_as full)
read -r delta_s delta_bytes < <(export_as delta --since="$run_dir/base")
read -r compared_s compared_bytes < <(export_as compared --since="$run_dir/base_without_marks")
# The marks may name a few rows written with their values kept (a zero
# gradient): then the two deltas differ, and both are right.
deltas_same=no
cmp -s "$run_dir/delta" "$run_dir/compared" && deltas_same=yes
"$exporter" --base="$run_dir/base" --apply="$run_dir/delta" --output="$run_dir/merged" >/dev/null
same=no
cmp -s "$run_dir/merged" "$run_dir/full" && same=yes
{
  echo "# delta_export: the changes since a base export against a full export of the same model (issue 40)"
  echo "command: bench/sparse/delta_export.sh --steps=$steps --more_steps=$more --fields=$fields --vocab=$vocab --repeats=$repeats"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo "CTR, 2 servers x 1 worker sync, ${FLAGS[*]:0:7}; base at step $steps, model at step $((steps + more)); exports from the running servers"
  echo
  printf '%-26s %10s %14s\n' export seconds bytes
  printf '%-26s %10s %14s\n' full "$full_s" "$full_bytes"
  printf '%-26s %10s %14s\n' "delta, change marks" "$delta_s" "$delta_bytes"
  printf '%-26s %10s %14s\n' "delta, comparing models" "$compared_s" "$compared_bytes"
  echo
  echo "delta's line: $(cat "$run_dir/delta.out")"
  echo "the two deltas are the same file: $deltas_same"
  echo "base + delta == full export, byte for byte: $same"
  time_share=$(awk -v a="$delta_s" -v b="$full_s" 'BEGIN { printf "%.1f", 100 * a / b }')
  byte_share=$(awk -v a="$delta_bytes" -v b="$full_bytes" 'BEGIN { printf "%.1f", 100 * a / b }')
  echo "delta / full: time ${time_share}%  goal <= 5%: $(awk -v x="$time_share" 'BEGIN { print (x <= 5) ? "MET" : "MISSED" }')"
  echo "delta / full: bytes ${byte_share}%  goal <= 5%: $(awk -v x="$byte_share" 'BEGIN { print (x <= 5) ? "MET" : "MISSED" }')"
} | if ((record)); then tee "bench/results/$name.txt"; else cat; fi
[[ $same == yes ]]
