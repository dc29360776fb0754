#!/usr/bin/env bash
# pstrain.torch between hosts (issue 37): a sync PyTorch job on the netns lab
# (tests/netns/lab.sh), 2 servers and 2 Python workers each on its own host
# with a shaped full-duplex link, its step pipelined (ParameterServer's
# default "auto": the servers are on other hosts, so the exchange starts
# during backward) and plain (pipeline=False), against what a PyTorch user
# would run instead over the same links: DistributedDataParallel over gloo,
# 2 ranks on 2 hosts. bench/pytorch/train.py in every variant: Fashion-MNIST,
# global batch 128, Adam (lr 0.001), one torch thread a process, the same
# data order; variants interleaved.
#
#   bazel build //ps_server && worker/python/install.sh
#   bench/netns/torch_pipeline.sh [--rate=1gbit] [--repeats=3]
#       [--epochs=0.25] [--models=mlp,cnn] [--report=FILE]
#
# Prints, per model and variant, the medians over repeats of the job's
# samples/s (global batch x steps / the slower worker's wall time), worker
# 0's forward+backward and update ms a step (DDP's all-reduce runs inside
# backward; pstrain's pipelined exchange too, its rest in ps.step()), the
# pipelined steps and the held-out accuracy; then pipelined / plain and
# pipelined / DDP.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
source tests/netns/lab.sh
source bench/lib.sh

command_line="$*"
rate=1gbit repeats=3 epochs=0.25 models=mlp,cnn report=""
for arg in "$@"; do
  case $arg in
    --rate=*) rate=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    --epochs=*) epochs=${arg#*=} ;;
    --models=*) models=${arg#*=} ;;
    --report=*) report=${arg#*=} ;;
    *) echo "torch_pipeline.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ $repeats =~ ^[1-9][0-9]*$ ]] || { echo "torch_pipeline.sh: --repeats must be a positive integer, got '$repeats'" >&2; exit 2; }
