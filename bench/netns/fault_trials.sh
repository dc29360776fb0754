#!/usr/bin/env bash
# Network fault trials on the netns lab (tests/netns/lab.sh): 2 shards and 2
# workers, each on its own host with a 1 Gbit/s link, training the probe
# model (every element is minus the unit updates applied), while the network
# misbehaves. Each trial checks that
#   - the job finishes, or fails cleanly (a worker exits non-zero with its
#     reason); a job still running at the deadline is "hung";
#   - nothing is applied twice: every element equals minus its shard's
#     version (bench/soak/observer --expect_shard_versions);
#   - no update is lost without being counted: the block gradients the
#     workers pushed (steps_run x blocks) equal those the shards applied plus
#     those reported late or lost;
#   - the job moves again soon after the fault is healed (recover_s: from the
#     heal to the next completed step); steps_during: the steps every shard
#     completed while the fault held (read just after the heal).
#
#   bazel build //ps_server //worker //bench/soak:observer //tests/netns:delay_proxy
#   bench/netns/fault_trials.sh [--faults=a,b,...] [--modes=sync,async]
#       [--planes=data,grpc] [--steps=200] [--replicas=1|2] [--report=FILE]
#       [--backup_reads=by_host|always|never]
#       [--pipeline_step=by_host|always|never] [--bin_dir=DIR]
#       [-- more worker flags]
# --backup_reads: whether the workers read half the shards from their
# backups (worker --pulls_from_backups; --replicas=2, sync, data plane).
# The default, by_host, reads them here (every host of the lab is its own);
# a bare --backup_reads is always.
# --pipeline_step: the workers' flag. The default, by_host, pipelines the
# sync steps here (the shards are on other hosts; not with backup reads);
# column "piped" says whether worker 0 did. Every sync worker checks that
# each step's values were all read at one step (--probe_check_pulls): one
# that outlived its lease on some shards and not others (partition_long,
# oneway, shard_cut_ckpt, primary_cut_workers) skips the step the others
# went on without it (README, "Faults, checkpoints and resharding").
# --bin_dir: where ps_server/ps_server, worker/worker, ... are (default
# bazel-bin; //tests:netns_faults_test passes its runfiles).
#
# Faults (a worker or shard is a host; the lease is 2 s):
#   none             baseline
#   loss1, loss5     every worker drops 1% / 5% of its packets, each way
#   delay20          20 ms +- 10 ms on every connection to a shard, each way
#   reorder          2 ms +- 2 ms: messages on different connections overtake
#                    each other (the kernel has no netem; see delay_proxy.cc)
#   partition_long   worker 1 cut from shard 0 for 4 s (twice the lease)
#   partition_short  worker 1 cut from both shards for 1 s (< retry window)
#   oneway           shard 0's packets to worker 0 dropped for 3 s
#   shard_cut_ckpt   shard 1 cut from every worker for 3 s while it writes a
#                    checkpoint every 10 steps
#   data_port_dropped  every shard drops packets to its data port (gRPC
#                    passes) for the whole job: the workers must fall back
#                    to gRPC within the data plane's 5 s connect bound
#   sigterm_slow_link  links of 2 Mbit/s (a push takes about a second, 50
#                    times the step's compute), and every worker SIGTERMed
#                    at once: each must end its step in hand, its push
#                    whole, and exit 0 or 143 (cut in a wait); the job must
#                    stop before its end, and in sync mode every shard must
#                    stop at the same step with none short (README,
#                    "Stopping").
#                    Not a fault of the network: its own checks replace the
#                    accounting (a stopped job's held step is neither
#                    applied nor lost), and no recovery is timed
# With --replicas=2 every shard is held by two servers on hosts of their own
# (ps_server --replicas; takeover after 2 s of silence), and these faults
# hit shard 1's replicas for 4 s:
#   primary_cut_backup   its primary cut from its backup (the workers reach
#                        both): the backup takes over; the old primary can
#                        get nothing confirmed and is fenced at the heal
#   primary_isolated     its primary cut from every other host: the backup
#                        takes over and the workers follow it
#   primary_cut_workers  its primary cut from the workers only: the backup
#                        still hears it and must not take over; the job
#                        waits for the heal
#   backup_isolated      its backup cut from every other host: the primary
#                        holds its answers (a silent backup is not dropped)
#                        until the heal
#   backup_cut_workers   its backup cut from the workers only, for 12 s:
#                        the primary still hears it, so the job goes on; a
#                        worker reading from it (--backup_reads) gives up
#                        on the read 5 s after the primary's answer and
#                        reads from the primary (steps_during > 0), where
#                        the call's deadline (30 s) would have held the job
# The accounting check (applied + late + lost = pushed) counts pushes on the
# shards' primaries, and a replica that took over applied the steps before
# as records: with replicas the trial checks instead that every element of
# the model is minus its shard's version and, in sync mode, that every
# shard ended at the job's last step.
# Exit status: 0 when every trial passed, 1 otherwise, 2 on bad usage; the lab
# skips (exit 0, "SKIP: ...") where namespaces are not allowed.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
source tests/netns/lab.sh
source bench/lib.sh

