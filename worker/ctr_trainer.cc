#include "worker/ctr_trainer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "worker/ctr_metrics.h"
#include "worker/embedding_bag.h"
#include "worker/last_tenth.h"

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

// One sparse table's per-batch state: the batch's bags, their unique ids,
// the pulled rows and their gradients.
struct Field {
  std::vector<int64_t> offsets;
  std::vector<uint64_t> ids;
  IdDeduplicator dedup;
  UniqueIds unique;
  std::vector<float> host_rows, host_grad_rows;
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
      field.host_rows.resize(occurrences * dim);
      field.host_grad_rows.resize(occurrences * dim);
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

  std::vector<float*> HostParams() { return Pointers(host_params_); }
  std::vector<const float*> HostGrads() {
    std::vector<const float*> out;
    for (auto& g : host_grads_) out.push_back(g.data());
    return out;
  }
  Field& field(int f) { return fields_[f]; }

  // Pulls the dense tensors (the model at `step`) and then the batch's rows
  // of every table, and uploads them with the batch. Returns the step the
  // model is at (see PsClient::Pull; past `step`, nothing else is loaded).
  // Dense first: its pull is the step's barrier, and an async table's rows
  // read after it hold every worker's rows of the steps before (each pushes
  // its rows before its dense gradient), so the final evaluation of every
  // worker reads one model.
  absl::StatusOr<int64_t> Load(PsClient& client, int64_t step,
                               const CtrDataset& batch) {
    absl::StatusOr<int64_t> at = client.Pull(step, HostParams());
    if (!at.ok() || *at > step) return at;
    for (size_t t = 0; t < params_.size(); ++t) {
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToDevice(
          host_params_[t].data(), params_[t].data(), params_[t].bytes()));
    }
    const int64_t dim = options_.dim;
    std::vector<PsClient::SparsePullPart> parts;
    for (int f = 0; f < options_.num_fields; ++f) {
      Field& field = fields_[f];
      ExtractFieldBags(batch, f, &field.offsets, &field.ids);
      field.dedup.Run(field.ids, &field.unique);
      parts.push_back({f, field.unique.unique, field.host_rows.data()});
    }
    PSTRAIN_RETURN_IF_ERROR(client.PullSparse(step, parts));
    for (int f = 0; f < options_.num_fields; ++f) {
      Field& field = fields_[f];
      const int64_t n = field.unique.unique.size();
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToDevice(
          field.host_rows.data(), field.rows.data(), n * dim * sizeof(float)));
      PSTRAIN_RETURN_IF_ERROR(
          field.bag->SetBags(field.offsets, field.unique.index, n));
      rows_pulled_ += n;
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
    return at;
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

