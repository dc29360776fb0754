#!/bin/bash
# Pins the flags of ps_server, worker and pstrain_export, and their defaults,
# against tests/golden/<binary>_flags.txt: a refactoring that drops a flag or
# moves a default fails here (issue 39). Help text is not pinned, so editing a
# flag's help does not break the test. A change made on purpose:
#   tests/flag_defaults_test.sh --update   (from the repository root, after
#   bazel build //ps_server //worker:worker //worker:pstrain_export)
set -euo pipefail

update=0
[[ "${1:-}" == "--update" ]] && update=1
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  root="$TEST_SRCDIR/${TEST_WORKSPACE:-__main__}"
else
  root="$(cd "$(dirname "$0")/.." && pwd)"
fi
bin_of() {  # the binary in runfiles, or bazel-bin when run by hand
  if [[ -x "$root/$1" ]]; then echo "$root/$1"; else echo "$root/bazel-bin/$1"; fi
}

# One line per flag defined in this repository (not Abseil's own):
# "--name=default", sorted.
flags_of() {
  "$1" --helpfull 2>&1 | python3 -c '
import re, sys
text = sys.stdin.read()
out = []
for section in re.split(r"\n  Flags from ", text)[1:]:
    source, _, body = section.partition(":\n")
    if not re.match(r"(ps_server|worker|common|kernels)/", source):
        continue
    for name, default in re.findall(
            r"^    --(\w+) \(.*?\);\s+default: (.*?);$", body, re.S | re.M):
        out.append("--%s=%s" % (name, default))
print("\n".join(sorted(out)))
'
}

status=0
for target in ps_server/ps_server worker/worker worker/pstrain_export; do
  name="$(basename "$target")"
  golden="$root/tests/golden/${name}_flags.txt"
  actual="$(flags_of "$(bin_of "$target")")"
  if [[ -z "$actual" ]]; then
    echo "FAIL: $name --helpfull listed no flags of this repository" >&2
    status=1
    continue
  fi
  if (( update )); then
    printf '%s\n' "$actual" > "$golden"
    echo "wrote $golden ($(wc -l < "$golden") flags)"
    continue
  fi
  if ! diff -u "$golden" <(printf '%s\n' "$actual") >&2; then
    echo "FAIL: $name's flags or defaults differ from $golden (above)." \
         "If on purpose: tests/flag_defaults_test.sh --update" >&2
    status=1
  else
    echo "ok: $name, $(wc -l < "$golden") flags and defaults as pinned"
  fi
done
exit "$status"
