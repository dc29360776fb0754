#!/usr/bin/env bash
# Checkpoints against training (issue 28), three measurements:
#
# 1. Stall: the 67 MB MLP 32-4096-4096-4 (1 server, 1 worker, sync, SGD),
#    step times (from the worker's --metrics_csv) with no checkpoints, then
#    with a checkpoint every --every steps to a directory on the root disk,
#    then the same with that directory on a loop device whose writes are
#    throttled to --throttle_mbps (cgroup v1 blkio.throttle or v2 io.max,
#    whichever this machine has; skipped with the reason where neither
#    works). Reported: p50 and p99 of every step, and of the steps that ran
#    while a checkpoint was written (the --window steps after each
#    checkpoint's step), each as a ratio to the no-checkpoint run measured
#    in the same invocation. Goal: <= 1.1x.
# 2. Full disk for --full_s seconds (a 2 MiB tmpfs filled by a filler file,
#    checkpoints every 20 steps of an MLP 512,256): failed tries (Stats, via
#    /metrics) and checkpoint log lines. Goal: <= 10 of each in 60 s.
# 3. The issue's scenario: the same tmpfs with no filler (three ~600 KB
#    checkpoints fill it), 1000 steps: failed tries and log lines.
#
#   bench/checkpoint_stall.sh [--steps=200] [--repeats=3] [--every=20] [--window=3]
#       [--throttle_mbps=20] [--full_s=60] [--keep]
#
# --keep leaves the run directory (logs, step CSVs) for a closer look.
#
# Needs root for the mounts (tmpfs, loop device) and the cgroup. Writes
# bench/results/checkpoint_stall.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=200
repeats=3
every=20
window=3
throttle_mbps=20
full_s=60
keep=0
for arg in "$@"; do
  case "$arg" in
    --steps=*) steps=${arg#*=} ;;
    --repeats=*) repeats=${arg#*=} ;;
    --every=*) every=${arg#*=} ;;
    --window=*) window=${arg#*=} ;;
    --throttle_mbps=*) throttle_mbps=${arg#*=} ;;
    --full_s=*) full_s=${arg#*=} ;;
    --keep) keep=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "checkpoint_stall.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in steps repeats every window throttle_mbps full_s; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "checkpoint_stall.sh: --$v must be a positive integer, got '${!v}'" >&2; exit 2; }
done

bazel build //ps_server:ps_server //worker:worker >/dev/null
source bench/lib.sh
out=bench/results/checkpoint_stall.txt
server_bin=bazel-bin/ps_server/ps_server
worker_bin=bazel-bin/worker/worker

run_dir=$(mktemp -d /tmp/checkpoint_stall.XXXXXX)
pids=()
mounts=()
loop_dev=""
cgroup_dir=""
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  for m in "${mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
  [[ -n "$loop_dev" ]] && losetup -d "$loop_dev" 2>/dev/null || true
  [[ -n "$cgroup_dir" ]] && rmdir "$cgroup_dir" 2>/dev/null || true
  if ((keep)); then echo "run directory kept: $run_dir" >&2; else rm -rf "$run_dir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start_server NAME CGROUP_PROCS_FILE_OR_EMPTY FLAGS...: starts a ps_server
# on a free port (its port in $run_dir/NAME.port, metrics port in
# $run_dir/NAME.mport), joined to the cgroup first when one is given.
start_server() {
  local name=$1 procs=$2
  shift 2
  rm -f "$run_dir/$name.port" "$run_dir/$name.mport"
  if [[ -n "$procs" ]]; then
    bash -c 'echo $$ >"$1"; shift; exec "$@"' _ "$procs" \
      "$server_bin" --host=127.0.0.1 --port=0 --port_file="$run_dir/$name.port" \
      --metrics_port=-1 --metrics_host=127.0.0.1 --metrics_port_file="$run_dir/$name.mport" \
      --shard_id=0 --num_shards=1 --num_workers=1 --mode=sync "$@" \
      2>"$run_dir/$name.log" &
  else
    "$server_bin" --host=127.0.0.1 --port=0 --port_file="$run_dir/$name.port" \
      --metrics_port=-1 --metrics_host=127.0.0.1 --metrics_port_file="$run_dir/$name.mport" \
      --shard_id=0 --num_shards=1 --num_workers=1 --mode=sync "$@" \
      2>"$run_dir/$name.log" &
  fi
  server_pid=$!
  pids+=("$server_pid")
  for _ in $(seq 300); do
    [[ -s "$run_dir/$name.port" && -s "$run_dir/$name.mport" ]] && return 0
    kill -0 "$server_pid" 2>/dev/null || { cat "$run_dir/$name.log" >&2; return 1; }
    sleep 0.1
  done
  echo "checkpoint_stall.sh: server $name did not start" >&2
  return 1
}
stop_server() {
  kill -TERM "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
}
metric() {  # metric NAME LABEL_FILTER: the value from the server's /metrics
  curl -s "http://127.0.0.1:$(cat "$run_dir/$1.mport")/metrics" |
    awk -v m="$2{" -v f="$3" 'index($1, m) == 1 && index($1, f) {print $2; exit}'
}

