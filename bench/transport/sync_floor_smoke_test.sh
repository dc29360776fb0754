#!/usr/bin/env bash
# Smoke test of sync_floor, not a performance check: a small run of 2
# servers and 2 workers exits 0 with its JSON line, a bad flag exits 2 with
# one line naming it, and no process it forked outlives it.
set -uo pipefail

bench="$1"
dir="${TEST_TMPDIR:-$(mktemp -d)}"

out=$(timeout --kill-after=5 60 "$bench" --elements=10000 --steps=50 \
  --warmup=5 --timeout_s=20 2>"$dir/err")
rc=$?
((rc == 0)) || { echo "FAIL: exit $rc"; cat "$dir/err"; exit 1; }
[[ "$out" =~ \{\"bench\":\"sync_floor\",\"servers\":2,\"workers\":2,\"elements\":10000,\"steps\":50,\"step_ms\":[0-9] ]] ||
  { echo "FAIL: no JSON line in: $out"; exit 1; }

timeout 20 "$bench" --workers=0 >/dev/null 2>"$dir/bad"
rc=$?
((rc == 2)) || { echo "FAIL: --workers=0 exited $rc, expected 2"; exit 1; }
grep -q -- "--workers must be >= 1, got 0" "$dir/bad" ||
  { echo "FAIL: no line naming --workers:"; cat "$dir/bad"; exit 1; }

# The bench and its re-executed server and worker children alike.
if pgrep -f -- "sync_floor .*--elements=10000" >/dev/null; then
  echo "FAIL: a sync_floor process outlived the run"; exit 1
fi
echo PASS
