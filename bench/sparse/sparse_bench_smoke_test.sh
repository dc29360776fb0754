#!/usr/bin/env bash
# Smoke test of sparse_bench, not a performance check: with tiny settings
# every ps_server starts, every dim yields its JSON line with every number,
# the servers hold a row per distinct id sent, the bench exits 0, and no
# process it started outlives it.
set -uo pipefail

bench="$1"
dir="${TEST_TMPDIR:-$(mktemp -d)}"
out="$dir/sparse_bench.out"
log="$dir/sparse_bench.log"
json="$dir/sparse_bench.json"

fail() {
  echo "FAIL: $*"
  echo "--- stdout"; cat "$out"
  echo "--- stderr (tail)"; tail -n 40 "$log"
  exit 1
}

# SIGTERM at the limit: the bench's guardian then kills its children.
timeout --kill-after=5 12 "$bench" --servers=2 --dims=4,8 --vocab=100000 \
  --batch=256 --repeats=4 --warmup=1 --deadline_s=10 --json_out="$json" \
  >"$out" 2>"$log"
rc=$?
((rc == 0)) || fail "sparse_bench exited with $rc"

keys=(unique_rows_mean sparse_pull_rows_per_s sparse_pull_gbps dense_pull_gbps
      ratio_pull sparse_push_rows_per_s sparse_push_gbps dense_push_gbps
      ratio_push rows_on_servers distinct_ids_sent)
for dim in 4 8; do
  for file in "$out" "$json"; do
    line=$(grep "^{\"bench\":\"sparse_bench\",\"dim\":$dim," "$file") ||
      fail "no JSON line for dim $dim in $file"
    for key in "${keys[@]}"; do
      [[ "$line" =~ \"$key\":[0-9] ]] || fail "dim $dim: no number for $key"
    done
    rows=$(sed -n 's/.*"rows_on_servers":\([0-9]*\).*/\1/p' <<<"$line")
    sent=$(sed -n 's/.*"distinct_ids_sent":\([0-9]*\).*/\1/p' <<<"$line")
    ((rows == sent && rows > 0)) ||
      fail "dim $dim: $rows rows on the servers, $sent distinct ids sent"
  done
done
grep -q "^# machine: nproc" "$out" || fail "no machine description"

# Every pid the bench started (it logs "started pid N") must be gone.
for pid in $(sed -n 's/.*started pid \([0-9]*\) .*/\1/p' "$log"); do
  if kill -0 "$pid" 2>/dev/null &&
     [[ "$(sed -n 's/^State:\s*\(.\).*/\1/p' "/proc/$pid/status" 2>/dev/null)" != Z ]]; then
    fail "process $pid outlived sparse_bench"
  fi
done
n=$(grep -c "started pid" "$log")
((n == 4)) || fail "expected 4 ps_server processes (2 per dim), saw $n"
echo "PASS"
