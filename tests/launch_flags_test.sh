#!/usr/bin/env bash
# deploy/local/launch.sh's --server. flags: one ps_server does not define
# exits 2 before anything starts, with one line that says where the flag
# belongs (issue 30: `--server.sparse_optimizer=ftrl` failed inside a
# server log as "Unknown command line flag"). A flag ps_server defines
# still reaches it and the job runs. A launch whose output reader leaves
# still stops what it started.
set -euo pipefail

fail() { echo "FAIL: $*" >&2; exit 1; }

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n "$runfiles" ]] || fail "run me with bazel test //tests:launch_flags_test"
root=$runfiles/pstrain
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/launch_flags.XXXXXX")
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/bin"
ln -s "$root/ps_server/ps_server" "$T/bin/ps_server"
ln -s "$root/worker/worker" "$T/bin/worker"
launch() { timeout 120 "$root/deploy/local/launch.sh" --bin_dir="$T/bin" "$@"; }

# expect_refusal NAME EXPECTED_TEXT: --server.NAME=1 is refused with exit 2.
expect_refusal() {
  local rc=0
  launch --run_dir="$T/run_$1" -- "--server.$1=1" --steps=5 >"$T/out" 2>"$T/err" || rc=$?
  [[ $rc == 2 ]] || fail "--server.$1: exit $rc, want 2: $(cat "$T/err")"
  [[ $(wc -l <"$T/err") == 1 ]] || fail "--server.$1: want one line, got: $(cat "$T/err")"
  grep -qF -- "$2" "$T/err" || fail "--server.$1: want '$2' in: $(cat "$T/err")"
  [[ ! -e "$T/run_$1/ps0.log" ]] || fail "--server.$1: a server was started"
}
expect_refusal sparse_optimizer "ps_server has no --sparse_optimizer; it is a worker flag (pass it as --sparse_optimizer)"
expect_refusal no_such_flag "ps_server has no --no_such_flag (ps_server --helpfull lists its flags)"

# A CSV path for every worker would be one file written by all of them.
rc=0
launch --run_dir="$T/run_csv" -- --metrics_csv="$T/one.csv" --steps=5 >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 ]] || fail "--metrics_csv for 2 workers: exit $rc, want 2: $(cat "$T/err")"
[[ $(wc -l <"$T/err") == 1 ]] || fail "--metrics_csv: want one line, got: $(cat "$T/err")"
grep -qF -- "use --csv" "$T/err" || fail "--metrics_csv: want 'use --csv' in: $(cat "$T/err")"
[[ ! -e "$T/run_csv/ps0.log" ]] || fail "--metrics_csv: a server was started"

# A job stopped early (SIGTERM, as Ctrl-C) still says where the servers
# left it: the job line a resume continues from.
"$root/deploy/local/launch.sh" --bin_dir="$T/bin" --servers=1 --workers=1 \
  --run_dir="$T/run_stopped" -- --steps=1000000 --log_every=0 >"$T/out" 2>"$T/err" &
launcher=$!
for ((i = 0; i < 600; i++)); do
  [[ -s "$T/run_stopped/cluster.json" ]] && break
  sleep 0.1 # polling the file the launcher writes once the servers are up; bounded
done
[[ -s "$T/run_stopped/cluster.json" ]] || fail "the stopped job never started: $(cat "$T/err")"
kill -TERM "$launcher"
rc=0
timeout 60 tail --pid="$launcher" -f /dev/null || fail "the launcher did not end 60 s after SIGTERM"
wait "$launcher" || rc=$?
[[ $rc == 143 ]] || fail "a launcher stopped by SIGTERM: exit $rc, want 143: $(tail -n 5 "$T/err")"
grep -q '^{"event":"job","mode":"sync","shards":1,' "$T/out" ||
  fail "no job line after SIGTERM: $(cat "$T/out") $(tail -n 5 "$T/err")"

