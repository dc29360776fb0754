#!/usr/bin/env bash
# Soak run: 2 ps_servers and many concurrent workers pushing and pulling for
# a bounded time; then checks that no worker failed, nothing was lost or
# applied twice (exact invariant of the probe model), and the servers'
# memory stayed flat. See bench/soak/README.md.
#
#   bazel build //ps_server //worker //bench/soak:observer   # first
#   bench/soak/soak.sh [SECONDS] [CLIENTS]                   # 120 s, 8
#
# Environment (optional):
#   SOAK_MODE            async (default) or sync
#   SOAK_ELEMENTS        probe tensor size (default 65536 floats)
#   SOAK_BLOCK_ELEMENTS  block size (default 8192: 8 blocks, 4 per shard)
#   SOAK_SAMPLE_S        seconds between samples (default 5)
#   SOAK_WARMUP_S        RSS baseline: the first sample at or after this
#                        (default min(30, SECONDS / 4))
#   SOAK_MAX_GROWTH_MB   allowed RSS growth per server after warm-up
#   SOAK_MAX_GROWTH_PCT  (both must be exceeded to fail; default 16 MB, 10 %)
#   SOAK_REPORT          report path (default bench/results/soak_<SECONDS>s.txt)
# Exits 0 when every check passes, 1 when one fails, 2 on bad usage.
set -euo pipefail

duration="${1:-120}"
clients="${2:-8}"
if ! [[ "${duration}" =~ ^[0-9]+$ && "${clients}" =~ ^[0-9]+$ ]] ||
  [[ "${duration}" -lt 10 || "${clients}" -lt 1 ]]; then
  echo "usage: $0 [SECONDS >= 10] [CLIENTS >= 1]" >&2
  exit 2
fi
mode="${SOAK_MODE:-async}"
if [[ "${mode}" != async && "${mode}" != sync ]]; then
  echo "soak.sh: SOAK_MODE must be async or sync, got '${mode}'" >&2
  exit 2
fi
elements="${SOAK_ELEMENTS:-65536}"
block_elements="${SOAK_BLOCK_ELEMENTS:-8192}"
interval="${SOAK_SAMPLE_S:-5}"
default_warmup=$((duration / 4 < 30 ? duration / 4 : 30))
warmup="${SOAK_WARMUP_S:-${default_warmup}}"
max_growth_mb="${SOAK_MAX_GROWTH_MB:-16}"
max_growth_pct="${SOAK_MAX_GROWTH_PCT:-10}"

repo="$(cd "$(dirname "$0")/../.." && pwd)"
report="${SOAK_REPORT:-${repo}/bench/results/soak_${duration}s.txt}"
for b in ps_server/ps_server worker/worker bench/soak/observer; do
  if [[ ! -x "${repo}/bazel-bin/${b}" ]]; then
    echo "soak.sh: ${repo}/bazel-bin/${b} is missing; run first:" >&2
    echo "  bazel build //ps_server //worker //bench/soak:observer" >&2
    exit 2
  fi
done

run="$(mktemp -d "${TMPDIR:-/tmp}/soak.XXXXXX")"
# A snapshot of the binaries: a build running meanwhile cannot swap them.
mkdir -p "${run}/bin"
cp "${repo}/bazel-bin/ps_server/ps_server" "${repo}/bazel-bin/worker/worker" \
  "${repo}/bazel-bin/bench/soak/observer" "${run}/bin/"

server_pids=()
worker_pids=()
running() { kill -0 "$1" 2>/dev/null; }
# Stops the given processes: SIGTERM, then SIGKILL after `grace` seconds.
stop_all() {
  local grace="$1"
  shift
  local pid deadline=$((SECONDS + grace))
  for pid in "$@"; do
    if running "${pid}"; then kill -TERM "${pid}" 2>/dev/null || true; fi
  done
  for pid in "$@"; do
    while running "${pid}" && [[ ${SECONDS} -lt ${deadline} ]]; do
      sleep 0.2
    done
    if running "${pid}"; then kill -KILL "${pid}" 2>/dev/null || true; fi
  done
}
cleanup() {
  stop_all 10 "${worker_pids[@]}" "${server_pids[@]}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

out() { echo "$*" | tee -a "${run}/report.txt"; }
indent() { while IFS= read -r line; do printf '    %s\n' "${line}"; done; }
: >"${run}/report.txt"

# ---- servers
for s in 0 1; do
  "${run}/bin/ps_server" --host=127.0.0.1 --port=0 \
    --port_file="${run}/ps${s}.port" --shard_id="${s}" --num_shards=2 \
    --num_workers="${clients}" --mode="${mode}" --optimizer=sgd \
    --learning_rate=1 --worker_lease_s=30 >"${run}/ps${s}.log" 2>&1 &
  server_pids+=("$!")
done
hosts=""
for s in 0 1; do
  deadline=$((SECONDS + 30))
  until [[ -s "${run}/ps${s}.port" ]]; do
    if ! running "${server_pids[s]}" || [[ ${SECONDS} -ge ${deadline} ]]; then
      echo "soak.sh: ps_server ${s} did not start; log:" >&2
      tail -n 20 "${run}/ps${s}.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  hosts+="${hosts:+,}127.0.0.1:$(tr -d '[:space:]' <"${run}/ps${s}.port")"
done

observe() {
  timeout 60 "${run}/bin/observer" --ps_hosts="${hosts}" \
    --num_workers="${clients}" --probe_elements="${elements}" \
    --block_elements="${block_elements}" "$@"
}
field() { # field NAME SHARD < observer output
  awk -v k="$1" -v s="shard=$2" '$1 == s {
    for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == k) print kv[2] } }'
}
rss_mb() {
  awk '/^VmRSS:/ { printf "%.1f", $2 / 1024 }' "/proc/$1/status" 2>/dev/null ||
    echo 0
}

