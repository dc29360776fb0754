#!/usr/bin/env bash
# Smoke test of tls_echo_floor, not a performance check: with certificates
# from deploy/tls/make_certs.sh a tiny run exits 0 and prints a row per
# repeat and the median ratio; without --tls_dir it exits 2 saying why.
set -uo pipefail

bench="$1"
make_certs="$2"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$make_certs" "$dir/tls" >/dev/null 2>&1 || { echo "FAIL: make_certs.sh"; exit 1; }
out=$(timeout --kill-after=5 60 "$bench" --tls_dir="$dir/tls" --trips=50 \
  --repeats=2 2>&1)
rc=$?
((rc == 0)) || { echo "FAIL: exit $rc: $out"; exit 1; }
rows=$(grep -cE '^ +[01] \| +[0-9.]+ +[0-9.]+ \| +[0-9.]+ +[0-9.]+ \|' <<<"$out")
((rows == 2)) || { echo "FAIL: expected 2 rows in: $out"; exit 1; }
grep -q '^# median TLS/plain p50: [0-9.]*$' <<<"$out" || { echo "FAIL: no median in: $out"; exit 1; }
out=$("$bench" 2>&1)
rc=$?
((rc == 2)) && grep -q -- '--tls_dir is required' <<<"$out" || { echo "FAIL: no --tls_dir: exit $rc: $out"; exit 1; }
echo PASS
