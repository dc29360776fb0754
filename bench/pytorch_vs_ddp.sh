#!/usr/bin/env bash
# A PyTorch model trained on pstrain's servers against what a PyTorch user
# would run instead, in one run, on Fashion-MNIST with global batch 128 and
# Adam (lr 0.001), the same data order everywhere:
#   (a) pstrain sync: 2 servers x 2 Python workers (pstrain.torch);
#   (b) torch.nn.parallel.DistributedDataParallel over gloo, 2 processes;
#   (c) one torch process (1 thread, and 2: the machine's cores);
#   (d) the C++ worker, 2 servers x 2 workers sync (MLP only: the same
#       784-256-128-10 network);
#   (e) "apart": two torch processes at batch 64 each at once, with no
#       communication at all: the most any 2-worker job can reach on this
#       machine, whatever moves its gradients.
# Worker 0's step time, split into forward+backward and the update (pstrain:
# ps.step's PushPull; C++ worker: its compute and network wait), shows
# where pstrain's Python workers lose to the C++ worker.
# Job samples/s (global batch x steps / the slowest worker's training wall
# time) and the final model's held-out accuracy after the same epochs;
# ratios of (a) to the others. MLP and CNN (conv32-conv64-dense128);
# `--repeats` runs interleave the variants and report medians.
#
#   bench/pytorch_vs_ddp.sh [--repeats=3] [--epochs=1]
#
# Writes bench/results/pytorch_vs_ddp.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=3
epochs=1
for arg in "$@"; do
  case "$arg" in
    --repeats=*) repeats=${arg#*=} ;;
    --epochs=*) epochs=${arg#*=} ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "pytorch_vs_ddp.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || { echo "pytorch_vs_ddp.sh: --repeats must be a positive integer" >&2; exit 2; }

# .bazelrc builds with -O2 in every configuration.
bazel build //ps_server:ps_server //worker:worker
worker/python/install.sh >/dev/null
source bench/lib.sh
python=${PSTRAIN_PYTHON:-/usr/bin/python3}
out=bench/results/pytorch_vs_ddp.txt
train=bench/pytorch/train.py
run_dir=$(mktemp -d /tmp/pytorch_vs_ddp.XXXXXX)
trap 'rm -rf "$run_dir"' EXIT
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# The slowest worker's wall time and the first worker's accuracy, from the
# final JSON lines in a file: "samples/s accuracy".
summarize() {
  local file=$1 batch=128 steps wall=0 w accuracy
  steps=$(json_field steps "$(grep -m1 '^{"event":"final"' "$file")")
  accuracy=$(json_field test_accuracy "$(grep -m1 '^{"event":"final"' "$file")")
  while read -r line; do
    w=$(json_field wall_time_s "$line")
    wall=$(awk -v a="$wall" -v b="$w" 'BEGIN {print (b > a) ? b : a}')
  done < <(grep '^{"event":"final"' "$file")
  awk -v s="$steps" -v w="$wall" -v b="$batch" -v a="$accuracy" 'BEGIN {printf "%.1f %s\n", s * b / w, a}'
}

run_pstrain() {  # model
  deploy/local/launch.sh --servers=2 --workers=2 --mode=sync \
    --run_dir="$run_dir/launch" --python="$train" -- \
    --server.optimizer=adam --server.learning_rate=0.001 \
    --backend=pstrain --model="$1" --epochs="$epochs" >"$run_dir/out" 2>"$run_dir/err" ||
    { tail -n 30 "$run_dir/err" >&2; exit 1; }
  rm -rf "$run_dir/launch"
  split_step "$run_dir/out" compute_s update_s >"$run_dir/split"
  summarize "$run_dir/out"
}

run_ddp() {  # model
  local port rank pids=()
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  : >"$run_dir/out"
  for rank in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank WORLD_SIZE=2 \
      timeout 1800 "$python" "$train" --backend=ddp --model="$1" --epochs="$epochs" \
      >>"$run_dir/out" 2>"$run_dir/err$rank" &
    pids+=($!)
  done
  for rank in 0 1; do wait "${pids[rank]}" || { tail -n 20 "$run_dir/err$rank" >&2; exit 1; }; done
  summarize "$run_dir/out"
}

run_local() {  # model threads
  timeout 1800 "$python" "$train" --backend=local --model="$1" --threads="$2" \
    --epochs="$epochs" >"$run_dir/out" 2>"$run_dir/err" || { tail -n 20 "$run_dir/err" >&2; exit 1; }
  summarize "$run_dir/out"
}

run_apart() {  # model: two processes at half the global batch, unconnected
  local pids=() k
  : >"$run_dir/out"
  for k in 0 1; do
    timeout 1800 "$python" "$train" --backend=local --model="$1" --threads=1 \
      --global_batch=64 --epochs="$(awk -v e="$epochs" 'BEGIN {print e / 2}')" \
      >>"$run_dir/out" 2>"$run_dir/err$k" &
    pids+=($!)
  done
  for k in 0 1; do wait "${pids[k]}" || { tail -n 20 "$run_dir/err$k" >&2; exit 1; }; done
  summarize "$run_dir/out"
}

# Worker 0's ms per step: "forward+backward update" (pstrain.torch) or
# "compute network_wait" (the C++ worker), from its final JSON line.
split_step() {  # file compute_field update_field
  local line
  line=$(grep '^{"event":"final"' "$1" | grep -m1 '"worker_id": *0[,}]')
  awk -v c="$(json_field "$2" "$line")" -v u="$(json_field "$3" "$line")" \
    -v s="$(json_field steps "$line")" 'BEGIN {printf "%.2f %.2f\n", 1e3 * c / s, 1e3 * u / s}'
}

run_cpp() {  # the MLP on the C++ worker
  deploy/local/launch.sh --servers=2 --workers=2 --mode=sync --run_dir="$run_dir/launch" -- \
    --server.optimizer=adam --server.learning_rate=0.001 --data=fashion_mnist \
    --model=mlp --hidden=256,128 --global_batch_size=128 \
    --steps="$(awk -v e="$epochs" 'BEGIN {print int(e * 468)}')" \
    --cpu_threads=1 --log_every=0 >"$run_dir/out" 2>"$run_dir/err" ||
    { tail -n 30 "$run_dir/err" >&2; exit 1; }
  rm -rf "$run_dir/launch"
  split_step "$run_dir/out" compute_s network_wait_s >"$run_dir/split"
  # The C++ worker reports its own samples/s (training time, evaluations
  # left out): the job's is the sum over workers.
  local rate=0 line
  while read -r line; do
    rate=$(awk -v a="$rate" -v b="$(json_field samples_per_sec "$line")" 'BEGIN {print a + b}')
  done < <(grep '^{"event":"final"' "$run_dir/out")
  echo "$rate $(json_field test_accuracy "$(grep -m1 '^{"event":"final"' "$run_dir/out")")"
}

declare -A rate accuracy split
rows=()
for model in mlp cnn; do
  variants=(pstrain ddp local1 local2 apart)
  [[ $model == mlp ]] && variants+=(cpp)
  for ((r = 1; r <= repeats; r++)); do
    for v in "${variants[@]}"; do
      case "$v" in
        pstrain) result=$(run_pstrain "$model") ;;
        ddp) result=$(run_ddp "$model") ;;
        local1) result=$(run_local "$model" 1) ;;
        local2) result=$(run_local "$model" 2) ;;
        cpp) result=$(run_cpp) ;;
        apart) result=$(run_apart "$model") ;;
      esac
      if [[ $v == pstrain || $v == cpp ]]; then
        read -r c u <"$run_dir/split"
        split[$model.$v.compute]+="$c " split[$model.$v.update]+="$u "
      fi
      read -r samples acc <<<"$result"
      rate[$model.$v]+="$samples "
      accuracy[$model.$v]+="$acc "
      rows+=("$(printf '%-4s %-8s %3d %12.1f %9s' "$model" "$v" "$r" "$samples" "$acc")")
      echo "${rows[-1]}" >&2
    done
  done
