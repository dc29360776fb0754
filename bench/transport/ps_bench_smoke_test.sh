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

# --tls_dir: the TLS data plane and gRPC+TLS are measured beside the
# plaintext PS, and the TLS table and JSON keys are there.
if [[ -n "${2:-}" ]]; then
  bash "$2" "$dir/tls" localhost 127.0.0.1 >/dev/null 2>&1 || fail "make_certs.sh failed"
  timeout --kill-after=5 45 "$bench" --sizes=4096 --iterations=5 --warmup=1 \
    --tls_dir="$dir/tls" >"$out" 2>"$log"
  rc=$?
  ((rc == 0)) || fail "ps_bench --tls_dir exited with $rc"
  grep -q "^# TLS (mutual, TLS 1.3)" "$out" || fail "no TLS table"
  line=$(grep '^{"bench":"ps_bench","size":4096,' "$out") || fail "no JSON line with --tls_dir"
  for key in tls_one_call_gbps tls_grpc_one_call_gbps tls_push_p50_us \
             ratio_tls_vs_plain_one_call ratio_tls_vs_tls_grpc_one_call \
             ratio_tls_vs_plain_push_p50; do
    [[ "$line" =~ \"$key\":[0-9] ]] || fail "--tls_dir: no number for $key"
  done
  n=$(grep -c "started pid" "$log")
  ((n == 5)) || fail "--tls_dir: expected 5 child processes (2 peers, 3 servers), saw $n"
  for pid in $(sed -n 's/.*started pid \([0-9]*\) .*/\1/p' "$log"); do
    if kill -0 "$pid" 2>/dev/null &&
       [[ "$(sed -n 's/^State:\s*\(.\).*/\1/p' /proc/$pid/status 2>/dev/null)" != Z ]]; then
      fail "--tls_dir: process $pid outlived ps_bench"
    fi
  done
fi
echo "PASS"
