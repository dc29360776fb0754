#!/usr/bin/env bash
# Issue 27 at scale: deploy/local/launch.sh with 32 and 64 workers on this
# 2-core machine, where the last workers register tens of seconds after the
# servers came up (each worker's start-up competes for the cores). Sync and
# ssp jobs must wait for every worker: each one runs every step, from step
# 0, and no sync step completes short of a gradient. Before the fix, 23 of
# 32 workers ran 0 steps and the job exited 0.
set -euo pipefail

fail() { echo "FAIL: $*" >&2; exit 1; }

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n "$runfiles" ]] || fail "run me with bazel test //tests:launch_scale_test"
root=$runfiles/pstrain
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/launch_scale.XXXXXX")
mkdir -p "$T/bin"
ln -s "$root/ps_server/ps_server" "$T/bin/ps_server"
ln -s "$root/worker/worker" "$T/bin/worker"
readonly STEPS=40

# run MODE WORKERS: the job must succeed with every worker's final line
# showing all STEPS steps run from step 0 and no short step.
run() {
  local mode=$1 workers=$2 run=$T/$1_$2
  "$root/deploy/local/launch.sh" --bin_dir="$T/bin" --run_dir="$run" \
    --servers=2 --workers="$workers" --mode="$mode" --timeout_s=400 -- \
    --model=mlp --hidden=16 --num_features=12 --train_examples=2000 \
    --test_examples=200 --steps=$STEPS --batch_size=8 --cpu_threads=1 \
    --log_every=0 --heartbeat_interval_s=1 --server.staleness=2 \
    >"$run.out" 2>"$run.err" || fail "$mode x $workers: launch.sh failed: $(tail -n 30 "$run.err")"
  local finals
  finals=$(grep -c '^{"event":"final"' "$run.out" || true)
  ((finals == workers)) || fail "$mode x $workers: $finals final lines, want $workers"
  local bad
  bad=$(grep '^{"event":"final"' "$run.out" |
    grep -v "\"start_step\":0,\"steps_run\":$STEPS,\"steps_skipped\":0,\"steps_short\":0," || true)
  [[ -z "$bad" ]] || fail "$mode x $workers: workers that did not run every step, or short steps:
$(head -c 2000 <<<"$bad")"
  ! grep -q "short" "$run.err" || fail "$mode x $workers: launch.sh warned of short steps"
  grep -q "all $workers workers have registered: the job starts" "$run/ps0.log" ||
    fail "$mode x $workers: ps0 never said the job started"
  echo "PASS: $mode, $workers workers: every worker ran $STEPS steps from step 0, none short"
}

run sync 32
run ssp 32
run sync 64
