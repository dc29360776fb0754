#!/usr/bin/env bash
# The main job, end to end on this machine: install what is missing, build,
# then train on built-in synthetic data with 2 parameter servers and 2
# workers, in sync and in async mode:
#  - an MLP classifier (best achievable test accuracy 0.9625, chance 0.25);
#  - a CTR model whose embedding tables live sharded on the servers (each
#    step moves only the rows its batch touches), scored by AUC against the
#    data's hidden ground truth.
#
#   deploy/local/demo.sh [extra worker flags, e.g. --steps=3000]
set -euo pipefail
cd "$(dirname "$0")/../.."

deploy/setup.sh
bazel build //ps_server:ps_server //worker:worker

summary=()
for mode in sync async; do
  echo "=== $mode: 2 servers, 2 workers ==="
  output=$(deploy/local/launch.sh --servers=2 --workers=2 --mode="$mode" -- \
    --server.optimizer=adam --server.learning_rate=0.01 \
    --model=mlp --hidden=64 --steps=1500 --batch_size=64 --log_every=300 "$@" |
    tee >(cat >&2))
  accuracy=$(grep -m1 '^{"event":"final"' <<<"$output" |
    sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p')
  summary+=("mlp $mode: worker 0 test accuracy $accuracy")
done
for mode in sync async; do
  echo "=== ctr $mode: 2 servers, 2 workers, sparse embedding tables ==="
  output=$(deploy/local/launch.sh --servers=2 --workers=2 --mode="$mode" -- \
    --server.optimizer=adam --server.learning_rate=0.01 \
    --model=ctr --ctr_fields=4 --ctr_dense=2 --ctr_vocab=2000 \
    --sparse_optimizer=adagrad --sparse_learning_rate=0.1 \
    --steps=400 --batch_size=128 --log_every=100 "$@" | tee >(cat >&2))
  auc=$(grep -m1 '^{"event":"final"' <<<"$output" |
    sed -n 's/.*"auc":\([0-9.]*\).*"true_auc":\([0-9.]*\).*/\1 (ground truth \2)/p')
  summary+=("ctr $mode: worker 0 held-out AUC $auc")
done
echo "=== done ==="
printf '%s\n' "${summary[@]}"
