# Shared by the bench scripts (source it): what every results file records.
# BENCH_COMMIT: the commit measured, marked when the tree has local changes
# (results files aside: a rerun rewrites them).
# BENCH_MACHINE: cores, CPU model and memory of this machine.
# json_field KEY LINE: the value of "KEY" in a one-line JSON object.
# Outside a git checkout (bazel runfiles) the commit is "unknown".
if BENCH_COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD -- . ':!bench/results' || BENCH_COMMIT+="+local changes"
else
  BENCH_COMMIT=unknown
fi
BENCH_MACHINE="$(nproc) vCPU $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1), $(free -g | awk '/Mem:/ {print $2}') GiB"
json_field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" <<<"$2" | head -n 1; }
