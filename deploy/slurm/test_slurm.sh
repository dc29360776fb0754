#!/usr/bin/env bash
# A real Slurm test of deploy/slurm/pstrain.sbatch on this one machine.
#
#   bash deploy/slurm/test_slurm.sh        # directly (binaries from bazel-bin)
#   bazel test //deploy/slurm:slurm_test   # under Bazel (binaries as runfiles)
#
# It installs Debian's slurm-wlm and munge when they are missing, then, in a
# new temporary directory: creates a munge key and a slurm.conf (cluster of two
# nodes n1 and n2, both NodeAddr=127.0.0.1 with their own SlurmdPort, ports
# picked free at run time), starts munged, slurmctld -D and two slurmd -D -N
# n1/n2, waits for both nodes to be idle, and submits eight heterogeneous jobs
# with sbatch (servers on n1, CPU workers on n2):
#   A  sync, 2 shards on fixed ports (PS_BASE_PORT), 2 workers: must COMPLETE
#      with every worker's final JSON line, test_accuracy well above chance
#   B  async, 1 shard on a free port, 3 workers: the same
#   C  a worker flag the worker rejects: the job must FAIL (non-zero exit)
#   D  the #SBATCH partitions and METRICS=1: every process's /metrics
#   E  a fixed metrics port for two shards on a node: FAILED 2 at once
#   F  Python workers (PYTHON_SCRIPT, pstrain.torch): as A
#   G  REPLICAS=2 (REPLICAS_SHARE_NODES=1: a hetjob's components cannot
#      share a node, and n2 runs the workers): one shard's two replicas on
#      n1; its primary is killed with SIGKILL mid-job and the job must
#      COMPLETE as A does, with the killed replica started again on n1
#      and caught up from the new primary
#   H  REPLICAS=2 on one server node without REPLICAS_SHARE_NODES: FAILED 2
# Every wait has a deadline. Whatever happens, it cancels its jobs, stops the
# daemons it started (by PID; SIGKILL after a grace period) and removes its
# temporary directory (KEEP_TMP=1 keeps it); on failure it prints the job
# output, the run logs and the tails of the daemons' logs first.
#
# Needs root (slurmd runs jobs as their user; the job runs as root here).
# Exit status: 0 pass, 1 fail.
set -euo pipefail

readonly PROG=test_slurm.sh
readonly START_S=$SECONDS
readonly DAEMON_UP_S=20      # munged socket, slurmctld answering
readonly NODES_IDLE_S=30     # both slurmd registered and idle
readonly JOBS_DONE_S=120     # all seven jobs finished
readonly STOP_GRACE_S=10     # SIGTERM -> SIGKILL for the daemons
readonly MIN_ACCURACY=0.6    # chance is 0.25 (4 classes)

