#!/usr/bin/env bash
# deploy/local/launch.sh --replicas=2 keeps a shard replicated through two
# failures: replica 0 (the primary) is killed with SIGKILL mid-job, replica 1
# takes over, the launcher starts replica 0 again and it catches up from
# replica 1; then replica 1 is killed and the restarted replica 0 carries the
# job to its last step. Without the restart (or the catch-up) the second
# kill leaves the shard with no replica and the job fails.
set -euo pipefail

fail() {
  echo "launch_replicas_test: FAIL: $*" >&2
  exit 1
}

root=${RUNFILES_DIR:-${TEST_SRCDIR:?run under bazel test}}/pstrain
T=${TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$T/bin"
ln -sf "$root/ps_server/ps_server" "$T/bin/ps_server"
ln -sf "$root/worker/worker" "$T/bin/worker"
run=$T/run
steps=1000

# Waits (polling, with a deadline) until FILE has a line matching REGEX.
wait_for_line() {
  local file=$1 regex=$2 what=$3 deadline=$((SECONDS + 90))
  until [[ -f $file ]] && grep -qE "$regex" "$file"; do
    ((SECONDS < deadline)) || fail "timed out waiting for $what: $(tail -n 5 "$file" 2>/dev/null)"
    kill -0 "$launcher" 2>/dev/null || fail "launch.sh ended before $what: $(tail -n 20 "$T/err")"
    sleep 0.1
  done
}

# The pid of server process I of this job (its own --port_file names it).
server_pid() { pgrep -f -- "--port_file=$run/ps$1.port" | head -n 1; }

cleanup() {
  [[ -n ${launcher:-} ]] && kill "$launcher" 2>/dev/null && wait "$launcher" 2>/dev/null
  pkill -9 -f -- "--port_file=$run/" 2>/dev/null || true
}
trap cleanup EXIT

# 1000 steps of 20 ms or more: long enough for two failovers and a
# catch-up, also on a loaded machine.
timeout 300 "$root/deploy/local/launch.sh" --bin_dir="$T/bin" --run_dir="$run" \
  --servers=1 --replicas=2 --workers=1 --timeout_s=240 -- \
  --steps=$steps --log_every=1 --inject_step_delay_ms=20 >"$T/out" 2>"$T/err" &
launcher=$!

wait_for_line "$run/worker0.out" 'step [2-9][0-9]/' "the job's 20th step"
first=$(server_pid 0)
[[ -n $first ]] || fail "no process for replica 0"
kill -9 "$first"
wait_for_line "$T/err" 'ps_server 0 \(shard 0, replica 0\) died during training.*starting it again \(restart 1 of 3\)' \
  "the launcher restarting replica 0"
wait_for_line "$run/ps0.log" 'caught up from replica 1 .*a backup now' "replica 0 catching up"
second=$(server_pid 1)
[[ -n $second ]] || fail "no process for replica 1"
kill -9 "$second"
wait_for_line "$T/err" 'ps_server 1 \(shard 0, replica 1\) died during training' "replica 1's death noticed"

rc=0
wait "$launcher" || rc=$?
launcher=""
((rc == 0)) || fail "launch.sh exited $rc: $(tail -n 20 "$T/err")"
grep -q "^{\"event\":\"job\",\"mode\":\"sync\",\"shards\":1,.*\"step\":$steps," "$T/out" ||
  fail "the job did not reach step $steps: $(cat "$T/out")"
grep -q "takes over" "$run/ps0.log" || grep -q "primary now" "$run/ps0.log" ||
  fail "the restarted replica 0 never took over: $(tail -n 20 "$run/ps0.log")"
echo PASS
