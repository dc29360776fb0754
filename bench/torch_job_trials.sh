#!/usr/bin/env bash
# pstrain.torch jobs (and one C++ worker job) stopped and broken the way an
# operator does it, run as a user runs them: deploy/local/launch.sh
# (--python for the torch ones), 2 servers, sync. Each trial picks a random moment between 30% and 90% of the
# job (timed by an undisturbed run of the same job, run first) and does, by
# --kinds (taken in turn):
#
#   stop      SIGTERM to launch.sh (it SIGTERMs the workers, then the
#             servers, which write a last checkpoint), then the same command
#             again, which resumes from the servers' checkpoints. ok: both
#             runs end as they should (143, then 0), no step is lost, and
#             the resumed job's checkpoint exports (pstrain_export) the
#             undisturbed job's bytes.
#   failover  --replicas=2, and the primary of shard 1 killed -9 (launch.sh
#             starts it again; it catches up from the replica that took
#             over). ok: the job exits 0 with no step short and every
#             worker reports the undisturbed job's last training loss and
#             held-out figures (loss and accuracy, or AUC).
#
# The models (--models, taken in turn):
#   cnn  worker/python/examples/fashion_mnist_cnn.py (BatchNorm, Dropout,
#        Adam on the servers), half an epoch of 96-image global batches;
#   ctr  worker/python/examples/ctr.py (dense layers and 4 sparse tables,
#        Adagrad rows), 4000 steps;
#   mlp  the C++ worker: MLP 784-2048-2048-10 on Fashion-MNIST, 2 workers of
#        2048 images, 40 steps, pipelined (--pipeline_step=always, the
#        default where the servers are on other hosts: the push leaves during
#        backward): a step whose compute (about 0.7 s on 2 vCPUs) outlasts a
#        fixed 0.4 s stop grace.
#
# The torch models run with 3 workers.
#
#   bench/torch_job_trials.sh [--trials=6] [--kinds=stop,failover]
#       [--models=cnn,ctr,mlp] [--seed=N] [--record] [--keep]
#
# Prints a line per trial and a summary; --record appends them (command,
# machine, date) to bench/results/torch_job_trials.txt. Exit status: 0 when
# every trial was ok, 1 otherwise, 2 bad usage. Needs pstrain installed for
# /usr/bin/python3 (worker/python/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

trials=6 kinds=stop,failover models=cnn,ctr seed=$$ record=0 keep=0
args="$*"
for arg in "$@"; do
  case "$arg" in
    --trials=*) trials=${arg#*=} ;;
    --kinds=*) kinds=${arg#*=} ;;
    --models=*) models=${arg#*=} ;;
    --seed=*) seed=${arg#*=} ;;
    --record) record=1 ;;
    --keep) keep=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "torch_job_trials.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in trials seed; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "torch_job_trials.sh: --$v must be a non-negative integer, got '${!v}'" >&2; exit 2; }
done
read -r -a kind_list <<<"${kinds//,/ }"
read -r -a model_list <<<"${models//,/ }"
for kind in "${kind_list[@]}"; do
  [[ $kind == stop || $kind == failover ]] ||
    { echo "torch_job_trials.sh: --kinds takes stop and failover, got '$kind'" >&2; exit 2; }
