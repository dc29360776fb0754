#!/usr/bin/env bash
# Network faults on real hosts-in-namespaces (bench/netns/fault_trials.sh,
# a few of its trials): a partition longer than the lease, a short one, loss,
# reordering, a shard cut off while it checkpoints, and partitions between a
# replicated shard's replicas. The sync trials run the pipelined step (the
# default where the shards are on other hosts). Each must finish with
# nothing applied twice and every lost gradient counted. Skips (passes with
# "SKIP:") where the machine does not allow network namespaces.
set -euo pipefail
runfiles=${RUNFILES_DIR:-${TEST_SRCDIR:-}}
[[ -n $runfiles ]] || { echo "run me with bazel test //tests:netns_faults_test" >&2; exit 1; }
root=$runfiles/pstrain
cd "$root"
trials() { bench/netns/fault_trials.sh --bin_dir="$root" --steps=120 "$@"; }
out=$(trials --faults=partition_long,loss5,shard_cut_ckpt,data_port_dropped --modes=sync --planes=data) ||
  { echo "$out"; exit 1; }
echo "$out"
grep -q '^SKIP: ' <<<"$out" && exit 0
# The sync trials ran pipelined, as a job across hosts does by default.
if awk 'NR > 1 && $2 == "sync" && $1 != "data_port_dropped" && $4 != "y" {bad = 1} END {exit !bad}' <<<"$out"; then
  echo "FAIL: a sync trial did not run the pipelined step" >&2
  exit 1
fi
# The partition really cut the worker off for longer than its lease: the
# shard completed steps without it and counted its late gradients.
read -r late short < <(awk '$1 == "partition_long" {print $10, $12}' <<<"$out")
if ((${late:-0} == 0 || ${short:-0} == 0)); then
  echo "FAIL: partition_long should have made steps short and gradients late (late=$late short=$short)" >&2
  exit 1
fi
# A data port that drops packets while gRPC works: the workers fall back to
# gRPC after one connect bound (5 s), not the 120 s call deadline.
wall=$(awk '$1 == "data_port_dropped" {print $7}' <<<"$out")
if ((${wall:-999} > 30)); then
  echo "FAIL: with the data port dropping packets the job took ${wall}s" >&2
  exit 1
fi
trials --faults=partition_short,reorder --modes=async --planes=grpc
# Every worker SIGTERMed while its pipelined push crawls over a 2 Mbit/s
# link: the step's grace covers the push, which goes in whole and every
# shard stops at the same step (with a grace of the step's compute alone,
# 4 of 4 were cut mid-push and the shards held two steps).
trials --faults=sigterm_slow_link --modes=sync --planes=data --steps=40
# Replicated shards: a primary cut from its backup (the backup takes over,
# the old primary is fenced at the heal) and an isolated backup; the model
# is exact and every shard at the last step.
trials --replicas=2 --faults=primary_cut_backup,backup_isolated --modes=sync --planes=data