default_faults=none,loss1,loss5,delay20,reorder,partition_long,partition_short,oneway,shard_cut_ckpt,data_port_dropped
faults=$default_faults
modes=sync,async
planes=data,grpc
replicas=1
backup_reads=by_host
pipeline_step=by_host
report=""
steps=200
bin=$repo/bazel-bin
readonly command_line="$*"
worker_flags=()
while (($#)); do
  arg=$1
  shift
  case $arg in
    --) worker_flags=("$@"); break ;;
    --faults=*) faults=${arg#*=} ;;
    --modes=*) modes=${arg#*=} ;;
    --planes=*) planes=${arg#*=} ;;
    --report=*) report=${arg#*=} ;;
    --steps=*) steps=${arg#*=} ;;
    --replicas=*) replicas=${arg#*=} ;;
    --backup_reads) backup_reads=always ;;
    --backup_reads=*) backup_reads=${arg#*=} ;;
    --pipeline_step=*) pipeline_step=${arg#*=} ;;
    --bin_dir=*) bin=${arg#*=} ;;
    *) echo "fault_trials.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

[[ $pipeline_step =~ ^(by_host|always|never)$ ]] || { echo "fault_trials.sh: --pipeline_step must be by_host, always or never, got '$pipeline_step'" >&2; exit 2; }
[[ $replicas == 1 || $replicas == 2 ]] || { echo "fault_trials.sh: --replicas must be 1 or 2, got '$replicas'" >&2; exit 2; }
if ((replicas == 2)) && [[ $faults == "$default_faults" ]]; then
  faults=none,primary_cut_backup,primary_isolated,primary_cut_workers,backup_isolated,backup_cut_workers
