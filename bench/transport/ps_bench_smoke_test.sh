#!/usr/bin/env bash
# Smoke test of ps_bench, not a performance check: on two small sizes every
# baseline peer and ps_server starts, every measurement yields its JSON line,
# the bench exits 0, and no process it started outlives it.
set -uo pipefail

bench="$1"
dir="${TEST_TMPDIR:-$(mktemp -d)}"
out="$dir/ps_bench.out"
log="$dir/ps_bench.log"
json="$dir/ps_bench.json"

fail() {
  echo "FAIL: $*"
  echo "--- stdout"; cat "$out"
  echo "--- stderr (tail)"; tail -n 40 "$log"
  exit 1
}

# SIGTERM at the limit: the bench's guardian then kills its children.
timeout --kill-after=5 45 "$bench" --sizes=4096,65536 --iterations=5 \
  --warmup=1 --json_out="$json" >"$out" 2>"$log"
rc=$?
((rc == 0)) || fail "ps_bench exited with $rc"

keys=(tcp_gbps tcp_rtt_p50_us grpc_floor_gbps ps_push_gbps ps_pull_gbps
      ps_pushpull_gbps ps_push_p50_us ps_push_p99_us ratio_pushpull_vs_tcp
      ratio_push_p50_vs_tcp_rtt ps_one_call_gbps ratio_one_call_vs_tcp)
for size in 4096 65536; do
  for file in "$out" "$json"; do
    line=$(grep "^{\"bench\":\"ps_bench\",\"size\":$size," "$file") ||
      fail "no JSON line for size $size in $file"
    for key in "${keys[@]}"; do
      [[ "$line" =~ \"$key\":[0-9] ]] || fail "size $size: no number for $key"
    done
  done
done
grep -q "^# machine: nproc" "$out" || fail "no machine description"

# Every pid the bench started (it logs "started pid N") must be gone.
for pid in $(sed -n 's/.*started pid \([0-9]*\) .*/\1/p' "$log"); do
  if kill -0 "$pid" 2>/dev/null &&
     [[ "$(cat /proc/$pid/status 2>/dev/null | sed -n 's/^State:\s*\(.\).*/\1/p')" != Z ]]; then
    fail "process $pid outlived ps_bench"
  fi
done
n=$(grep -c "started pid" "$log")
((n == 4)) || fail "expected 4 child processes (2 peers, 1 server per size), saw $n"
echo "PASS"
