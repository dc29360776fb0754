#!/usr/bin/env bash
# Issue 24, third defect: a CTR job that hung after a shard restored from its
# checkpoint. Each trial runs the issue's job (2 shards, 3 sync workers,
# --model=ctr --steps=400 --batch_size=128 --inject_step_delay_ms=10, Adam,
# --checkpoint_every_steps=10), SIGKILLs shard 1 once the job reaches a step
# picked at random, restarts it on its port 0.25 s later from its
# checkpoint, and waits for the workers. A trial is
#   ok      every worker exited 0 and both shards report --steps;
#   failed  a worker exited non-zero (its last log lines are shown);
#   hung    the workers were still running at --trial_timeout_s.
# The servers keep their default --max_pull_wait_s (120 s, as the RPC
# deadline), so a pull left waiting outlasts the trial. Hung and failed
# trials print the shards' versions and waiting pulls, then SIGTERM the
# workers, which say which shard each was waiting for.
#
#   bench/ctr_restore_trials.sh [--trials=20] [--trial_timeout_s=60]
#       [--min_step=20] [--max_step=360] [--kill_at=step|checkpoint]
#       [--restart_delay_s=0.25] [--bin_dir=DIR] [--seed=N] [--record] [--keep]
#
# --kill_at=step (default) kills at the random step; --kill_at=checkpoint
# kills as soon as shard 1 has written a checkpoint at or after it, so the
# restored shard is within a step or two of the workers: the race is then
# likelier. --bin_dir runs the ps_server and worker binaries found there
# (default: bazel-bin of this checkout, built if missing).
#
# --record appends the summary (command, machine, load, trials, hung) to
# bench/results/ctr_restore_trials.txt. --keep leaves the run directory.
# Exit status: 0 when every trial was ok, 1 otherwise, 2 bad usage.
# Every process a trial starts is killed when the trial ends and on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

trials=20
trial_timeout_s=60
min_step=20
max_step=360
restart_delay_s=0.25
kill_at=step
bin_dir=""
seed=$$
record=0
keep=0
steps=400
args="$*"
for arg in "$@"; do
  case "$arg" in
    --trials=*) trials=${arg#*=} ;;
    --trial_timeout_s=*) trial_timeout_s=${arg#*=} ;;
    --min_step=*) min_step=${arg#*=} ;;
    --max_step=*) max_step=${arg#*=} ;;
    --restart_delay_s=*) restart_delay_s=${arg#*=} ;;
    --kill_at=step | --kill_at=checkpoint) kill_at=${arg#*=} ;;
    --bin_dir=*) bin_dir=${arg#*=} ;;
    --seed=*) seed=${arg#*=} ;;
    --record) record=1 ;;
    --keep) keep=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "ctr_restore_trials.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in trials trial_timeout_s min_step max_step seed; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "ctr_restore_trials.sh: --$v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
((trials >= 1 && min_step <= max_step && max_step < steps)) ||
  { echo "ctr_restore_trials.sh: need --trials >= 1 and --min_step <= --max_step < $steps" >&2; exit 2; }

if [[ -n $bin_dir ]]; then
  server_bin=$bin_dir/ps_server
  worker_bin=$bin_dir/worker
else
  server_bin=bazel-bin/ps_server/ps_server
  worker_bin=bazel-bin/worker/worker
  [[ -x $server_bin && -x $worker_bin ]] ||
    bazel build //ps_server:ps_server //worker:worker >/dev/null
fi
[[ -x $server_bin && -x $worker_bin ]] ||
  { echo "ctr_restore_trials.sh: no ps_server and worker binaries in ${bin_dir:-bazel-bin}" >&2; exit 2; }
source bench/lib.sh

bench_trial_processes ctr_restore_trials

RANDOM=$seed
num_workers=3
server_flags=(--optimizer=adam --learning_rate=0.01 --checkpoint_every_steps=10)
worker_flags=(--model=ctr --steps=$steps --batch_size=128 --inject_step_delay_ms=10
  --log_every=0 --device=cpu --heartbeat_interval_s=0.2 --retry_window_s=45
  --rpc_timeout_s=120)