# step_stats CSV...: "p50_ms p99_ms wp50_ms wp99_ms rp50_ms rp99_ms" over
# every step of every file, over the steps within $window after each
# checkpoint step (k*every < s <= k*every+window), and over the rest. The first 10 steps (warm-up) of each run
# are left out.
step_stats() {
  local rows
  rows=$(awk -F, -v every="$every" -v window="$window" '
    FNR == 1 {next}
    {t[FILENAME, $1 + 0] = $2; f[FILENAME] = 1; if ($1 + 0 > max) max = $1 + 0}
    END {
      for (file in f) for (s = 11; s <= max; s++) {
        if (!((file, s) in t) || !((file, s - 1) in t)) continue
        d = (t[file, s] - t[file, s - 1]) * 1000
        print "all", d
        print (((s - 1) % every < window) ? "win" : "rest"), d
      }
    }' "$@")
  pct() {  # pct KIND Q: the Q quantile (nearest rank) of the KIND rows
    awk -v k="$1" '$1 == k {print $2}' <<<"$rows" | sort -g |
      awk -v q="$2" '{v[NR] = $1} END {i = int(q * NR + 0.999); if (i < 1) i = 1; printf "%.1f", v[i]}'
  }
  echo "$(pct all 0.5) $(pct all 0.99) $(pct win 0.5) $(pct win 0.99) $(pct rest 0.5) $(pct rest 0.99)"
}

# stall_run NAME PROCS_OR_EMPTY SERVER_FLAGS...: one 67 MB job of $steps
# steps; its step times in $run_dir/NAME.csv, "checkpoints seconds" appended
# to $run_dir/NAME.ckpt.
stall_run() {
  local name=$1 procs=$2
  shift 2
  start_server "$name" "$procs" "$@" || return 1
  "$worker_bin" --ps_hosts="127.0.0.1:$(cat "$run_dir/$name.port")" --worker_id=0 \
    --num_workers=1 --model=mlp --num_features=32 --hidden=4096,4096 --num_classes=4 \
    --batch_size=32 --train_examples=8192 --test_examples=256 --steps="$steps" \
    --log_every=0 --progress=lines --device=cpu --cpu_threads=1 \
    --metrics_csv="$run_dir/$name.csv" >"$run_dir/$name.worker.out" 2>&1 ||
    { tail -n 20 "$run_dir/$name.worker.out" >&2; return 1; }
  local written took
  written=$(metric "$name" pstrain_checkpoint_written_total 'shard="0"')
  took=$(metric "$name" pstrain_checkpoint_duration_seconds_total 'shard="0"')
  stop_server
  echo "${written:-0} ${took:-0}" >>"$run_dir/${name%%.*}.ckpt"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.2f", a / b; else printf "-"}'; }
# row LABEL KIND: a table row for the runs of KIND against the base runs.
row() {
  local p50 p99 w50 w99 r50 r99 n t
  read -r p50 p99 w50 w99 r50 r99 < <(step_stats "$run_dir/$2".*.csv)
  read -r n t < <(awk '{n += $1; t += $2} END {printf "%d %.2f", n, (n > 0) ? t / n : 0}' "$run_dir/$2.ckpt")
  if [[ "$2" == base ]]; then w50=- w99=- r50=- r99=- n=0 t=-; fi
  printf '%-30s %7s %7s %8s %8s %8s %8s %6s %6s %6s %6s %5s %6s' "$1" "$p50" "$p99" "$w50" "$w99" "$r50" "$r99" \
    "$(ratio "${w50/-/$p50}" "$b50")" "$(ratio "${w99/-/$p99}" "$b99")" \
    "$(ratio "$w50" "$r50")" "$(ratio "$w99" "$r99")" "$n" "$t"
}

# The throttled disk: a loop device (ext4 on a file), writes capped for the
# server's cgroup.
throttle_note=""
slow_procs=""
if image=$(mktemp "$run_dir/disk.XXXXXX.img") && truncate -s 1G "$image" &&
  loop_dev=$(losetup --find --show "$image" 2>/dev/null) &&
  mkfs.ext4 -q "$loop_dev" 2>/dev/null && mkdir -p "$run_dir/slow" &&
  mount "$loop_dev" "$run_dir/slow" 2>/dev/null; then
  mounts+=("$run_dir/slow")
  majmin=$(lsblk -dno MAJ:MIN "$loop_dev" | tr -d ' ')
  bps=$((throttle_mbps * 1000 * 1000))
  if [[ -d /sys/fs/cgroup/blkio ]] && cgroup_dir=/sys/fs/cgroup/blkio/checkpoint_stall_$$ &&
    mkdir "$cgroup_dir" 2>/dev/null &&
    echo "$majmin $bps" >"$cgroup_dir/blkio.throttle.write_bps_device" 2>/dev/null; then
    slow_procs="$cgroup_dir/cgroup.procs"
    throttle_note="cgroup v1 blkio.throttle.write_bps_device $majmin ${throttle_mbps} MB/s"
  elif [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw io /sys/fs/cgroup/cgroup.controllers &&
    cgroup_dir=/sys/fs/cgroup/checkpoint_stall_$$ && mkdir "$cgroup_dir" 2>/dev/null &&
    echo "$majmin wbps=$bps" >"$cgroup_dir/io.max" 2>/dev/null; then
    slow_procs="$cgroup_dir/cgroup.procs"
    throttle_note="cgroup v2 io.max $majmin wbps=${throttle_mbps} MB/s"
  else
    cgroup_dir=""
    throttle_note="skipped: no cgroup io throttle available here"
  fi
  if [[ -n "$slow_procs" ]]; then
    # Check the throttle before trusting it: 64 MB written and fsync'ed
    # from inside the cgroup.
    check=$(bash -c 'echo $$ >"$1"; dd if=/dev/zero of="$2" bs=1M count=64 conv=fsync 2>&1 | tail -n 1' _ "$slow_procs" "$run_dir/slow/ddcheck")
    rm -f "$run_dir/slow/ddcheck"
    throttle_note="$throttle_note (dd 64 MB + fsync in the cgroup: ${check##*, })"
  fi
else
  throttle_note="skipped: no loop device or ext4 here"
fi

# The runs interleaved, so drift on a shared machine hits every kind alike.
mkdir -p "$run_dir/ckpt_disk"
for ((r = 1; r <= repeats; r++)); do
  echo "== stall, repeat $r/$repeats: no checkpoints" >&2
  stall_run "base.$r" ""
  echo "== stall, repeat $r/$repeats: checkpoint every $every steps to the root disk" >&2
  stall_run "disk.$r" "" --checkpoint_dir="$run_dir/ckpt_disk" --checkpoint_every_steps="$every"
  if [[ -n "$slow_procs" ]]; then
    echo "== stall, repeat $r/$repeats: checkpoint every $every steps to a ${throttle_mbps} MB/s disk" >&2
    stall_run "slow.$r" "$slow_procs" --checkpoint_dir="$run_dir/slow/ckpt" --checkpoint_every_steps="$every"
  fi
done
read -r b50 b99 _ _ _ _ < <(step_stats "$run_dir"/base.*.csv)
rows=("$(row 'no checkpoints' base)" "$(row "every $every steps, root disk" disk)")
[[ -n "$slow_procs" ]] && rows+=("$(row "every $every steps, ${throttle_mbps} MB/s disk" slow)")

# Full disk for $full_s seconds.
full_job() {  # full_job NAME STEPS: MLP 512,256 with checkpoints every 20 steps
  start_server "$1" "" --checkpoint_dir="$run_dir/tiny/ckpt" --checkpoint_every_steps=20 || return 1
  "$worker_bin" --ps_hosts="127.0.0.1:$(cat "$run_dir/$1.port")" --worker_id=0 \
    --num_workers=1 --model=mlp --hidden=512,256 --batch_size=32 --steps="$2" \
    --log_every=0 --progress=lines --device=cpu --cpu_threads=1 \
    >"$run_dir/$1.worker.out" 2>&1 &
  worker_pid=$!
  pids+=("$worker_pid")
}
mkdir -p "$run_dir/tiny"
mount -t tmpfs -o size=2m tmpfs "$run_dir/tiny"
mounts+=("$run_dir/tiny")
echo "== full disk for ${full_s} s" >&2
dd if=/dev/zero of="$run_dir/tiny/filler" bs=4k 2>/dev/null || true
full_job full 100000000
sleep "$full_s"  # the scenario's length, not a synchronisation
full_tries=$(curl -s "http://127.0.0.1:$(cat "$run_dir/full.mport")/metrics" |
  awk '/^pstrain_checkpoint_failures_total/ {n += $2} END {print n + 0}')
full_lines=$(grep -c checkpoint "$run_dir/full.log" || true)
full_start_lines=$(grep -c 'no checkpoint in' "$run_dir/full.log" || true)
kill -9 "$worker_pid" 2>/dev/null || true
stop_server
full_example=$(grep -m 2 -E 'checkpoint failed|checkpoints failing' "$run_dir/full.log" | sed 's/^/    /')

echo "== the issue's scenario: 2 MiB tmpfs, 1000 steps" >&2
rm -rf "$run_dir/tiny/filler" "$run_dir/tiny/ckpt"
full_job issue 1000
wait "$worker_pid" || true
issue_tries=$(curl -s "http://127.0.0.1:$(cat "$run_dir/issue.mport")/metrics" |
  awk '/^pstrain_checkpoint_failures_total/ {n += $2} END {print n + 0}')
issue_written=$(metric issue pstrain_checkpoint_written_total 'shard="0"')
issue_lines=$(grep -c -E 'checkpoint failed|checkpoints failing|before its time' "$run_dir/issue.log" || true)
stop_server

{
  echo "# bench/checkpoint_stall.sh: checkpoints against training (issue 28)"
  echo "# commit $BENCH_COMMIT; $BENCH_MACHINE; $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# args: --steps=$steps --repeats=$repeats --every=$every --window=$window --throttle_mbps=$throttle_mbps --full_s=$full_s"
  echo
  echo "## 1. Step time while a checkpoint is written (MLP 32-4096-4096-4, 67 MB, sync, 1x1, batch 32, $repeats runs of $steps steps each)"
  echo "# p50/p99: every step after 10 warm-up steps; ckpt_*: the $window steps after each checkpoint step"
  echo "# (the steps that ran while it was written); rest_*: the run's other steps."
  echo "# vs_base: ckpt_p50 / p50 and ckpt_p99 / p99 of the no-checkpoint runs; vs_rest: ckpt_* / rest_* of the"
  echo "# same runs (the same machine load: fairer on a shared machine). Goal: <= 1.10. s/ckpt: mean checkpoint duration"
  printf '%-30s %7s %7s %8s %8s %8s %8s %6s %6s %6s %6s %5s %6s\n' run p50_ms p99_ms ckpt_p50 ckpt_p99 rest_p50 rest_p99 \
    base50 base99 rest50 rest99 ckpts s/ckpt
  printf '%s\n' "${rows[@]}"
  echo "# throttled disk: $throttle_note"
  echo
  echo "## 2. Disk full for ${full_s} s (2 MiB tmpfs filled, MLP 512,256, checkpoint every 20 steps)"
  echo "failed tries: $full_tries (goal <= 10)"
  echo "checkpoint log lines: $((full_lines - full_start_lines)) (goal <= 10; the start-up 'no checkpoint' line not counted)"
  echo "$full_example"
  echo
  echo "## 3. The issue's scenario: 2 MiB tmpfs, no filler, 1000 steps (3 checkpoints of ~600 KB fill it)"
  echo "written: ${issue_written:-0}; failed tries: $issue_tries; failure/early-prune log lines: $issue_lines"
  echo "# (before: 396 failed tries and 1,333 lines in 3.4 s; now the files the write would prune go first)"
} | tee "$out"
