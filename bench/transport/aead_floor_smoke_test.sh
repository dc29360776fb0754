#!/usr/bin/env bash
# Smoke test of aead_floor, not a performance check: a tiny run exits 0 and
# prints one row per size and connection count.
set -uo pipefail

bench="$1"
out=$(timeout --kill-after=5 60 "$bench" --sizes=65536 --connections=1,2 \
  --seconds=0.05 --repeats=1 2>&1)
rc=$?
((rc == 0)) || { echo "FAIL: exit $rc: $out"; exit 1; }
rows=$(grep -cE '^ +65536 +[12] \|' <<<"$out")
((rows == 2)) || { echo "FAIL: expected 2 rows in: $out"; exit 1; }
echo PASS
