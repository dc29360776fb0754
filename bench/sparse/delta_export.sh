#!/usr/bin/env bash
# Issue 40, changed rows for serving: a CTR job (2 servers, 1 worker, sync)
# trains --steps, its model is exported in full (the serving copy's base),
# the same job trains --more_steps, and then the model is exported twice
# from the running servers: in full, and as the delta since the base
# (pstrain_export --since). Prints each export's wall time and bytes, the
# share of rows the delta carries, and checks that base + delta
# (pstrain_export --apply) is the full export byte for byte. Goal: a delta
# of ~1% changed rows costs <= 5% of a full export's time and bytes.
#
#   bench/sparse/delta_export.sh [--steps=400] [--more_steps=2] [--record]
#
# --record writes bench/results/delta_export.txt. Exit status: 0, or 1 when
# a run failed or base + delta differs from the full export; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/../.."

steps=400 more=2 record=0
for arg in "$@"; do
  case "$arg" in
    --steps=*) steps=${arg#*=} ;;
    --more_steps=*) more=${arg#*=} ;;
    --record) record=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "delta_export.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in steps more; do
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
readonly FLAGS=(--model=ctr --ctr_fields=8 --ctr_vocab=1000000 --embedding_dim=16
  --ctr_train_examples=262144 --batch_size=512 --log_every=0 --ps_hosts="$hosts"
  --worker_id=0 --num_workers=1)
train_to() {
  bazel-bin/worker/worker "${FLAGS[@]}" --steps="$1" >"$run_dir/worker.out" 2>"$run_dir/worker.err" ||
    { echo "delta_export.sh: training to step $1 failed: $(tail -n 5 "$run_dir/worker.err")" >&2; exit 1; }
}
# export NAME [FLAGS]: prints "seconds bytes" and keeps the tool's line.
export_as() {
  local name=$1 start end
  shift
  start=$(date +%s.%N)
  "$exporter" --ps_hosts="$hosts" --output="$run_dir/$name" "$@" >"$run_dir/$name.out" 2>"$run_dir/$name.err" ||
    { echo "delta_export.sh: export $name failed: $(tail -n 5 "$run_dir/$name.err")" >&2; exit 1; }
  end=$(date +%s.%N)
  echo "$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }') $(stat -c %s "$run_dir/$name")"
}

train_to "$steps"
read -r base_s base_bytes < <(export_as base)
train_to $((steps + more))
read -r full_s full_bytes < <(export_as full)
read -r delta_s delta_bytes < <(export_as delta --since="$run_dir/base")
"$exporter" --base="$run_dir/base" --apply="$run_dir/delta" --output="$run_dir/merged" >/dev/null
same=no
cmp -s "$run_dir/merged" "$run_dir/full" && same=yes
{
  echo "# delta_export: the changes since a base export against a full export of the same model (issue 40)"
  echo "command: bench/sparse/delta_export.sh --steps=$steps --more_steps=$more"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo "CTR, 2 servers x 1 worker sync, ${FLAGS[*]:0:7}; base at step $steps, model at step $((steps + more)); exports from the running servers"
  echo
  printf '%-8s %10s %14s\n' export seconds bytes
  printf '%-8s %10s %14s\n' base "$base_s" "$base_bytes"
  printf '%-8s %10s %14s\n' full "$full_s" "$full_bytes"
  printf '%-8s %10s %14s\n' delta "$delta_s" "$delta_bytes"
  echo
  echo "delta's line: $(cat "$run_dir/delta.out")"
  echo "base + delta == full export, byte for byte: $same"
  time_share=$(awk -v a="$delta_s" -v b="$full_s" 'BEGIN { printf "%.1f", 100 * a / b }')
  byte_share=$(awk -v a="$delta_bytes" -v b="$full_bytes" 'BEGIN { printf "%.1f", 100 * a / b }')
  echo "delta / full: time ${time_share}%  goal <= 5%: $(awk -v x="$time_share" 'BEGIN { print (x <= 5) ? "MET" : "MISSED" }')"
  echo "delta / full: bytes ${byte_share}%  goal <= 5%: $(awk -v x="$byte_share" 'BEGIN { print (x <= 5) ? "MET" : "MISSED" }')"
} | if ((record)); then tee bench/results/delta_export.txt; else cat; fi
[[ $same == yes ]]
