#!/usr/bin/env bash
# Issue 38, replicated shards: one replica of a shard killed -9 at a moment
# an operator does not choose, and what the job then holds. Each trial runs
# a job on 2 shards x 2 replicas on loopback, and kills, in turn, replica 0
# (the primary) of shard 1, replica 1 (a backup), or both: the primary, then
# started again at once (it catches up from replica 1, which took over),
# then replica 1 the moment the catch-up is done, so the caught-up replica
# carries the job on; in sync and async mode. With --replicas=3 (2 shards x
# 3 replicas) the third case is two in turn: the primary, then replica 1 the
# moment it has taken over, so replica 2 carries the job on (the backup
# killed in the second case is replica 2). The job is, by --models
# (taken in turn):
#
#   probe  2 workers, 200 steps, SGD at rate 1, a gradient of 1 everywhere:
#          every element ends at minus the updates it got;
#   ctr    the CTR model (dense layers and sparse embedding tables, 2
#          workers, 200 steps); in sync mode its final loss and AUC must be
#          those of an undisturbed run of the same job (run once first).
#
# The moment of the kill:
#
#   mid   at a random moment 0.1-1.2 s after the workers start (the job runs
#         about 1.5 s undisturbed): registration, the first steps, or later;
#   end   as soon as the first worker has finished (just after the last step,
#         while the other may still be pushing it).
#   start (every trial, with --start_race) shard 1's backups start 0.3 s
#         after the workers, so they come up after the primary took the
#         model and must catch up; the kill comes the moment the first of
#         them says it catches up (the job's start-up race: a primary
#         killed then leaves no replica holding the shard, and the backup
#         starts the shard afresh on the primary's promise; README
#         "A primary that dies before its first backup caught up").
#
# ok: every worker exits 0 within --trial_timeout_s (else "hung"/"failed"),
# and the model is what an undisturbed run gives (else "wrong"): probe, the
# servers' model read by bench/soak/observer through the replica sets, every
# element -200 (sync) or -400 (async), so nothing was lost and nothing
# applied twice; ctr in sync mode, worker 0's final_loss, auc and logloss
# equal to the undisturbed run's (async: exits only). For a primary killed mid-job it also reports the failover
# pause: worker 0's longest gap between two completed steps (its
# --metrics_csv), which holds the time from the kill to the next step.
#
# --checkpoint_every_steps=N (default 0: none) gives every server a
# checkpoint directory of its own written every N steps, so that kills land
# while a checkpoint is written, and a replica started again reads its own
# older checkpoint (it must catch up from the running replica, not keep it).
#
# --backup_reads: the workers read half the shards from their backups
# (--pulls_from_backups=always; --replicas=2, the probe model's PushPull steps),
# and a sync probe worker fails a step whose pulled values are not all the
# same (--probe_check_pulls: a block read at the wrong step shows).
#
#   bench/replication_trials.sh [--trials=40] [--models=probe,ctr]
#       [--replicas=2|3] [--checkpoint_every_steps=N] [--trial_timeout_s=60]
#       [--backup_reads] [--start_race] [--seed=N] [--record] [--keep]
#
# Prints a line per trial and a summary; --record appends them (command,
# machine, date) to bench/results/replication_trials.txt. Exit status: 0
# when every trial was ok, 1 otherwise, 2 bad usage. Every process a trial
# starts is killed when it ends and on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

trials=40 models=probe replicas=2 checkpoint_every_steps=0 trial_timeout_s=60 seed=$$ record=0 keep=0
backup_reads=0 start_race=0
args="$*"
for arg in "$@"; do
  case "$arg" in
    --trials=*) trials=${arg#*=} ;;
    --models=*) models=${arg#*=} ;;
    --replicas=*) replicas=${arg#*=} ;;
    --checkpoint_every_steps=*) checkpoint_every_steps=${arg#*=} ;;
    --trial_timeout_s=*) trial_timeout_s=${arg#*=} ;;
    --seed=*) seed=${arg#*=} ;;
    --record) record=1 ;;
    --keep) keep=1 ;;
    --backup_reads) backup_reads=1 ;;
    --start_race) start_race=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "replication_trials.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in trials trial_timeout_s seed checkpoint_every_steps; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "replication_trials.sh: --$v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
