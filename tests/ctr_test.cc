// The CTR model with its embedding tables sharded on real servers: it gets
// close to the synthetic task's ground-truth AUC, and the same job on 1 and
// 3 shards ends with the same model.
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/ctr_data.h"
#include "worker/ctr_trainer.h"

namespace pstrain {
namespace {

using testing::ClusterOptions;
using testing::FinalJsonNumber;
using testing::TestCluster;

std::vector<std::string> CtrFlags(int steps) {
  return {"--model=ctr",
          "--ctr_data=synthetic",
          "--ctr_fields=4",
          "--ctr_dense=2",
          "--ctr_vocab=2000",
          "--ctr_train_examples=32768",
          "--ctr_test_examples=4096",
          "--embedding_dim=8",
          "--ctr_hidden=16",
          "--sparse_optimizer=adagrad",
          "--sparse_learning_rate=0.1",
          "--batch_size=128",
          "--block_elements=256",
          "--seed=3",
          "--log_every=0",
          "--device=cpu",
          absl::StrCat("--steps=", steps)};
}

// 2 shards running Adam at 0.01 for the dense layers, `workers` workers.
ClusterOptions CtrCluster(const std::string& mode, int workers) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = workers;
  options.mode = mode;
  options.server_flags = {"--optimizer=adam", "--learning_rate=0.01"};
  return options;
}

double Number(const std::string& out, const std::string& key) {
  absl::StatusOr<double> value = FinalJsonNumber(out, key);
  EXPECT_TRUE(value.ok()) << value.status() << "\n" << out;
  return value.value_or(NAN);
}

TEST(CtrTest, ReachesTheGroundTruthAucWithinAMargin) {
  // Sync: deterministic, so the margin below cannot flake.
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(CtrCluster("sync", 2), "ctr_auc");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::vector<std::string>> outputs = (*cluster)->RunWorkers(
      {CtrFlags(400), CtrFlags(400)}, absl::Seconds(240));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  for (const std::string& out : *outputs) {
    const double auc = Number(out, "auc");
    const double truth = Number(out, "true_auc");
    std::cout << "[ ctr ] auc " << auc << " vs ground truth " << truth << "\n";
    // Stated margin: within 0.05 of what the generating model achieves.
    EXPECT_GE(auc, truth - 0.05) << out;
    EXPECT_GT(Number(out, "sparse_rows_pulled"), 0);
  }
  // Rows exist only for ids the job touched, spread over both shards.
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok());
  for (const StatsResponse& shard : *stats) {
    ASSERT_EQ(shard.sparse_size(), 4);
    EXPECT_GT(shard.sparse(0).rows(), 0);
    EXPECT_LT(shard.sparse(0).rows(), 2000);
  }
}

// --sparse_row_ttl: rows of ids nobody pulled or pushed for a second go
// while the job runs (it lasts at least 3 s: 60 steps, 50 ms each), and the
// job still ends and evaluates.
TEST(CtrTest, RowsUntouchedForTheirTtlExpireWhileTheJobRuns) {
  ClusterOptions options = CtrCluster("async", 1);
  options.server_flags.push_back("--sparse_row_ttl=1s");
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "ctr_ttl");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> flags = CtrFlags(60);
  flags.push_back("--inject_step_delay_ms=50");
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags}, absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_GT(Number(outputs->front(), "auc"), 0.5) << outputs->front();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok());
  int64_t expired = 0, evicted = 0;
  for (const StatsResponse& shard : *stats) {
    for (const SparseStats& table : shard.sparse()) {
      expired += table.rows_expired();
      evicted += table.rows_evicted();
    }
  }
  std::cout << "[ ctr ] rows expired by the 1 s TTL: " << expired << "\n";
  EXPECT_GT(expired, 0);
  EXPECT_EQ(evicted, 0);  // no bound: only the TTL removed rows
}

// --sparse_row_ttl_steps: the same in the job's steps, in a sync job run as
// fast as it goes: rows of ids no batch had in the last 5 steps go, however
// little time passed.
TEST(CtrTest, RowsUntouchedForTheirTtlInStepsExpireWhileTheJobRuns) {
  ClusterOptions options = CtrCluster("sync", 1);
  options.server_flags.push_back("--sparse_row_ttl_steps=5");
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, "ctr_ttl_steps");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({CtrFlags(60)}, absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_GT(Number(outputs->front(), "auc"), 0.5) << outputs->front();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok());
  int64_t expired = 0;
  for (const StatsResponse& shard : *stats) {
    for (const SparseStats& table : shard.sparse()) {
      expired += table.rows_expired();
    }
  }
  std::cout << "[ ctr ] rows expired by the 5-step TTL: " << expired << "\n";
  EXPECT_GT(expired, 0);
}

