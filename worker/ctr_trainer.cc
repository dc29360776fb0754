#include "worker/ctr_trainer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "worker/ctr_metrics.h"
#include "worker/embedding_bag.h"
#include "worker/last_tenth.h"
#include "worker/step_overlap.h"
#include "worker/unique_ids.h"

namespace pstrain {
namespace {

using kernels::Backend;
using kernels::DeviceArray;

#define PSTRAIN_RETURN_IF_ERROR(expr)  \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (false)

DenseTensorSpec Tensor(const std::string& name, std::vector<int64_t> shape,
                       bool glorot) {
  DenseTensorSpec spec;
  spec.set_name(name);
  for (int64_t d : shape) spec.add_shape(d);
  if (glorot) {
    spec.mutable_init()->set_kind(InitSpec::UNIFORM);
    spec.mutable_init()->set_scale(
        std::sqrt(6.0f / static_cast<float>(shape[0] + shape[1])));
  }
  return spec;
}

int64_t MaxBag(const CtrDataset& data, int field) {
  int64_t largest = 0;
  for (int64_t i = 0; i < data.size(); ++i) {
    largest =
        std::max(largest, data.BagEnd(i, field) - data.BagBegin(i, field));
  }
  return largest;
}

// One table's share of a batch on the host: its bags, their unique ids, the
// rows pulled for them and the rows' gradients. A TableBatch holds every
// table's; with the table lane (async tables) there are two, one being
// trained on while the other's rows move.
struct FieldRows {
  std::vector<int64_t> offsets;
  std::vector<uint64_t> ids;
  IdDeduplicator dedup;
  UniqueIds unique;
  std::vector<float> host_rows, host_grad_rows;
};

struct TableBatch {
  std::vector<FieldRows> fields;
  // Of its PullRows: the unique ids asked for, and what the row cache
  // served of them (read on the thread that pulled, the cache's only user
  // meanwhile).
  int64_t rows_asked = 0;
  int64_t cache_hits = 0;
  int64_t cache_bytes_saved = 0;
};

// One table's memory on the backend, for the batch being trained on.
struct Field {
  DeviceArray<float> rows, grad_rows, bags, bag_grads;  // bags: E_f [B, dim]
  std::unique_ptr<EmbeddingBag> bag;
};

// The network's memory, all allocated once for batches of up to max_batch.
class CtrNet {
 public:
  static absl::StatusOr<std::unique_ptr<CtrNet>> Create(
      const CtrModelOptions& options, int64_t max_batch,
      const std::vector<int64_t>& max_bag, Backend* backend) {
    auto net = std::unique_ptr<CtrNet>(new CtrNet(options, max_batch, backend));
    const ModelSchema schema = CtrSchema(options);
    for (const DenseTensorSpec& spec : schema.dense()) {
      const int64_t n = NumElements(spec);
      net->host_params_.emplace_back(n);
      net->host_grads_.emplace_back(n);
      PSTRAIN_RETURN_IF_ERROR(net->Allocate(n, &net->params_));
      PSTRAIN_RETURN_IF_ERROR(net->Allocate(n, &net->grads_));
    }
    const int64_t dim = options.dim, hidden = options.hidden;
    for (int f = 0; f < options.num_fields; ++f) {
      Field& field = net->fields_.emplace_back();
      const int64_t occurrences = std::max<int64_t>(1, max_batch * max_bag[f]);
      net->occurrences_.push_back(occurrences);
      for (auto* array : {&field.rows, &field.grad_rows}) {
        absl::StatusOr<DeviceArray<float>> a =
            DeviceArray<float>::Create(backend, occurrences * dim);
        if (!a.ok()) return a.status();
        *array = std::move(*a);
      }
      for (auto* array : {&field.bags, &field.bag_grads}) {
        absl::StatusOr<DeviceArray<float>> a =
            DeviceArray<float>::Create(backend, max_batch * dim);
        if (!a.ok()) return a.status();
        *array = std::move(*a);
      }
      absl::StatusOr<EmbeddingBag> bag = EmbeddingBag::Create(
          backend, EmbeddingBag::Mode::kMean, dim, max_batch, occurrences);
      if (!bag.ok()) return bag.status();
      field.bag = std::make_unique<EmbeddingBag>(std::move(*bag));
    }
    for (auto [array, n] :
         {std::pair{&net->dense_, max_batch * std::max(options.num_dense, 1)},
          std::pair{&net->hidden_, max_batch * hidden},
          std::pair{&net->hidden_grad_, max_batch * hidden},
          std::pair{&net->logits_, max_batch * 2}}) {
      absl::StatusOr<DeviceArray<float>> a =
          DeviceArray<float>::Create(backend, n);
      if (!a.ok()) return a.status();
      *array = std::move(*a);
    }
    absl::StatusOr<DeviceArray<int32_t>> labels =
        DeviceArray<int32_t>::Create(backend, max_batch);
    if (!labels.ok()) return labels.status();
    net->labels_ = std::move(*labels);
    net->host_labels_.resize(max_batch);
    net->host_logits_.resize(max_batch * 2);
    return net;
  }