done
for model in "${model_list[@]}"; do
  [[ $model == cnn || $model == ctr || $model == mlp ]] ||
    { echo "torch_job_trials.sh: --models takes cnn, ctr and mlp, got '$model'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker //worker:pstrain_export >/dev/null
source bench/lib.sh
bench_trial_processes torch_job_trials
RANDOM=$seed

# The launcher's arguments for MODEL, KIND, checkpointing to DIR.
job_args() {
  local model=$1 kind=$2 dir=$3 extra=()
  [[ $kind == failover ]] && extra=(--replicas=2)
  if [[ $model == cnn ]]; then
    echo "--servers=2 --workers=3 --mode=sync ${extra[*]} --python=worker/python/examples/fashion_mnist_cnn.py --" \
      "--server.optimizer=adam --server.learning_rate=0.001 --server.checkpoint_dir=$dir" \
      "--epochs=0.5 --global_batch_size=96 --test_examples=1000"
  elif [[ $model == ctr ]]; then
    echo "--servers=2 --workers=3 --mode=sync ${extra[*]} --python=worker/python/examples/ctr.py --" \
      "--server.optimizer=adam --server.learning_rate=0.001 --server.checkpoint_dir=$dir" \
      "--steps=4000 --test_examples=2000"
  else
    echo "--servers=2 --workers=2 --mode=sync ${extra[*]} --" \
      "--server.optimizer=adam --server.learning_rate=0.001 --server.checkpoint_dir=$dir" \
      "--data=fashion_mnist --model=mlp --hidden=2048,2048 --global_batch_size=4096 --steps=40" \
      "--pipeline_step=always"
  fi
}
# Every worker's last training loss and held-out figures, from launch.sh's
# stdout FILE.
figures() {
  local line
  grep '^{"event":"final"' "$1" | sort | while read -r line; do
    echo -n "$(json_field final_loss "$line")/$(json_field test_loss "$line")$(json_field auc "$line")/$(json_field test_accuracy "$line") "
  done
}
# launch ARGS OUT: launch.sh in the background; sets launched.
launch() {
  # shellcheck disable=SC2086
  setsid deploy/local/launch.sh $1 >"$2" 2>"$2.err" &
  launched=$!
  pids+=("$launched")
}

# trial MODEL KIND DIR AT_S: prints "result detail"; AT_S 0: undisturbed
# (prints its wall time as detail).
trial() {
  local model=$1 kind=$2 dir=$3 at=$4 rc start victim p
  mkdir -p "$dir"
  start=$(date +%s.%N)
  launch "$(job_args "$model" "$kind" "$dir/ckpt")" "$dir/run1"
  if [[ $at == 0 ]]; then
    rc=0
    wait "$launched" || rc=$?
    ((rc == 0)) || { echo "failed undisturbed run exited $rc (see $dir)"; return; }
    echo "ok $(echo "$(date +%s.%N) - $start" | bc)"
    return
  fi
  sleep "$at"
  if [[ $kind == stop ]]; then
    kill -TERM "$launched"
    rc=0
    wait "$launched" || rc=$?
    ((rc == 143)) || { echo "failed stopped run exited $rc, not 143"; return; }
    launch "$(job_args "$model" "$kind" "$dir/ckpt")" "$dir/run2"
    rc=0
    wait "$launched" || rc=$?
    ((rc == 0)) || { echo "failed resumed run exited $rc"; return; }
    if grep -q "lost\|warning" "$dir/run2.err"; then
      echo "wrong $(grep -m1 "lost\|warning" "$dir/run2.err")"
      return
    fi
    bazel-bin/worker/pstrain_export --checkpoint_dir="$dir/ckpt" --output="$dir/model.safetensors" >/dev/null 2>&1 ||
      { echo "failed export"; return; }
    if cmp -s "$dir/model.safetensors" "$baseline_dir/model.safetensors"; then
      at=$(sed -n 's/.*shards at step \([0-9]*\).*/\1/p' "$dir/run2.err" | head -n 1)
      echo "ok resumed at step ${at:-0 (stopped before a checkpoint)}"
    else
      echo "wrong exported model differs from the undisturbed job's"
    fi
    return
  fi
  victim=""
  for p in $(pgrep -f 'ps_server .*--shard_id=1 ' || true); do
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- '--replica_index=0 ' && victim=$p
  done
  [[ -n $victim ]] && kill -9 "$victim"
  rc=0
  wait "$launched" || rc=$?
  ((rc == 0)) || { echo "failed exited $rc"; return; }
  if grep -q '"steps_short":[1-9]' "$dir/run1"; then
    echo "wrong a step short"
  elif [[ "$(figures "$dir/run1")" != "$(figures "$baseline_dir/run1")" ]]; then
    echo "wrong figures $(figures "$dir/run1")"
  else
    echo "ok $([[ -n $victim ]] && echo "primary of shard 1 killed" || echo "(the job was over before the kill)")"
  fi
}

results=()
failures=0
for kind in "${kind_list[@]}"; do
  for model in "${model_list[@]}"; do
    baseline_dir="$run_dir/$model-$kind-undisturbed"
    read -r result wall < <(trial "$model" "$kind" "$baseline_dir" 0)
    [[ $result == ok ]] || { echo "$model $kind: undisturbed run $result $wall" >&2; exit 1; }
    if [[ $kind == stop ]]; then
      bazel-bin/worker/pstrain_export --checkpoint_dir="$baseline_dir/ckpt" \
        --output="$baseline_dir/model.safetensors" >/dev/null 2>&1
    fi
    for ((t = 1; t <= trials; ++t)); do
      # A moment in the last 70% of the undisturbed run (its first seconds
      # are Python's and torch's start-up).
      at=$(echo "scale=2; $wall * $((30 + RANDOM % 60)) / 100" | bc)
      line="$model $kind trial $t at ${at}s: $(trial "$model" "$kind" "$run_dir/$model-$kind-$t" "$at")"
      echo "$line"
      results+=("$line")
      [[ $line == *": ok"* ]] || failures=$((failures + 1))
    done
  done
done
summary="$((${#results[@]} - failures)) of ${#results[@]} trials ok"
echo "$summary"
if ((record)); then
  {
    echo "## $(date -u +%Y-%m-%d) bench/torch_job_trials.sh $args"
    echo "commit $BENCH_COMMIT; $BENCH_MACHINE"
    printf '%s\n' "${results[@]}" "$summary" ""
  } >>bench/results/torch_job_trials.txt
fi
((failures == 0))
