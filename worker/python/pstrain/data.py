"""The C++ worker's data, from Python: the same readers and the same order.

A job visits its training set in global batches of one permutation per
epoch, from (seed, epoch); worker k of W takes the k-th slice of each global
batch (worker/data.h, EpochPlan). So W Python workers with batch b see, step
by step, exactly the samples of one process with batch W*b, as the C++
workers do: the sync contract can be checked against a single process, and a
Python job compared with a C++ one sample for sample.
"""

import os

import numpy as np
import torch

from pstrain import _core

__all__ = ["Batches", "CtrData", "FASHION_MNIST", "auc", "evaluate",
           "fashion_mnist", "synthetic"]

# Debian's dataset-fashion-mnist, unless $PSTRAIN_FASHION_MNIST names
# another folder of the four -ubyte.gz files.
FASHION_MNIST = os.environ.get("PSTRAIN_FASHION_MNIST",
                               "/usr/share/datasets/fashion-mnist")


def fashion_mnist(train=True, directory=FASHION_MNIST):
    """Fashion-MNIST's 60,000 training (or 10,000 held-out) 28x28 images,
    pixels scaled to [0, 1], as flat rows of 784 features."""
    return _core.open_idx(directory, train)


def synthetic(count, num_features=32, num_classes=4, label_noise=0.05, seed=1,
              first_index=0):
    """The C++ worker's synthetic task (--data=synthetic): example i is a
    pure function of (seed, i)."""
    return _core.synthetic(count, first_index, num_features, num_classes,
                             label_noise, seed)


class Batches:
    """This worker's batches of ``examples`` in the job's order.

    ``batch(step)`` gives (features, labels) of global step ``step`` as torch
    tensors (features reshaped to ``shape`` per example, e.g. (1, 28, 28)),
    in buffers reused from call to call.
    """

    def __init__(self, examples, batch_size, worker_id=0, num_workers=1,
                 seed=1, shuffle=True, shape=None):
        self.examples = examples
        self.batch_size = batch_size
        self._plan = _core.epoch_plan(examples.size, batch_size, num_workers,
                                        worker_id, shuffle, seed)
        self._shape = tuple(shape) if shape else (examples.num_features,)
        self._x = np.empty((batch_size, examples.num_features), np.float32)
        self._y = np.empty(batch_size, np.int64)

    @property
    def steps_per_epoch(self):
        return self._plan.steps_per_epoch

    @property
    def global_batch(self):
        return self._plan.global_batch

    def batch(self, step):
        self.examples.gather(self._plan.worker_indices(step), self._x, self._y)
        return (torch.from_numpy(self._x).view(-1, *self._shape),
                torch.from_numpy(self._y))


@torch.no_grad()
def evaluate(model, examples, batch_size=1000, shape=None, limit=None):
    """Mean cross-entropy loss and accuracy of ``model`` (logits) on
    ``examples`` (the first ``limit`` of them, or all), in eval mode (the mode
    is restored), on the device the model is on."""
    was_training = model.training
    device = next(model.parameters()).device  # where the model is
    model.eval()
    shape = tuple(shape) if shape else (examples.num_features,)
    size = examples.size if limit is None else min(limit, examples.size)
    loss_sum, correct = 0.0, 0
    x = np.empty((batch_size, examples.num_features), np.float32)
    y = np.empty(batch_size, np.int64)
    for first in range(0, size, batch_size):
        rows = min(batch_size, size - first)
        indices = np.arange(first, first + rows, dtype=np.int64)
        examples.gather(indices, x[:rows], y[:rows])
        logits = model(torch.from_numpy(x[:rows]).view(-1, *shape).to(device))
        labels = torch.from_numpy(y[:rows]).to(device)
        loss_sum += torch.nn.functional.cross_entropy(
            logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
    model.train(was_training)
    return loss_sum / size, correct / size


# Criteo Kaggle's 26 categorical fields' numbers of values (DLRM's counts).
CRITEO_KAGGLE_CARDINALITIES = _core.criteo_kaggle_cardinalities()


class CtrData:
    """The C++ CTR worker's synthetic click data (worker/ctr_data.h):
    examples [first_index, first_index + count) of the stream for ``seed``,
    with the hidden true click probabilities (what a perfect model scores).

    ``batch(rows)`` gives (dense features, labels, bags) of those rows as
    torch tensors, bags as one (ids, offsets) pair per field, the form
    ``EmbeddingBag`` takes. ``field_vocab``: each field's own number of
    values (``CRITEO_KAGGLE_CARDINALITIES`` with 26 fields and 13 dense
    features: Criteo's shape), in place of ``vocab_per_field``.
    """

    def __init__(self, count, first_index=0, num_dense=4, num_fields=6,
                 vocab_per_field=10000, max_bag=3, seed=1, field_vocab=None):
        d = _core.synthetic_ctr(count, first_index, num_dense, num_fields,
                                  vocab_per_field, max_bag, seed, field_vocab)
        self.size = count
        self.num_dense = num_dense
        self.num_fields = num_fields
        self.labels = d["labels"]
        self.dense = d["dense"]
        self.offsets = d["offsets"]
        # Ids are 64-bit hashes; torch embeds int64: the same bits.
        self.ids = d["ids"].view(np.int64)
        self.true_probabilities = d["true_probabilities"]
        # The most ids one example has: a batch's room for its bags.
        self._most_ids = int(np.diff(self.offsets[::num_fields]).max(
            initial=0))

    def batch(self, rows):
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        # One C++ call: numpy took ~25 us a field.
        ids, offsets, field_ids = _core.ctr_gather_bags(
            self.offsets, self.ids, self.num_fields, rows,
            len(rows) * self._most_ids)
        bags = [(torch.from_numpy(ids[field_ids[f]:field_ids[f + 1]]),
                 torch.from_numpy(offsets[f]))
                for f in range(self.num_fields)]
        return (torch.from_numpy(self.dense[rows]),
                torch.from_numpy(self.labels[rows]), bags)


def auc(labels, scores):
    """Area under the ROC curve (ties count half), as the C++ worker's."""
    labels = np.asarray(labels, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True,
                                 return_counts=True)
    average = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(average, counts)
    positives = labels.sum()
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2)
                 / (positives * negatives))