  // Host memory for one batch's table rows (see TableBatch).
  TableBatch MakeTableBatch() const {
    TableBatch t;
    for (int64_t occurrences : occurrences_) {
      FieldRows& field = t.fields.emplace_back();
      field.host_rows.resize(occurrences * options_.dim);
      field.host_grad_rows.resize(occurrences * options_.dim);
    }
    return t;
  }

  std::vector<float*> HostParams() { return Pointers(host_params_); }
  std::vector<const float*> HostGrads() {
    std::vector<const float*> out;
    for (auto& g : host_grads_) out.push_back(g.data());
    return out;
  }

  // The whole step's load, one part after the other: the dense tensors
  // (the model at `step`), then the batch's rows of every table, then the
  // upload. Returns the step the model is at (see PsClient::Pull; past
  // `step`, nothing else is loaded). Dense first: its pull is the step's
  // barrier, and an async table's rows read after it hold every worker's
  // rows of the steps before (each pushes its rows before its dense
  // gradient), so the final evaluation of every worker reads one model.
  absl::StatusOr<int64_t> Load(PsClient& client, int64_t step,
                               const CtrDataset& batch, TableBatch& tables) {
    absl::StatusOr<int64_t> at = PullDense(client, step);
    if (!at.ok() || *at > step) return at;
    GatherIds(batch, tables);
    PSTRAIN_RETURN_IF_ERROR(PullRows(client, step, tables));
    PSTRAIN_RETURN_IF_ERROR(Upload(batch, tables));
    return at;
  }

  // The dense tensors at `step`, on the backend; as Load.
  absl::StatusOr<int64_t> PullDense(PsClient& client, int64_t step) {
    absl::StatusOr<int64_t> at = client.Pull(step, HostParams());
    if (!at.ok() || *at > step) return at;
    for (size_t t = 0; t < params_.size(); ++t) {
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToDevice(
          host_params_[t].data(), params_[t].data(), params_[t].bytes()));
    }
    return at;
  }

  // The ids of `batch`'s bags in every table, and their unique ids: what
  // PullRows asks for. Host work only (any thread).
  void GatherIds(const CtrDataset& batch, TableBatch& tables) const {
    for (int f = 0; f < options_.num_fields; ++f) {
      FieldRows& field = tables.fields[f];
      ExtractFieldBags(batch, f, &field.offsets, &field.ids);
      field.dedup.Run(field.ids, &field.unique);
    }
  }

  // The gathered rows of every table, from the servers (or the row cache),
  // in one round trip. The network and host memory only (any thread).
  absl::Status PullRows(PsClient& client, int64_t step, TableBatch& tables) {
    std::vector<PsClient::SparsePullPart> parts;
    int64_t rows = 0;
    for (int f = 0; f < options_.num_fields; ++f) {
      FieldRows& field = tables.fields[f];
      parts.push_back({f, field.unique.unique, field.host_rows.data()});
      rows += static_cast<int64_t>(field.unique.unique.size());
    }
    const SparseRowCacheStats before = client.sparse_row_cache_stats();
    PSTRAIN_RETURN_IF_ERROR(client.PullSparse(step, parts));
    const SparseRowCacheStats after = client.sparse_row_cache_stats();
    tables.rows_asked = rows;
    tables.cache_hits = after.hits - before.hits;
    tables.cache_bytes_saved = after.bytes_saved - before.bytes_saved;
    rows_pulled_.fetch_add(rows);
    return absl::OkStatus();
  }