# ---- workers
for ((k = 0; k < clients; ++k)); do
  "${run}/bin/worker" --ps_hosts="${hosts}" --worker_id="${k}" \
    --num_workers="${clients}" --model=probe --probe_elements="${elements}" \
    --block_elements="${block_elements}" --steps=1000000000 --log_every=0 \
    --device=cpu --batch_size=8 --num_features=4 --num_classes=2 \
    --train_examples=4096 --test_examples=64 --connections_per_shard=2 \
    >"${run}/worker${k}.out" 2>"${run}/worker${k}.log" &
  worker_pids+=("$!")
done

out "# Soak run: bench/soak/soak.sh ${duration} ${clients} (SOAK_MODE=${mode})"
out "date:      $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
out "machine:   $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')," \
  "$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)," \
  "$(uname -sr)"
dirty=""
git -C "${repo}" diff --quiet HEAD 2>/dev/null || dirty=" + uncommitted changes"
out "revision:  $(git -C "${repo}" rev-parse --short HEAD 2>/dev/null || echo '?')${dirty}" \
  "(binaries from bazel-bin, built $(date -u -r "${repo}/bazel-bin/ps_server/ps_server" '+%H:%M:%S UTC'))"
out "job:       2 ps_servers (${mode}, sgd, learning_rate 1), ${clients} workers" \
  "(--model=probe: gradient exactly 1 per element per step)," \
  "${elements} floats in blocks of ${block_elements}, run dir ${run}"
out ""
out "$(printf '%8s %10s %10s %12s %12s %s' t_s ps0_rss_MB ps1_rss_MB \
  version steps_per_s note)"

# ---- load, sampled
start=${SECONDS}
end=$((start + duration))
samples_t=()
samples_rss0=()
samples_rss1=()
last_version=0
last_t=0
failed_early=""
while true; do
  now=${SECONDS}
  [[ ${now} -ge ${end} ]] && break
  sleep "$((end - now < interval ? end - now : interval))"
  t=$((SECONDS - start))
  for pid in "${worker_pids[@]}" "${server_pids[@]}"; do
    if ! running "${pid}"; then failed_early="process ${pid} exited early"; fi
  done
  stats="$(observe 2>/dev/null || true)"
  version="$(field version 0 <<<"${stats}")"
  version="${version:-0}"
  rate="$(awk -v d="$((version - last_version))" -v s="$((t - last_t))" \
    'BEGIN { printf "%.1f", (s > 0 ? d / s : 0) }')"
  r0="$(rss_mb "${server_pids[0]}")"
  r1="$(rss_mb "${server_pids[1]}")"
  note=""
  [[ ${t} -ge ${warmup} && -z "${baseline_index:-}" ]] &&
    baseline_index=${#samples_t[@]} && note="(RSS baseline)"
  samples_t+=("${t}")
  samples_rss0+=("${r0}")
  samples_rss1+=("${r1}")
  out "$(printf '%8s %10s %10s %12s %12s %s' "${t}" "${r0}" "${r1}" \
    "${version}" "${rate}" "${note}")"
  last_version=${version}
  last_t=${t}
  if [[ -n "${failed_early}" ]]; then break; fi
done
loaded_t=$((SECONDS - start))

# ---- stop the workers: each finishes its step, leaves, prints its JSON
stop_all 60 "${worker_pids[@]}"
total_steps=0
worker_errors=0
steps_list=""
duplicates=0
for ((k = 0; k < clients; ++k)); do
  code=0
  wait "${worker_pids[k]}" || code=$?
  json="$(grep '"event":"final"' "${run}/worker${k}.out" | tail -n 1 || true)"
  steps="$(sed -n 's/.*"steps_run":\([0-9]*\).*/\1/p' <<<"${json}")"
  dup="$(sed -n 's/.*"duplicate_blocks":\([0-9]*\).*/\1/p' <<<"${json}")"
  if [[ ${code} -ne 0 || -z "${steps}" ]]; then
    worker_errors=$((worker_errors + 1))
    out "worker ${k}: exit ${code}, no final line; log tail:"
    tail -n 5 "${run}/worker${k}.log" | indent | tee -a "${run}/report.txt"
    steps=0
  fi
  total_steps=$((total_steps + steps))
  duplicates=$((duplicates + ${dup:-0}))
  steps_list+="${steps_list:+ }${steps}"
done
worker_pids=()
error_lines="$(cat "${run}"/worker*.log "${run}"/ps*.log |
  grep -c '^[EF][0-9]\{4\} ' || true)"