[[ $replicas == 2 || $replicas == 3 ]] ||
  { echo "replication_trials.sh: --replicas must be 2 or 3, got '$replicas'" >&2; exit 2; }
readonly R=$replicas
read -r -a model_list <<<"${models//,/ }"
for model in "${model_list[@]}"; do
  [[ $model == probe || $model == ctr ]] ||
    { echo "replication_trials.sh: --models takes probe and ctr, got '$model'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker //bench/soak:observer >/dev/null
server_bin=bazel-bin/ps_server/ps_server
worker_bin=bazel-bin/worker/worker
observer_bin=bazel-bin/bench/soak/observer
source bench/lib.sh

bench_trial_processes replication_trials
RANDOM=$seed
readonly STEPS=200 ELEMENTS=262144 BLOCK=16384

# The workers' flags for MODEL.
model_flags() {
  if [[ $1 == probe ]]; then
    echo "--model=probe --probe_elements=$ELEMENTS --block_elements=$BLOCK --steps=$STEPS"
  else
    echo "--model=ctr --ctr_fields=4 --ctr_dense=2 --ctr_vocab=2000 --batch_size=128 --steps=$STEPS"
  fi
}
ctr_figures() { # worker 0's final_loss auc logloss, from its stdout FILE
  local line
  line=$(grep '^{"event":"final"' "$1" | tail -n 1)
  echo "$(json_field final_loss "$line") $(json_field auc "$line") $(json_field logloss "$line")"
}

# trial MODEL MODE REPLICA MOMENT DIR: prints "result detail". REPLICA -1:
# nothing killed (the undisturbed baseline); 2: both (R = 3: two) in turn
# (see above).
trial() {
  local model=$1 mode=$2 victim=$3 moment=$4 dir=$5 i k r pid deadline detail="" hosts="" set
  mkdir -p "$dir"
  local -a ports server_pid worker_pids=() sets=()
  mapfile -t ports < <(free_ports $((2 * R)))
  for ((k = 0; k < 2; ++k)); do
    set=""
    for ((r = 0; r < R; ++r)); do set+="${set:+,}127.0.0.1:${ports[R * k + r]}"; done
    sets[k]=$set
    hosts+="${hosts:+,}${set//,/|}"
  done
  # start_server I [NAME]: server I (replica I % R of shard I / R).
  start_server() {
    local i=$1 name=${2:-ps$1} shard=$(($1 / R)) checkpoints=()
    if ((checkpoint_every_steps > 0)); then
      # One directory per server process, kept across its restart.
      checkpoints=(--checkpoint_dir="$dir/checkpoints-$i" --checkpoint_every_steps="$checkpoint_every_steps")
    fi
    "$server_bin" "${checkpoints[@]}" --host=127.0.0.1 --port="${ports[i]}" --shard_id=$shard --num_shards=2 \
      --num_workers=2 --mode="$mode" --optimizer=sgd --learning_rate=1 --worker_lease_s=5 \
      --replicas=$R --replica_index=$((i % R)) --replica_hosts="${sets[shard]}" \
      >"$dir/$name.out" 2>"$dir/$name.log" &
    server_pid[i]=$!
    pids+=("$!")
  }
  local late=() # shard 1's backups, with --start_race
  for ((i = 0; i < 2 * R; ++i)); do
    if [[ $moment == start ]] && ((i > R)); then late+=("$i"); else start_server "$i"; fi
  done
  for ((k = 0; k < 2; ++k)); do
    # shellcheck disable=SC2046
    "$worker_bin" --ps_hosts="$hosts" --worker_id=$k --num_workers=2 $(model_flags "$model") \
      --inject_step_delay_ms=5 --log_every=0 --device=cpu --heartbeat_interval_s=0.2 \
      --retry_window_s=30 --rpc_timeout_s=20 --metrics_csv="$dir/w$k.csv" \
      --pulls_from_backups=$( ((backup_reads)) && echo always || echo never) \
      --probe_check_pulls=$( ((backup_reads)) && [[ $model == probe && $mode == sync ]] && echo true || echo false) \
      >"$dir/w$k.out" 2>"$dir/w$k.log" &
    worker_pids+=("$!")
    pids+=("$!")
  done
  deadline=$((SECONDS + trial_timeout_s))
  local target=$R # shard 1's primary; its last replica for "backup"
  ((victim == 1)) && target=$((2 * R - 1))
  local late_logs=()
  if [[ $moment == start ]]; then
    sleep 0.3
    for i in "${late[@]}"; do
      start_server "$i"
      late_logs+=("$dir/ps$i.log")
    done
    while ! grep -q "started without the shard's state" "${late_logs[@]}" 2>/dev/null &&
      kill -0 "${worker_pids[0]}" 2>/dev/null && ((SECONDS < deadline)); do
      read -r -t 0.002 <> <(:) || true
    done
  fi
  if ((victim < 0)); then
    detail="undisturbed"
  elif [[ $moment == start ]]; then
    detail="killed as a late backup began catching up"
    grep -q "started without the shard's state" "${late_logs[@]}" 2>/dev/null ||
      detail="killed with no late backup catching up"
  elif [[ $moment == mid ]]; then
    local at
    at=$(awk -v r=$RANDOM 'BEGIN {printf "%.2f", 0.1 + 1.1 * r / 32767}')
    # Both in turn: early, so that the catch-up and the second kill fall
    # inside the job.
    ((victim == 2)) && at=$(awk -v a="$at" 'BEGIN {printf "%.2f", a / 2}')
    sleep "$at"
    detail="killed at $at s"
  else
    while kill -0 "${worker_pids[0]}" 2>/dev/null && kill -0 "${worker_pids[1]}" 2>/dev/null &&
      ((SECONDS < deadline)); do
      read -r -t 0.002 <> <(:) || true
    done
    detail="killed after a worker finished"
  fi
  # Worker 0's steps so far (its CSV is flushed every step, after a header).
  local rows_at_kill
  rows_at_kill=$( (wc -l <"$dir/w0.csv") 2>/dev/null || echo 0)
  if ((victim >= 0)); then
    kill -9 "${server_pid[target]}"
    wait "${server_pid[target]}" 2>/dev/null || true
  fi
  if ((victim == 2 && R == 3)); then
    # Two in turn: replica 1 the moment it has taken over.
    while ! grep -q "takes over" "$dir/ps4.log" && kill -0 "${worker_pids[0]}" 2>/dev/null &&
      ((SECONDS < deadline)); do
      read -r -t 0.005 <> <(:) || true
    done
    if grep -q "takes over" "$dir/ps4.log"; then
      kill -9 "${server_pid[4]}"
      wait "${server_pid[4]}" 2>/dev/null || true
      detail+=", then replica 1 the moment it took over"
    else
      detail+=", replica 1 had not taken over when the job ended"
    fi
  elif ((victim == 2)); then
    : >"$dir/ps2_again.log"
    start_server 2 ps2_again
    while ! grep -q "caught up\|is the primary" "$dir/ps2_again.log" && kill -0 "${worker_pids[0]}" 2>/dev/null &&
      ((SECONDS < deadline)); do
      read -r -t 0.005 <> <(:) || true
    done
    if grep -q "is the primary" "$dir/ps2_again.log"; then
      # Back before the job registered its model: nothing to catch up.
      detail+=", restarted before the model was registered (primary again)"
    elif grep -q "caught up" "$dir/ps2_again.log"; then
      kill -9 "${server_pid[3]}"
      wait "${server_pid[3]}" 2>/dev/null || true
      detail+=", restarted, caught up ($(sed -n 's/.*caught up from replica 1 (epoch \([0-9]*\), \([0-9]*\) chunks).*/epoch \1, \2 chunks/p' "$dir/ps2_again.log")), then replica 1 killed"
    else
      detail+=", restarted; the job ended before it caught up"
    fi
  fi
  local codes="" result=ok code
  for pid in "${worker_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.05; done
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
  if [[ $result == ok && $model == ctr ]]; then
    local figures
    figures=$(ctr_figures "$dir/w0.out")
    detail+=", final_loss/auc/logloss $figures"
    if [[ $mode == sync && -n ${ctr_baseline:-} && $figures != "$ctr_baseline" ]]; then
      result=wrong
      detail+=" (undisturbed: $ctr_baseline)"
    fi
  elif [[ $result == ok ]]; then
    local expect=$STEPS out mismatches
    [[ $mode != sync ]] && expect=$((2 * STEPS))
    out=$("$observer_bin" --ps_hosts="$hosts" --num_workers=2 --probe_elements=$ELEMENTS \
      --block_elements=$BLOCK --expect_updates=$expect --retry_window_s=10 2>"$dir/observer.log" || true)
    mismatches=$(sed -n 's/.*mismatches=\([0-9]*\).*/\1/p' <<<"$out")
    detail+=", elements off -$expect: ${mismatches:-unread}"
    [[ $mismatches == 0 ]] || result=wrong
  fi
  if [[ $victim == 0 && $moment == mid && $result == ok && $model == probe ]]; then
    if ((rows_at_kill >= 2)); then
      # The gap holding the kill: the last step before it to the first
      # after. A step (~10 ms) may complete between the count and the kill,
      # so the larger of the two gaps after the count.
      local gap
      gap=$(awk -F, -v k="$rows_at_kill" 'NR >= k && NR <= k + 2 {if (NR > k && $2 - t > m) m = $2 - t; t = $2} END {printf "%.3f", m}' "$dir/w0.csv")
      detail+=", failover pause $gap s (after worker 0's step $((rows_at_kill - 1)))"
      [[ -n $gap ]] && echo "$gap" >>"$run_dir/pauses"
    else
      detail+=", killed before worker 0's first step"
    fi
  fi
  if ((victim == 2 && R == 3)); then
    grep -q "takes over" "$dir/ps5.log" 2>/dev/null && detail+=", replica 2 took over"
  elif ((victim == 2)); then
    grep -q "takes over" "$dir/ps2_again.log" 2>/dev/null && detail+=", the caught-up replica took over"
  elif ((victim == 0)) && grep -q "takes over" "$dir/ps$((R + 1)).log" 2>/dev/null; then
    detail+=", backup took over"
  fi
  kill_all
  echo "$result $detail"
}

rows=()
pauses=()
ok=0
bad=0
status=0
ctr_baseline=""
if [[ " ${model_list[*]} " == *" ctr "* ]]; then
  line=$(trial ctr sync -1 mid "$run_dir/ctr_baseline")
  [[ $line == ok* ]] || { echo "replication_trials.sh: the undisturbed CTR job failed: $line" >&2; exit 1; }
  ctr_baseline=$(ctr_figures "$run_dir/ctr_baseline/w0.out")
  rows+=("undisturbed sync CTR job: final_loss/auc/logloss $ctr_baseline")
  echo "${rows[-1]}"
fi
for t in $(seq 1 "$trials"); do
  mode=sync
  ((t % 2)) || mode=async
  victim=$(((t - 1) / 2 % 3)) # primary, primary, backup, backup, both, both, ...
  moment=mid
  ((t % 5)) || moment=end
  ((start_race)) && moment=start
  model=${model_list[$(((t - 1) / 4 % ${#model_list[@]}))]}
  line=$(trial "$model" $mode $victim $moment "$run_dir/t$t")
  victim_name=(primary backup both)
  ((R == 3)) && victim_name=(primary backup two)
  rows+=("$(printf '%3d %-5s %-5s %-7s %-3s  %s' "$t" "$model" $mode "${victim_name[victim]}" $moment "$line")")
  echo "${rows[-1]}"
  if [[ $line == ok* ]]; then ok=$((ok + 1)); else bad=$((bad + 1)); status=1; fi
done
summary="$ok of $trials ok, $bad not (hung, failed or wrong)"
[[ -s "$run_dir/pauses" ]] && mapfile -t pauses <"$run_dir/pauses"
if ((${#pauses[@]} > 0)); then
  summary+="; failover pause (primary killed mid-job) p50 $(printf '%s\n' "${pauses[@]}" | sort -n |
    awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}') s, max $(printf '%s\n' "${pauses[@]}" | sort -n | tail -n 1) s over ${#pauses[@]}"
fi
echo "$summary"
if ((record)); then
  {
    echo "# $(date -u +%F) bench/replication_trials.sh $args at $BENCH_COMMIT on $BENCH_MACHINE"
    printf '%s\n' "${rows[@]}" "$summary"
  } >>bench/results/replication_trials.txt
fi
exit $status