  // The batch and its pulled rows to the backend; Forward and Backward then
  // train on them.
  absl::Status Upload(const CtrDataset& batch, const TableBatch& tables) {
    const int64_t dim = options_.dim;
    for (int f = 0; f < options_.num_fields; ++f) {
      Field& field = fields_[f];
      const FieldRows& rows = tables.fields[f];
      const int64_t n = rows.unique.unique.size();
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToDevice(
          rows.host_rows.data(), field.rows.data(), n * dim * sizeof(float)));
      PSTRAIN_RETURN_IF_ERROR(
          field.bag->SetBags(rows.offsets, rows.unique.index, n));
    }
    const int64_t rows = batch.size();
    for (int64_t i = 0; i < rows; ++i) {
      host_labels_[i] = batch.labels[i] > 0.5f ? 1 : 0;
    }
    PSTRAIN_RETURN_IF_ERROR(backend_->CopyToDevice(
        host_labels_.data(), labels_.data(), rows * sizeof(int32_t)));
    if (options_.num_dense > 0) {
      PSTRAIN_RETURN_IF_ERROR(
          backend_->CopyToDevice(batch.dense.data(), dense_.data(),
                                 rows * options_.num_dense * sizeof(float)));
    }
    return absl::OkStatus();
  }

  // Forward over `rows` examples; logits stay on the device.
  absl::Status Forward(int64_t rows) {
    const int64_t dim = options_.dim, hidden = options_.hidden;
    for (int f = 0; f < options_.num_fields; ++f) {
      Field& field = fields_[f];
      PSTRAIN_RETURN_IF_ERROR(
          field.bag->Forward(field.rows.data(), field.bags.data()));
      PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(
          false, false, rows, hidden, dim, 1.0f, field.bags.data(),
          params_[f].data(), f == 0 ? 0.0f : 1.0f, hidden_.data()));
    }
    if (options_.num_dense > 0) {
      PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(
          false, false, rows, hidden, options_.num_dense, 1.0f, dense_.data(),
          params_[DenseWeight()].data(), 1.0f, hidden_.data()));
    }
    PSTRAIN_RETURN_IF_ERROR(
        backend_->AddBias(rows, hidden, params_[B1()].data(), hidden_.data()));
    PSTRAIN_RETURN_IF_ERROR(
        backend_->Relu(rows * hidden, hidden_.data(), hidden_.data()));
    PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(false, false, rows, 2, hidden, 1.0f,
                                           hidden_.data(), params_[W2()].data(),
                                           0.0f, logits_.data()));
    return backend_->AddBias(rows, 2, params_[B2()].data(), logits_.data());
  }

  // Loss of the batch and every gradient, downloaded for the pushes: the
  // dense ones here, the rows' into `tables` (those Upload was given).
  absl::StatusOr<double> Backward(int64_t rows, TableBatch& tables) {
    const int64_t dim = options_.dim, hidden = options_.hidden;
    double loss_sum = 0;
    int64_t correct = 0;
    float* dlogits = logits_.data();  // overwritten in place
    PSTRAIN_RETURN_IF_ERROR(backend_->SoftmaxCrossEntropy(
        rows, 2, logits_.data(), labels_.data(), 1.0f / rows, dlogits,
        &loss_sum, &correct));
    PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(true, false, hidden, 2, rows, 1.0f,
                                           hidden_.data(), dlogits, 0.0f,
                                           grads_[W2()].data()));
    PSTRAIN_RETURN_IF_ERROR(
        backend_->BiasGrad(rows, 2, dlogits, grads_[B2()].data()));
    PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(false, true, rows, hidden, 2, 1.0f,
                                           dlogits, params_[W2()].data(), 0.0f,
                                           hidden_grad_.data()));
    PSTRAIN_RETURN_IF_ERROR(backend_->ReluGrad(rows * hidden, hidden_.data(),
                                               hidden_grad_.data(),
                                               hidden_grad_.data()));
    PSTRAIN_RETURN_IF_ERROR(backend_->BiasGrad(
        rows, hidden, hidden_grad_.data(), grads_[B1()].data()));
    for (int f = 0; f < options_.num_fields; ++f) {
      Field& field = fields_[f];
      PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(
          true, false, dim, hidden, rows, 1.0f, field.bags.data(),
          hidden_grad_.data(), 0.0f, grads_[f].data()));
      PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(
          false, true, rows, dim, hidden, 1.0f, hidden_grad_.data(),
          params_[f].data(), 0.0f, field.bag_grads.data()));
      PSTRAIN_RETURN_IF_ERROR(
          field.bag->Backward(field.bag_grads.data(), field.grad_rows.data()));
      FieldRows& rows_of_field = tables.fields[f];
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToHost(
          field.grad_rows.data(), rows_of_field.host_grad_rows.data(),
          rows_of_field.unique.unique.size() * dim * sizeof(float)));
    }
    if (options_.num_dense > 0) {
      PSTRAIN_RETURN_IF_ERROR(backend_->Gemm(
          true, false, options_.num_dense, hidden, rows, 1.0f, dense_.data(),
          hidden_grad_.data(), 0.0f, grads_[DenseWeight()].data()));
    }
    for (size_t t = 0; t < grads_.size(); ++t) {
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToHost(
          grads_[t].data(), host_grads_[t].data(), grads_[t].bytes()));
    }
    return loss_sum;
  }

  // Every gradient of the step: dense tensors, then each table's rows. Async
  // tables (--embedding_mode=async) go first: their rows have no step of
  // their own, so once the dense step completes every worker's rows of it
  // are in, and the model each worker evaluates at the end is the same one.
  absl::Status Push(PsClient& client, int64_t step, const TableBatch& tables) {
    const bool tables_first = options_.table_mode == "async";
    if (tables_first) PSTRAIN_RETURN_IF_ERROR(PushRows(client, step, tables));
    PSTRAIN_RETURN_IF_ERROR(PushDense(client, step));
    if (!tables_first) PSTRAIN_RETURN_IF_ERROR(PushRows(client, step, tables));
    return absl::OkStatus();
  }

  absl::Status PushDense(PsClient& client, int64_t step) {
    return client.Push(step, HostGrads()).status();
  }

  // The rows' gradients Backward left in `tables`. The network and host
  // memory only (any thread).
  absl::Status PushRows(PsClient& client, int64_t step,
                        const TableBatch& tables) {
    std::vector<PsClient::SparsePushPart> parts;
    int64_t rows = 0;
    for (int f = 0; f < options_.num_fields; ++f) {
      const FieldRows& field = tables.fields[f];
      parts.push_back({f, field.unique.unique, field.host_grad_rows.data()});
      rows += static_cast<int64_t>(field.unique.unique.size());
    }
    PSTRAIN_RETURN_IF_ERROR(client.PushSparse(step, parts).status());
    rows_pushed_.fetch_add(rows);
    return absl::OkStatus();
  }

  // Scores (logit_1 - logit_0) of the last Forward.
  absl::Status Scores(int64_t rows, std::vector<float>* scores) {
    PSTRAIN_RETURN_IF_ERROR(backend_->CopyToHost(
        logits_.data(), host_logits_.data(), rows * 2 * sizeof(float)));
    for (int64_t i = 0; i < rows; ++i) {
      scores->push_back(host_logits_[2 * i + 1] - host_logits_[2 * i]);
    }
    return absl::OkStatus();
  }

  // Added to on whichever thread pulls or pushes (the table lane's too).
  int64_t rows_pulled() const { return rows_pulled_.load(); }
  int64_t rows_pushed() const { return rows_pushed_.load(); }

 private:
  CtrNet(const CtrModelOptions& options, int64_t max_batch, Backend* backend)
      : options_(options), max_batch_(max_batch), backend_(backend) {}

  // Tensor indices, in CtrSchema's order.
  int DenseWeight() const { return options_.num_fields; }
  int B1() const { return options_.num_fields + (options_.num_dense > 0); }
  int W2() const { return B1() + 1; }
  int B2() const { return B1() + 2; }

  absl::Status Allocate(int64_t n, std::vector<DeviceArray<float>>* into) {
    absl::StatusOr<DeviceArray<float>> a =
        DeviceArray<float>::Create(backend_, n);
    if (!a.ok()) return a.status();
    into->push_back(std::move(*a));
    return absl::OkStatus();
  }
  static std::vector<float*> Pointers(std::vector<std::vector<float>>& v) {
    std::vector<float*> out;
    for (auto& x : v) out.push_back(x.data());
    return out;
  }

  const CtrModelOptions options_;
  const int64_t max_batch_;
  Backend* backend_;
  std::vector<std::vector<float>> host_params_, host_grads_;
  std::vector<DeviceArray<float>> params_, grads_;
  std::vector<Field> fields_;
  std::vector<int64_t> occurrences_;  // per field: the most in one batch
  DeviceArray<float> dense_, hidden_, hidden_grad_, logits_;
  DeviceArray<int32_t> labels_;
  std::vector<int32_t> host_labels_;
  std::vector<float> host_logits_;
  std::atomic<int64_t> rows_pulled_{0}, rows_pushed_{0};
};

