#include "worker/ctr_main.h"

#include <cmath>
#include <cstdio>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/learning_rates.h"
#include "glog/logging.h"
#include "worker/ctr_data.h"
#include "worker/ctr_metrics.h"
#include "worker/ctr_trainer.h"

ABSL_FLAG(std::string, ctr_data, "synthetic",
          "--model=ctr data: synthetic (a hidden ground-truth model, so the "
          "achievable AUC is known), criteo (TSV) or libsvm.");
ABSL_FLAG(int, ctr_fields, 6, "Categorical fields (synthetic, criteo).");
ABSL_FLAG(int, ctr_dense, 4, "Dense features (synthetic, criteo).");
ABSL_FLAG(int64_t, ctr_vocab, 10000, "Synthetic: ids per field (Zipf).");
ABSL_FLAG(int64_t, ctr_train_examples, 65536,
          "Synthetic: training examples in the whole job.");
ABSL_FLAG(int64_t, ctr_test_examples, 8192, "Synthetic: held-out examples.");
ABSL_FLAG(int64_t, embedding_dim, 8, "Embedding row size.");
ABSL_FLAG(int64_t, ctr_hidden, 32, "Hidden units of the CTR model's MLP.");
ABSL_FLAG(std::string, sparse_optimizer, "adagrad",
          "Row updates on the servers: sgd, adagrad, adam (lazy) or ftrl.");
ABSL_FLAG(double, sparse_learning_rate, 0,
          "Sparse optimizer rate (not ftrl's: see --ftrl_alpha). 0 (the "
          "default): the optimizer's own default, as PyTorch and Keras users "
          "know it: adagrad 0.01 (torch.optim.Adagrad), adam 0.001 "
          "(torch.optim.SparseAdam and keras Adam), sgd 0.01 (keras SGD). "
          "The rate in effect is logged at start.");
ABSL_FLAG(double, adagrad_initial_accumulator, 0.1, "Adagrad's start.");
ABSL_FLAG(double, ftrl_alpha, 0.05,
          "FTRL-proximal alpha, ftrl's learning rate (keras Ftrl's "
          "learning_rate defaults to 0.001; this keeps the 0.05 pstrain has "
          "always used).");
ABSL_FLAG(double, ftrl_beta, 1.0, "FTRL-proximal beta.");
ABSL_FLAG(double, ftrl_l1, 0.0, "FTRL-proximal L1.");
ABSL_FLAG(double, ftrl_l2, 0.0, "FTRL-proximal L2.");
ABSL_FLAG(double, embedding_init_scale, 0.05,
          "Rows start uniform in [-scale, scale] (deterministic per id).");

