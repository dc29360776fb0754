# Shared by the bench scripts (source it): what every results file records.
# BENCH_COMMIT: the commit measured, marked when the tree has local changes
# (results files aside: a rerun rewrites them).
# BENCH_MACHINE: cores, CPU model and memory of this machine.
# json_field KEY LINE: the value of "KEY" in a one-line JSON object.
# bench_trial_processes NAME: for scripts that start and kill processes:
# makes $run_dir (/tmp/NAME.XXXXXX) and pids=(); kill_all kills -9 and reaps
# every pid in pids; on exit (and Ctrl-C) all are killed and $run_dir is
# removed unless keep=1.
# free_ports N: N distinct free loopback ports, one per line, below the
# kernel's ephemeral range (32768-60999 by default), so that no port a
# process binds to port 0 (a data port) and no outgoing connection takes one
# between the pick and the server's bind.
# Outside a git checkout (bazel runfiles) the commit is "unknown".
if BENCH_COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD -- . ':!bench/results' || BENCH_COMMIT+="+local changes"
else
  BENCH_COMMIT=unknown
fi
BENCH_MACHINE="$(nproc) vCPU $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1), $(free -g | awk '/Mem:/ {print $2}') GiB"
json_field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" <<<"$2" | head -n 1; }

bench_trial_processes() {
  run_dir=$(mktemp -d "/tmp/$1.XXXXXX")
  pids=()
  trap bench_trial_cleanup EXIT
  trap 'exit 130' INT TERM
}
kill_all() {
  local pid
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
bench_trial_cleanup() {
  kill_all
  if ((${keep:-0})); then echo "run directory kept: $run_dir" >&2; else rm -rf "$run_dir"; fi
}
free_ports() { /usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/../deploy/local/free_ports.py" "$1"; }