# start_server DIR SHARD PORT NAME: a shard of the trial in DIR.
start_server() {
  local dir=$1 shard=$2 port=$3 name=$4
  rm -f "$dir/ps$shard.port" "$dir/ps$shard.mport"
  "$server_bin" --host=127.0.0.1 --port="$port" --port_file="$dir/ps$shard.port" \
    --metrics_port=-1 --metrics_host=127.0.0.1 --metrics_port_file="$dir/ps$shard.mport" \
    --shard_id="$shard" --num_shards=2 --num_workers=$num_workers --mode=sync \
    --checkpoint_dir="$dir/ckpt" "${server_flags[@]}" 2>"$dir/$name.log" &
  server_pid[$shard]=$!
  pids+=("$!")
  local _
  for _ in $(seq 300); do
    [[ -s "$dir/ps$shard.port" && -s "$dir/ps$shard.mport" ]] && return 0
    kill -0 "${server_pid[$shard]}" 2>/dev/null || { tail -n 5 "$dir/$name.log" >&2; return 1; }
    sleep 0.1
  done
  echo "ctr_restore_trials.sh: shard $shard did not start" >&2
  return 1
}
metric() {  # metric DIR SHARD NAME: a value from the shard's /metrics
  curl -s -m 2 "http://127.0.0.1:$(cat "$1/ps$2.mport")/metrics" 2>/dev/null |
    awk -v m="$3" '$1 == m || index($1, m "{") == 1 {print $2; exit}' || true
}
newest_checkpoint() {  # newest_checkpoint DIR: shard 1's newest file
  local files=("$1"/ckpt/shard-1-of-2/*.pstrain)
  echo "${files[-1]}"
}
describe() {  # describe DIR: what a failed or hung trial left
  local dir=$1 s k pid
  for s in 0 1; do
    echo "    shard $s: version=$(metric "$dir" $s pstrain_shard_version)" \
      "waiting_pulls=$(metric "$dir" $s pstrain_shard_waiting_pulls)" \
      "steps_lost=$(metric "$dir" $s pstrain_shard_steps_lost_total)" \
      "gradients_lost=$(metric "$dir" $s pstrain_shard_gradients_lost_total)"
  done
  # A worker still running says, when interrupted, what it waited for.
  for pid in "${worker_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 3
  for k in $(seq 0 $((num_workers - 1))); do
    echo "    worker $k: $(grep -E 'interrupted|retrying|rror|not complete' "$dir/worker$k.log" | tail -n 2 | cut -c1-400)"
  done
}

ok=0
hung=0
failed=0
trial_lines=()
started_at=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for t in $(seq 1 "$trials"); do
  dir="$run_dir/trial$t"
  mkdir -p "$dir"
  kill_step=$((min_step + RANDOM % (max_step - min_step + 1)))
  start_server "$dir" 0 0 ps0
  start_server "$dir" 1 0 ps1
  port1=$(cat "$dir/ps1.port")
  hosts="127.0.0.1:$(cat "$dir/ps0.port"),127.0.0.1:$port1"
  worker_pids=()
  for k in $(seq 0 $((num_workers - 1))); do
    "$worker_bin" --ps_hosts="$hosts" --worker_id="$k" --num_workers=$num_workers \
      "${worker_flags[@]}" >"$dir/worker$k.out" 2>"$dir/worker$k.log" &
    worker_pids+=("$!")
    pids+=("$!")
  done
  t0=$(date +%s.%N)
  deadline=$(($(date +%s) + trial_timeout_s))
  # Kill shard 1 once it reports the chosen step (polled every 20 ms), or
  # with --kill_at=checkpoint as soon as its next checkpoint file appears
  # after that (a glob every 2 ms: no process per look).
  killed_at=""
  while (($(date +%s) < deadline)); do
    v=$(metric "$dir" 1 pstrain_shard_version)
    fire=0
    if [[ -n "$v" ]] && ((${v%.*} >= kill_step)); then
      fire=1
      if [[ $kill_at == checkpoint ]]; then
        newest=$(newest_checkpoint "$dir")
        while [[ $(newest_checkpoint "$dir") == "$newest" ]] && (($(date +%s) < deadline)); do
          read -r -t 0.002 <> <(:) || true
        done
      fi
    fi
    if ((fire)); then
      kill -9 "${server_pid[1]}"
      wait "${server_pid[1]}" 2>/dev/null || true
      killed_at="$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f", b - a}') s, version $v"
      sleep "$restart_delay_s"
      start_server "$dir" 1 "$port1" ps1_restart
      break
    fi
    sleep 0.02
  done
  # Wait for the workers, bounded by the trial's deadline.
  codes=()
  for pid in "${worker_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && (($(date +%s) < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      codes+=(hung)
    else
      set +e
      wait "$pid"
      codes+=($?)
      set -e
    fi
  done
  elapsed=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  result=ok
  if [[ " ${codes[*]} " == *" hung "* ]]; then
    result=hung
  elif [[ " ${codes[*]} " != " 0 0 0 " ]]; then
    result=failed
  elif [[ -z "$killed_at" ]]; then
    result=failed  # the job ended before the kill: not a trial of the scenario
  fi
  v0=$(metric "$dir" 0 pstrain_shard_version)
  v1=$(metric "$dir" 1 pstrain_shard_version)
  lost="steps_lost=$(metric "$dir" 1 pstrain_shard_steps_lost_total)"
  lost+=" gradients_lost=$(metric "$dir" 1 pstrain_shard_gradients_lost_total)"
  if [[ $result == ok && ("${v0%.*}" != "$steps" || "${v1%.*}" != "$steps") ]]; then
    result=failed
  fi
  line="trial $t: $result (kill at step $kill_step: ${killed_at:-never}; ${elapsed} s; workers ${codes[*]}; versions $v0/$v1; shard 1 $lost)"
  echo "$line"
  trial_lines+=("$line")
  case $result in
    ok) ok=$((ok + 1)) ;;
    hung) hung=$((hung + 1)); describe "$dir" ;;
    failed) failed=$((failed + 1)); describe "$dir" ;;
  esac
  kill_all
  ((keep)) || [[ $result != ok ]] || rm -rf "$dir"
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
summary="trials=$trials ok=$ok hung=$hung failed=$failed ($(($(date +%s) - started_at)) s)"
echo "$summary"
if ((record)); then
  {
    echo "== $(date -u +%Y-%m-%dT%H:%MZ) commit $BENCH_COMMIT"
    echo "command: bench/ctr_restore_trials.sh $args"
    echo "machine: $BENCH_MACHINE"
    echo "load average (1/5/15 min): before $load_before, after $load_after"
    echo "scenario: 2 shards, 3 sync workers, --model=ctr --steps=$steps --batch_size=128"
    echo "  --inject_step_delay_ms=10, --optimizer=adam, --checkpoint_every_steps=10;"
    echo "  shard 1 SIGKILLed at a random step in [$min_step, $max_step] (--kill_at=$kill_at), restarted"
    echo "  ${restart_delay_s} s later from its checkpoint; trial timeout ${trial_timeout_s} s"
    printf '%s\n' "${trial_lines[@]}"
    echo "$summary"
    echo
  } >>bench/results/ctr_restore_trials.txt
fi
((ok == trials))