// The table lane: a thread that moves async tables' rows while the training
// thread computes and exchanges the dense tensors. Its work runs in the
// order given (PsClient takes one sparse call at a time beside the dense
// ones); a pull hands back a ticket to wait for, a push only its error,
// which the next wait returns.
class TableLane {
 public:
  struct Ticket {
    absl::Notification done;
    absl::Status status;
  };

  std::shared_ptr<Ticket> Pull(std::function<absl::Status()> pull) {
    auto ticket = std::make_shared<Ticket>();
    worker_.Schedule([this, ticket, pull = std::move(pull)] {
      ticket->status = Timed(pull);
      ticket->done.Notify();
    });
    return ticket;
  }

  void Push(std::function<absl::Status()> push) {
    worker_.Schedule([this, push = std::move(push)] {
      absl::Status status = Timed(push);
      absl::MutexLock lock(&mu_);
      if (push_status_.ok()) push_status_ = std::move(status);
    });
  }

  // The ticket's pull, or an earlier push's failure.
  absl::Status Await(Ticket& ticket) {
    const absl::Time start = absl::Now();
    ticket.done.WaitForNotification();
    waited_ += absl::Now() - start;
    if (absl::Status pushed = PushStatus(); !pushed.ok()) return pushed;
    return ticket.status;
  }

