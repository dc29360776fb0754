#!/usr/bin/env bash
# Aggregate goodput as shards and clients grow: ps_bench (its raw TCP
# baseline in the same run) at one tensor size for every S servers x W
# clients, medians of --repeats interleaved runs, one row per (S, W).
#
#   bench/transport/aggregate.sh [--size=4194304] [--servers=1,2,4] [--clients=1,2,4] [--repeats=3]
#
# Writes bench/results/transport_aggregate.txt. On a 2-core machine every
# server, client and baseline peer shares the same two cores, so what grows
# with shards is what the cores allow, not what the network does.
set -euo pipefail
cd "$(dirname "$0")/../.."

size=4194304
servers_list=1,2,4
clients_list=1,2,4
repeats=3
for arg in "$@"; do
  case "$arg" in
    --size=*) size=${arg#*=} ;;
    --servers=*) servers_list=${arg#*=} ;;
    --clients=*) clients_list=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "aggregate.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

bazel build -c opt //bench/transport:ps_bench //ps_server:ps_server
bench=$(bazel info -c opt bazel-bin)/bench/transport/ps_bench
out=bench/results/transport_aggregate.txt
source bench/lib.sh

# median_of KEY LINES: the median of KEY over the JSON lines.
median_of() {
  sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" <<<"$2" | sort -g |
    awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'
}

declare -A runs
# Interleaved: every configuration once per round, so drift hits all alike.
for ((r = 1; r <= repeats; r++)); do
  for s in ${servers_list//,/ }; do
    for w in ${clients_list//,/ }; do
      json=$("$bench" --sizes="$size" --servers="$s" --clients="$w" --repeats=1 2>/dev/null |
        grep '^{"bench":"ps_bench"' | head -n 1)
      runs[$s,$w]+="$json"$'\n'
    done
  done
done

{
  echo "# transport_aggregate: ps_bench push+pull of one $size-byte tensor, S servers x W clients, medians of $repeats interleaved runs"
  echo "command: bench/transport/aggregate.sh --size=$size --servers=$servers_list --clients=$clients_list --repeats=$repeats"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "goodput GB/s summed over the W clients (push+pull: 2N per push then pull; 1call: 2N per PushPull); TCP: the same W clients over raw TCP"
  echo
  printf '%7s %7s %12s %12s %12s %10s %10s %14s\n' servers clients ps_p+p_GB/s ps_1call_GB/s tcp_p+p_GB/s p+p/tcp 1call/tcp push_p50_us
  for s in ${servers_list//,/ }; do
    for w in ${clients_list//,/ }; do
      lines=${runs[$s,$w]}
      pp=$(median_of ps_pushpull_gbps "$lines")
      one=$(median_of ps_one_call_gbps "$lines")
      tcp=$(median_of tcp_gbps "$lines")
      ratio=$(median_of ratio_pushpull_vs_tcp "$lines")
      one_ratio=$(median_of ratio_one_call_vs_tcp "$lines")
      p50=$(median_of ps_push_p50_us "$lines")
      printf '%7s %7s %12.3f %12.3f %12.3f %10.3f %10.3f %14.1f\n' "$s" "$w" "$pp" "$one" "$tcp" "$ratio" "$one_ratio" "$p50"
    done
  done
} | tee "$out"