  // Loss of the batch and every gradient, downloaded for the pushes.
  absl::StatusOr<double> Backward(int64_t rows) {
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
      PSTRAIN_RETURN_IF_ERROR(backend_->CopyToHost(
          field.grad_rows.data(), field.host_grad_rows.data(),
          field.unique.unique.size() * dim * sizeof(float)));
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
  absl::Status Push(PsClient& client, int64_t step) {
    const bool tables_first = options_.table_mode == "async";
    if (tables_first) PSTRAIN_RETURN_IF_ERROR(PushTables(client, step));
    absl::StatusOr<PsClient::PushResult> pushed =
        client.Push(step, HostGrads());
    if (!pushed.ok()) return pushed.status();
    if (!tables_first) PSTRAIN_RETURN_IF_ERROR(PushTables(client, step));
    return absl::OkStatus();
  }

  absl::Status PushTables(PsClient& client, int64_t step) {
    std::vector<PsClient::SparsePushPart> parts;
    for (int f = 0; f < options_.num_fields; ++f) {
      const Field& field = fields_[f];
      parts.push_back({f, field.unique.unique, field.host_grad_rows.data()});
    }
    absl::StatusOr<PsClient::PushResult> rows = client.PushSparse(step, parts);
    if (!rows.ok()) return rows.status();
    for (const Field& field : fields_) {
      rows_pushed_ += field.unique.unique.size();
    }
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

  int64_t rows_pulled() const { return rows_pulled_; }
  int64_t rows_pushed() const { return rows_pushed_; }

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
  DeviceArray<float> dense_, hidden_, hidden_grad_, logits_;
  DeviceArray<int32_t> labels_;
  std::vector<int32_t> host_labels_;
  std::vector<float> host_logits_;
  int64_t rows_pulled_ = 0, rows_pushed_ = 0;
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
  for (int64_t first = 0; first < test.size(); first += batch_size) {
    const int64_t rows = std::min(batch_size, test.size() - first);
    CtrBatchCursor slice(&test);
    slice.Next(first, &batch);  // skip to `first`
    slice.Next(rows, &batch);
    absl::StatusOr<int64_t> at = net.Load(reader, step, batch);
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
  CtrDataset batch;
  LastTenth window(options.steps);  // the last tenth of the job's batches
  const absl::Time start = absl::Now();
  std::vector<float> step_scores;
  int64_t step = options.start_step;
  while (step < options.steps) {
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    const absl::Time step_start = absl::Now();
    const SparseRowCacheStats cache_before = client.sparse_row_cache_stats();
    const int64_t rows_before = (*net)->rows_pulled();
    cursor.Next(options.batch_size, &batch);
    absl::StatusOr<int64_t> at = (*net)->Load(client, step, batch);
    if (!at.ok()) return at.status();
    if (*at > step) {  // the job went on without this worker: catch up
      step = *at;
      if (step >= options.steps) break;
      continue;
    }
    const absl::Time pulled = absl::Now();
    if (absl::Status s = (*net)->Forward(batch.size()); !s.ok()) return s;
    step_scores.clear();
    if (options.on_step) {  // before Backward overwrites the logits
      if (absl::Status s = (*net)->Scores(batch.size(), &step_scores);
          !s.ok()) {
        return s;
      }
    }
    absl::StatusOr<double> loss_sum = (*net)->Backward(batch.size());
    if (!loss_sum.ok()) return loss_sum.status();
    const absl::Time computed = absl::Now();
    if (options.learning_rate_at) {
      client.SetGroupRates({options.learning_rate_at(step)});
    }
    if (options.step_delay > absl::ZeroDuration()) {
      absl::SleepFor(options.step_delay);
    }
    if (absl::Status s = (*net)->Push(client, step); !s.ok()) return s;
    ++result.steps_run;
    ++step;
    window.Add(step,
               BatchResult{*loss_sum, 0, static_cast<int64_t>(batch.size())});
    if (options.on_step) {
      StepReport report =
          CtrStepReport(step, options.steps, *loss_sum, batch, step_scores,
                        step_start, pulled, computed);
      const SparseRowCacheStats cache = client.sparse_row_cache_stats();
      report.sparse_cache_hits = cache.hits - cache_before.hits;
      report.sparse_rows_pulled =
          (*net)->rows_pulled() - rows_before - report.sparse_cache_hits;
      report.sparse_cache_bytes_saved =
          cache.bytes_saved - cache_before.bytes_saved;
      options.on_step(report);
    }
  }
  if (options.on_steps_done) options.on_steps_done();
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
    if (absl::Status s = client.Leave(); !s.ok()) return s;
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
      "\"steps_short\":%d,\"final_model\":\"%s\",\"final_state\":\"%s\","
      "\"shards_behind\":[%s],\"stopped_early\":%s}",
      ConsistencyModeName(r.mode), worker_id, num_workers, device, r.steps,
      r.steps_run, r.final_loss, r.auc, r.logloss, truth, r.test_examples,
      r.samples_per_sec, r.wall_time_s, r.rows_pulled, r.rows_pushed,
      r.rows_from_servers, r.cache_hits, r.cache_bytes_saved, r.steps_short,
      r.final_model, r.final_state.summary,
      absl::StrJoin(r.final_state.shards_behind, ","),
      r.stopped_early ? "true" : "false");
}

}  // namespace pstrain