// Async: every worker evaluates the same final model, the servers' once all
// have finished, even when one finishes well before the other (worker 1
// starts 1.5 s late, so worker 0 would otherwise evaluate a model that is
// still changing).
TEST(CtrTest, AsyncWorkersEvaluateOneFinalModel) {
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(CtrCluster("async", 2), "ctr_async_final");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({CtrFlags(200), CtrFlags(200)}, absl::Seconds(240),
                             {absl::ZeroDuration(), absl::Milliseconds(1500)});
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  ASSERT_EQ(outputs->size(), 2u);
  for (const std::string& out : *outputs) {
    EXPECT_NE(out.find("\"final_model\":\"all_done\""), std::string::npos)
        << out;
  }
  EXPECT_EQ(Number((*outputs)[0], "auc"), Number((*outputs)[1], "auc"));
  EXPECT_EQ(Number((*outputs)[0], "logloss"), Number((*outputs)[1], "logloss"));
}

// Sync servers, async tables (--embedding_mode=async): the dense layers step
// together while each table applies every push on arrival. The tables take
// no part in the step (their version is not the step count), the job still
// learns, and both workers evaluate one final model, with the table lane
// (--embedding_prefetch) or without.
TEST(CtrTest, SyncDenseLayersWithAsyncTablesLearnAndEndOnOneModel) {
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(CtrCluster("sync", 2), "ctr_async_tables");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> flags = CtrFlags(300);
  flags.push_back("--embedding_mode=async");
  // Worker 1 moves its rows in line with the step (the lane is a worker's
  // own choice), worker 0 beside the dense exchange (the default).
  std::vector<std::string> in_line = flags;
  in_line.push_back("--embedding_prefetch=false");
  // Worker 1 starts late: the tables' pulls of worker 0 do not wait for it.
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags, in_line}, absl::Seconds(240),
                             {absl::ZeroDuration(), absl::Milliseconds(500)});
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  ASSERT_EQ(outputs->size(), 2u);
  for (const std::string& out : *outputs) {
    EXPECT_NE(out.find("\"final_model\":\"sync_step\""), std::string::npos)
        << out;
    EXPECT_GE(Number(out, "auc"), Number(out, "true_auc") - 0.06) << out;
  }
  EXPECT_EQ(Number((*outputs)[0], "auc"), Number((*outputs)[1], "auc"));
  EXPECT_EQ(Number((*outputs)[0], "logloss"), Number((*outputs)[1], "logloss"));
  // Worker 0's table lane pushed and pulled the rows beside the dense
  // exchange: it waited for the lane less than the lane worked.
  const std::string& lane = (*outputs)[0];
  EXPECT_GT(Number(lane, "table_lane_s"), 0) << lane;
  EXPECT_LT(Number(lane, "table_lane_wait_s"), Number(lane, "table_lane_s"))
      << lane;
  EXPECT_EQ(Number((*outputs)[1], "table_lane_s"), 0) << (*outputs)[1];
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), 300);  // the dense step
    ASSERT_EQ(shard.sparse_size(), 4);
    for (const SparseStats& table : shard.sparse()) {
      EXPECT_EQ(table.mode(), "async") << table.name();
      EXPECT_EQ(table.version(), 0) << table.name();
      EXPECT_GT(table.rows_pushed(), 0) << table.name();
    }
  }
}

