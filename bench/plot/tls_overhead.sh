#!/usr/bin/env bash
# What TLS costs the parameter server, in two parts.
#
# 1. Transport (always): bench/transport/ps_bench --tls_dir, which measures
#    in one run raw TCP, the PS on the plaintext data plane, the PS with
#    mutual TLS on the TLS data plane, and the PS with mutual TLS over gRPC
#    only (what TLS clusters had before the data plane took TLS), and prints
#    the ratios issue 25 states its goals in: TLS PushPull / plaintext
#    PushPull, TLS PushPull / gRPC+TLS PushPull, TLS push p50 / plaintext.
# 2. Jobs (--jobs): the same job (deploy/local/launch.sh, 1 server, 1
#    worker, the probe model: trivial compute, so the step is the transport)
#    in plaintext and with mutual TLS plus the bearer token, for a few model
#    sizes, comparing the workers' per-step pull and push times (their
#    --metrics_csv rows, first 10% dropped as warm-up).
#
#   bench/plot/tls_overhead.sh [--ps_bench=PATH] [--bench_sizes=N,...]
#       [--bench_repeats=R] [--ktls] [--pin_cpu=N] [--jobs [--bin_dir=DIR] [--sizes=N,...]
#       [--steps=N] [--repeats=R]]
#
#   --ps_bench      the ps_bench binary (default: bazel-bin's; build it with
#                   bazel build //bench/transport:ps_bench)
#   --bench_sizes   ps_bench sizes in bytes (default 4096,1048576,4194304,
#                   16777216)
#   --bench_repeats ps_bench --repeats (default 3; medians are reported)
#   --ktls          ask for kernel TLS on both ends (--data_plane_ktls)
#   --pin_cpu       run ps_bench and its servers on CPU N alone (taskset): on a
#                   VM, small round trips are mostly cross-CPU wake-ups whose
#                   p50 moves 2-4x with load; pinned, the 4 KiB p50s are stable
#                   to 0.1 us and show the CPU cost of TLS (part 1 only)
#   --jobs          also run part 2:
#   --bin_dir       ps_server and worker to run (default: bazel-bin's)
#   --sizes         model sizes in floats (default 1000,262144,1048576:
#                   4 KB, 1 MiB, 4 MiB each way per step)
#   --steps         steps per run (default 300)
#   --repeats       runs per size and mode, interleaved; medians are reported
#                   (default 3)
#
# Part 1 prints ps_bench's tables (the TLS one last) and JSON lines; part 2
# one table row per size: median pull and push ms, plaintext vs TLS, and the
# ratios. Certificates are made with deploy/tls/make_certs.sh in a temporary
# directory, removed afterwards.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
usage_error() { printf 'tls_overhead.sh: %s\n' "$*" >&2; exit 2; }

repo=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)
bin_dir=""
ps_bench="$repo/bazel-bin/bench/transport/ps_bench"
bench_sizes=4096,1048576,4194304,16777216
bench_repeats=3
ktls=false
pin_cpu=""
jobs=false
sizes=1000,262144,1048576
steps=300
repeats=3
for arg in "$@"; do
  case "$arg" in
    -h | --help) usage; exit 0 ;;
    --bin_dir=*) bin_dir=${arg#*=} ;;
    --ps_bench=*) ps_bench=${arg#*=} ;;
    --bench_sizes=*) bench_sizes=${arg#*=} ;;
    --bench_repeats=*) bench_repeats=${arg#*=} ;;
    --ktls) ktls=true ;;
    --pin_cpu=*) pin_cpu=${arg#*=} ;;
    --jobs) jobs=true ;;
    --sizes=*) sizes=${arg#*=} ;;
    --steps=*) steps=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    *) usage_error "unknown argument '$arg' (see --help)" ;;
  esac