  // Until everything given has run; the first push failure.
  absl::Status Drain() {
    const absl::Time start = absl::Now();
    worker_.Drain();
    waited_ += absl::Now() - start;
    return PushStatus();
  }

  // Time at work (all of it, once drained), and time the training thread
  // waited for it.
  absl::Duration busy() {
    absl::MutexLock lock(&mu_);
    return busy_;
  }
  absl::Duration waited() const { return waited_; }

 private:
  absl::Status Timed(const std::function<absl::Status()>& work) {
    const absl::Time start = absl::Now();
    absl::Status status = work();
    absl::MutexLock lock(&mu_);
    busy_ += absl::Now() - start;
    return status;
  }
  absl::Status PushStatus() {
    absl::MutexLock lock(&mu_);
    return push_status_;
  }

  absl::Mutex mu_;
  absl::Status push_status_ ABSL_GUARDED_BY(mu_);
  absl::Duration busy_ ABSL_GUARDED_BY(mu_);
  absl::Duration waited_;  // the training thread's
  SerialWorker worker_;    // last: its thread stops before the rest goes
};

// What on_step is told about the step just trained on `batch`, whose
// scores (logit_1 - logit_0) are `scores`: a click is predicted at
// score > 0.
StepReport CtrStepReport(int64_t step, int64_t steps, double loss_sum,
                         const CtrDataset& batch,
                         const std::vector<float>& scores,
                         absl::Time step_start, absl::Time pulled,
                         absl::Time computed) {
  StepReport report;
  report.step = step;
  report.steps = steps;
  report.loss = loss_sum / batch.size();
  int64_t correct = 0;
  for (int64_t i = 0; i < batch.size(); ++i) {
    correct += (scores[i] > 0) == (batch.labels[i] > 0.5f);
  }
  report.train_accuracy = static_cast<double>(correct) / batch.size();
  report.examples = batch.size();
  report.step_seconds = absl::ToDoubleSeconds(absl::Now() - step_start);
  report.pull_seconds = absl::ToDoubleSeconds(pulled - step_start);
  report.push_seconds = absl::ToDoubleSeconds(absl::Now() - computed);
  report.compute_seconds = absl::ToDoubleSeconds(computed - pulled);
  report.network_wait_seconds = report.pull_seconds + report.push_seconds;
  return report;
}

// AUC and log loss of the model `reader` holds at `step` on `test`, into
// `result`. Held-out ids are pulled, never pushed.
absl::Status EvaluateHeldOut(CtrNet& net, PsClient& reader, int64_t step,
                             const CtrDataset& test, int64_t batch_size,
                             CtrResult* result) {
  std::vector<float> scores, labels;
  CtrDataset batch;
  TableBatch tables = net.MakeTableBatch();
  for (int64_t first = 0; first < test.size(); first += batch_size) {
    const int64_t rows = std::min(batch_size, test.size() - first);
    CtrBatchCursor slice(&test);
    slice.Next(first, &batch);  // skip to `first`
    slice.Next(rows, &batch);
    absl::StatusOr<int64_t> at = net.Load(reader, step, batch, tables);
    if (!at.ok()) return at.status();
    PSTRAIN_RETURN_IF_ERROR(net.Forward(rows));
    PSTRAIN_RETURN_IF_ERROR(net.Scores(rows, &scores));
    labels.insert(labels.end(), batch.labels.begin(), batch.labels.end());
  }
  result->test_examples = static_cast<int64_t>(labels.size());
  if (!labels.empty()) {
    result->auc = Auc(labels, scores);
    result->logloss = LogLossFromLogits(labels, scores);
  }
  return absl::OkStatus();
}

}  // namespace