// The worker's row cache (--sparse_cache_steps): hot rows come from the
// cache, fewer rows from the servers, and the job still learns. Without the
// cache every training row comes from the servers.
TEST(CtrTest, TheRowCacheServesHotRowsWithinItsBound) {
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(CtrCluster("sync", 1), "ctr_row_cache");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> flags = CtrFlags(300);
  flags.push_back("--sparse_cache_steps=2");
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags}, absl::Seconds(240));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  const std::string& out = outputs->front();
  const double hits = Number(out, "sparse_cache_hits");
  const double from_servers = Number(out, "sparse_rows_from_servers");
  EXPECT_GT(hits, 0) << out;
  EXPECT_GT(from_servers, 0) << out;
  // Rows of dim 8, float32.
  EXPECT_EQ(Number(out, "sparse_cache_bytes_saved"), hits * 8 * 4) << out;
  std::cout << "[ ctr ] row cache: " << hits << " hits, " << from_servers
            << " rows from the servers\n";
  EXPECT_GE(Number(out, "auc"), Number(out, "true_auc") - 0.06) << out;
  // A second job of the same cluster without the cache: no hits.
  absl::StatusOr<std::unique_ptr<TestCluster>> plain =
      TestCluster::Start(CtrCluster("sync", 1), "ctr_no_row_cache");
  ASSERT_TRUE(plain.ok()) << plain.status();
  outputs = (*plain)->RunWorkers({CtrFlags(300)}, absl::Seconds(240));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_EQ(Number(outputs->front(), "sparse_cache_hits"), 0);
  EXPECT_EQ(Number(outputs->front(), "sparse_rows_from_servers"),
            hits + from_servers)
      << "the same job asks for the same rows";
}

// A sync table's pull is its step's barrier: a worker whose rows on some
// shard all come from the cache (tables of 1 to 3 ids, a bound longer than
// the job) still waits there for the step before pushing the next, or its
// push would find the table a step behind (jittered pushes make that
// likely at every step).
TEST(CtrTest, CachedRowsStillWaitForTheirTablesSyncStep) {
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(CtrCluster("sync", 2), "ctr_cached_barrier");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::string> flags = CtrFlags(150);
  flags.push_back("--ctr_cardinalities=1,2,3,2000");
  flags.push_back("--sparse_cache_steps=1000");
  flags.push_back("--inject_push_jitter_ms=4");
  absl::StatusOr<std::vector<std::string>> outputs =
      (*cluster)->RunWorkers({flags, flags}, absl::Seconds(240));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  for (const std::string& out : *outputs) {
    EXPECT_EQ(Number(out, "steps_run"), 150) << out;
    EXPECT_GT(Number(out, "sparse_cache_hits"), 0) << out;
  }
  EXPECT_EQ(Number((*outputs)[0], "auc"), Number((*outputs)[1], "auc"));
}

// The schema the workers of CtrFlags build, for an observer to read with.
ModelSchema CtrFlagsSchema() {
  CtrModelOptions model;
  model.num_fields = 4;
  model.num_dense = 2;
  model.dim = 8;
  model.hidden = 16;
  model.seed = 3;
  model.block_elements = 256;
  model.embedding_init.set_kind(InitSpec::UNIFORM);
  model.embedding_init.set_scale(0.05f);
  SparseOptimizer& o = model.sparse_optimizer;
  o.set_name("adagrad");
  o.set_learning_rate(0.1f);
  o.set_initial_accumulator(0.1f);
  o.set_beta1(0.9f);
  o.set_beta2(0.999f);
  o.set_epsilon(1e-8f);
  o.set_ftrl_alpha(0.05f);
  o.set_ftrl_beta(1.0f);
  return CtrSchema(model);
}

// The model (dense tensors and every row the job touched) after a sync job.
struct FinalModel {
  std::vector<std::vector<float>> dense;
  std::vector<std::vector<float>> rows;  // per table, for ids 0..N of field
};

