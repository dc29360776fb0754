#!/usr/bin/env bash
# Issue 38 with one replica: a shard killed -9 at moments an operator does
# not choose, restarted on its port, and what the job then says. Two kinds,
# alternating sync and async, 2 shards on loopback, --checkpoint_dir set:
#
#   early       the CTR job (3 workers, 300 steps) with shard 1 killed 0.05-0.8 s
#               after the workers start (registration, job start, the first
#               steps: before its first checkpoint) and restarted with none.
#               ok: every worker exits 0 within --trial_timeout_s.
#   checkpoint  the probe model (2 workers, 120 steps, SGD at rate 1, a
#               gradient of 1 everywhere: each element is minus the updates
#               its block got) with shard 1 killed while it writes its first,
#               second or third checkpoint (its temporary file is there).
#               ok: every worker exits 0, and the updates the model lacks
#               (read off it by bench/soak/observer) equal the shards'
#               updates_lost.
#
#   bench/restart_trials.sh [--trials=12] [--kinds=early,checkpoint]
#       [--trial_timeout_s=60] [--seed=N] [--record] [--keep]
#
# Prints a line per trial and a summary per kind; --record appends the
# summary (command, machine, date) to bench/results/restart_trials.txt.
# Exit status: 0 when every trial was ok, 1 otherwise, 2 bad usage. Every
# process a trial starts is killed when it ends and on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

trials=12 kinds=early,checkpoint trial_timeout_s=60 seed=$$ record=0 keep=0
args="$*"
for arg in "$@"; do
  case "$arg" in
    --trials=*) trials=${arg#*=} ;;
    --kinds=*) kinds=${arg#*=} ;;
    --trial_timeout_s=*) trial_timeout_s=${arg#*=} ;;
    --seed=*) seed=${arg#*=} ;;
    --record) record=1 ;;
    --keep) keep=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "restart_trials.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in trials trial_timeout_s seed; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "restart_trials.sh: --$v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