log() { printf '%s [%3ds] %s\n' "$PROG" "$((SECONDS - START_S))" "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

export PATH=$PATH:/usr/sbin:/sbin
# Never talk to (or inherit the job of) another Slurm this might run under.
while read -r v; do unset "$v"; done < <(compgen -e | grep -E '^(SLURM|SBATCH|SRUN|SALLOC)_' || true)

[[ $(id -u) -eq 0 ]] || fail "must run as root (starts slurmd, which runs jobs as their user)"

# --- Dependencies ----------------------------------------------------------------

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
  ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  log "installing slurm-wlm and munge (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null
fi

# The binaries and the job script: Bazel runfiles when run as a test, else this
# repository (bazel-bin).
runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
if [[ -n "$runfiles" && -e "$runfiles/pstrain/deploy/slurm/pstrain.sbatch" ]]; then
  PS_BIN=$runfiles/pstrain/ps_server/ps_server
  WORKER_BIN=$runfiles/pstrain/worker/worker
  SBATCH_SCRIPT=$runfiles/pstrain/deploy/slurm/pstrain.sbatch
  # The pstrain Python package as users get it: the wheel, pip-installed
  # into a venv that sees Debian's torch (made below, once $T exists).
  PYTHON_WHEEL=$(ls "$runfiles"/pstrain/worker/python/pstrain-*.whl)
else
  here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
  repo=$(cd -- "$here/../.." && pwd)
  PS_BIN=$repo/bazel-bin/ps_server/ps_server
  WORKER_BIN=$repo/bazel-bin/worker/worker
  SBATCH_SCRIPT=$here/pstrain.sbatch
  PYTHON_WHEEL=""  # the installed one (worker/python/install.sh)
fi
for f in "$PS_BIN" "$WORKER_BIN"; do
  [[ -x "$f" ]] || fail "$f missing (bazel build //ps_server:ps_server //worker:worker)"
done
[[ -r "$SBATCH_SCRIPT" ]] || fail "$SBATCH_SCRIPT missing"

# --- State for cleanup -------------------------------------------------------------

# Under /tmp, not TEST_TMPDIR: munge's socket path must fit in sun_path.
T=$(mktemp -d /tmp/pstrain-slurm.XXXXXX)
chmod 755 "$T"  # munged wants its socket directory searchable by all
declare -A DAEMONS=()  # pid -> name, every daemon this script started
JOBS=()
PASSED=0

daemon_alive() { kill -0 "$1" 2>/dev/null; }

show_file() {  # file [lines]
  local f=$1 n=${2:-25}
  printf -- '----- %s (last %d lines)\n' "${f#"$T"/}" "$n" >&2
  if [[ -s "$f" ]]; then tail -n "$n" -- "$f" | sed 's/^/  | /' >&2; else echo '  | (empty or missing)' >&2; fi
}

diagnostics() {
  log "diagnostics (temp dir $T):"
  if [[ -n "${SLURM_CONF:-}" ]] && daemon_alive "${CTLD_PID:-0}"; then
    { timeout 5 sinfo -N -l; timeout 5 squeue -l; } 2>&1 | sed 's/^/  | /' >&2 || true
    local id
    for id in ${JOBS[@]+"${JOBS[@]}"}; do
      timeout 5 scontrol show job -o "$id" 2>&1 | head -n 1 |
        grep -oE '(JobId|JobState|Reason|ExitCode|NodeList|BatchHost)=[^ ]*' |
        paste -sd' ' | sed 's/^/  | /' >&2 || true
    done
  fi
  local f
  for f in "$T"/job-*.out "$T"/run-*/servers.log "$T"/run-*/workers.log "$T"/run-*/workers.out; do
    [[ -e "$f" ]] && show_file "$f" 30
  done
  for f in "$T"/log/slurmctld.log "$T"/log/slurmd.n1.log "$T"/log/slurmd.n2.log "$T"/log/*.stderr "$T"/log/munged.log; do
    [[ -e "$f" ]] && show_file "$f" 25
  done
  return 0
}

stop_daemons() {
  local pid deadline
  # Jobs first, so that no slurmstepd or task outlives its slurmd.
  if ((${#JOBS[@]} > 0)) && daemon_alive "${CTLD_PID:-0}"; then
    timeout 5 scancel "${JOBS[@]}" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while ((SECONDS < deadline)); do
      [[ -z "$(timeout 5 squeue -h -o %i 2>/dev/null || echo busy)" ]] && break
      sleep 0.2
    done
  fi
  # slurmd, then slurmctld, then munged: each SIGTERM, SIGKILL after the grace.
  local order=() name
  for name in slurmd slurmctld munged; do
    for pid in "${!DAEMONS[@]}"; do
      [[ ${DAEMONS[$pid]} == "$name"* ]] && order+=("$pid")
    done
  done
  for pid in ${order[@]+"${order[@]}"}; do
    daemon_alive "$pid" || continue
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_GRACE_S))
    while daemon_alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
    if daemon_alive "$pid"; then
      log "${DAEMONS[$pid]} (pid $pid) ignored SIGTERM for ${STOP_GRACE_S}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
}

cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM HUP
  trap '' PIPE  # a closed stdout/stderr must not stop the cleanup half-way
  ((PASSED)) || { ((rc != 0)) || rc=1; diagnostics; }
  stop_daemons
  if [[ "${KEEP_TMP:-0}" == 1 ]]; then
    log "kept $T"
  else
    rm -rf -- "$T"
  fi
  if ((rc == 0)); then log "PASS"; else log "FAIL (exit $rc)"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM HUP

# Waits until "$@" succeeds; fails after a deadline, or at once if a daemon
# this script started has died.
wait_for() {  # seconds description command...
  local limit=$1 what=$2 deadline=$((SECONDS + $1)) pid
  shift 2
  until "$@" >/dev/null 2>&1; do
    for pid in "${!DAEMONS[@]}"; do
      daemon_alive "$pid" || fail "${DAEMONS[$pid]} (pid $pid) died while waiting for $what"
    done
    ((SECONDS < deadline)) || fail "no $what within ${limit}s"
    sleep 0.2
  done
}

# --- Ports -------------------------------------------------------------------------

# Picks ports nobody listens on, below the kernel's ephemeral range (so the
# free ports other programs get from the kernel cannot take them meanwhile).
declare -A TAKEN=()
while read -r _ local_addr _ _ _; do
  [[ $local_addr == *:* ]] || continue
  TAKEN[$((16#${local_addr##*:}))]=1
done < <(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | tail -n +2)
read -r ephemeral_low _ </proc/sys/net/ipv4/ip_local_port_range
pick_port() {  # [consecutive=1] -> first port of a free run
  local n=${1:-1} p i ok
  while :; do
    p=$((10000 + RANDOM % (ephemeral_low - 10000 - 16)))
    ok=1
    for ((i = 0; i < n; i++)); do [[ -z "${TAKEN[$((p + i))]:-}" ]] || ok=0; done
    ((ok)) || continue
    for ((i = 0; i < n; i++)); do TAKEN[$((p + i))]=1; done
    echo "$p"
    return
  done
}
CTLD_PORT=$(pick_port)
N1_PORT=$(pick_port)
N2_PORT=$(pick_port)
PS_BASE=$(pick_port 2)
PS_BASE_G=$(pick_port 2)

# --- munge ------------------------------------------------------------------------

mkdir -p "$T/munge" "$T/log" "$T/state" "$T/spool/n1" "$T/spool/n2"
chmod 755 "$T/munge"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$T/munge/munge.key"
MUNGE_SOCKET=$T/munge/munge.socket
munged --foreground --force --key-file="$T/munge/munge.key" --socket="$MUNGE_SOCKET" \
  --pid-file="$T/munge/munged.pid" --seed-file="$T/munge/munged.seed" \
  --log-file="$T/log/munged.log" >"$T/log/munged.stderr" 2>&1 &
DAEMONS[$!]="munged"
wait_for "$DAEMON_UP_S" "munge socket" bash -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET'"

# --- slurm.conf, slurmctld, slurmd n1/n2 ---------------------------------------------

export SLURM_CONF=$T/slurm.conf
cat >"$SLURM_CONF" <<EOF
# Generated by $PROG: a throwaway two-node cluster on 127.0.0.1.
ClusterName=pstest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool/%n
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.%n.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Heterogeneous jobs are started by the backfill scheduler: run it every second.
SchedulerParameters=bf_interval=1
# The nodes claim more CPUs than this machine has.
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=300
KillWait=5
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=localhost Port=$N1_PORT CPUs=8 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=localhost Port=$N2_PORT CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=cpu Nodes=n1 MaxTime=30 State=UP
PartitionName=gpu Nodes=n2 MaxTime=30 State=UP
PartitionName=all Nodes=n1,n2 Default=YES MaxTime=30 State=UP
EOF

log "temp dir $T; slurmctld port $CTLD_PORT, slurmd n1 $N1_PORT, n2 $N2_PORT"
slurmctld -D -f "$SLURM_CONF" >"$T/log/slurmctld.stderr" 2>&1 &
CTLD_PID=$!
DAEMONS[$CTLD_PID]="slurmctld"
wait_for "$DAEMON_UP_S" "answer from slurmctld" timeout 5 scontrol ping
for node in n1 n2; do
  slurmd -D -N "$node" -f "$SLURM_CONF" >"$T/log/slurmd.$node.stderr" 2>&1 &
  DAEMONS[$!]="slurmd $node"
done

nodes_idle() {
  local states
  states=$(timeout 5 sinfo -h -N -p all -o '%N %T' | sort -u | tr '\n' ' ')
  [[ "$states" == "n1 idle n2 idle " ]]
}
wait_for "$NODES_IDLE_S" "idle nodes n1 and n2" nodes_idle
log "cluster up: n1 and n2 idle"

# --- Jobs -----------------------------------------------------------------------------

mkdir -p "$T/bin"
ln -s "$PS_BIN" "$T/bin/ps_server"
ln -s "$WORKER_BIN" "$T/bin/worker"

# submit name env-assignments -- sbatch-args...   (sets JOB_<name>)
submit() {
  local name=$1 id
  shift
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  id=$(env BIN_DIR="$T/bin" RUN_DIR="$T/run-$name" GPUS_PER_NODE=0 STOP_GRACE_S=10 \
    ${envs[@]+"${envs[@]}"} \
    timeout 20 sbatch --parsable --chdir="$T" --time=5 --output="$T/job-$name.out" "$@") ||
    fail "sbatch of job $name failed"
  id=${id%%;*}
  JOBS+=("$id")
  printf -v "JOB_$name" '%s' "$id"
  log "job $name submitted: $id"
}
readonly TRAIN=(--model=softmax --steps=200 --batch_size=32 --log_every=50 --server.learning_rate=0.1)
#        component 0: servers on n1                 component 1: CPU workers on n2
submit A PS_BASE_PORT="$PS_BASE" -- \
  -p cpu -w n1 -N1 -n2 -c1 : -p gpu -w n2 -N1 -n2 -c1 --gres=none \
  "$SBATCH_SCRIPT" --mode=sync -- "${TRAIN[@]}"
submit B PS_BASE_PORT=0 MODE=async -- \
  -p cpu -w n1 -N1 -n1 -c1 : -p gpu -w n2 -N1 -n3 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- "${TRAIN[@]}"
submit C PS_BASE_PORT=0 -- \
  -p cpu -w n1 -N1 -n1 -c1 : -p gpu -w n2 -N1 -n2 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- --steps=20 --model=no_such_model

# D: the #SBATCH lines' partitions (no -p/-w here: servers must land on
# partition cpu = n1, workers on gpu = n2) and METRICS=1: every process a
# free metrics port, listed for Prometheus. The workers linger so that the
# test can scrape every target while the job runs.
submit D PS_BASE_PORT=0 METRICS=1 WORKER_FLAGS=--metrics_linger_s=20 -- \
  -N1 -n2 -c1 : -N1 -n2 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- "${TRAIN[@]}"
# E: a fixed metrics port for two shards on one node can only fail; it must
# fail at once, saying what to do instead.
E_METRICS_PORT=$(pick_port)
submit E PS_BASE_PORT=0 SERVER_FLAGS="--metrics_port=$E_METRICS_PORT" -- \
  -p cpu -w n1 -N1 -n2 -c1 : -p gpu -w n2 -N1 -n1 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- "${TRAIN[@]}"

# F: Python workers (PYTHON_SCRIPT): a pstrain.torch script, its arguments
# after "--", its rank from Slurm.
cat >"$T/torch_worker.py" <<'PY'
import sys, torch, pstrain, pstrain.data, pstrain.torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 4))
ps = pstrain.torch.ParameterServer(model)
# The client's flags went to the client (the cluster description), the
# script's to the script.
assert sys.argv[1:] == ["--steps=300"], sys.argv
assert pstrain.cluster_spec().client_options == {"parameter_wire_type": "bf16"}
steps = int(sys.argv[1].removeprefix("--steps="))
data = pstrain.data.synthetic(4096)
batches = pstrain.data.Batches(data, 32, ps.worker_id, ps.num_workers)
for step in range(ps.step_count, steps):
    x, y = batches.batch(step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    ps.step()
ps.finish()
_, accuracy = pstrain.data.evaluate(model, data)
pstrain.print_final(worker_id=ps.worker_id, mode=ps.mode,
                    num_workers=ps.num_workers, test_accuracy=accuracy)
PY
PYTHON_FOR_F=/usr/bin/python3
if [[ -n "$PYTHON_WHEEL" ]]; then
  /usr/bin/python3 -m venv --system-site-packages "$T/venv" ||
    fail "python3 -m venv failed (python3-venv)"
  "$T/venv/bin/python" -m pip install --quiet --no-index --no-deps --ignore-installed \
    --disable-pip-version-check "$PYTHON_WHEEL" || fail "pip install $PYTHON_WHEEL failed"
  PYTHON_FOR_F=$T/venv/bin/python
fi
submit F PS_BASE_PORT=0 PYTHON_SCRIPT="$T/torch_worker.py" PYTHON="$PYTHON_FOR_F" -- \
  -p cpu -w n1 -N1 -n2 -c1 : -p gpu -w n2 -N1 -n2 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- --steps=300 --parameter_wire_type=bf16 --server.optimizer=adam \
  --server.learning_rate=0.01

# G: one shard, two replicas, 2 workers; slowed so that its primary can be
# killed mid-job.
submit G PS_BASE_PORT="$PS_BASE_G" REPLICAS=2 REPLICAS_SHARE_NODES=1 -- \
  -p cpu -w n1 -N1 -n2 -c1 : -p gpu -w n2 -N1 -n2 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- "${TRAIN[@]/--steps=200/--steps=400}" --inject_step_delay_ms=20
# H: the same shape without REPLICAS_SHARE_NODES is refused at once.
submit H PS_BASE_PORT="$PS_BASE_G" REPLICAS=2 -- \
  -p cpu -w n1 -N1 -n2 -c1 : -p gpu -w n2 -N1 -n1 -c1 --gres=none \
  "$SBATCH_SCRIPT" -- "${TRAIN[@]}"
g_at_step_100() { grep -qE ': worker 0 step (1|2|3)[0-9]{2}/400' "$T/run-G/workers.out"; }
wait_for "$JOBS_DONE_S" "job G's worker 0 at step 100" g_at_step_100
g_primary=$(pgrep -f -- "--port=$PS_BASE_G --port_file=" | head -n 1)
[[ -n $g_primary ]] || fail "job G: no ps_server on port $PS_BASE_G"
kill -9 "$g_primary"
log "job G: killed its primary (pid $g_primary, replica 0 on n1)"

# While D runs: its target file lists 2 shards and 2 workers, each answering
# /metrics on the port listed.
D_TARGETS=$T/run-D/prometheus_targets.json
d_targets_complete() {
  [[ -s "$D_TARGETS" ]] && (($(grep -c '"targets"' "$D_TARGETS") == 4))
}
wait_for "$JOBS_DONE_S" "4 Prometheus targets in $D_TARGETS" d_targets_complete
log "job D targets: $(tr -d '\n' <"$D_TARGETS")"
mapfile -t d_targets < <(/usr/bin/python3 -c '
import json, sys
for entry in json.load(open(sys.argv[1])):
    labels = entry["labels"]
    index = labels.get("shard", labels.get("worker"))
    print(entry["targets"][0], labels["role"], index, labels["slurm_job_id"])
' "$D_TARGETS") || fail "job D: $D_TARGETS is not file_sd JSON"
((${#d_targets[@]} == 4)) || fail "job D: ${#d_targets[@]} targets, want 4"
for t in "${d_targets[@]}"; do
  read -r address role index job_id <<<"$t"
  [[ $job_id == "$JOB_D" ]] || fail "job D: target $address labelled slurm_job_id=$job_id"
  page=$(curl -s --max-time 5 "http://$address/metrics") || fail "job D: $role $index at $address does not answer /metrics"
  if [[ $role == ps ]]; then
    grep -q "^pstrain_shard_info{shard=\"$index\",num_shards=\"2\"" <<<"$page" ||
      fail "job D: $address is not shard $index: $(head -c 300 <<<"$page")"
  else
    grep -q "^pstrain_worker_step{worker=\"$index\"}" <<<"$page" ||
      fail "job D: $address is not worker $index: $(head -c 300 <<<"$page")"
  fi
  echo "  job D $role $index: /metrics at $address" >&2
done

job_state() {  # id -> "STATE EXITCODE" of the het leader
  timeout 5 scontrol show job -o "$1" 2>/dev/null | head -n 1 |
    sed -nE 's/.*JobState=([A-Z_]+).* ExitCode=([0-9]+:[0-9]+).*/\1 \2/p'
}
all_done() {
  local id s
  for id in "${JOBS[@]}"; do
    s=$(job_state "$id")
    case "${s%% *}" in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED) ;;
      *) return 1 ;;
    esac
  done
}
wait_for "$JOBS_DONE_S" "end of jobs ${JOBS[*]}" all_done
log "all jobs ended"