fi
for fault in ${faults//,/ }; do
  if [[ $fault == primary_* || $fault == backup_* ]] && ((replicas == 1)); then
    echo "fault_trials.sh: fault $fault needs --replicas=2" >&2
    exit 2
  fi
done
lab_require || exit 0
for b in ps_server/ps_server worker/worker bench/soak/observer tests/netns/delay_proxy; do
  if [[ ! -x $bin/$b ]]; then
    echo "fault_trials.sh: missing $bin/$b; build first:" >&2
    echo "  bazel build //ps_server //worker //bench/soak:observer //tests/netns:delay_proxy" >&2
    exit 2
  fi
done
run=$(mktemp -d "${TEST_TMPDIR:-/tmp}/fault_trials.XXXXXX")
# Copies: a build running meanwhile cannot swap the binaries.
mkdir -p "$run/bin"
cp $bin/ps_server/ps_server $bin/worker/worker $bin/bench/soak/observer \
  $bin/tests/netns/delay_proxy "$run/bin/"

readonly kShards=2 kWorkers=2 kElements=65536 kBlockElements=8192 kBlocks=8
readonly kPort=7000 kDataPort=7001 kDeadline=120
# Hosts 0..S*R-1 are the servers (replica r of shard s on host s*R + r;
# replica 0 starts as the primary), then the workers.
replica_host() { echo $(($1 * replicas + $2)); }
shard_host() { replica_host "$1" 0; }
worker_host() { echo $((kShards * replicas + $1)); }

replica_set() {  # the addresses of shard $1's replicas, joined by $2
  local r out=""
  for ((r = 0; r < replicas; ++r)); do out+="${out:+$2}$(lab_addr "$(replica_host "$1" $r)"):$kPort"; done
  echo "$out"
}
hosts_csv() {
  local s out=""
  for ((s = 0; s < kShards; ++s)); do out+="${out:+,}$(replica_set $s '|')"; done
  echo "$out"
}

observe() {  # observer output, read from the router
  # A replicated shard's calls move to its next replica when one refuses
  # (a backup, a stale primary).
  lab_exec r timeout 60 "$run/bin/observer" --ps_hosts="$(hosts_csv)" \
    --num_workers=$kWorkers --probe_elements=$kElements \
    --block_elements=$kBlockElements \
    --retry_window_s=$((replicas > 1 ? 10 : 0)) "$@" 2>&1
}
version_of() { sed -n "s/^shard=$1 version=\([0-9]*\).*/\1/p" <<<"$2"; }
sum_field() {  # sum_field NAME OBSERVER_OUTPUT: over shards
  sed -n "s/^shard=.* $1=\([0-9]*\).*/\1/p" <<<"$2" | awk '{s += $1} END {print s + 0}'
}
min_version() {
  local out
  out=$(observe 2>/dev/null) || { echo -1; return; }
  sed -n 's/^shard=[0-9]* version=\([0-9]*\).*/\1/p' <<<"$out" | sort -n | head -n 1
}

apply_fault() {  # apply_fault NAME: starts the fault; sets hold (s)
  case $1 in
    none | delay20 | reorder | data_port_dropped) hold=0 ;;  # whole job, or none
    sigterm_slow_link)
      # ip netns exec runs the worker under lab_exec's subshell: signal the
      # worker itself, found in its host's namespace.
      local w pid
      for ((w = 0; w < kWorkers; ++w)); do
        for pid in $(ip netns pids "$(lab_ns "$(worker_host $w)")"); do
          [[ $(cat "/proc/$pid/comm" 2>/dev/null) == worker ]] && kill -TERM "$pid"
        done
      done
      hold=0 ;;
    loss1 | loss5)
      local w
      for ((w = 0; w < kWorkers; ++w)); do lab_loss "$(worker_host $w)" "${1#loss}"; done
      hold=3 ;;
    partition_long) lab_partition "$(worker_host 1)" "$(shard_host 0)"; hold=4 ;;
    partition_short)
      lab_partition "$(worker_host 1)" "$(shard_host 0)"
      lab_partition "$(worker_host 1)" "$(shard_host 1)"
      hold=1 ;;
    oneway) lab_partition "$(shard_host 0)" "$(worker_host 0)" oneway; hold=3 ;;
    shard_cut_ckpt)
      local w
      for ((w = 0; w < kWorkers; ++w)); do lab_partition "$(shard_host 1)" "$(worker_host $w)"; done
      hold=3 ;;
    primary_cut_backup) lab_partition "$(replica_host 1 0)" "$(replica_host 1 1)"; hold=4 ;;
    primary_isolated | backup_isolated)
      local cut other
      cut=$(replica_host 1 $([[ $1 == primary_isolated ]] && echo 0 || echo 1))
      for ((other = 0; other < LAB_HOSTS; ++other)); do
        ((other == cut)) || lab_partition "$cut" "$other"
      done
      hold=4 ;;
    primary_cut_workers | backup_cut_workers)
      local w cut
      cut=$(replica_host 1 $([[ $1 == primary_cut_workers ]] && echo 0 || echo 1))
      for ((w = 0; w < kWorkers; ++w)); do lab_partition "$cut" "$(worker_host $w)"; done
      hold=4
      [[ $1 == backup_cut_workers ]] && hold=12 ;;
  esac
}

