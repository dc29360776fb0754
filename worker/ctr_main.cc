#include "worker/ctr_main.h"

#include <cmath>
#include <cstdio>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/consistency_mode.h"
#include "common/learning_rates.h"
#include "glog/logging.h"
#include "worker/ctr_data.h"
#include "worker/ctr_metrics.h"
#include "worker/ctr_trainer.h"
#include "worker/lr_schedule.h"

namespace pstrain {
namespace {

// The model the configuration describes (checked: ValidateWorkerConfig).
CtrModelOptions CtrModel(const WorkerConfig& config) {
  const CtrConfig& ctr = config.ctr;
  CtrModelOptions model;
  model.dim = ctr.embedding_dim;
  model.hidden = ctr.hidden;
  model.seed = config.seed;
  model.block_elements = config.model.block_elements;
  model.embedding_init.set_kind(InitSpec::UNIFORM);
  model.embedding_init.set_scale(ctr.embedding_init_scale);
  model.table_max_bytes = ctr.embedding_max_bytes;
  model.table_mode = ctr.embedding_mode;
  SparseOptimizer& o = model.sparse_optimizer;
  o.set_name(ctr.sparse_optimizer);
  o.set_learning_rate(EffectiveLearningRate(
      ctr.sparse_learning_rate, DefaultSparseLearningRate(o.name())));
  o.set_initial_accumulator(ctr.adagrad_initial_accumulator);
  o.set_beta1(0.9f);
  o.set_beta2(0.999f);
  o.set_epsilon(1e-8f);
  o.set_ftrl_alpha(ctr.ftrl_alpha);
  o.set_ftrl_beta(ctr.ftrl_beta);
  o.set_ftrl_l1(ctr.ftrl_l1);
  o.set_ftrl_l2(ctr.ftrl_l2);
  return model;
}

// This worker's slice of the training set and the whole held-out set, from
// --ctr_data; for synthetic data also the ground truth's figures (NaN
// otherwise). Exits 2 on a data flag that cannot be read.
struct CtrData {
  CtrDataset train, test;
  double true_auc = NAN, true_logloss = NAN;
};

CtrData LoadCtrData(const WorkerConfig& config) {
  const CtrConfig& ctr = config.ctr;
  const std::string& source = ctr.data;
  const ShardSpec shard{config.worker_id, config.num_workers};
  CtrData data;
  if (source == "synthetic") {
    SyntheticCtrOptions synthetic;
    synthetic.num_fields = ctr.fields;
    synthetic.num_dense = ctr.dense;
    synthetic.vocab_per_field = ctr.vocab;
    // Checked with the rest of the flags (ValidateWorkerConfig).
    synthetic.field_vocab = CtrFieldVocab(ctr).value_or(std::vector<int64_t>{});
    synthetic.seed = config.seed;
    const int64_t train_examples = ctr.train_examples;
    absl::StatusOr<CtrDataset> t =
        MakeSyntheticCtr(synthetic, 0, train_examples, shard);
    std::vector<double> truth;
    absl::StatusOr<CtrDataset> h = MakeSyntheticCtr(
        synthetic, train_examples, ctr.test_examples, {0, 1}, &truth);
    ExitOnFlagErrors({t.status(), h.status()});
    data.train = std::move(*t);
    data.test = std::move(*h);
    std::vector<double> logits;
    for (double p : truth) logits.push_back(std::log(p / (1 - p)));
    data.true_auc = Auc(data.test.labels, logits);
    data.true_logloss = LogLoss(data.test.labels, truth);
    LOG(INFO) << "synthetic CTR task: ground-truth AUC " << data.true_auc
              << ", logloss " << data.true_logloss;
  } else {
    auto read = [&](const std::string& path,
                    ShardSpec s) -> absl::StatusOr<CtrDataset> {
      if (source == "criteo") {
        return ReadCriteoTsv(path, ctr.dense, ctr.fields, s);
      }
      return ReadLibsvmCtr(path, s);
    };
    absl::StatusOr<CtrDataset> t = read(config.data.train_file, shard);
    ExitOnFlagErrors({t.status()});
    data.train = std::move(*t);
    if (!config.data.test_file.empty()) {
      absl::StatusOr<CtrDataset> h = read(config.data.test_file, {0, 1});
      ExitOnFlagErrors({h.status()});
      data.test = std::move(*h);
    }
  }
  return data;
}

}  // namespace

int RunCtrWorker(const CtrWorkerContext& context) {
  const WorkerConfig& config = *context.config;
  const CtrConfig& ctr = config.ctr;
  CtrModelOptions model = CtrModel(config);
  const SparseOptimizer& o = model.sparse_optimizer;
  LOG(INFO) << "sparse optimizer " << o.name() << ", learning rate "
            << (o.name() == "ftrl"
                    ? absl::StrCat(o.ftrl_alpha(), " (--ftrl_alpha)")
                    : DescribeLearningRate(ctr.sparse_learning_rate, o.name(),
                                           DefaultSparseLearningRate(o.name()),
                                           "--sparse_learning_rate"));

  const CtrData data = LoadCtrData(config);
  model.num_fields = data.train.num_fields;
  model.num_dense = data.train.num_dense;

  // A wait cut short by a signal (SIGINT/SIGTERM set `stop`, then the
  // caller interrupted the client).
  auto interrupted = [&](const absl::Status& status) {
    return context.stopped_while_waiting && context.stop != nullptr &&
           context.stop->load() && absl::IsCancelled(status);
  };
  absl::StatusOr<Registration> registration =
      context.register_model
          ? context.register_model(CtrSchema(model))
          : context.client->Register(CtrSchema(model), config.num_workers,
                                     config.worker_id);
  if (!registration.ok() && interrupted(registration.status())) {
    return context.stopped_while_waiting(
        "to reach the servers and register the model", registration.status());
  }
  if (!registration.ok()) {
    LOG(ERROR) << "cannot register the model: " << registration.status();
    return 1;
  }
  if (absl::Status started =
          context.client->AwaitJobStart(context.on_waiting, context.stop);
      !started.ok()) {
    if (interrupted(started)) {
      return context.stopped_while_waiting(
          "for the job's other workers to register", started);
    }
    LOG(ERROR) << "the job did not start: " << started;
    context.client->Leave().IgnoreError();
    return 1;
  }
  // Without client options there is no observer: the worker's own client
  // reads the final model, as in sync.
  absl::StatusOr<std::unique_ptr<PsClient>> observer =
      std::unique_ptr<PsClient>();
  if (context.client_options != nullptr) {
    observer = PsClient::CreateFinalModelReader(
        registration->mode, *context.client_options, CtrSchema(model),
        config.num_workers);
  }
  if (!observer.ok()) {
    LOG(ERROR) << "cannot connect the observer for the final model: "
               << observer.status();
    context.client->Leave().IgnoreError();
    return 1;
  }
  CtrTrainerOptions options;
  options.worker_id = config.worker_id;
  options.num_workers = config.num_workers;
  options.observer = observer->get();
  options.final_model_timeout = absl::Seconds(config.client.rpc_timeout_s);
  options.start_step = registration->start_step;
  options.steps = config.training.steps;
  options.batch_size = config.training.batch_size;
  options.stop = context.stop;
  options.graceful_stop = context.graceful_stop;
  options.on_steps_done = context.on_steps_done;
  options.table_lane = ctr.embedding_prefetch;
  options.step_delay = absl::Milliseconds(config.training.inject_step_delay_ms);
  options.sigterm_after_step = config.training.inject_sigterm_after_step;
  options.sigterm_before_push_step =
      config.training.inject_sigterm_before_push_step;
  std::vector<absl::Status> problems;
  options.learning_rate_at =
      ScheduledRate(config.training.lr_schedule, config.training.steps,
                    registration->learning_rate, &problems);
  ExitOnFlagErrors(problems);
  int64_t last_step = registration->start_step;
  options.on_step = [&](const StepReport& r) {
    last_step = r.step;
    if (context.on_step) context.on_step(r);
  };
  absl::StatusOr<CtrResult> result =
      TrainCtr(model, options, registration->mode, *context.client,
               *context.backend, data.train, data.test);
  if (!result.ok() && interrupted(result.status())) {
    return context.stopped_while_waiting(
        absl::StrCat("on the servers after step ", last_step, " of ",
                     config.training.steps),
        result.status());
  }
  if (!result.ok()) {
    LOG(ERROR) << "training failed: " << result.status();
    return 1;
  }
  std::printf("%s\n", CtrFinalJson(*result, config.worker_id,
                                   config.num_workers, context.backend->Name(),
                                   data.true_auc, data.true_logloss)
                          .c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace pstrain