[[ $epochs =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "torch_pipeline.sh: --epochs must be a positive number, got '$epochs'" >&2; exit 2; }
for m in ${models//,/ }; do
  [[ $m == mlp || $m == cnn ]] || { echo "torch_pipeline.sh: --models takes mlp and cnn, got '$m'" >&2; exit 2; }
done
lab_require || exit 0
python=${PSTRAIN_PYTHON:-/usr/bin/python3}
server=$repo/bazel-bin/ps_server/ps_server
[[ -x $server ]] || { echo "torch_pipeline.sh: missing $server; bazel build //ps_server" >&2; exit 2; }
(cd / && "$python" -c 'import pstrain.torch') 2>/dev/null ||
  { echo "torch_pipeline.sh: $python has no pstrain; worker/python/install.sh" >&2; exit 2; }
run=$(mktemp -d /tmp/torch_pipeline.XXXXXX)
cp "$server" "$run/ps_server"
train=$repo/bench/pytorch/train.py

# run_job VARIANT MODEL: prints "samples/s compute_ms update_ms pipelined accuracy"
run_job() {
  local variant=$1 model=$2
  local dir="$run/$variant-$model-$((++job_count))"
  mkdir -p "$dir"
  LAB_PREFIX="pstlab$$-j$job_count"
  lab_create 4 "$rate"
  local w pids=() ps
  ps="\"$(lab_addr 0):7000\",\"$(lab_addr 1):7000\""
  if [[ $variant != ddp ]]; then
    for s in 0 1; do
      lab_exec $s "$run/ps_server" --host="$(lab_addr $s)" --port=7000 \
        --data_port=7001 --shard_id=$s --num_shards=2 --num_workers=2 \
        --mode=sync >"$dir/ps$s.out" 2>"$dir/ps$s.log" &
    done
  fi
  for w in 0 1; do
    if [[ $variant == ddp ]]; then
      lab_exec $((2 + w)) env MASTER_ADDR="$(lab_addr 2)" MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 \
        RANK=$w WORLD_SIZE=2 OMP_NUM_THREADS=1 timeout 900 "$python" "$train" \
        --backend=ddp --model="$model" --epochs="$epochs" \
        >"$dir/worker$w.out" 2>"$dir/worker$w.log" &
    else
      lab_exec $((2 + w)) env OMP_NUM_THREADS=1 \
        PSTRAIN_CLUSTER="{\"ps\":[$ps],\"workers\":2,\"mode\":\"sync\",\"task\":{\"type\":\"worker\",\"index\":$w}}" \
        timeout 900 "$python" "$train" --backend=pstrain --model="$model" \
        --epochs="$epochs" --pipeline="$([[ $variant == plain ]] && echo off || echo auto)" \
        >"$dir/worker$w.out" 2>"$dir/worker$w.log" &
    fi
    pids+=($!)
  done
  local ok=1 pid
  for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
  lab_destroy
  local f0 f1
  f0=$(grep -m1 '^{"event":"final"' "$dir/worker0.out" || true)
  f1=$(grep -m1 '^{"event":"final"' "$dir/worker1.out" || true)
  if ((!ok)) || [[ -z $f0 || -z $f1 ]]; then
    echo "torch_pipeline.sh: $variant $model failed; logs in $dir" >&2
    echo "nan nan nan nan nan"
    return
  fi
  awk -v w0="$(json_field wall_time_s "$f0")" -v w1="$(json_field wall_time_s "$f1")" \
    -v steps="$(json_field steps "$f0")" -v c="$(json_field compute_s "$f0")" \
    -v u="$(json_field update_s "$f0")" -v p="$(json_field pipelined_steps "$f0")" \
    -v a="$(json_field test_accuracy "$f0")" \
    'BEGIN {w = w0 > w1 ? w0 : w1;
            printf "%.1f %.2f %.2f %s %s\n", steps * 128 / w, 1e3 * c / steps, 1e3 * u / steps, p, a}'
}

job_count=0
variants=(pipelined plain ddp)
declare -A results
for ((r = 1; r <= repeats; ++r)); do
  for model in ${models//,/ }; do
    for v in "${variants[@]}"; do
      line=$(run_job "$v" "$model")
      echo "repeat $r $model $v: $line" >&2
      results[$model.$v]+="$line"$'\n'
    done
  done
done

median() { grep -v nan | sort -g | awk '{a[NR] = $1} END {print (NR ? a[int((NR + 1) / 2)] : "nan")}'; }
column() { awk -v c="$2" 'NF {print $c}' <<<"${results[$1]}" | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
{
  echo "# torch_pipeline: pstrain.torch's pipelined step between hosts, against its plain step and DDP (issue 37)"
  echo "command: bench/netns/torch_pipeline.sh $command_line"
  echo "commit: $BENCH_COMMIT; machine: $BENCH_MACHINE; links: $rate each host, full duplex (tbf)"
  echo "2 servers + 2 Python workers (DDP: 2 ranks), each on its own lab host; bench/pytorch/train.py,"
  echo "Fashion-MNIST, global batch 128, Adam, --epochs=$epochs, 1 thread a process; medians of $repeats interleaved runs"
  echo
  for model in ${models//,/ }; do
    printf '%-5s %-10s %10s %11s %10s %10s %9s\n' model variant samples/s fwd+bwd_ms update_ms pipelined accuracy
    declare -A sps=()
    for v in "${variants[@]}"; do
      sps[$v]=$(column "$model.$v" 1)
      printf '%-5s %-10s %10s %11s %10s %10s %9s\n' "$model" "$v" "${sps[$v]}" "$(column "$model.$v" 2)" \
        "$(column "$model.$v" 3)" "$(column "$model.$v" 4)" "$(column "$model.$v" 5)"
    done
    echo "$model pipelined / plain: $(ratio "${sps[pipelined]}" "${sps[plain]}")x; pipelined / DDP: $(ratio "${sps[pipelined]}" "${sps[ddp]}")x"
    echo
  done
} | if [[ -n $report ]]; then tee "$report"; else cat; fi
rm -rf "$run"
