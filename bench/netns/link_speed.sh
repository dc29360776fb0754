#!/usr/bin/env bash
# The PS at link speed: a sync step of the Fashion-MNIST MLP and CNN on the
# netns lab (tests/netns/lab.sh), every shard and worker on its own host with
# a shaped full-duplex link, against the link-bound ideal.
#
#   bazel build //ps_server //worker //bench/soak:observer
#   bench/netns/link_speed.sh [--rate=1gbit] [--repeats=3] [--steps=150]
#       [--models=mlp,cnn,probe] [--workers=2,4] [--shards=1,2,4]
#       [--replicas=1] [--report=FILE] [--any_rate] [--bin_dir=DIR]
#       [-- extra worker flags]
#
# probe: the MLP's size (235,146 floats) with no compute, the network part
# alone. --any_rate measures even where the shaping misses its rate (e.g.
# --rate=10gbit, above what veth pairs carry on this machine: the CPU floor
# of the exchange; the ratio to the ideal is then meaningless).
#
# --bin_dir: where ps_server/ps_server, worker/worker and
# bench/soak/observer are (default bazel-bin; another build's, to compare;
# a relative path is from the repository's root).
#
# --replicas=R: each shard held by R servers (ps_server --replicas), each on
# a host of its own; the primary is replica 0.
#
# The ideal: links are full duplex, so for each host the bytes it must send
# and those it must receive in a step, each divided by the link rate; the
# largest over hosts and directions. A worker sends and receives the model
# (P bytes); a shard receives W*P/S and sends as much. With replicas the
# primary also sends each backup its step's record (the step's summed
# gradient, P/S: ps_server/replication.h), so it sends (W + R - 1)*P/S. The rate is what a raw
# TCP stream (iperf3) measured between two lab hosts in this run, so TCP/IP
# headers are not counted against the PS; the run stops when that stream is
# more than 10% off the set rate (the shaping is not to be trusted then).
#
# Per configuration it prints the median over repeats of the step time
# (worker 0: wall time less evaluation, over the steps), its ratio to the
# ideal, worker 0's network-wait share, and the job's samples/s; and the
# throughput growth from 1 shard to 2 and 4.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
source tests/netns/lab.sh
source bench/lib.sh

command_line="$*"
rate=1gbit repeats=3 steps=150 models=mlp,cnn workers_list=2,4 shards_list=1,2,4
replicas=1
report=""
bin=$repo/bazel-bin
any_rate=0
extra=()
while (($#)); do
  case $1 in
    --rate=*) rate=${1#*=} ;;
    --repeats=*) repeats=${1#*=} ;;
    --steps=*) steps=${1#*=} ;;
    --models=*) models=${1#*=} ;;
    --workers=*) workers_list=${1#*=} ;;
    --shards=*) shards_list=${1#*=} ;;
    --replicas=*) replicas=${1#*=} ;;
    --report=*) report=${1#*=} ;;
    --any_rate) any_rate=1 ;;
    --bin_dir=*) bin=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "link_speed.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

[[ $replicas =~ ^[1-9]$ ]] || { echo "link_speed.sh: --replicas must be 1-9, got '$replicas'" >&2; exit 2; }
lab_require || exit 0
command -v iperf3 >/dev/null || { echo "link_speed.sh: needs iperf3 (deploy/setup.sh installs it)" >&2; exit 2; }
for b in ps_server/ps_server worker/worker bench/soak/observer; do
  [[ -x $bin/$b ]] || { echo "link_speed.sh: missing $bin/$b; bazel build //ps_server //worker //bench/soak:observer" >&2; exit 2; }
done
run=$(mktemp -d /tmp/link_speed.XXXXXX)
mkdir -p "$run/bin"
cp $bin/ps_server/ps_server $bin/worker/worker $bin/bench/soak/observer "$run/bin/"

readonly CNN=conv:32:3,relu,maxpool:2,conv:64:3,relu,maxpool:2,flatten,dense:128,relu,dense:10
model_flags() {
  case $1 in
    mlp) echo "--model=mlp --hidden=256,128" ;;
    probe) echo "--model=probe --probe_elements=235146" ;;
    cnn) echo "--model=layers --layers=$CNN" ;;
  esac
}