ModelSchema CtrSchema(const CtrModelOptions& options) {
  ModelSchema schema;
  schema.set_seed(options.seed);
  schema.set_block_elements(options.block_elements);
  for (int f = 0; f < options.num_fields; ++f) {
    *schema.add_dense() = Tensor(absl::StrCat("ctr/w1_", CtrTableName(f)),
                                 {options.dim, options.hidden}, true);
  }
  if (options.num_dense > 0) {
    *schema.add_dense() =
        Tensor("ctr/w1_dense", {options.num_dense, options.hidden}, true);
  }
  *schema.add_dense() = Tensor("ctr/b1", {options.hidden}, false);
  *schema.add_dense() = Tensor("ctr/w2", {options.hidden, 2}, true);
  *schema.add_dense() = Tensor("ctr/b2", {2}, false);
  for (int f = 0; f < options.num_fields; ++f) {
    SparseTableSpec* table = schema.add_sparse();
    table->set_name(CtrTableName(f));
    table->set_dim(options.dim);
    *table->mutable_init() = options.embedding_init;
    *table->mutable_optimizer() = options.sparse_optimizer;
    table->set_max_bytes(options.table_max_bytes);
    table->set_mode(options.table_mode);
  }
  return schema;
}

absl::StatusOr<CtrResult> TrainCtr(const CtrModelOptions& model,
                                   const CtrTrainerOptions& options,
                                   ConsistencyMode mode, PsClient& client,
                                   kernels::Backend& backend,
                                   const CtrDataset& train,
                                   const CtrDataset& test) {
  if (train.size() == 0) {
    return absl::FailedPreconditionError(
        "this worker's shard of the training data is empty");
  }
  std::vector<int64_t> max_bag(model.num_fields);
  for (int f = 0; f < model.num_fields; ++f) {
    max_bag[f] = std::max(MaxBag(train, f), MaxBag(test, f));
  }
  absl::StatusOr<std::unique_ptr<CtrNet>> net =
      CtrNet::Create(model, options.batch_size, max_bag, &backend);
  if (!net.ok()) return net.status();

  CtrResult result;
  result.mode = mode;
  result.steps = options.steps;
  CtrBatchCursor cursor(&train);
  cursor.Seek(options.start_step * options.batch_size);
  // Two batches and their rows: with the table lane, the next one's rows
  // are pulled while this one trains.
  std::array<CtrDataset, 2> batches;
  std::array<TableBatch, 2> tables = {(*net)->MakeTableBatch(),
                                      (*net)->MakeTableBatch()};
  int current = 0;
  const bool table_lane =
      options.table_lane &&
      (model.table_mode == "async" || mode == ConsistencyMode::kAsync);
  LastTenth window(options.steps);  // the last tenth of the job's batches
  const absl::Time start = absl::Now();
  std::vector<float> step_scores;
  int64_t step = options.start_step;
  CtrNet& n = **net;
  // Last: destroyed first, so no closure outlives what it uses.
  TableLane lane;
  // The lane's pull of batches[current]'s rows into tables[current]; null
  // when the training thread pulls them itself.
  std::shared_ptr<TableLane::Ticket> rows_pull;
  while (step < options.steps) {
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    const absl::Time step_start = absl::Now();
    const bool rows_from_lane = rows_pull != nullptr;
    if (!rows_from_lane) cursor.Next(options.batch_size, &batches[current]);
    const CtrDataset& batch = batches[current];
    TableBatch& rows = tables[current];
    absl::StatusOr<int64_t> at = n.PullDense(client, step);
    if (rows_from_lane) {
      absl::Status pulled = lane.Await(*rows_pull);
      rows_pull = nullptr;
      if (!pulled.ok()) return pulled;
    }
    if (!at.ok()) return at.status();
    if (*at > step) {  // the job went on without this worker: catch up
      step = *at;
      cursor.Seek(step * options.batch_size);
      continue;
    }
    if (step == options.sigterm_before_push_step) {
      InjectSigterm(options.stop, step);
    }
    // Stopped while the pull waited: another worker may have stopped before
    // pushing this step, so this one does not push it either, and every
    // shard stops at the same step with none short (LeaveRequest.stopping).
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    if (!rows_from_lane) {
      // One sparse call at a time: the lane's pushes land first.
      if (table_lane) {
        if (absl::Status s = lane.Drain(); !s.ok()) return s;
      }
      n.GatherIds(batch, rows);
      if (absl::Status s = n.PullRows(client, step, rows); !s.ok()) return s;
    }
    if (absl::Status s = n.Upload(batch, rows); !s.ok()) return s;
    const absl::Time pulled = absl::Now();
    // The job's last step moves its rows in line (below), so the lane has
    // nothing to pull for after it.
    const bool lane_step = table_lane && step + 1 < options.steps;
    const int next = 1 - current;
    if (lane_step) {
      // The next batch's rows come while this one trains.
      cursor.Next(options.batch_size, &batches[next]);
      rows_pull = lane.Pull([&n, &client, &batches, &tables, next, step] {
        n.GatherIds(batches[next], tables[next]);
        return n.PullRows(client, step + 1, tables[next]);
      });
    }
    if (options.graceful_stop != nullptr) {
      options.graceful_stop->StepWorkBegins();
    }
    if (absl::Status s = n.Forward(batch.size()); !s.ok()) return s;
    step_scores.clear();
    if (options.on_step) {  // before Backward overwrites the logits
      if (absl::Status s = n.Scores(batch.size(), &step_scores); !s.ok()) {
        return s;
      }
    }
    absl::StatusOr<double> loss_sum = n.Backward(batch.size(), rows);
    if (!loss_sum.ok()) return loss_sum.status();
    const absl::Time computed = absl::Now();
    if (options.learning_rate_at) {
      client.SetGroupRates({options.learning_rate_at(step)});
    }
    if (options.step_delay > absl::ZeroDuration()) {
      absl::SleepFor(options.step_delay);
    }
    if (lane_step) {
      const int pushed = current;
      lane.Push([&n, &client, &tables, pushed, step] {
        return n.PushRows(client, step, tables[pushed]);
      });
      if (absl::Status s = n.PushDense(client, step); !s.ok()) return s;
    } else {
      // In line, rows before the dense gradient (async tables): once the
      // job's last step completes, every worker's rows are in, and every
      // worker evaluates one model.
      if (table_lane) {
        if (absl::Status s = lane.Drain(); !s.ok()) return s;
      }
      if (absl::Status s = n.Push(client, step, rows); !s.ok()) return s;
    }
    // Not once stopping: the lane's rows of this step may still be on
    // their way, under the grace they had.
    if (options.graceful_stop != nullptr &&
        !(options.stop != nullptr && options.stop->load())) {
      options.graceful_stop->StepWorkDone(absl::Now() - pulled);
    }
    if (step == options.sigterm_after_step) {
      InjectSigterm(options.stop, step);
    }
    ++result.steps_run;
    ++step;
    window.Add(step,
               BatchResult{*loss_sum, 0, static_cast<int64_t>(batch.size())});
    if (options.on_step) {
      StepReport report =
          CtrStepReport(step, options.steps, *loss_sum, batch, step_scores,
                        step_start, pulled, computed);
      report.sparse_cache_hits = rows.cache_hits;
      report.sparse_rows_pulled = rows.rows_asked - rows.cache_hits;
      report.sparse_cache_bytes_saved = rows.cache_bytes_saved;
      options.on_step(report);
    }
    if (lane_step) current = next;
  }
  // A stop between steps: the rows the lane pushed are the job's.
  if (absl::Status s = lane.Drain(); !s.ok()) return s;
  result.table_lane_seconds = absl::ToDoubleSeconds(lane.busy());
  result.table_lane_wait_seconds = absl::ToDoubleSeconds(lane.waited());
  // A sync worker stopped by a signal waits for the step it reached (below)
  // with its waits still cut short, as the dense trainer's does
  // (PullFinalModel): another may have stopped before pushing that step.
  const bool quiet_once_pulled =
      result.stopped_early && mode == ConsistencyMode::kSync;
  if (options.on_steps_done && !quiet_once_pulled) options.on_steps_done();
  const SparseRowCacheStats cache = client.sparse_row_cache_stats();
  result.cache_hits = cache.hits;
  result.cache_bytes_saved = cache.bytes_saved;
  result.rows_from_servers = (*net)->rows_pulled() - cache.hits;
  // The final model is the servers' rows, not the cache's.
  client.DropSparseRowCache();
  result.wall_time_s = absl::ToDoubleSeconds(absl::Now() - start);
  result.samples_per_sec = result.steps_run * options.batch_size /
                           std::max(result.wall_time_s, 1e-9);
  if (const BatchResult tail = window.Sums(result.steps_run); tail.rows > 0) {
    result.final_loss = tail.loss_sum / tail.rows;
  }

  // Every worker evaluates the job's final model. sync: the model after the
  // last step (the pulls wait for it). async/ssp: this worker leaves first
  // (the wait counts it as done), then reads the servers' model once every
  // worker has finished, through the observer.
  const int64_t eval_step = result.stopped_early ? step : options.steps;
  PsClient* reader = &client;
  if (mode == ConsistencyMode::kSync) {
    result.final_model = "sync_step";
    if (quiet_once_pulled) {
      absl::StatusOr<int64_t> at = n.PullDense(client, eval_step);
      if (!at.ok()) return at.status();
      if (options.on_steps_done) options.on_steps_done();
    }
  } else {
    if (absl::Status s = client.Leave(); !s.ok()) return s;
    if (options.observer != nullptr) reader = options.observer;
    result.final_model = reader->AwaitFinalModel(
        options.num_workers * options.steps, options.final_model_timeout);
  }
  if (absl::Status s = EvaluateHeldOut(**net, *reader, eval_step, test,
                                       options.batch_size, &result);
      !s.ok()) {
    return s;
  }
  // The servers' copy of the model just evaluated (sync: the pulls above
  // waited for the last step everywhere).
  if ((mode == ConsistencyMode::kSync && eval_step > 0) ||
      result.final_model == "all_done") {
    absl::StatusOr<FinalState> state = reader->SecureFinalState(
        mode == ConsistencyMode::kSync ? eval_step
                                       : options.num_workers * options.steps);
    if (!state.ok()) return state.status();
    result.final_state = *std::move(state);
  }
  if (mode == ConsistencyMode::kSync) {
    absl::StatusOr<int64_t> steps_short = client.StepsShort();
    if (!steps_short.ok()) return steps_short.status();
    result.steps_short = *steps_short;
    if (absl::Status s =
            client.Leave(result.stopped_early, GraceOf(options.graceful_stop));
        !s.ok()) {
      return s;
    }
  }
  result.rows_pulled = (*net)->rows_pulled();
  result.rows_pushed = (*net)->rows_pushed();
  return result;
}