FinalModel TrainAndRead(int shards, const std::string& name) {
  constexpr int kSteps = 40;
  ClusterOptions options;
  options.num_shards = shards;
  options.num_workers = 2;
  options.mode = "sync";
  options.server_flags = {"--optimizer=sgd", "--learning_rate=0.1"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return {};
  absl::StatusOr<std::vector<std::string>> outputs = (*cluster)->RunWorkers(
      {CtrFlags(kSteps), CtrFlags(kSteps)}, absl::Seconds(120));
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  if (!outputs.ok()) return {};

  // Read back as an observer with the same schema the workers built.
  const ModelSchema schema = CtrFlagsSchema();
  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
  auto client = std::move(*PsClient::Create(client_options));
  absl::StatusOr<Registration> registration =
      client->Register(schema, 2, /*worker_id=*/-1);
  EXPECT_TRUE(registration.ok()) << registration.status();
  FinalModel result;
  std::vector<float*> pointers;
  for (const DenseTensorSpec& spec : schema.dense()) {
    result.dense.emplace_back(NumElements(spec));
  }
  for (auto& t : result.dense) pointers.push_back(t.data());
  EXPECT_TRUE(client->Pull(kSteps, pointers).ok());
  // The ids the training data uses for each field.
  SyntheticCtrOptions synthetic;
  synthetic.num_fields = 4;
  synthetic.num_dense = 2;
  synthetic.vocab_per_field = 2000;
  synthetic.seed = 3;
  absl::StatusOr<CtrDataset> data = MakeSyntheticCtr(synthetic, 0, 512, {0, 1});
  EXPECT_TRUE(data.ok());
  for (int f = 0; f < 4; ++f) {
    std::vector<int64_t> offsets;
    std::vector<uint64_t> ids;
    ExtractFieldBags(*data, f, &offsets, &ids);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    result.rows.emplace_back(ids.size() * 8);
    EXPECT_TRUE(
        client->PullSparse(f, kSteps, ids, result.rows.back().data()).ok());
  }
  return result;
}

TEST(CtrTest, SameModelOnOneAndThreeShards) {
  const FinalModel one = TrainAndRead(1, "ctr_one_shard");
  const FinalModel three = TrainAndRead(3, "ctr_three_shards");
  ASSERT_EQ(one.dense.size(), three.dense.size());
  ASSERT_EQ(one.rows.size(), 4u);
  ASSERT_EQ(three.rows.size(), 4u);
  double max_difference = 0, moved = 0;
  for (size_t t = 0; t < one.dense.size(); ++t) {
    for (size_t i = 0; i < one.dense[t].size(); ++i) {
      max_difference = std::max<double>(
          max_difference, std::abs(one.dense[t][i] - three.dense[t][i]));
    }
  }
  for (size_t t = 0; t < 4; ++t) {
    ASSERT_EQ(one.rows[t].size(), three.rows[t].size());
    for (size_t i = 0; i < one.rows[t].size(); ++i) {
      max_difference = std::max<double>(
          max_difference, std::abs(one.rows[t][i] - three.rows[t][i]));
      moved += std::abs(one.rows[t][i]);
    }
  }
  EXPECT_LE(max_difference, 1e-6);
  EXPECT_GT(moved, 0);
}

// Every table a model pulls at a step goes to each shard in one call
// (SparsePullRequest.more): the rows are those each table's own pull
// brings, and a call naming a table the model lacks fails, naming it,
// with the good tables of the same call not answered.
TEST(CtrTest, TablesPulledInOneCallAreTheRowsOfEachPulledAlone) {
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(CtrCluster("async", 1), "ctr_tables_in_one_call");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const ModelSchema schema = CtrFlagsSchema();
  PsClientOptions client_options;
  client_options.hosts = (*cluster)->HostList();
  auto client = std::move(*PsClient::Create(client_options));
  ASSERT_TRUE(client->Register(schema, 1, /*worker_id=*/-1).ok());

  // Rows are made on first use: pull every table alone first, then all
  // together, and compare.
  std::vector<std::vector<uint64_t>> ids(4);
  std::vector<std::vector<float>> alone(4), together(4);
  std::vector<PsClient::SparsePullPart> parts;
  for (int f = 0; f < 4; ++f) {
    for (uint64_t id = f; id < 600; id += 3 + f) ids[f].push_back(id);
    alone[f].resize(ids[f].size() * 8);
    together[f].resize(ids[f].size() * 8, -1.0f);
    ASSERT_TRUE(client->PullSparse(f, 0, ids[f], alone[f].data()).ok());
    parts.push_back({f, ids[f], together[f].data()});
  }
  ASSERT_TRUE(client->PullSparse(0, parts).ok());
  for (int f = 0; f < 4; ++f) EXPECT_EQ(together[f], alone[f]) << "table " << f;

  // The same call by hand, its second table unknown.
  auto stub = ParameterServer::NewStub(grpc::CreateChannel(
      (*cluster)->HostList()[0], grpc::InsecureChannelCredentials()));
  SparsePullRequest request;
  request.set_protocol_version(kProtocolVersion);
  request.set_worker_id(-1);
  request.set_step(0);
  request.set_table(schema.sparse(0).name());
  request.add_ids(3);
  SparseTableIds* more = request.add_more();
  more->set_table("no_such_table");
  more->add_ids(5);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  SparsePullResponse response;
  const grpc::Status status = stub->SparsePull(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("no_such_table"), std::string::npos)
      << status.error_message();
  // And the shard still answers.
  ASSERT_TRUE(client->PullSparse(0, parts).ok());
}

}  // namespace
}  // namespace pstrain