# The shaping, checked: a raw TCP stream from host 0 to host 1 and back.
LAB_PREFIX="pstlab$$-rate"
lab_create 2 "$rate"
rate_bps() {  # rate_bps FROM TO
  lab_exec "$2" iperf3 -s -1 -D -p 5201 >/dev/null
  local tries=0
  until lab_exec "$1" iperf3 -c "$(lab_addr "$2")" -p 5201 -t 2 -J >"$run/iperf.json" 2>/dev/null; do
    ((++tries < 20)) || { echo "link_speed.sh: iperf3 failed" >&2; exit 1; }
    sleep 0.1
  done
  python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"]))' "$run/iperf.json"
}
up=$(rate_bps 0 1)
down=$(rate_bps 1 0)
lab_destroy
set_bps=$(tc_rate_bits "$rate")
link_bps=$(((up + down) / 2))
rate_line="link: set $rate; raw TCP (iperf3) $((up / 1000000)) and $((down / 1000000)) Mbit/s each way ($(awk -v a=$link_bps -v b=$set_bps 'BEGIN {printf "%.3f", a / b}')x the set rate)"
echo "$rate_line"
if ((!any_rate)) && awk -v a=$link_bps -v b=$set_bps 'BEGIN {exit !(a < 0.9 * b || a > 1.02 * b)}'; then
  echo "link_speed.sh: the shaped link does not reach its rate; not measuring" >&2
  exit 1
fi

# run_job MODEL WORKERS SHARDS REPEAT: prints "step_ms wait_share samples_per_s elements"
run_job() {
  local model=$1 W=$2 S=$3 rep=$4
  local dir="$run/$model-w$W-s$S-r$rep"
  mkdir -p "$dir"
  LAB_PREFIX="pstlab$$-$model$W$S$rep"
  local R=$replicas servers=$((S * replicas))
  lab_create $((servers + W)) "$rate"
  local s r w h hosts="" set pids=()
  # Replica r of shard s on host s*R + r; a shard's entry lists its replicas
  # joined by '|'.
  for ((s = 0; s < S; ++s)); do
    set=""
    for ((r = 0; r < R; ++r)); do set+="${set:+|}$(lab_addr $((s * R + r))):7000"; done
    hosts+="${hosts:+,}$set"
  done
  for ((s = 0; s < S; ++s)); do
    for ((r = 0; r < R; ++r)); do
      h=$((s * R + r))
      local replica_flags=()
      if ((R > 1)); then
        replica_flags=(--replicas=$R --replica_index=$r
          --replica_hosts="$(cut -d, -f$((s + 1)) <<<"$hosts" | tr '|' ,)")
      fi
      lab_exec $h "$run/bin/ps_server" --host="$(lab_addr $h)" --port=7000 \
        --data_port=7001 --shard_id=$s --num_shards=$S --num_workers=$W \
        --mode=sync --optimizer=adam "${replica_flags[@]}" \
        >"$dir/ps$h.out" 2>"$dir/ps$h.log" &
    done
  done
  # The lab's hosts share this machine's cores: each worker gets its share
  # of them for its BLAS threads, as launch.sh gives workers that share a
  # machine (a worker on a host of its own has that host's cores). Without
  # it 2 workers x every core kept both cores 98-100% busy and the links
  # idle while the kernel's network work waited (README, "The link speed").
  local share=()
  if [[ " ${extra[*]} " != *" --cpu_threads="* ]]; then
    share=(--cpu_threads=$(($(nproc) / W > 0 ? $(nproc) / W : 1)))
  fi
  for ((w = 0; w < W; ++w)); do
    # shellcheck disable=SC2046
    lab_exec $((servers + w)) timeout 300 "$run/bin/worker" --ps_hosts="$hosts" \
      --worker_id=$w --num_workers=$W $(model_flags "$model") \
      --data=fashion_mnist --global_batch_size=128 --steps="$steps" \
      --eval_every_epochs=0 --log_every=0 --device=cpu "${share[@]}" "${extra[@]}" \
      >"$dir/worker$w.out" 2>"$dir/worker$w.log" &
    pids+=($!)
  done
  local ok=1
  for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
  local final stats
  final=$(grep '"event":"final"' "$dir/worker0.out" || true)
  stats=$(lab_exec r timeout 30 "$run/bin/observer" --ps_hosts="$hosts" --num_workers=$W 2>/dev/null || true)
  tc -s -n "$(lab_ns r)" qdisc show >"$dir/router_qdiscs.txt" 2>&1 || true
  lab_destroy
  if ((!ok)) || [[ -z $final ]]; then
    echo "link_speed.sh: $model W=$W S=$S failed; logs in $dir" >&2
    echo "nan nan nan 0"
    return
  fi
  local elements=0 e
  for e in $(sed -n 's/.* elements=\([0-9]*\).*/\1/p' <<<"$stats"); do elements=$((elements + e)); done
  local samples=0 f
  for ((w = 0; w < W; ++w)); do
    f=$(grep '"event":"final"' "$dir/worker$w.out")
    samples=$(awk -v a=$samples -v b="$(json_field samples_per_sec "$f")" 'BEGIN {print a + b}')
  done
  awk -v wall="$(json_field wall_time_s "$final")" -v ev="$(json_field evaluation_s "$final")" \
    -v n="$(json_field steps_run "$final")" -v share="$(json_field network_wait_share "$final")" \
    -v samples=$samples -v el=$elements \
    'BEGIN {printf "%.2f %.3f %.0f %d\n", (wall - ev) * 1000 / n, share, samples, el}'
}

