#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run every test
# (unit and multi-process), and close with "tests: N passed, M failed,
# K skipped" counted over individual test cases (GPU tests skip where no
# GPU is visible).
set -uo pipefail
cd "$(dirname "$0")/.."

deploy/setup.sh || exit 1
bazel test //... "$@"
status=$?

passed=0
failed=0
skipped=0
while IFS= read -r -d '' xml; do
  header=$(grep -o '<testsuites[^>]*>' "$xml" | head -n 1)
  [[ -n "$header" ]] || continue
  attribute() { sed -n "s/.* $1=\"\([0-9]*\)\".*/\1/p" <<<"$header"; }
  tests=$(attribute tests)
  failures=$(attribute failures)
  errors=$(attribute errors)
  disabled=$(attribute disabled)
  skips=$(grep -c 'result="skipped"' "$xml")
  bad=$((${failures:-0} + ${errors:-0}))
  failed=$((failed + bad))
  skipped=$((skipped + skips))
  passed=$((passed + ${tests:-0} - bad - ${disabled:-0} - skips))
  # run_N_of_M: repeated runs (--runs_per_test) of an earlier invocation,
  # which bazel leaves behind and this one did not produce.
done < <(find -L bazel-testlogs/ -type d -name 'run_*_of_*' -prune -o \
  -name test.xml -print0 2>/dev/null)

if ((status != 0 && failed == 0)); then
  failed=1  # a build failure or a test that died before writing its report
fi
echo "tests: $passed passed, $failed failed, $skipped skipped"
exit "$status"