namespace pstrain {

int RunCtrWorker(const CtrWorkerContext& context) {
  const std::string source = absl::GetFlag(FLAGS_ctr_data);
  std::vector<absl::Status> checks;
  if (source != "synthetic" && source != "criteo" && source != "libsvm") {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--ctr_data must be synthetic, criteo or libsvm, got '", source, "'")));
  }
  if (source != "synthetic" && context.train_file.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--ctr_data=", source, " needs --train_file")));
  }
  CtrModelOptions model;
  model.dim = absl::GetFlag(FLAGS_embedding_dim);
  model.hidden = absl::GetFlag(FLAGS_ctr_hidden);
  model.seed = context.seed;
  model.block_elements = context.block_elements;
  if (model.dim < 1 || model.hidden < 1) {
    checks.push_back(absl::InvalidArgumentError(
        "--embedding_dim and --ctr_hidden must be >= 1"));
  }
  model.embedding_init.set_kind(InitSpec::UNIFORM);
  model.embedding_init.set_scale(absl::GetFlag(FLAGS_embedding_init_scale));
  SparseOptimizer& o = model.sparse_optimizer;
  o.set_name(absl::GetFlag(FLAGS_sparse_optimizer));
  const double given_rate = absl::GetFlag(FLAGS_sparse_learning_rate);
  const std::optional<DefaultLearningRate> default_rate =
      DefaultSparseLearningRate(o.name());
  o.set_learning_rate(EffectiveLearningRate(given_rate, default_rate));
  o.set_initial_accumulator(absl::GetFlag(FLAGS_adagrad_initial_accumulator));
  o.set_beta1(0.9f);
  o.set_beta2(0.999f);
  o.set_epsilon(1e-8f);
  o.set_ftrl_alpha(absl::GetFlag(FLAGS_ftrl_alpha));
  o.set_ftrl_beta(absl::GetFlag(FLAGS_ftrl_beta));
  o.set_ftrl_l1(absl::GetFlag(FLAGS_ftrl_l1));
  o.set_ftrl_l2(absl::GetFlag(FLAGS_ftrl_l2));
  // The servers check every field at registration; these are the mistakes
  // worth one clear line before any work.
  if (o.name() != "sgd" && o.name() != "adagrad" && o.name() != "adam" &&
      o.name() != "ftrl") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--sparse_optimizer must be sgd, adagrad, adam or ftrl, "
                     "got '",
                     o.name(), "'")));
  }
  // FTRL's rate is --ftrl_alpha; it reads no --sparse_learning_rate.
  if (!(o.learning_rate() > 0 || o.name() == "ftrl") || !(o.ftrl_alpha() > 0)) {
    checks.push_back(absl::InvalidArgumentError(
        "--sparse_learning_rate and --ftrl_alpha must be positive"));
  }
  ExitOnFlagErrors(checks);
  LOG(INFO) << "sparse optimizer " << o.name() << ", learning rate "
            << (o.name() == "ftrl"
                    ? absl::StrCat(o.ftrl_alpha(), " (--ftrl_alpha)")
                    : DescribeLearningRate(given_rate, o.name(), default_rate,
                                           "--sparse_learning_rate"));

  const ShardSpec shard{context.worker_id, context.num_workers};
  CtrDataset train, test;
  double true_auc = NAN, true_logloss = NAN;
  if (source == "synthetic") {
    SyntheticCtrOptions synthetic;
    synthetic.num_fields = absl::GetFlag(FLAGS_ctr_fields);
    synthetic.num_dense = absl::GetFlag(FLAGS_ctr_dense);
    synthetic.vocab_per_field = absl::GetFlag(FLAGS_ctr_vocab);
    synthetic.seed = context.seed;
    const int64_t train_examples = absl::GetFlag(FLAGS_ctr_train_examples);
    absl::StatusOr<CtrDataset> t =
        MakeSyntheticCtr(synthetic, 0, train_examples, shard);
    absl::StatusOr<CtrDataset> h =
        MakeSyntheticCtr(synthetic, train_examples,
                         absl::GetFlag(FLAGS_ctr_test_examples), {0, 1});
    ExitOnFlagErrors({t.status(), h.status()});
    train = std::move(*t);
    test = std::move(*h);
    absl::StatusOr<std::vector<double>> truth =
        SyntheticCtrTrueProbabilities(synthetic, test);
    if (truth.ok()) {
      std::vector<double> logits;
      for (double p : *truth) logits.push_back(std::log(p / (1 - p)));
      true_auc = Auc(test.labels, logits);
      true_logloss = LogLoss(test.labels, *truth);
      LOG(INFO) << "synthetic CTR task: ground-truth AUC " << true_auc
                << ", logloss " << true_logloss;
    }
  } else {
    auto read = [&](const std::string& path,
                    ShardSpec s) -> absl::StatusOr<CtrDataset> {
      if (source == "criteo") {
        return ReadCriteoTsv(path, absl::GetFlag(FLAGS_ctr_dense),
                             absl::GetFlag(FLAGS_ctr_fields), s);
      }
      return ReadLibsvmCtr(path, s);
    };
    absl::StatusOr<CtrDataset> t = read(context.train_file, shard);
    ExitOnFlagErrors({t.status()});
    train = std::move(*t);
    if (!context.test_file.empty()) {
      absl::StatusOr<CtrDataset> h = read(context.test_file, {0, 1});
      ExitOnFlagErrors({h.status()});
      test = std::move(*h);
    }
  }
  model.num_fields = train.num_fields;
  model.num_dense = train.num_dense;

  // A wait cut short by a signal (SIGINT/SIGTERM set `stop`, then the
  // caller interrupted the client).
  auto interrupted = [&](const absl::Status& status) {
    return context.stopped_while_waiting && context.stop != nullptr &&
           context.stop->load() && absl::IsCancelled(status);
  };
  absl::StatusOr<Registration> registration =
      context.register_model
          ? context.register_model(CtrSchema(model))
          : context.client->Register(CtrSchema(model), context.num_workers,
                                     context.worker_id);
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
  // async/ssp: the final model is read as an observer, after this worker
  // has left (a pull as a worker would rejoin the job).
  std::unique_ptr<PsClient> observer;
  if (registration->mode != "sync" && context.client_options != nullptr) {
    absl::StatusOr<std::unique_ptr<PsClient>> created =
        PsClient::CreateObserver(*context.client_options, CtrSchema(model),
                                 context.num_workers);
    if (!created.ok()) {
      LOG(ERROR) << "cannot connect the observer for the final model: "
                 << created.status();
      context.client->Leave().IgnoreError();
      return 1;
    }
    observer = std::move(*created);
  }
  CtrTrainerOptions options;
  options.worker_id = context.worker_id;
  options.num_workers = context.num_workers;
  options.observer = observer.get();
  options.final_model_timeout = context.final_model_timeout;
  options.start_step = registration->start_step;
  options.steps = context.steps;
  options.batch_size = context.batch_size;
  options.stop = context.stop;
  options.on_steps_done = context.on_steps_done;
  int64_t last_step = registration->start_step;
  options.on_step = [&](const StepReport& r) {
    last_step = r.step;
    if (context.on_step) context.on_step(r);
  };
  absl::StatusOr<CtrResult> result =
      TrainCtr(model, options, registration->mode, *context.client,
               *context.backend, train, test);
  if (!result.ok() && interrupted(result.status())) {
    return context.stopped_while_waiting(
        absl::StrCat("on the servers after step ", last_step, " of ",
                     context.steps),
        result.status());
  }
  if (!result.ok()) {
    LOG(ERROR) << "training failed: " << result.status();
    return 1;
  }
  std::printf("%s\n",
              CtrFinalJson(*result, context.worker_id, context.num_workers,
                           context.backend->Name(), true_auc, true_logloss)
                  .c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace pstrain