done
[[ $steps =~ ^[1-9][0-9]*$ && $repeats =~ ^[1-9][0-9]*$ ]] || usage_error "--steps and --repeats must be positive integers"
[[ $sizes =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || usage_error "--sizes must be positive integers separated by commas"
[[ $bench_sizes =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || usage_error "--bench_sizes must be positive integers separated by commas"
[[ $bench_repeats =~ ^[1-9][0-9]*$ ]] || usage_error "--bench_repeats must be a positive integer"
[[ -z $pin_cpu || $pin_cpu =~ ^[0-9]+$ ]] || usage_error "--pin_cpu must be a CPU number, got '$pin_cpu'"
pin=()
if [[ -n $pin_cpu ]]; then
  command -v taskset >/dev/null || usage_error "--pin_cpu needs taskset (Debian: util-linux)"
  taskset -c "$pin_cpu" true 2>/dev/null || usage_error "--pin_cpu: CPU $pin_cpu is not available to this process"
  pin=(taskset -c "$pin_cpu")
fi
[[ -x $ps_bench ]] || usage_error "no ps_bench at $ps_bench (bazel build //bench/transport:ps_bench, or --ps_bench=PATH)"
bin_args=()
[[ -z "$bin_dir" ]] || bin_args=(--bin_dir="$bin_dir")

tmp=$(mktemp -d "${TMPDIR:-/tmp}/tls_overhead.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT
bash "$repo/deploy/tls/make_certs.sh" "$tmp/tls" localhost 127.0.0.1 2>/dev/null
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/token"

# median of the numbers on stdin
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# run MODE SIZE I: one job; prints "pull_ms push_ms" medians of its steps.
run() {
  local mode=$1 size=$2 i=$3 dir="$tmp/$1-$2-$3" security=()
  [[ $mode == plain ]] || security=(--tls_dir="$tmp/tls" --auth_token_file="$tmp/token")
  "$repo/deploy/local/launch.sh" ${bin_args[@]+"${bin_args[@]}"} --servers=1 --workers=1 \
    --csv --run_dir="$dir" ${security[@]+"${security[@]}"} -- \
    --model=probe --probe_elements="$size" --block_elements=$((size > 262144 ? 262144 : size)) \
    --steps="$steps" --log_every=0 >/dev/null 2>"$dir.log" ||
    { cat "$dir.log" >&2; exit 1; }
  local skip=$((steps / 10 + 1))
  printf '%s %s\n' \
    "$(tail -n +$((skip + 1)) "$dir/worker0.csv" | cut -d, -f6 | median)" \
    "$(tail -n +$((skip + 1)) "$dir/worker0.csv" | cut -d, -f7 | median)"
}

printf '# part 1: ps_bench --tls_dir, sizes %s, %s repeat(s), kernel TLS requested: %s, pinned to CPU: %s\n' \
  "$bench_sizes" "$bench_repeats" "$ktls" "${pin_cpu:-no}"
ktls_args=()
! $ktls || ktls_args=(--ktls)
${pin[@]+"${pin[@]}"} "$ps_bench" --tls_dir="$tmp/tls" --sizes="$bench_sizes" --repeats="$bench_repeats" \
  ${ktls_args[@]+"${ktls_args[@]}"} 2>"$tmp/ps_bench.log" || { tail -n 40 "$tmp/ps_bench.log" >&2; exit 1; }
$jobs || exit 0
echo

printf '# part 2: tls_overhead.sh: %s steps, %s repeat(s), probe model, 1 server + 1 worker on 127.0.0.1\n' "$steps" "$repeats"
printf '# machine: %s, %s cores\n' "$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1)" "$(nproc)"
printf '%-10s %12s %12s %12s %12s %10s %10s\n' bytes plain_pull plain_push tls_pull tls_push pull_x push_x
IFS=, read -r -a size_list <<<"$sizes"
for size in "${size_list[@]}"; do
  : >"$tmp/plain.txt"
  : >"$tmp/tls.txt"
  for ((i = 0; i < repeats; i++)); do
    run plain "$size" "$i" >>"$tmp/plain.txt"
    run tls "$size" "$i" >>"$tmp/tls.txt"
  done
  pp=$(cut -d' ' -f1 "$tmp/plain.txt" | median) ps=$(cut -d' ' -f2 "$tmp/plain.txt" | median)
  tp=$(cut -d' ' -f1 "$tmp/tls.txt" | median) ts=$(cut -d' ' -f2 "$tmp/tls.txt" | median)
  awk -v b=$((size * 4)) -v pp="$pp" -v ps="$ps" -v tp="$tp" -v ts="$ts" 'BEGIN {
    printf "%-10d %10.3fms %10.3fms %10.3fms %10.3fms %9.2fx %9.2fx\n", b, pp, ps, tp, ts, tp / pp, ts / ps }'
done