# --- Checks -----------------------------------------------------------------------

check_training_job() {  # name mode workers shards [server processes]
  local name=$1 mode=$2 workers=$3 shards=$4 processes=${5:-$4} id state out lines line acc k
  id=$(eval echo "\$JOB_$name")
  state=$(job_state "$id")
  [[ "$state" == "COMPLETED 0:0" ]] || fail "job $name ($id): state '$state', want 'COMPLETED 0:0'"
  out=$T/job-$name.out
  grep -q "^{\"event\":\"job\",\"mode\":\"$mode\",\"shards\":$shards,\"workers\":$workers,\"step\":" "$out" ||
    fail "job $name: no report of the job from its servers in $out"
  lines=$(grep -c '^{"event":"final"' "$out" || true)
  ((lines == workers)) || fail "job $name: $lines final JSON lines in $out, want $workers"
  for ((k = 0; k < workers; k++)); do
    line=$(grep "^{\"event\":\"final\".*\"worker_id\":$k," "$out" || true)
    [[ -n "$line" ]] || fail "job $name: no final line of worker $k"
    [[ "$line" == *"\"mode\":\"$mode\""* ]] || fail "job $name: worker $k not in mode $mode: $line"
    [[ "$line" == *"\"num_workers\":$workers,"* ]] || fail "job $name: worker $k: wrong num_workers: $line"
    acc=$(grep -oE '"test_accuracy":[0-9.]+' <<<"$line" | cut -d: -f2)
    [[ -n "$acc" ]] || fail "job $name: worker $k: no test_accuracy: $line"
    awk -v a="$acc" -v m="$MIN_ACCURACY" 'BEGIN { exit !(a >= m) }' ||
      fail "job $name: worker $k test_accuracy $acc < $MIN_ACCURACY"
    echo "  job $name worker $k: mode $mode test_accuracy $acc" >&2
  done
  # Placement: every shard reported from n1, every worker ran on n2 (a
  # replica started again reports again: counted once).
  local ready
  ready=$(grep -o 'pstrain-ps-ready shard=[0-9]* node=n1 port=[0-9]*\( replica=[0-9]*\)\?' "$T/run-$name/servers.log" |
    sort -u | grep -c . || true)
  ((ready == processes)) || fail "job $name: $ready of $processes server processes reported ready on n1"
  local on_n2
  on_n2=$(grep -c 'pstrain: worker [0-9]* on n2 .* device cpu' "$T/run-$name/workers.log" || true)
  ((on_n2 == workers)) || fail "job $name: $on_n2 of $workers workers ran on n2 with device cpu"
}

