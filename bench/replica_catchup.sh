#!/usr/bin/env bash
# Issue 38, catch-up by state transfer: how long a replica that starts
# while the job runs takes to get a live primary's state, and how long the
# job is held for it, against the floor: the same bytes sent once over
# loopback TCP (one socket, Python's sendall/recv_into: a copy in and out of
# the kernel, what any transfer of them pays).
#
# A sync job of the probe model (one tensor of --elements float32 in one
# shard, 2 replicas, 2 workers, SGD) runs; after --kill_after_s its backup
# is killed -9 and started again, and catches up from the primary. The
# primary's log says how many bytes it sent and in how long, and how long
# it held the job's changes (quiet moment + export + transfer); worker 0's
# median step time says what one step costs the job for comparison.
#
#   bench/replica_catchup.sh [--elements=16777216] [--repeats=3] [--record]
#
# --record writes bench/results/replica_catchup.txt. Every process is
# killed when the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."

elements=16777216 repeats=3 record=0 kill_after_s=4
for arg in "$@"; do
  case "$arg" in
    --elements=*) elements=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    --kill_after_s=*) kill_after_s=${arg#*=} ;;
    --record) record=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "replica_catchup.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in elements repeats kill_after_s; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "replica_catchup.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker >/dev/null
server_bin=bazel-bin/ps_server/ps_server
worker_bin=bazel-bin/worker/worker
source bench/lib.sh
bench_trial_processes replica_catchup

# tcp_copy_s BYTES: seconds to send BYTES once over loopback TCP.
tcp_copy_s() {
  /usr/bin/python3 - "$1" <<'PY'
import socket, sys, threading, time
n = int(sys.argv[1])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
data = bytearray(n)
got = bytearray(n)
def serve():
    conn, _ = listener.accept()
    view, done = memoryview(got), 0
    while done < n:
        done += conn.recv_into(view[done:])
    conn.sendall(b"k")
    conn.close()
t = threading.Thread(target=serve)
t.start()
c = socket.create_connection(listener.getsockname())
start = time.perf_counter()
c.sendall(data)
c.recv(1)
print("%.4f" % (time.perf_counter() - start))
t.join()
PY
}

# One round: prints "bytes transfer_s held_s step_ms".
round() {
  local dir=$1
  mkdir -p "$dir"
  local -a ports server_pid worker_pids=()
  mapfile -t ports < <(free_ports 2)
  start_server() {
    "$server_bin" --host=127.0.0.1 --port="${ports[$1]}" --shard_id=0 --num_shards=1 \
      --num_workers=2 --mode=sync --optimizer=sgd --learning_rate=1 --worker_lease_s=10 \
      --replicas=2 --replica_index="$1" \
      --replica_hosts="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]}" \
      >"$dir/$2.out" 2>"$dir/$2.log" &
    server_pid[$1]=$!
    pids+=("$!")
  }
  start_server 0 ps0
  start_server 1 ps1
  for k in 0 1; do
    "$worker_bin" --ps_hosts="127.0.0.1:${ports[0]}|127.0.0.1:${ports[1]}" --worker_id=$k \
      --num_workers=2 --model=probe --probe_elements="$elements" --block_elements=262144 \
      --steps=100000 --log_every=0 --device=cpu --retry_window_s=60 --rpc_timeout_s=60 \
      --metrics_csv="$dir/w$k.csv" >"$dir/w$k.out" 2>"$dir/w$k.log" &
    worker_pids+=("$!")
    pids+=("$!")
  done
  sleep "$kill_after_s"
  kill -9 "${server_pid[1]}"
  wait "${server_pid[1]}" 2>/dev/null || true
  start_server 1 ps1_again
  local deadline=$((SECONDS + 120))
  until grep -q "catch-up of replica 1" "$dir/ps0.log" || ((SECONDS > deadline)); do sleep 0.1; done
  sleep 1
  kill_all
  local sent held
  sent=$(sed -n 's/.*brought replica 1 into its set: [0-9]* chunks, \([0-9]*\) bytes in \([0-9.e-]*\) s.*/\1 \2/p' "$dir/ps0.log")
  held=$(sed -n 's/.*catch-up of replica 1: changes held \([^ ]*\) .*/\1/p' "$dir/ps0.log")
  [[ -n $sent && -n $held ]] || { echo "replica_catchup.sh: no catch-up in $dir" >&2; exit 1; }
  # absl durations: "1.234s" or "123.4ms".
  held=$(awk -v d="$held" 'BEGIN {if (d ~ /ms$/) {sub(/ms$/, "", d); print d / 1000} else if (d ~ /us$/) {sub(/us$/, "", d); print d / 1e6} else {sub(/s$/, "", d); print d}}')
  local step_ms
  step_ms=$(awk -F, 'NR > 2 {print 1000 * ($2 - t)} {t = $2}' "$dir/w0.csv" | sort -g |
    awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
  echo "$sent $held $step_ms"
}

rows=()
for ((r = 1; r <= repeats; r++)); do
  read -r bytes transfer held step_ms < <(round "$run_dir/r$r")
  tcp=$(tcp_copy_s "$bytes")
  rows+=("$(awk -v b="$bytes" -v t="$transfer" -v h="$held" -v c="$tcp" -v s="$step_ms" \
    'BEGIN {printf "%11.1f %11.3f %9.3f %9.3f %9.2f %10.1f", b / 1e6, t, c, t / c, h, s}')")
  echo "round $r: ${rows[-1]}" >&2
done
header=$(printf '%11s %11s %9s %9s %9s %10s' "state MB" "transfer s" "tcp s" ratio "held s" "step ms")
{
  echo "# replica_catchup: a restarted backup catching up from the primary while a sync job runs"
  echo "command: bench/replica_catchup.sh --elements=$elements --repeats=$repeats; commit $BENCH_COMMIT; machine: $BENCH_MACHINE"
  echo "$header"
  printf '%s\n' "${rows[@]}"
  echo "transfer: the primary's export and send of its state (its log); tcp: the same bytes once over"
  echo "loopback TCP; ratio = transfer / tcp. held: how long the job's changes were held (quiet moment,"
  echo "export, transfer); step: worker 0's median step time in the same job."
} >"$run_dir/result"
cat "$run_dir/result"
((record)) && cp "$run_dir/result" bench/results/replica_catchup.txt
exit 0
