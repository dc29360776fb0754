#!/usr/bin/env bash
# deploy/local/launch.sh on a terminal shows worker 0's progress bar, redrawn
# in place and fitted to the terminal: run under script(1) on a 50-column
# pseudo-terminal, every redraw must fit in 50 columns (a wider one wraps,
# and each redraw then starts a new line).
set -euo pipefail

fail() { echo "FAIL: $*" >&2; exit 1; }

runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n "$runfiles" ]] || fail "run me with bazel test //tests:launch_progress_test"
root=$runfiles/pstrain
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/launch_progress.XXXXXX")
mkdir -p "$T/bin"
ln -s "$root/ps_server/ps_server" "$T/bin/ps_server"
ln -s "$root/worker/worker" "$T/bin/worker"

# script(1) gives the launcher a terminal; stty sets its size first.
timeout 180 script -qec "stty cols 50 rows 24; $root/deploy/local/launch.sh \
  --bin_dir=$T/bin --run_dir=$T/run --servers=1 --workers=1 --timeout_s=120 \
  -- --model=probe --steps=30 --inject_step_delay_ms=40" "$T/typescript" \
  >/dev/null 2>&1 || fail "launch.sh failed: $(tail -n 20 "$T/typescript")"

# Redraws: pieces between carriage returns and newlines, less the
# erase-to-end-of-line sequence.
esc=$'\033'
pieces=$(tr '\r' '\n' <"$T/typescript" | sed "s/${esc}\[K//g")
redraws=$(grep -c '^\[worker 0\] .*[0-9]*/30 ' <<<"$pieces" || true)
((redraws >= 2)) || fail "no progress bar redraws from worker 0 in:
$(cat -A "$T/typescript" | head -n 40)"
grep -q '^\[worker 0\] .*30/30 100%' <<<"$pieces" || fail "no final 30/30 redraw"
# The bar is drawn in place: worker 0's progress never comes as lines.
! grep -q '^\[worker 0\] worker 0 step' <<<"$pieces" || fail "progress came as lines"
while IFS= read -r piece; do
  [[ "$piece" == "[worker 0]"* ]] || continue
  ((${#piece} < 50)) || fail "a redraw wider than the 50-column terminal: '$piece'"
done <<<"$pieces"
grep -q '^{"event":"final"' <<<"$pieces" || fail "no final JSON line"
echo "PASS: $redraws in-place redraws, all under 50 columns"