# With --server.checkpoint_dir the launcher says whether the job resumed (at
# which step) or found nothing there: a mistyped directory shows at once.
for steps in 5 8; do
  launch --servers=2 --workers=1 --run_dir="$T/run_ckpt$steps" -- \
    --server.checkpoint_dir="$T/ckpt" --steps=$steps --log_every=0 \
    >"$T/out" 2>"$T/err_ckpt$steps" ||
    fail "a job with --server.checkpoint_dir failed: $(tail -n 5 "$T/err_ckpt$steps")"
done
grep -qF "no checkpoint in $T/ckpt yet: the job starts at step 0" "$T/err_ckpt5" ||
  fail "no 'starts at step 0' line for the first job: $(cat "$T/err_ckpt5")"
grep -qF "resuming from the checkpoints in $T/ckpt: shards at step 5, 5" "$T/err_ckpt8" ||
  fail "no 'resuming' line for the second job: $(cat "$T/err_ckpt8")"

# One fixed port for every server: refused at once, in one line.
rc=0
launch --run_dir="$T/run_port" -- --server.data_port=25021 --steps=5 >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 ]] || fail "--server.data_port for 2 servers: exit $rc, want 2: $(cat "$T/err")"
[[ $(wc -l <"$T/err") == 1 ]] || fail "--server.data_port: want one line, got: $(cat "$T/err")"
grep -qF -- "listen on one port" "$T/err" || fail "--server.data_port: want 'listen on one port' in: $(cat "$T/err")"
[[ ! -e "$T/run_port/ps0.log" ]] || fail "--server.data_port: a server was started"

# An interpreter that cannot import pstrain.torch: one line, with its error.
printf '#!/bin/sh\necho "ModuleNotFoundError: No module named numpy" >&2\nexit 1\n' >"$T/python"
chmod +x "$T/python"
echo "print(1)" >"$T/script.py"
rc=0
PSTRAIN_PYTHON="$T/python" launch --python="$T/script.py" >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 ]] || fail "--python without pstrain: exit $rc, want 2: $(cat "$T/err")"
[[ $(wc -l <"$T/err") == 1 ]] || fail "--python without pstrain: want one line, got: $(cat "$T/err")"
grep -qF "No module named numpy" "$T/err" || fail "--python without pstrain: want its import error in: $(cat "$T/err")"
# A bare name is looked up on PATH, as a shell would (here the same
# interpreter, so the same refusal, not "no interpreter at python").
rc=0
PATH="$T:$PATH" PSTRAIN_PYTHON=python launch --python="$T/script.py" >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 ]] || fail "PSTRAIN_PYTHON=python: exit $rc, want 2: $(cat "$T/err")"
grep -qF "$T/python cannot import pstrain.torch" "$T/err" ||
  fail "PSTRAIN_PYTHON=python (on PATH): want it found, got: $(cat "$T/err")"
rc=0
PSTRAIN_PYTHON=no-such-python-here launch --python="$T/script.py" >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 ]] && grep -qF "no interpreter at no-such-python-here" "$T/err" ||
  fail "PSTRAIN_PYTHON naming nothing: exit $rc: $(cat "$T/err")"

# A server flag passes the check and takes effect.
launch --servers=1 --workers=1 --run_dir="$T/ok" -- --server.optimizer=adam \
  --server.learning_rate=0.001 --steps=5 --log_every=0 >"$T/out" 2>"$T/err" ||
  fail "a valid --server. flag was refused: $(tail -n 20 "$T/err")"
grep -q "adam" "$T/ok/ps0.log" || fail "ps_server did not get --optimizer=adam: $(head -n 20 "$T/ok/ps0.log")"
# A CTR table budget reaches the servers: each logs the table's bound
# before the first step, and the job trains under it.
launch --servers=1 --workers=1 --run_dir="$T/budget" -- --model=ctr --steps=20 \
  --log_every=0 --embedding_max_bytes=20000 >"$T/out" 2>"$T/err" ||
  fail "a CTR job with --embedding_max_bytes failed: $(tail -n 20 "$T/err")"
