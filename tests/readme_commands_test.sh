#!/usr/bin/env bash
# Runs the README's operator commands as written: each marked block
# (<!-- readme_commands_test: NAME --> before a ```sh block) is taken from
# README.md itself, its fixed ports replaced by the ones this test's
# ps_server got (5000 -> --port, 5001 -> --health_port, 9100 ->
# --metrics_port), and every line must exit 0 with the output it promises.
set -euo pipefail

fail() { echo "FAIL: $*" >&2; exit 1; }

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n "$runfiles" ]] || fail "run me with bazel test //tests:readme_commands_test"
root=$runfiles/pstrain
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/readme.XXXXXX")
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

# A block of the README: the lines of the ```sh block after its marker.
block() {
  awk -v marker="<!-- readme_commands_test: $1 -->" '
    $0 == marker { found = 1; next }
    found && /^```sh/ { inside = 1; next }
    inside && /^```/ { exit }
    inside { print }' "$root/README.md"
}

wait_for_file() {
  local i
  for ((i = 0; i < 300; i++)); do
    [[ -s "$1" ]] && return 0
    sleep 0.1  # polling a file the server writes once serving; bounded
  done
  fail "$1 never appeared: $(cat "$T"/*.log)"
}

free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# --- Metrics and health ----------------------------------------------------
health_port=$(free_port)
"$root/ps_server/ps_server" --host=127.0.0.1 --port=0 --port_file="$T/port" \
  --health_port="$health_port" --metrics_port=-1 --metrics_host=127.0.0.1 \
  --metrics_port_file="$T/metrics_port" 2>"$T/ps.log" &
pids+=($!)
wait_for_file "$T/port"
wait_for_file "$T/metrics_port"
port=$(cat "$T/port")
metrics_port=$(cat "$T/metrics_port")

commands=$(block metrics-and-health)
[[ -n "$commands" ]] || fail "no metrics-and-health block in README.md"
expected=("SERVING" "SERVING" "pstrain.ParameterServer" "pstrain_shard_version{shard=\"0\"} 0")
i=0
cd "$root"
while IFS= read -r line; do
  [[ -n "$line" ]] || continue
  command=${line//localhost:5000/localhost:$port}
  command=${command//localhost:5001/localhost:$health_port}
  command=${command//localhost:9100/localhost:$metrics_port}
  output=$(bash -c "$command" 2>&1) || fail "README line failed: $line
(ran: $command)
$output"
  grep -qF -- "${expected[i]}" <<<"$output" ||
    fail "README line: $line
expected '${expected[i]}' in:
$output"
  echo "ok: $line"
  i=$((i + 1))
done <<<"$commands"
((i == ${#expected[@]})) || fail "ran $i README lines, expected ${#expected[@]}"

# The health check tells NOT_SERVING and unreachable apart, by exit code.
set +e
deploy/grpc/grpc_check.py "localhost:$(free_port)" >/dev/null 2>&1
[[ $? == 2 ]] || fail "grpc_check.py against nothing must exit 2"
deploy/grpc/grpc_check.py --list "localhost:$health_port" 2>"$T/list.err"
[[ $? == 2 ]] && grep -q "no server reflection" "$T/list.err" ||
  fail "--list on the health port: $(cat "$T/list.err")"
set -e
# --- Whole blocks, run as scripts in a stand-in checkout ----------------------
# deploy/ as in the repository, the binaries where a build leaves them
# (bazel-bin/), so the README's relative paths work as written; /tmp in a
# block becomes this test's own directory.
repo=$T/repo
mkdir -p "$repo/deploy/local" "$repo/deploy/tls" "$repo/bazel-bin/ps_server" "$repo/bazel-bin/worker" "$T/tmp"
ln -s "$root/deploy/local/launch.sh" "$repo/deploy/local/launch.sh"
ln -s "$root/deploy/local/free_ports.py" "$repo/deploy/local/free_ports.py"
ln -s "$root/deploy/tls/make_certs.sh" "$repo/deploy/tls/make_certs.sh"
ln -s "$root/ps_server/ps_server" "$repo/bazel-bin/ps_server/ps_server"
ln -s "$root/worker/worker" "$repo/bazel-bin/worker/worker"

# What a block's launcher left: its stderr, and the end of every log in
# the run directory it named.
block_logs() {  # name
  local run log
  tail -n 30 "$T/$1.err"
  run=$(grep -o 'run dir [^;]*' "$T/$1.err" | head -n 1 | cut -d' ' -f3)
  [[ -n "$run" && -d "$run" ]] || return 0
  for log in "$run"/*.log; do
    [[ -f "$log" ]] || continue
    printf -- '--- %s (last 15 lines)\n' "$log"
    tail -n 15 "$log"
  done
}

# Each block's jobs take seconds; 120 s (then SIGKILL for what is left)
# keeps the test's own report, with the logs, inside bazel's 300 s.
run_block() {  # name expected-final-lines grep-pattern-of-each
  local name=$1 finals=$2 pattern=$3 script output count
  script=$(block "$name")
  [[ -n "$script" ]] || fail "no $name block in README.md"
  script=${script//\/tmp\//$T/tmp/}
  output=$(cd "$repo" && TMPDIR=$T/tmp timeout -k 10 120 bash -euo pipefail -c "$script" 2>"$T/$name.err") ||
    fail "README block $name failed:
$script
$(block_logs "$name")"
  count=$(grep -c "$pattern" <<<"$output" || true)
  ((count == finals)) || fail "README block $name: $count final lines matching '$pattern', want $finals:
$output
$(block_logs "$name")"
  echo "ok: README block $name ($count workers finished)"
}
run_block local-launcher 4 '^{"event":"final","mode":"async",.*"steps":500,'
run_block tls 2 '^{"event":"final","mode":"sync",.*"steps":500,'
# Async CTR: every worker evaluates the one final model.
run_block ctr-synthetic 2 '^{"event":"final","model":"ctr","mode":"async",.*"final_model":"all_done"'
# Sync dense layers with async tables: the job ends on the sync step.
run_block ctr-async-tables 2 '^{"event":"final","model":"ctr","mode":"sync",.*"final_model":"sync_step"'

# Defaults the README states are the binaries' own (--help says them).
readme_default() {  # binary flag
  local help rest default
  help=$("$root/$1" --help | tr '\n' ' ')
  [[ "$help" == *"--$2 ("* ]] || fail "$1 --help has no --$2"
  rest=${help#*"--$2 ("}
  default=$(grep -oE 'default: [^;]*' <<<"$rest" | head -n 1 | cut -d' ' -f2)
  grep -qE -- "\`--$2\`(, | \()default $default[ )]" "$root/README.md" ||
    fail "README.md does not say --$2 defaults to $default ($1 --help): $(grep -o -- "--$2\`[^.]*" "$root/README.md")"
  echo "ok: README: --$2 default $default"
}
readme_default worker/worker block_elements
readme_default worker/worker connections_per_shard

echo PASS
