#!/usr/bin/env bash
# The worker's defaults by host (--connections_per_shard=0 and
# --pipeline_step=by_host) on real hosts-in-namespaces:
# 1. In one sync job, a worker on the shard's host keeps four data-plane
#    connections and the plain step, and a worker on another host opens one
#    and runs its steps as a pipeline. Both end on the same model.
# 2. A plain worker and a pipelined one, both on other hosts (one request in
#    flight on each link): they send their groups in one order, so no step
#    waits for a lease to run out (with two orders each one's first request
#    waits for a group the other sends later) and the job ends in time.
# Skips (passes with "SKIP:") where the machine does not allow network
# namespaces.
set -euo pipefail
runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n $runfiles ]] || { echo "run me with bazel test //tests:netns_by_host_test" >&2; exit 1; }
root=$runfiles/pstrain
cd "$root"
source tests/netns/lab.sh
lab_require || exit 0
tmp=$(mktemp -d)
lab_create 3 1gbit
trap 'lab_destroy; rm -rf "$tmp"' EXIT
trap 'lab_destroy; rm -rf "$tmp"; exit 130' INT
trap 'lab_destroy; rm -rf "$tmp"; exit 143' TERM

shard=$(lab_addr 0)
# run_job PORT HOST0 HOST1 [FLAGS0] [FLAGS1]: a 2-worker sync job of the
# shard on host 0, worker w on host HOSTw with FLAGSw.
run_job() {
  local port=$1
  lab_exec 0 timeout 120 "$root/ps_server/ps_server" --host="$shard" --port=$port \
    --data_port=$((port + 1)) --shard_id=0 --num_shards=1 --num_workers=2 --mode=sync \
    >"$tmp/ps.out" 2>"$tmp/ps.log" &
  local server=$! pids=() w
  for w in 0 1; do
    # A job of 40 steps takes a few seconds; one step that waits for a
    # lease takes the servers' --worker_lease_s (10 s).
    lab_exec "$((w == 0 ? $2 : $3))" timeout 60 "$root/worker/worker" --ps_hosts="$shard:$port" \
      --worker_id=$w --num_workers=2 --model=mlp --hidden=256,128 --steps=40 \
      --batch_size=32 --log_every=0 --device=cpu $([[ $w == 0 ]] && echo "${4:-}" || echo "${5:-}") \
      >"$tmp/worker$w.out" 2>"$tmp/worker$w.log" &
    pids+=($!)
  done
  for w in 0 1; do
    if ! wait "${pids[$w]}"; then
      echo "FAIL: worker $w exited non-zero (124: still running after 60 s); its log:" >&2
      tail -20 "$tmp/worker$w.log" >&2
      exit 1
    fi
  done
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
}

# 1. Worker 0 on the shard's host, worker 1 on another.
run_job 7000 0 1

expect() {  # expect WORKER yes|no PATTERN
  if grep -q "$3" "$tmp/worker$1.log"; then found=yes; else found=no; fi
  if [[ $found != "$2" ]]; then
    echo "FAIL: worker $1's log should $([[ $2 == no ]] && echo "not ")say '$3'; it says:" >&2
    grep -E "data plane|pipeline" "$tmp/worker$1.log" >&2 || true
    exit 1
  fi
}
grep -q '"pipelined":false' "$tmp/worker0.out" || { echo "FAIL: worker 0's final JSON should say \"pipelined\":false" >&2; exit 1; }
grep -q '"pipelined":true' "$tmp/worker1.out" || { echo "FAIL: worker 1's final JSON should say \"pipelined\":true" >&2; exit 1; }
expect 0 yes "shard 0's data plane (.*) is on this host: 4 connections"
expect 0 no "steps run as a pipeline"
expect 1 yes "shard 0's data plane (.*) is on another host: 1 connection"
expect 1 yes "steps run as a pipeline"

final0=$(grep '"event":"final"' "$tmp/worker0.out")
final1=$(grep '"event":"final"' "$tmp/worker1.out")
loss0=$(sed 's/.*"test_loss":\([^,}]*\).*/\1/' <<<"$final0")
loss1=$(sed 's/.*"test_loss":\([^,}]*\).*/\1/' <<<"$final1")
if [[ -z $loss0 || $loss0 != "$loss1" ]]; then
  echo "FAIL: the two workers of one sync job ended on different models (test_loss $loss0 vs $loss1)" >&2
  exit 1
fi
echo "PASS: worker 0 (shard's host): 4 connections, plain step; worker 1 (another host): 1 connection, pipelined; same model (test_loss $loss0)"

# 2. Both on other hosts, worker 0 plain and worker 1 pipelined.
run_job 7100 1 2 --pipeline_step=never
expect 0 no "steps run as a pipeline"
expect 1 yes "steps run as a pipeline"
echo "PASS: a plain and a pipelined worker on other hosts finished their job in time"
