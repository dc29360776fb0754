#!/usr/bin/env bash
# Smoke test of aead_floor, not a performance check: a tiny run exits 0 and
# prints one row per size and connection count; a bad flag exits 2.
set -uo pipefail

bench="$1"
out=$(timeout --kill-after=5 60 "$bench" --sizes=65536 --connections=1,2 \
  --seconds=0.05 --repeats=1 2>&1)
rc=$?
((rc == 0)) || { echo "FAIL: exit $rc: $out"; exit 1; }
rows=$(grep -cE '^ +65536 +[12] \|' <<<"$out")
((rows == 2)) || { echo "FAIL: expected 2 rows in: $out"; exit 1; }
# A bad flag is one line and exit 2 (--connections=0 once divided by zero).
out=$("$bench" --connections=0 2>&1)
rc=$?
((rc == 2)) && grep -q -- '--connections must be positive' <<<"$out" ||
  { echo "FAIL: --connections=0: exit $rc: $out"; exit 1; }
echo PASS