# trial FAULT MODE PLANE INDEX: prints one table row; returns 1 when it
# failed.
trial() {
  local fault=$1 mode=$2 plane=$3 trial_count=$4
  local dir="$run/$fault-$mode-$plane"
  mkdir -p "$dir"
  LAB_PREFIX="pstlab$$-t$trial_count"
  local rate=1gbit
  [[ $fault == sigterm_slow_link ]] && rate=2mbit
  lab_create $((kShards * replicas + kWorkers)) $rate
  local s r w server_pids=() worker_pids=()
  local proxy_delay="" proxy_jitter=""
  case $fault in
    delay20) proxy_delay=20 proxy_jitter=10 ;;
    reorder) proxy_delay=2 proxy_jitter=2 ;;
  esac
  for ((s = 0; s < kShards * replicas; ++s)); do
    local host bind extra=() shard=$((s / replicas)) replica=$((s % replicas))
    host=$(replica_host $shard $replica)
    bind=$(lab_addr "$host")
    # Behind a proxy the shard listens on its own loopback and the proxy on
    # the host's address, same ports: the workers cannot tell.
    [[ -n $proxy_delay ]] && bind=127.0.0.1
    [[ $fault == shard_cut_ckpt ]] && extra=(--checkpoint_dir="$dir/ckpt$s" --checkpoint_every_steps=10)
    ((replicas > 1)) && extra+=(--replicas=$replicas --replica_index=$replica
      --replica_hosts="$(replica_set $shard ,)")
    lab_exec "$host" "$run/bin/ps_server" --host="$bind" --port=$kPort \
      --data_port=$kDataPort --shard_id=$shard --num_shards=$kShards \
      --num_workers=$kWorkers --mode="$mode" --optimizer=sgd --learning_rate=1 \
      --worker_lease_s=2 "${extra[@]}" >"$dir/ps$s.out" 2>"$dir/ps$s.log" &
    server_pids+=($!)
    if [[ -n $proxy_delay ]]; then
      lab_exec "$host" "$run/bin/delay_proxy" --listen_host="$(lab_addr "$host")" \
        --ports=$kPort,$kDataPort --delay_ms=$proxy_delay --jitter_ms=$proxy_jitter \
        --seed=$((trial_count * 7 + s)) --duration_s=$((kDeadline + 60)) \
        >"$dir/proxy$s.log" 2>&1 &
    fi
  done
  if [[ $fault == data_port_dropped ]]; then
    for ((s = 0; s < kShards; ++s)); do lab_drop_port "$(shard_host $s)" $kDataPort; done
  fi
  local started=$SECONDS check_pulls=
  [[ $mode == sync ]] && check_pulls=--probe_check_pulls
  for ((w = 0; w < kWorkers; ++w)); do
    lab_exec "$(worker_host $w)" "$run/bin/worker" --ps_hosts="$(hosts_csv)" \
      --worker_id=$w --num_workers=$kWorkers --model=probe \
      --probe_elements=$kElements --block_elements=$kBlockElements \
      --steps="$steps" --inject_step_delay_ms=10 --device=cpu --log_every=0 \
      --heartbeat_interval_s=0.5 --connect_timeout_s=30 --rpc_timeout_s=30 \
      --data_plane=$([[ $plane == data ]] && echo true || echo false) \
      --pulls_from_backups=$backup_reads --pipeline_step=$pipeline_step \
      $check_pulls "${worker_flags[@]}" \
      >"$dir/worker$w.out" 2>"$dir/worker$w.log" &
    worker_pids+=($!)
  done

  # The fault starts a quarter into the job and is healed after $hold s.
  local hold=0 heal_version=-1 recover_s="-" v
  local fault_at=$((steps / 4)) t0
  t0=$(date +%s.%N)
  while v=$(min_version); ((v < fault_at)); do
    if (($(date +%s) - ${t0%.*} > 60)); then break; fi
    sleep 0.1
  done
  local fault_version steps_during="-"
  fault_version=$(min_version)
  apply_fault "$fault"
  if ((hold > 0)); then
    sleep "$hold"
    lab_heal
    # Read after the heal: the observer may not reach every shard before.
    heal_version=$(min_version)
    steps_during=$((heal_version - fault_version))
    local healed_at
    healed_at=$(date +%s.%N)
    # Recovery: the first step completed after the heal (bounded by the
    # deadline; a job that finished meanwhile has recovered).
    while :; do
      v=$(min_version)
      if ((v > heal_version || v >= steps)) || ! kill -0 "${worker_pids[0]}" 2>/dev/null; then
        recover_s=$(awk -v a="$healed_at" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f", b - a}')
        break
      fi
      if (($(date +%s) - ${healed_at%.*} > kDeadline)); then recover_s=">$kDeadline"; break; fi
      sleep 0.05
    done
  fi

  # Every worker ends by the deadline, or the trial is hung.
  local result=ok codes="" code
  for ((w = 0; w < kWorkers; ++w)); do
    code=0
    while kill -0 "${worker_pids[$w]}" 2>/dev/null && ((SECONDS - started < kDeadline)); do sleep 0.2; done
    if kill -0 "${worker_pids[$w]}" 2>/dev/null; then
      result=hung
      kill -9 "${worker_pids[$w]}" 2>/dev/null || true
    fi
    wait "${worker_pids[$w]}" || code=$?
    codes+="${codes:+/}$code"
    # A stopped worker exits 0 once its step is in, 143 when cut in a wait
    # (after its step, or in its push: the shards' steps tell which).
    local clean_exit=0
    [[ $fault == sigterm_slow_link && $code == 143 ]] && clean_exit=143
    [[ $code != "$clean_exit" && $result == ok ]] && result="failed"
  done
  local wall=$((SECONDS - started))

  # The exact checks, read from the router.
  local stats check mismatches pushed=0 late=0 applied lost short dup steps_run piped
  stats=$(observe)
  observe --expect_shard_versions >"$dir/check.txt" || true
  check=$(grep '^check' "$dir/check.txt" || echo "check mismatches=?")
  mismatches=$(sed -n 's/.*mismatches=\([0-9?]*\).*/\1/p' <<<"$check")
  for ((w = 0; w < kWorkers; ++w)); do
    local final
    final=$(grep '"event":"final"' "$dir/worker$w.out" || true)
    steps_run=$(json_field steps_run "$final")
    pushed=$((pushed + ${steps_run:-0} * kBlocks))
    local late_blocks
    late_blocks=$(json_field late_blocks "$final")
    late=$((late + ${late_blocks:-0}))
    ((w == 0)) && piped=$(json_field pipelined "$final" | sed -e 's/^true$/y/' -e 's/^false$/n/' -e 's/^$/-/')
    # A worker stopped while it waited prints no final line: its log says.
    if ((w == 0)) && [[ -z $piped || $piped == - ]] && grep -q 'steps run as a pipeline' "$dir/worker0.log"; then
      piped=y
    fi
  done
  applied=$(sum_field blocks_applied "$stats")
  lost=$(sum_field gradients_lost "$stats")
  short=$(sum_field steps_short "$stats")
  dup=$(sum_field blocks_duplicate "$stats")
  local uncounted=$((pushed - applied - late - lost))
  [[ $mismatches != 0 && $result == ok ]] && result="double-applied"
  if [[ $fault == sigterm_slow_link ]]; then
    uncounted="-"
    # The signals came: the job stopped before its end.
    if [[ $result == ok && $(version_of 0 "$stats") -ge $steps ]]; then
      result="not-stopped"
    fi
    if [[ $mode == sync && $result == ok &&
          ($(version_of 0 "$stats") != "$(version_of 1 "$stats")" || $short != 0) ]]; then
      result="stopped-apart"
    fi
  elif ((replicas == 1)); then
    [[ $uncounted != 0 && $result == ok ]] && result="uncounted"
  else
    uncounted="-"
    local s0 s1
    s0=$(version_of 0 "$stats") s1=$(version_of 1 "$stats")
    if [[ $mode == sync && $result == ok && ($s0 != "$steps" || $s1 != "$steps") ]]; then
      result="lost"
    fi
  fi
  printf '%-16s %-5s %-4s %-5s %-14s %5s %6s %8s %6s %6s %5s %5s %6s %9s %10s %12s\n' \
    "$fault" "$mode" "$plane" "$piped" "$result" "$codes" "$wall" "$recover_s" \
    "$(version_of 0 "$stats")" "$late" "$lost" "$short" "$dup" \
    "$mismatches" "$uncounted" "$steps_during"
  for pid in "${server_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  lab_destroy
  trap - EXIT INT TERM
  [[ $result == ok ]]
}