grep -q "memory: .*table 'field0' up to 0.0 MiB ([0-9]* rows of up to [0-9]* bytes)" "$T/budget/ps0.log" ||
  fail "no table bound in the server's log: $(grep memory: "$T/budget/ps0.log")"
# More servers than the model has blocks (the probe's 1000 floats are one
# block): the empty shard has no step, and the report is the job's step,
# with no shard "behind" it (it used to say step 0 and warn of one).
launch --servers=2 --workers=1 --run_dir="$T/empty_shard" -- --model=probe \
  --steps=5 --log_every=0 >"$T/out" 2>"$T/err" ||
  fail "a probe job on 2 servers failed: $(tail -n 20 "$T/err")"
grep -q '^{"event":"job","mode":"sync","shards":2,.*"step":5,"step_max":5,.*"shards_behind":0' "$T/out" ||
  fail "the job line of a job with an empty shard: $(grep '"event":"job"' "$T/out")"
grep -q "ended the sync job at step 5" "$T/err" && ! grep -q "behind" "$T/err" ||
  fail "launch.sh's report of a job with an empty shard: $(tail -n 5 "$T/err")"
# --replicas: a bad count is one line, exit 2; two replicas per shard run
# the job, replica 0 as the primary and replica 1 as its backup.
rc=0
launch --replicas=0 --run_dir="$T/bad_replicas" -- --steps=5 >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 && $(wc -l <"$T/err") == 1 ]] || fail "--replicas=0: exit $rc: $(cat "$T/err")"
grep -qF -- "--replicas must be an integer >= 1, got '0'" "$T/err" || fail "--replicas=0: $(cat "$T/err")"
rc=0
launch --replicas=2 --replica_restarts=-1 --run_dir="$T/bad_restarts" -- --steps=5 >"$T/out" 2>"$T/err" || rc=$?
[[ $rc == 2 && $(wc -l <"$T/err") == 1 ]] || fail "--replica_restarts=-1: exit $rc: $(cat "$T/err")"
grep -qF -- "--replica_restarts must be an integer >= 0, got '-1'" "$T/err" ||
  fail "--replica_restarts=-1: $(cat "$T/err")"
launch --servers=1 --replicas=2 --workers=1 --run_dir="$T/replicated" -- --steps=5 \
  --log_every=0 >"$T/out" 2>"$T/err" || fail "a replicated job failed: $(tail -n 20 "$T/err")"
grep -q "replica 0 of shard 0 is the primary" "$T/replicated/ps0.log" ||
  fail "replica 0 is not the primary: $(head -n 20 "$T/replicated/ps0.log")"
grep -q "replica 1 of shard 0 is a backup" "$T/replicated/ps1.log" ||
  fail "replica 1 is not a backup: $(head -n 20 "$T/replicated/ps1.log")"
grep -q '^{"event":"job","mode":"sync","shards":1,.*"step":5,' "$T/out" ||
  fail "the job line does not count the replicated shard once: $(cat "$T/out")"
grep -q '"ps": \["127.0.0.1:[0-9]*|127.0.0.1:[0-9]*"\]' "$T/replicated/cluster.json" ||
  fail "cluster.json lacks the replica set: $(cat "$T/replicated/cluster.json")"
# A reader that leaves early (`launch.sh ... | grep -m1 step`): the launcher
# still stops the servers and workers it started (a closed pipe used to kill
# it before its cleanup, leaving the servers running).
launch --run_dir="$T/pipe" -- --steps=40 --log_every=1 2>&1 | head -n 1 >/dev/null || true
left() { pgrep -f -- "--port_file=$T/pipe/" >/dev/null; }
for _ in $(seq 300); do left || break; sleep 0.1; done
if left; then
  pkill -f -- "--port_file=$T/pipe/" || true
  fail "processes of a launch whose reader left were still running 30 s later"
fi
echo PASS
