#!/usr/bin/env bash
# The wheel as users install it: `pip install` into a fresh venv of every
# CPython 3 on this machine (Debian's python3 with its torch, and the pyenv
# 3.9 to 3.13 these machines carry, which have neither numpy nor torch),
# nothing downloaded; then tests/python/install_smoke.py against a real
# ps_server from each (and a pstrain.torch step where torch is). Also: pip
# refuses the wheel for a platform older than its glibc floor.
set -euo pipefail

runfiles=${TEST_SRCDIR:?run under bazel test}/pstrain
tmp=${TEST_TMPDIR:?}
wheel=$(ls "$runfiles"/worker/python/pstrain-*.whl)
smoke=$runfiles/tests/python/install_smoke.py
ps_server=$runfiles/ps_server/ps_server
fail() { echo "FAIL: $*" >&2; exit 1; }

server_pid=""
trap '[[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null; true' EXIT
# One sync shard, one worker, SGD at 0.25 (install_smoke.py's arithmetic).
start_server() {
  rm -f "$tmp/port"
  "$ps_server" --host=127.0.0.1 --port=0 --port_file="$tmp/port" --num_workers=1 \
    --mode=sync --optimizer=sgd --learning_rate=0.25 --shutdown_grace_s=1 \
    >>"$tmp/ps.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 300); do [[ -s "$tmp/port" ]] && break; sleep 0.1; done
  [[ -s "$tmp/port" ]] || fail "ps_server wrote no port: $(tail -5 "$tmp/ps.log")"
  HOSTS=127.0.0.1:$(cat "$tmp/port")
}
stop_server() { kill "$server_pid"; wait "$server_pid" || true; server_pid=""; }

pythons=(/usr/bin/python3)
for version in 3.9 3.10 3.11 3.12 3.13; do
  for candidate in /root/.pyenv/versions/"$version".*/bin/python3; do
    [[ -x "$candidate" ]] && pythons+=("$candidate") && break
  done
done
passed=0
for python in "${pythons[@]}"; do
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv=$tmp/venv-$passed
  site=()
  [[ "$python" == /usr/bin/python3 ]] && site=(--system-site-packages)
  "$python" -m venv ${site[@]+"${site[@]}"} "$venv" || fail "$python -m venv failed"
  "$venv/bin/python" -m pip install --quiet --no-index --no-deps --ignore-installed \
    --disable-pip-version-check "$wheel" || fail "pip install into CPython $version failed"
  start_server
  (cd / && "$venv/bin/python" "$smoke" --hosts="$HOSTS") || fail "CPython $version: the smoke test failed"
  stop_server
  if [[ "$python" == /usr/bin/python3 ]]; then
    start_server
    (cd / && "$venv/bin/python" "$smoke" --hosts="$HOSTS" --torch) ||
      fail "CPython $version: a pstrain.torch step failed"
    stop_server
  fi
  passed=$((passed + 1))
done
echo "the wheel installed and ran in $passed interpreter(s): ${pythons[*]}"

# A library this host cannot load (here: a copy whose core is not a shared
# library at all; on a host older than the glibc floor, the loader's own
# words): an ImportError saying what was built for what, and the fix.
broken=$tmp/broken
mkdir -p "$broken"
cp -r "$tmp/venv-0"/lib/python3*/site-packages/pstrain "$broken/"
echo "not a shared library" >"$broken/pstrain/_lib/libpstrain.so"
if (cd / && PYTHONPATH=$broken /usr/bin/python3 -c 'import pstrain' 2>"$tmp/import.err"); then
  fail "a package whose core cannot load imported"
fi
grep -q "pstrain cannot load its C++ core" "$tmp/import.err" &&
  grep -q "glibc" "$tmp/import.err" && grep -q "build_wheel.sh" "$tmp/import.err" ||
  fail "the import error does not say what and how to fix it: $(cat "$tmp/import.err")"

# A platform older than the wheel's glibc floor: pip says no, naming it.
if /usr/bin/python3 -m pip install --quiet --no-index --no-deps --target="$tmp/old" \
    --platform=manylinux_2_17_x86_64 --only-binary=:all: "$wheel" 2>"$tmp/pip.err"; then
  fail "pip installed the wheel for glibc 2.17"
fi
grep -q "is not a supported wheel on this platform" "$tmp/pip.err" ||
  fail "pip's refusal did not say why: $(cat "$tmp/pip.err")"
echo "1 passed, 0 failed"