std::string CtrFinalJson(const CtrResult& r, int worker_id, int num_workers,
                         const std::string& device, double true_auc,
                         double true_logloss) {
  std::string truth;
  if (std::isfinite(true_auc)) {
    truth = absl::StrFormat(",\"true_auc\":%.4f,\"true_logloss\":%.4f",
                            true_auc, true_logloss);
  }
  return absl::StrFormat(
      "{\"event\":\"final\",\"model\":\"ctr\",\"mode\":\"%s\","
      "\"worker_id\":%d,\"num_workers\":%d,\"device\":\"%s\",\"steps\":%d,"
      "\"steps_run\":%d,\"final_loss\":%.6f,\"auc\":%.4f,\"logloss\":%.4f%s,"
      "\"test_examples\":%d,\"samples_per_sec\":%.1f,\"wall_time_s\":%.3f,"
      "\"sparse_rows_pulled\":%d,\"sparse_rows_pushed\":%d,"
      "\"sparse_rows_from_servers\":%d,\"sparse_cache_hits\":%d,"
      "\"sparse_cache_bytes_saved\":%d,"
      "\"table_lane_s\":%.3f,\"table_lane_wait_s\":%.3f,"
      "\"steps_short\":%d,\"final_model\":\"%s\",\"final_state\":\"%s\","
      "\"shards_behind\":[%s],\"stopped_early\":%s}",
      ConsistencyModeName(r.mode), worker_id, num_workers, device, r.steps,
      r.steps_run, r.final_loss, r.auc, r.logloss, truth, r.test_examples,
      r.samples_per_sec, r.wall_time_s, r.rows_pulled, r.rows_pushed,
      r.rows_from_servers, r.cache_hits, r.cache_bytes_saved,
      r.table_lane_seconds, r.table_lane_wait_seconds, r.steps_short,
      r.final_model, r.final_state.summary,
      absl::StrJoin(r.final_state.shards_behind, ","),
      r.stopped_early ? "true" : "false");
}

}  // namespace pstrain