median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

header=$(printf '%-5s %3s %3s %9s %9s %7s %10s %10s %9s' model W S step_ms ideal_ms ratio wait_share samples/s vs_1shard)
echo "$header"
rows=""
for model in ${models//,/ }; do
  for W in ${workers_list//,/ }; do
    base_samples=""
    for S in ${shards_list//,/ }; do
      results=()
      for ((rep = 1; rep <= repeats; ++rep)); do results+=("$(run_job "$model" "$W" "$S" "$rep")"); done
      step=$(printf '%s\n' "${results[@]}" | awk '{print $1}' | median)
      share=$(printf '%s\n' "${results[@]}" | awk '{print $2}' | median)
      samples=$(printf '%s\n' "${results[@]}" | awk '{print $3}' | median)
      elements=$(printf '%s\n' "${results[@]}" | awk '{print $4}' | sort -n | tail -n 1)
      ideal=$(awk -v p=$((elements * 4)) -v w=$W -v s=$S -v r=$replicas -v bps=$link_bps \
        'BEGIN {b = p; if ((w + r - 1) * p / s > b) b = (w + r - 1) * p / s; printf "%.2f", b * 8 / bps * 1000}')
      [[ $S == 1 ]] && base_samples=$samples
      growth=$(awk -v a="$samples" -v b="${base_samples:-nan}" 'BEGIN {printf "%.2fx", a / b}')
      row=$(printf '%-5s %3s %3s %9s %9s %7s %10s %10s %9s' "$model" "$W" "$S" "$step" "$ideal" \
        "$(awk -v a="$step" -v b="$ideal" 'BEGIN {printf "%.2fx", a / b}')" "$share" "$samples" "$growth")
      echo "$row"
      rows+="$row"$'\n'
    done
  done
done
if [[ -n $report ]]; then
  {
    echo "# bench/netns/link_speed.sh $command_line"
    echo "# commit $BENCH_COMMIT, $BENCH_MACHINE, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%F)"
    echo "# $rate_line"
    echo "# sync, Adam, --replicas=$replicas, global batch 128, $steps steps, median of $repeats runs; MLP 784-256-128-10,"
    echo "# CNN $CNN; step_ms from worker 0 (wall less evaluation, per step)."
    echo "$header"
    printf '%s' "$rows"
  } >"$report"
fi