done

med() { tr ' ' '\n' <<<"$1" | grep -v '^$' | median; }
{
  echo "# bench/pytorch_vs_ddp.sh --repeats=$repeats --epochs=$epochs"
  echo "# commit $BENCH_COMMIT; $BENCH_MACHINE; $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "# torch $("$python" -c 'import torch; print(torch.__version__)') (Debian python3-torch, CPU); load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# Fashion-MNIST, global batch 128, Adam lr 0.001, $epochs epoch(s); job samples/s"
  echo "# = 128 x steps / slowest worker's training time; accuracy: held-out, final model."
  echo "#"
  echo "# model variant run  samples/s  accuracy"
  printf '%s\n' "${rows[@]}"
  echo "#"
  echo "# medians; ratios are pstrain (a) over each variant"
  echo "# model variant   samples/s  accuracy  pstrain/variant"
  for model in mlp cnn; do
    a=$(med "${rate[$model.pstrain]}")
    for v in pstrain ddp local1 local2 apart cpp; do
      [[ -n "${rate[$model.$v]:-}" ]] || continue
      m=$(med "${rate[$model.$v]}")
      printf '%-5s %-8s %11.1f %9s %8.2f\n' "$model" "$v" "$m" "$(med "${accuracy[$model.$v]}")" \
        "$(awk -v a="$a" -v b="$m" 'BEGIN {print a / b}')"
    done
  done
  echo "#"
  echo "# worker 0, medians, ms per step: forward+backward (C++: compute), update"
  echo "# (pstrain.torch: ps.step's PushPull; C++: network wait)"
  for key in mlp.pstrain cnn.pstrain mlp.cpp; do
    printf '%-12s %8.2f %8.2f\n' "$key" "$(med "${split[$key.compute]}")" "$(med "${split[$key.update]}")"
  done
} | tee "$out"
