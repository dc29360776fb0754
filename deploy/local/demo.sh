#!/usr/bin/env bash
# The main job, end to end on this machine: install what is missing, build,
# then with 2 parameter servers and 2 workers:
#  - train an MLP (784-256-128-10, Adam) on Fashion-MNIST, the real Zalando
#    images of Debian's dataset-fashion-mnist, in sync and then in async mode,
#    evaluating on the 10,000 held-out images after every epoch, and print the
#    final model's held-out accuracy beside the data set's published figure
#    for a 256-128-100 MLP (0.8833);
#  - train a small two-conv CNN on the same images (sync, 3 epochs), the
#    layer-list model an image job uses (--model=layers);
#  - train a CTR model whose embedding tables live sharded on the servers
#    (each step moves only the rows its batch touches), scored by AUC against
#    the synthetic data's hidden ground truth;
#  - train a PyTorch CNN (BatchNorm, Dropout, a custom loss) with Python
#    workers on pstrain.torch (worker/python/examples/fashion_mnist_cnn.py).
# About two minutes after the build on a 2-core machine.
#
#   deploy/local/demo.sh [extra worker flags, e.g. --epochs=15]
set -euo pipefail
cd "$(dirname "$0")/../.."

readonly REFERENCE="0.8833 (MLP 256-128-100, the Fashion-MNIST benchmark)"

deploy/setup.sh
bazel build //ps_server:ps_server //worker:worker
worker/python/install.sh  # the pstrain Python package, for the PyTorch example

# The value of "key" in a final JSON line.
json_field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" <<<"$2"; }

summary=()
for mode in sync async; do
  echo "=== Fashion-MNIST, $mode: 2 servers, 2 workers ==="
  output=$(deploy/local/launch.sh --servers=2 --workers=2 --mode="$mode" -- \
    --server.optimizer=adam --server.learning_rate=0.001 \
    --data=fashion_mnist --model=mlp --hidden=256,128 \
    --global_batch_size=128 --epochs=6 --eval_every_epochs=1 \
    --target_accuracy=0.85 --log_every=200 "$@" | tee >(cat >&2))
  finals=$(grep '^{"event":"final"' <<<"$output")
  first=$(head -n 1 <<<"$finals")
  accuracy=$(json_field test_accuracy "$first")
  # Every worker evaluates the job's final model: one number.
  distinct=$(while read -r line; do json_field test_accuracy "$line"; done <<<"$finals" | sort -u | wc -l)
  agree="all $(wc -l <<<"$finals") workers agree"
  ((distinct == 1)) || agree="WORKERS DISAGREE: $(tr '\n' ' ' <<<"$finals")"
  short=$(json_field steps_short "$first")
  [[ "${short:-0}" == 0 ]] && short="" || short="; $short short sync steps"
  summary+=("fashion-mnist mlp $mode: held-out accuracy $accuracy ($agree; $(json_field epochs "$first") epochs, 0.85 after $(json_field time_to_target_s "$first") s$short); published: $REFERENCE")
done
echo "=== Fashion-MNIST, CNN, sync: 2 servers, 2 workers ==="
output=$(deploy/local/launch.sh --servers=2 --workers=2 --mode=sync -- \
  --server.optimizer=adam --server.learning_rate=0.001 \
  --data=fashion_mnist --model=layers --cpu_threads=1 \
  --layers=conv:16:3,relu,maxpool:2,conv:32:3,relu,maxpool:2,flatten,dense:64,relu,dense:10 \
  --global_batch_size=128 --epochs=3 --eval_every_epochs=1 --log_every=200 |
  tee >(cat >&2))
first=$(grep -m1 '^{"event":"final"' <<<"$output")
summary+=("fashion-mnist cnn sync: held-out accuracy $(json_field test_accuracy "$first") after $(json_field epochs "$first") epochs (conv16-conv32-dense64; 12 epochs of a conv32-conv64 CNN reach 0.909, README)")
echo "=== CTR, async: 2 servers, 2 workers, sparse embedding tables ==="
output=$(deploy/local/launch.sh --servers=2 --workers=2 --mode=async -- \
  --server.optimizer=adam --server.learning_rate=0.01 \
  --model=ctr --ctr_fields=4 --ctr_dense=2 --ctr_vocab=2000 \
  --sparse_optimizer=adagrad --sparse_learning_rate=0.1 \
  --steps=400 --batch_size=128 --log_every=100 | tee >(cat >&2))
first=$(grep -m1 '^{"event":"final"' <<<"$output")
summary+=("ctr async: worker 0 held-out AUC $(json_field auc "$first") (ground truth $(json_field true_auc "$first"))")
echo "=== Fashion-MNIST, a PyTorch CNN (BatchNorm, Dropout) on pstrain.torch, sync: 2 servers, 2 workers ==="
output=$(deploy/local/launch.sh --servers=2 --workers=2 --mode=sync \
  --python=worker/python/examples/fashion_mnist_cnn.py -- \
  --server.optimizer=adam --server.learning_rate=0.001 --epochs=1 | tee >(cat >&2))
first=$(grep -m1 '^{"event":"final"' <<<"$output")
summary+=("fashion-mnist torch cnn sync: held-out accuracy $(json_field test_accuracy "$first") after $(json_field epochs "$first") epoch (worker/python/examples/fashion_mnist_cnn.py, Python workers)")
echo "=== done ==="
printf '%s\n' "${summary[@]}"
