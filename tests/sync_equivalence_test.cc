// The sync contract: W workers sharing a global batch G end with the same
// weights as one worker with batch G, whatever the number of shards, with
// the data reshuffled every epoch: worker k of W takes the k-th slice of
// each global batch of the epoch's permutation, so the workers' slices of
// step s together are the single process's batch of step s. (Any other
// split, e.g. example i to worker i mod W, gives the workers other examples
// at step s, and the comparison with the single process below fails.)
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/init.h"
#include "common/partition.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"

namespace pstrain {
namespace {

constexpr int kSteps = 60;
constexpr int kGlobalBatch = 32;

// Flags shared by every worker: an MLP on the synthetic task. 1000 examples
// make 31 steps an epoch, so the job crosses into a second permutation.
std::vector<std::string> ModelFlags(bool shuffle, int global_batch) {
  return {"--model=mlp",
          "--hidden=16",
          "--num_features=12",
          "--num_classes=3",
          "--train_examples=1000",
          "--test_examples=256",
          "--block_elements=50",
          "--seed=11",
          absl::StrCat("--steps=", kSteps),
          absl::StrCat("--global_batch_size=", global_batch),
          absl::StrCat("--shuffle=", shuffle),
          "--log_every=0",
          "--device=cpu"};
}

ModelSchema Schema() {
  auto backend =
      std::move(*kernels::CreateBackend(kernels::BackendOptions{"cpu"}));
  auto model = std::move(*CreateMlp(backend.get(), 12, {16}, 3, 1));
  ModelSchema schema;
  schema.set_seed(11);
  schema.set_block_elements(50);
  for (const DenseTensorSpec& spec : model->Params()) {
    *schema.add_dense() = spec;
  }
  return schema;
}

// When the workers start, relative to the servers, and what they print.
struct Staggering {
  std::vector<absl::Duration> start_delays;  // one per worker
  std::vector<std::string> server_flags;
  std::vector<std::string>* worker_outputs = nullptr;
  // Flags for worker k only (after the shared ones), where given.
  std::vector<std::vector<std::string>> worker_flags;
};

// Trains with `workers` workers sharing the global batch on `shards` shards
// and returns the final model, pulled from the servers.
std::vector<std::vector<float>> TrainAndPull(
    int workers, int shards, const std::string& mode, const std::string& name,
    bool shuffle = true, int global_batch = kGlobalBatch,
    std::vector<std::string> extra = {}, const Staggering& staggering = {}) {
  testing::ClusterOptions options;
  options.num_shards = shards;
  options.num_workers = workers;
  options.mode = mode;
  options.server_flags = {"--optimizer=sgd", "--learning_rate=0.2"};
  options.server_flags.insert(options.server_flags.end(),
                              staggering.server_flags.begin(),
                              staggering.server_flags.end());
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  std::vector<std::string> worker_flags = ModelFlags(shuffle, global_batch);
  worker_flags.insert(worker_flags.end(), extra.begin(), extra.end());
  std::vector<std::vector<std::string>> flags(workers, worker_flags);
  for (size_t k = 0; k < staggering.worker_flags.size(); ++k) {
    flags[k].insert(flags[k].end(), staggering.worker_flags[k].begin(),
                    staggering.worker_flags[k].end());
  }
  absl::StatusOr<std::vector<std::string>> outputs = (*cluster)->RunWorkers(
      flags, absl::Seconds(120), staggering.start_delays);
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  if (!outputs.ok()) return {};
  if (staggering.worker_outputs != nullptr) {
    *staggering.worker_outputs = *outputs;
  }

  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
  client_options.rpc_timeout = absl::Seconds(10);
  auto client = std::move(*PsClient::Create(client_options));
  const ModelSchema schema = Schema();
  EXPECT_TRUE(client->Register(schema, workers, /*worker_id=*/-1).ok());
  std::vector<std::vector<float>> tensors;
  std::vector<float*> pointers;
  for (const DenseTensorSpec& spec : schema.dense()) {
    tensors.emplace_back(NumElements(spec));
  }
  for (auto& t : tensors) pointers.push_back(t.data());
  // sync: the model after exactly kSteps updates; async: the current one.
  const absl::StatusOr<int64_t> pulled = client->Pull(kSteps, pointers);
  EXPECT_TRUE(pulled.ok()) << pulled.status();
  return tensors;
}

double MaxAbsDifference(const std::vector<std::vector<float>>& a,
                        const std::vector<std::vector<float>>& b) {
  double max_diff = 0;
  for (size_t t = 0; t < a.size(); ++t) {
    for (size_t i = 0; i < a[t].size(); ++i) {
      max_diff = std::max(max_diff, std::abs(double{a[t][i]} - b[t][i]));
    }
  }
  return max_diff;
}

std::vector<std::vector<float>> InitialModel() {
  const ModelSchema schema = Schema();
  std::vector<std::vector<float>> tensors;
  for (const DenseTensorSpec& spec : schema.dense()) {
    tensors.emplace_back(NumElements(spec));
    FillInitialValues(spec.init(), schema.seed(), spec.name(), 0,
                      absl::MakeSpan(tensors.back()));
  }
  return tensors;
}

TEST(SyncEquivalenceTest, TwoWorkersEqualOneWorkerWithTheGlobalBatch) {
  const auto distributed = TrainAndPull(2, 2, "sync", "two_workers");
  const auto single = TrainAndPull(1, 1, "sync", "one_worker");
  ASSERT_EQ(distributed.size(), 4u);  // fc0 weight/bias, fc1 weight/bias
  ASSERT_EQ(single.size(), 4u);
  EXPECT_LE(MaxAbsDifference(distributed, single), 1e-5);

  // Not a vacuous pass: training moved the weights far beyond the tolerance,
  // and applying each worker's gradient on arrival (async) does not match.
  EXPECT_GE(MaxAbsDifference(single, InitialModel()), 1e-2);
  const auto async = TrainAndPull(2, 2, "async", "two_workers_async");
  ASSERT_EQ(async.size(), 4u);
  EXPECT_GE(MaxAbsDifference(async, single), 1e-4);

  // The shuffle matters to the weights, so the match above needed every
  // worker to take exactly its slice of the shuffled order.
  const auto unshuffled = TrainAndPull(1, 1, "sync", "one_worker_in_order",
                                       /*shuffle=*/false);
  ASSERT_EQ(unshuffled.size(), 4u);
  EXPECT_GE(MaxAbsDifference(unshuffled, single), 1e-3);
}

TEST(SyncEquivalenceTest, ThreeWorkersEqualOneWorkerWithTheGlobalBatch) {
  const auto single = TrainAndPull(1, 1, "sync", "one_worker_30", true, 30);
  ASSERT_EQ(single.size(), 4u);
  const auto three = TrainAndPull(3, 2, "sync", "three_workers_30", true, 30);
  ASSERT_EQ(three.size(), 4u);
  EXPECT_LE(MaxAbsDifference(three, single), 1e-5);
}

// Each tensor's gradient pushed on its own as backward produces it, from a
// push thread (several pushes per step, each block on its own): the model
// is still exactly the single process's.
// Every group of a shard on one connection: a step's PushPulls go back to
// back on it and each is answered as its group's step completes (the
// pipelined exchange that keeps a bound link busy both ways).
TEST(SyncEquivalenceTest, PipelinedGroupsOnOneConnectionChangeNothing) {
  const auto single =
      TrainAndPull(1, 1, "sync", "one_worker_30_pipe", true, 30);
  ASSERT_EQ(single.size(), 4u);
  const auto three =
      TrainAndPull(3, 2, "sync", "three_workers_30_pipe", true, 30,
                   {"--connections_per_shard=1", "--block_elements=50"});
  ASSERT_EQ(three.size(), 4u);
  EXPECT_LE(MaxAbsDifference(three, single), 1e-5);
}

// A plain and a pipelined worker in one job, each with one request in
// flight on one connection a shard (as on links to other hosts): they send
// a PushPull's groups in one order. With two orders each worker's first
// request waited for a group the other sent last, and every step for a
// lease to run out (60 steps: far past the workers' 120 s).
TEST(SyncEquivalenceTest, APlainAndAPipelinedWorkerShareOneOrder) {
  const auto single = TrainAndPull(1, 1, "sync", "one_worker_mixed_ref");
  ASSERT_EQ(single.size(), 4u);
  Staggering mixed;
  mixed.worker_flags = {{"--pipeline_step=never"}, {"--pipeline_step=always"}};
  std::vector<std::string> outputs;
  mixed.worker_outputs = &outputs;
  const auto two = TrainAndPull(
      2, 2, "sync", "two_workers_mixed", true, kGlobalBatch,
      {"--connections_per_shard=1", "--data_requests_in_flight=1"}, mixed);
  ASSERT_EQ(two.size(), 4u);
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_THAT(outputs[0], ::testing::HasSubstr("\"pipelined\":false"));
  EXPECT_THAT(outputs[1], ::testing::HasSubstr("\"pipelined\":true"));
  // The pipelined worker's forward sums its first layer block by block.
  EXPECT_LE(MaxAbsDifference(two, single), 1e-4);
}

TEST(SyncEquivalenceTest, PushingLayerByLayerDuringBackwardChangesNothing) {
  const auto single = TrainAndPull(1, 1, "sync", "one_worker_overlap_ref");
  ASSERT_EQ(single.size(), 4u);
  const auto overlapped =
      TrainAndPull(2, 2, "sync", "two_workers_overlap", true, kGlobalBatch,
                   {"--overlap_push=true"});
  ASSERT_EQ(overlapped.size(), 4u);
  EXPECT_LE(MaxAbsDifference(overlapped, single), 1e-5);
  EXPECT_GE(MaxAbsDifference(single, InitialModel()), 1e-2);
}

// Issue 27: servers first, workers late, as on a cluster (scheduling, image
// pulls, CUDA start-up). The servers' leases of 1 s used to drop a worker
// that had not come yet: the first one ran every step alone and the others
// joined a finished job, all exiting 0. Now every worker runs every step,
// none is short, and the model is the single process's.
TEST(SyncEquivalenceTest, WorkersStartingLateEqualOneWorkerWithTheGlobalBatch) {
  const auto single = TrainAndPull(1, 1, "sync", "one_worker_late_ref");
  ASSERT_EQ(single.size(), 4u);
  constexpr int kLeaseMs = 1000;
  // Heartbeats well inside the short lease while a worker waits.
  const std::vector<std::string> heartbeats = {"--heartbeat_interval_s=0.2"};
  Staggering late;
  late.server_flags = {absl::StrCat("--worker_lease_s=", kLeaseMs / 1000.0)};
  std::vector<std::string> outputs;
  late.worker_outputs = &outputs;
  // Worker 0 after its lease would have lapsed, worker 1 three seconds on.
  late.start_delays = {absl::Milliseconds(kLeaseMs + 2000),
                       absl::Milliseconds(kLeaseMs + 5000)};
  const auto staggered = TrainAndPull(2, 2, "sync", "two_workers_late", true,
                                      kGlobalBatch, heartbeats, late);
  ASSERT_EQ(staggered.size(), 4u);
  EXPECT_LE(MaxAbsDifference(staggered, single), 1e-5);
  ASSERT_EQ(outputs.size(), 2u);
  for (const std::string& output : outputs) {
    EXPECT_EQ(*testing::FinalJsonNumber(output, "start_step"), 0);
    EXPECT_EQ(*testing::FinalJsonNumber(output, "steps_run"), kSteps);
    EXPECT_EQ(*testing::FinalJsonNumber(output, "steps_short"), 0);
  }

  // Three workers at random times up to twice the lease (the seed is fixed
  // so a failure reproduces).
  std::mt19937 random(27);
  std::uniform_int_distribution<int> delay_ms(0, 2 * kLeaseMs);
  late.start_delays.clear();
  for (int k = 0; k < 3; ++k) {
    late.start_delays.push_back(absl::Milliseconds(delay_ms(random)));
  }
  const auto single_30 =
      TrainAndPull(1, 1, "sync", "one_worker_30_late", true, 30);
  const auto three = TrainAndPull(3, 2, "sync", "three_workers_late", true, 30,
                                  heartbeats, late);
  ASSERT_EQ(three.size(), 4u);
  EXPECT_LE(MaxAbsDifference(three, single_30), 1e-5);
  for (const std::string& output : outputs) {
    EXPECT_EQ(*testing::FinalJsonNumber(output, "steps_run"), kSteps);
    EXPECT_EQ(*testing::FinalJsonNumber(output, "steps_short"), 0);
  }
}

}  // namespace
}  // namespace pstrain
