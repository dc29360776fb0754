#!/usr/bin/env bash
# Ctrl-C on the terminal running deploy/local/launch.sh reaches its whole
# process group at once: the launcher, every server and every worker. The
# launcher's stop must still be the one that counts: workers first
# (SIGTERM: each finishes its step and leaves as stopping), servers after
# (SIGTERM: a last checkpoint of a job that holds one step). Servers that
# took the terminal's SIGINT themselves shut down while the workers were
# still pushing, and 2 of 6 such stops left a shard's blocks a step apart,
# a step lost on resume. Here launch.sh runs in a session of its own (as a
# shell's foreground job is a process group of its own) and gets the
# group's SIGINT mid-job: every process must say SIGTERM stopped it.
set -euo pipefail

fail() { echo "FAIL: $*" >&2; exit 1; }

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n "$runfiles" ]] || fail "run me with bazel test //tests:launch_ctrl_c_test"
root=$runfiles/pstrain
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/launch_ctrl_c.XXXXXX")
mkdir -p "$T/bin"
ln -s "$root/ps_server/ps_server" "$T/bin/ps_server"
ln -s "$root/worker/worker" "$T/bin/worker"

# A script's background job starts with SIGINT ignored, as a terminal's
# foreground job does not: env gives launch.sh the default back.
env --default-signal=INT setsid "$root/deploy/local/launch.sh" \
  --bin_dir="$T/bin" --run_dir="$T/run" --servers=2 --workers=3 \
  --timeout_s=120 -- --server.checkpoint_dir="$T/ckpt" --model=mlp \
  --hidden=32 --steps=1000000 --log_every=20 >"$T/out" 2>"$T/err" &
launcher=$!
trap 'kill -KILL -- -"$launcher" 2>/dev/null || true' EXIT

deadline=$((SECONDS + 60))
until grep -q 'worker 0 step [0-9]' "$T/out" 2>/dev/null; do
  ((SECONDS < deadline)) || fail "no step from worker 0 within 60 s: $(tail -n 20 "$T/err")"
  kill -0 "$launcher" 2>/dev/null || fail "launch.sh ended early: $(tail -n 20 "$T/err")"
  sleep 0.05
done

kill -INT -- -"$launcher"
rc=0
wait "$launcher" || rc=$?
((rc == 130)) || fail "launch.sh exited $rc after Ctrl-C, not 130: $(tail -n 20 "$T/err")"
grep -q 'caught SIGINT' "$T/err" || fail "launch.sh did not say it caught SIGINT: $(cat "$T/err")"

for k in 0 1 2; do
  log=$T/run/worker$k.log
  grep -q 'signal 15: stopping after this step' "$log" ||
    fail "worker $k was not stopped by the launcher's SIGTERM: $(grep -m3 'signal' "$log" || tail -n 5 "$log")"
  ! grep -q 'signal 2:' "$log" || fail "worker $k took the terminal's SIGINT itself"
done
for i in 0 1; do
  log=$T/run/ps$i.log
  grep -q 'signal 15: shutting down' "$log" ||
    fail "server $i was not stopped by the launcher's SIGTERM: $(grep -m3 'signal' "$log" || tail -n 5 "$log")"
  ! grep -q 'signal 2:' "$log" || fail "server $i took the terminal's SIGINT itself"
done
# One step on every shard, none short: the resume point is whole.
steps=$(sed -n 's/.*"event":"shard_final".*"version":\([0-9]*\).*/\1/p' "$T/run"/ps*.log | sort -u)
[[ $(wc -l <<<"$steps") == 1 && -n $steps ]] || fail "the shards stopped at different steps: $steps"
! grep -q '"steps_short":[1-9]' "$T/run"/ps*.log || fail "a step completed short"
echo "PASS: stopped at step $steps by the launcher, in order"