for kind in ${kinds//,/ }; do
  [[ $kind == early || $kind == checkpoint ]] ||
    { echo "restart_trials.sh: --kinds takes early and checkpoint, got '$kind'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker //bench/soak:observer >/dev/null
server_bin=bazel-bin/ps_server/ps_server
worker_bin=bazel-bin/worker/worker
observer_bin=bazel-bin/bench/soak/observer
source bench/lib.sh

bench_trial_processes restart_trials
RANDOM=$seed

# start_server DIR SHARD PORT MODE WORKERS: a shard of the trial in DIR.
start_server() {
  local dir=$1 shard=$2 port=$3 mode=$4 workers=$5 _
  rm -f "$dir/ps$shard.port"
  "$server_bin" --host=127.0.0.1 --port="$port" --port_file="$dir/ps$shard.port" \
    --shard_id="$shard" --num_shards=2 --num_workers="$workers" --mode="$mode" \
    --checkpoint_dir="$dir/ckpt" --checkpoint_every_steps=10 --worker_lease_s=5 \
    "${server_flags[@]}" >>"$dir/ps$shard.out" 2>>"$dir/ps$shard.log" &
  server_pid[$shard]=$!
  pids+=("$!")
  for _ in $(seq 300); do
    [[ -s "$dir/ps$shard.port" ]] && return 0
    kill -0 "${server_pid[$shard]}" 2>/dev/null || { tail -n 3 "$dir/ps$shard.log" >&2; return 1; }
    sleep 0.02
  done
  echo "restart_trials.sh: shard $shard did not start" >&2
  return 1
}

# trial KIND MODE DIR: prints "result detail".
trial() {
  local kind=$1 mode=$2 dir=$3 workers k pid port1 hosts deadline detail=""
  mkdir -p "$dir"
  if [[ $kind == early ]]; then
    workers=3
    server_flags=(--optimizer=adam --learning_rate=0.01)
    worker_flags=(--model=ctr --ctr_fields=4 --ctr_dense=2 --ctr_vocab=2000
      --batch_size=128 --steps=300)
  else
    workers=2
    server_flags=(--optimizer=sgd --learning_rate=1)
    worker_flags=(--model=probe --probe_elements=4194304 --block_elements=65536
      --steps=120)
  fi
  start_server "$dir" 0 0 "$mode" $workers
  start_server "$dir" 1 0 "$mode" $workers
  port1=$(cat "$dir/ps1.port")
  hosts="127.0.0.1:$(cat "$dir/ps0.port"),127.0.0.1:$port1"
  worker_pids=()
  for ((k = 0; k < workers; ++k)); do
    "$worker_bin" --ps_hosts="$hosts" --worker_id=$k --num_workers=$workers \
      "${worker_flags[@]}" --log_every=0 --device=cpu --heartbeat_interval_s=0.2 \
      --retry_window_s=60 --rpc_timeout_s=30 >"$dir/w$k.out" 2>"$dir/w$k.log" &
    worker_pids+=("$!")
    pids+=("$!")
  done
  deadline=$((SECONDS + trial_timeout_s))
  if [[ $kind == early ]]; then
    local at
    at=$(awk -v r=$RANDOM 'BEGIN {printf "%.2f", 0.05 + 0.75 * r / 32767}')
    sleep "$at"
    detail="killed at $at s"
  else
    local nth=$((1 + RANDOM % 3)) seq
    seq=$(printf '%012d' $((nth - 1)))
    until compgen -G "$dir/ckpt/shard-1-of-2/.ckpt-$seq.pstrain.tmp-*" >/dev/null; do
      ((SECONDS < deadline)) || { echo "no-write checkpoint $nth never written"; return; }
      read -r -t 0.0005 <> <(:) || true
    done
    detail="killed writing checkpoint $nth"
  fi
  kill -9 "${server_pid[1]}"
  wait "${server_pid[1]}" 2>/dev/null || true
  start_server "$dir" 1 "$port1" "$mode" $workers
  local codes="" result=ok code
  for pid in "${worker_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      result=hung
      kill -9 "$pid" 2>/dev/null || true
    fi
    code=0
    wait "$pid" 2>/dev/null || code=$?
    codes+="${codes:+/}$code"
    [[ $code != 0 && $result == ok ]] && result=failed
  done
  detail+=", exits $codes"
  if [[ $kind == checkpoint && $result == ok ]]; then
    local expect=120 out missing counted
    [[ $mode != sync ]] && expect=240
    out=$("$observer_bin" --ps_hosts="$hosts" --num_workers=$workers \
      --probe_elements=4194304 --block_elements=65536 --expect_updates=$expect 2>/dev/null || true)
    missing=$(sed -n 's/.*missing_block_steps=\([0-9.-]*\).*/\1/p' <<<"$out")
    counted=$(sed -n 's/.* updates_lost=\([0-9]*\).*/\1/p' <<<"$out" | awk '{s += $1} END {print s + 0}')
    detail+=", model lacks ${missing%.*} block-updates, updates_lost $counted"
    [[ -n $missing && ${missing%.*} == "$counted" ]] || result=uncounted
  fi
  kill_all
  echo "$result $detail"
}

summary=()
rows=()
status=0
for kind in ${kinds//,/ }; do
  ok=0
  bad=0
  for t in $(seq 1 "$trials"); do
    mode=sync
    ((t % 2)) || mode=async
    line=$(trial "$kind" $mode "$run_dir/$kind$t")
    rows+=("$(printf '%-10s %-5s %3d  %s' "$kind" $mode "$t" "$line")")
    echo "${rows[-1]}"
    if [[ $line == ok* ]]; then ok=$((ok + 1)); else bad=$((bad + 1)); status=1; fi
  done
  summary+=("$kind: $ok of $trials ok, $bad not (hung, failed, uncounted or no-write)")
done
printf '%s\n' "${summary[@]}"
if ((record)); then
  {
    echo "# $(date -u +%F) bench/restart_trials.sh $args at $BENCH_COMMIT on $BENCH_MACHINE"
    printf '%s\n' "${rows[@]}" "${summary[@]}"
  } >>bench/results/restart_trials.txt
fi
exit $status