check_training_job A sync 2 2
check_training_job B async 3 1
# Job A's shards listen on PS_BASE_PORT + shard id.
for i in 0 1; do
  grep -q "pstrain-ps-ready shard=$i node=n1 port=$((PS_BASE + i))\$" "$T/run-A/servers.log" ||
    fail "job A: shard $i is not on port $((PS_BASE + i))"
done
grep -q "servers serving: 127.0.0.1:$PS_BASE,127.0.0.1:$((PS_BASE + 1))\$" "$T/job-A.out" ||
  fail "job A: ps_hosts is not 127.0.0.1:$PS_BASE,127.0.0.1:$((PS_BASE + 1))"
# The workers found the servers through the cluster description
# (PSTRAIN_CLUSTER), not through flags.
grep -q "from the cluster spec: --ps_hosts=127.0.0.1:$PS_BASE,127.0.0.1:$((PS_BASE + 1))" "$T/run-A/workers.log" ||
  fail "job A: the workers did not take --ps_hosts from PSTRAIN_CLUSTER"
# The servers were stopped with SIGTERM (clean shutdown), not killed.
grep -q 'shutting down' "$T/run-A/servers.log" || fail "job A: servers did not shut down on SIGTERM"

check_training_job D sync 2 2
check_training_job F sync 2 2
check_training_job G sync 2 1 2
for r in 0 1; do
  grep -q "pstrain-ps-ready shard=0 node=n1 port=$((PS_BASE_G + r)) replica=$r\$" "$T/run-G/servers.log" ||
    fail "job G: replica $r of shard 0 is not on n1, port $((PS_BASE_G + r))"
