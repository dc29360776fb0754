#!/usr/bin/env bash
# Builds the push/pull libFuzzer target (push_pull_fuzz.cc) with clang-14,
# AddressSanitizer and UndefinedBehaviorSanitizer, outside Bazel, and runs it
# for a bounded time from the seed corpus.
#
#   ps_server/fuzz/run_fuzz.sh [SECONDS] [LIBFUZZER_FLAG...]
#   ps_server/fuzz/run_fuzz.sh replay FILE...   # run inputs once, sanitized
#
# SECONDS defaults to 60. Environment:
#   FUZZ_CORPUS  writable corpus directory, kept between runs (default: a
#                fresh copy of the seed corpus in the temporary build dir)
#   FUZZ_OUT     where crash/leak/timeout inputs are written (default
#                /tmp/push_pull_fuzz_artifacts)
#   FUZZ_JOBS    parallel compiles (default: nproc)
#   FUZZ_KEEP=1  keep the temporary build directory (binary and log)
# Prints the executions, corpus size and coverage; exits 1 when the fuzzer
# found something (the input is under FUZZ_OUT; replay it with
# bazel-bin/ps_server/fuzz/push_pull_fuzz_smoke_test FILE).
set -euo pipefail

seconds="${1:-60}"
shift || true
replay=()
if [[ "${seconds}" == replay ]]; then
  [[ $# -gt 0 ]] || {
    echo "usage: $0 replay FILE..." >&2
    exit 2
  }
  for f in "$@"; do replay+=("$(realpath "${f}")"); done
  set --
  seconds=1
fi
if ! [[ "${seconds}" =~ ^[0-9]+$ ]] || [[ "${seconds}" -lt 1 ]]; then
  echo "usage: $0 [SECONDS] [LIBFUZZER_FLAG...]" >&2
  exit 2
fi
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "${repo}"

cxx="${CXX_FUZZ:-clang++-14}"
command -v "${cxx}" >/dev/null || {
  echo "run_fuzz.sh: ${cxx} not found (apt-get install clang-14)" >&2
  exit 2
}

work="$(mktemp -d "${TMPDIR:-/tmp}/push_pull_fuzz.XXXXXX")"
fuzzer_pid=""
cleanup() {
  if [[ -n "${fuzzer_pid}" ]] && kill -0 "${fuzzer_pid}" 2>/dev/null; then
    kill "${fuzzer_pid}" 2>/dev/null || true
    wait "${fuzzer_pid}" 2>/dev/null || true
  fi
  if [[ "${FUZZ_KEEP:-0}" == 1 ]]; then
    echo "run_fuzz.sh: kept ${work}"
  else
    rm -rf "${work}"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

artifacts="${FUZZ_OUT:-/tmp/push_pull_fuzz_artifacts}"
mkdir -p "${artifacts}"
corpus="${FUZZ_CORPUS:-${work}/corpus}"
mkdir -p "${corpus}"

# The code under test: the working tree, or with FUZZ_REV a committed
# revision (git archive) plus this directory from the working tree. Either
# way it is copied first, so edits made while this compiles cannot mix two
# versions of a header.
src="${work}/src"
mkdir -p "${src}"
if [[ -n "${FUZZ_REV:-}" ]]; then
  git -C "${repo}" archive "${FUZZ_REV}" common ps_server proto third_party |
    tar -x -C "${src}"
  echo "run_fuzz.sh: code under test: ${FUZZ_REV}" \
    "($(git -C "${repo}" rev-parse --short "${FUZZ_REV}"))"
else
  cp -r common ps_server proto third_party "${src}/"
  echo "run_fuzz.sh: code under test: working tree at" \
    "$(git -C "${repo}" rev-parse --short HEAD 2>/dev/null || echo '?')"
fi
mkdir -p "${src}/ps_server/fuzz"
cp ps_server/fuzz/push_pull_fuzz.cc ps_server/fuzz/push_pull_fuzz.h \
  ps_server/fuzz/thread_annotations_off.h "${src}/ps_server/fuzz/"
cd "${src}"

# The protocol, generated exactly as //proto's genrules do (system protoc).
gen="${work}/gen"
mkdir -p "${gen}"
protoc --proto_path=. --cpp_out="${gen}" proto/*.proto

# Every library source the shard may need goes into an archive; the linker
# takes only what is used. Tests, binaries and gRPC code stay out.
library=()
for f in common/*.cc ps_server/*.cc "${gen}"/proto/*.pb.cc; do
  case "${f}" in
    *_test.cc | */main.cc) continue ;;
  esac
  header="${f%.cc}.h"
  [[ -f "${header}" ]] || header=/dev/null
  grep -q 'grpc\|"common/cli.h"' "${f}" "${header}" && continue
  library+=("${f}")
done
flags=("-fsanitize=fuzzer,address,undefined" -fno-sanitize-recover=undefined
  -std=c++17 -O1 -g -I. -I"${gen}")
if ! echo '#include "ps_server/shard.h"' |
  "${cxx}" -std=c++17 -I. -I"${gen}" -fsyntax-only -x c++ - 2>/dev/null; then
  echo "run_fuzz.sh: ps_server/shard.h does not parse with ${cxx};" \
    "compiling with ps_server/fuzz/thread_annotations_off.h"
  flags+=(-include ps_server/fuzz/thread_annotations_off.h)
fi
mapfile -t absl_libs < <(grep -o '"-labsl_[a-z0-9_]*"' third_party/BUILD.bazel |
  tr -d '"')
read -r -a protobuf_flags <<<"$(pkg-config --cflags --libs protobuf)"

echo "run_fuzz.sh: compiling ${#library[@]} library sources and the target" \
  "with ${cxx} in ${work}"
mkdir -p "${work}/obj"
export cxx work
# The inner script is expanded by the sh that xargs starts, on purpose.
# shellcheck disable=SC2016
printf '%s\n' ps_server/fuzz/push_pull_fuzz.cc "${library[@]}" |
  xargs -P "${FUZZ_JOBS:-$(nproc)}" -I{} sh -c \
    'f="$1"; shift; "${cxx}" "$@" -c "${f}" \
       -o "${work}/obj/$(basename "${f}" .cc).o"' sh {} "${flags[@]}"
mv "${work}/obj/push_pull_fuzz.o" "${work}/"
ar rcs "${work}/libunder_test.a" "${work}"/obj/*.o
"${cxx}" "${flags[@]}" "${work}/push_pull_fuzz.o" "${work}/libunder_test.a" \
  "${protobuf_flags[@]}" "${absl_libs[@]}" -lglog -lz -lpthread \
  -o "${work}/push_pull_fuzz"
cd "${repo}"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
if [[ ${#replay[@]} -gt 0 ]]; then
  PUSH_PULL_FUZZ_VERBOSE=1 timeout 300 "${work}/push_pull_fuzz" "${replay[@]}"
  exit
fi

echo "run_fuzz.sh: fuzzing for ${seconds} s (corpus ${corpus}," \
  "artifacts ${artifacts})"
log="${work}/fuzz.log"
status=0
"${work}/push_pull_fuzz" -max_total_time="${seconds}" -timeout=20 \
  -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
  -dict=ps_server/fuzz/push_pull.dict -artifact_prefix="${artifacts}/" \
  "$@" "${corpus}" ps_server/fuzz/corpus >"${log}" 2>&1 &
fuzzer_pid=$!
# libFuzzer stops itself at -max_total_time; this bound only catches a
# fuzzer that does not (a hang in an uninterruptible state).
deadline=$((SECONDS + seconds + 120))
while kill -0 "${fuzzer_pid}" 2>/dev/null; do
  if [[ ${SECONDS} -gt ${deadline} ]]; then
    echo "run_fuzz.sh: the fuzzer ran past its time; killing it" >&2
    kill -9 "${fuzzer_pid}" 2>/dev/null || true
    break
  fi
  sleep 1
done
wait "${fuzzer_pid}" || status=$?
fuzzer_pid=""

saved="${artifacts}/fuzz-$(date -u +%Y%m%d-%H%M%S).log"
cp "${log}" "${saved}"
grep -E '^INFO: (Seed|Loaded| *[0-9]+ files found)|^#[0-9]+[[:space:]]+(INITED|DONE)|^Done [0-9]+ runs|SUMMARY|invariant violated' \
  "${log}" || true
last="$(grep -E '^#[0-9]+' "${log}" | tail -n 1 || true)"
execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "${log}")"
echo "---- summary"
echo "seconds:     ${seconds}"
echo "executions:  ${execs:-unknown}"
echo "exec/s:      $(sed -n 's/^stat::average_exec_per_sec: *//p' "${log}")"
echo "last status: ${last}"
echo "corpus:      $(find "${corpus}" -type f | wc -l) files in ${corpus}"
echo "peak RSS:    $(sed -n 's/^stat::peak_rss_mb: *//p' "${log}") MB"
echo "full log:    ${saved}"
if [[ ${status} -ne 0 ]]; then
  echo "FINDING: the fuzzer exited ${status}; inputs in ${artifacts}:"
  grep -E 'Test unit written' "${log}" || true
  exit 1
fi
echo "findings:    none (no crash, leak, timeout or sanitizer error)"