header=$(printf '%-16s %-5s %-4s %-5s %-14s %5s %6s %8s %6s %6s %5s %5s %6s %9s %10s %12s' \
  fault mode plane piped result exits wall_s recover_s steps late lost short dup \
  doubled uncounted steps_during)
trial_count=0
failed=0
rows=""
trap 'lab_destroy' EXIT
echo "$header"
for fault in ${faults//,/ }; do
  for mode in ${modes//,/ }; do
    for plane in ${planes//,/ }; do
      trial_count=$((trial_count + 1))
      row=$(trial "$fault" "$mode" "$plane" "$trial_count") || failed=$((failed + 1))
      echo "$row"
      rows+="$row"$'\n'
    done
  done
done
total=$(grep -c . <<<"$rows")
hung=$(grep -c ' hung ' <<<"$rows" || true)
summary="trials $total, failed $failed, hung $hung (logs: $run)"
echo "$summary"
if [[ -n $report ]]; then
  {
    echo "# bench/netns/fault_trials.sh $command_line"
    echo "# commit $BENCH_COMMIT, $BENCH_MACHINE, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%F)"
    echo "# 2 shards x 2 workers, one host each ($replicas replica(s) a shard), 1 Gbit/s links; probe model"
    echo "# ($kElements floats, $kBlocks blocks), SGD lr 1, $steps steps, lease 2 s."
    echo "$header"
    printf '%s' "$rows"
    echo "$summary"
  } >"$report"
fi
((failed == 0))