done
grep -q "servers serving: 127.0.0.1:$PS_BASE_G|127.0.0.1:$((PS_BASE_G + 1))\$" "$T/job-G.out" ||
  fail "job G: ps_hosts is not the replica set 127.0.0.1:$PS_BASE_G|127.0.0.1:$((PS_BASE_G + 1))"
grep -q "takes over as primary" "$T/run-G/servers.log" ||
  fail "job G: replica 1 did not take over from the killed primary"
grep -q "pstrain-ps-restart shard=0 node=n1 status=137 replica=0: starting it again (restart 1 of 3)" "$T/run-G/servers.log" ||
  fail "job G: the killed replica 0 was not started again"
grep -q "replica 0 of shard 0 caught up from replica 1 " "$T/run-G/servers.log" ||
  fail "job G: the restarted replica 0 did not catch up from replica 1"
(($(grep -c "pstrain-ps-ready shard=0 node=n1 port=$PS_BASE_G replica=0" "$T/run-G/servers.log") == 2)) ||
  fail "job G: the restarted replica 0 did not report ready again"
! grep -q "pstrain-ps-restart shard=0 node=n1 status=[0-9]* replica=1" "$T/run-G/servers.log" ||
  fail "job G: replica 1 was started again (the job's stop must not restart it)"