# ---- the exact invariant, read by an observer
stats="$(observe 2>&1 || true)"
v0="$(field version 0 <<<"${stats}")"
v1="$(field version 1 <<<"${stats}")"
if [[ "${mode}" == async ]]; then
  expected="${total_steps}" # one unit update per push, every element
else
  expected="${v0:-0}" # one update of mean 1 per completed step
fi
check="$(observe --expect_updates="${expected}" 2>&1)" && invariant=ok ||
  invariant=FAILED
idle_r0="$(rss_mb "${server_pids[0]}")"
idle_r1="$(rss_mb "${server_pids[1]}")"

# ---- servers stop cleanly
stop_all 30 "${server_pids[@]}"
server_codes=""
for pid in "${server_pids[@]}"; do
  code=0
  wait "${pid}" || code=$?
  server_codes+="${server_codes:+ }${code}"
done
server_pids=()

# ---- memory
growth() { # growth BASE_MB END_MB -> "delta_mb pct"
  awk -v b="$1" -v e="$2" \
    'BEGIN { printf "%.1f %.1f", e - b, (b > 0 ? 100 * (e - b) / b : 0) }'
}
n=${#samples_t[@]}
bi="${baseline_index:-0}"
read -r g0_mb g0_pct <<<"$(growth "${samples_rss0[bi]}" "${samples_rss0[n - 1]}")"
read -r g1_mb g1_pct <<<"$(growth "${samples_rss1[bi]}" "${samples_rss1[n - 1]}")"
memory_ok=ok
for g in "${g0_mb} ${g0_pct}" "${g1_mb} ${g1_pct}"; do
  read -r mb pct <<<"${g}"
  if awk -v m="${mb}" -v p="${pct}" -v mm="${max_growth_mb}" -v mp="${max_growth_pct}" \
    'BEGIN { exit !(m > mm && p > mp) }'; then
    memory_ok=FAILED
  fi
done

verdict=PASS
reasons=""
fail() {
  verdict=FAIL
  reasons+="${reasons:+; }$1"
}
[[ -n "${failed_early}" ]] && fail "${failed_early}"
[[ ${worker_errors} -gt 0 ]] && fail "${worker_errors} workers failed"
[[ "${invariant}" != ok ]] && fail "invariant check failed"
if [[ "${mode}" == async && ("${v0}" != "${total_steps}" || "${v1}" != "${total_steps}") ]]; then
  fail "server versions ${v0}/${v1} != ${total_steps} pushes"
fi
[[ "${v0}" != "${v1}" ]] && fail "shards at different versions ${v0}/${v1}"
[[ "${server_codes}" != "0 0" ]] && fail "server exit codes ${server_codes}"
[[ "${memory_ok}" != ok ]] && fail "RSS grew more than ${max_growth_mb} MB and ${max_growth_pct} %"

out ""
out "loaded for ${loaded_t} s; workers stopped with SIGTERM (each finished its step and left)"
out "worker steps (pushes of the whole model): ${total_steps} in all," \
  "$(awk -v n="${total_steps}" -v t="${loaded_t}" 'BEGIN { printf "%.1f", n / t }')/s;" \
  "per worker: ${steps_list}"
out "worker failures: ${worker_errors}; duplicate blocks acknowledged: ${duplicates};" \
  "error/fatal log lines (workers and servers): ${error_lines}"
out "server stats at the end:"
indent <<<"${stats}" | tee -a "${run}/report.txt"
out "invariant (every element == -${expected}): ${invariant}"
{ grep '^check' <<<"${check}" || echo "${check}"; } | indent | tee -a "${run}/report.txt"
out "RSS ps0: ${samples_rss0[bi]} MB at t=${samples_t[bi]} s -> ${samples_rss0[n - 1]} MB at" \
  "t=${samples_t[n - 1]} s: ${g0_mb} MB (${g0_pct} %); idle after the workers left: ${idle_r0} MB"
out "RSS ps1: ${samples_rss1[bi]} MB at t=${samples_t[bi]} s -> ${samples_rss1[n - 1]} MB at" \
  "t=${samples_t[n - 1]} s: ${g1_mb} MB (${g1_pct} %); idle after the workers left: ${idle_r1} MB"
out "server exit codes after SIGTERM: ${server_codes}"
out "verdict: ${verdict}${reasons:+ (${reasons})}"

mkdir -p "$(dirname "${report}")"
cp "${run}/report.txt" "${report}"
echo "soak.sh: report in ${report}; logs in ${run}"
[[ "${verdict}" == PASS ]]
