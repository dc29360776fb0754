#!/usr/bin/env bash
# The main job, end to end on this machine: install what is missing, build,
# then train an MLP on the built-in synthetic task (best achievable test
# accuracy 0.9625, chance 0.25) with 2 parameter servers and 2 workers, once
# in sync mode and once in async mode.
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
    tee /dev/stderr)
  accuracy=$(grep -m1 '^{"event":"final"' <<<"$output" |
    sed -n 's/.*"test_accuracy":\([0-9.]*\).*/\1/p')
  summary+=("$mode: worker 0 test accuracy $accuracy")
done
echo "=== done ==="
printf '%s\n' "${summary[@]}"