log "job G: the shard's backup took over, the killed replica came back as its backup, and the job completed"
state=$(job_state "$JOB_H")
[[ "$state" == "FAILED 2:0" ]] ||
  fail "job H (REPLICAS=2 on one server node): state '$state', want 'FAILED 2:0'"
grep -q "would share a node and its fate; give component 0 at least 2 nodes" "$T/job-H.out" ||
  fail "job H: no message naming the shared node in $(cat "$T/job-H.out")"

state=$(job_state "$JOB_E")
[[ "$state" == "FAILED 2:0" ]] ||
  fail "job E (fixed --metrics_port, 2 shards on a node): state '$state', want 'FAILED 2:0'"
grep -q "only one can have port $E_METRICS_PORT; use METRICS=1" "$T/job-E.out" ||
  fail "job E: no message naming the port conflict and METRICS=1 in $(cat "$T/job-E.out")"
log "job E refused the fixed metrics port: $state"

state=$(job_state "$JOB_C")
[[ "${state%% *}" == FAILED && "${state#* }" != "0:0" ]] ||
  fail "job C (bad worker flag): state '$state', want FAILED with a non-zero exit code"
grep -q 'worker step failed' "$T/job-C.out" || fail "job C: no 'worker step failed' in its output"
log "job C failed as it should: $state"

PASSED=1
log "all checks passed in $((SECONDS - START_S))s"
