// sparse_bench: sparse embedding-table pull and push rates on real ps_server
// processes, next to the dense Pull and Push of the same bytes, measured in
// the same run (interleaved, so drift on a noisy machine hits both):
//
//   sparse_bench [--servers=2] [--dims=16,64] [--batch=4096]
//                [--vocab=10000000] [--zipf=1.1] [--repeats=30]
//
// Batches of --batch ids are drawn from a Zipf(--zipf) distribution over
// --vocab feature ids (rank r scrambled to a 64-bit id, as hashed features
// are) and de-duplicated with the worker's own IdDeduplicator. For every
// dim, fresh servers (async, SGD) hold one sparse table of that dim and one
// dense tensor of (mean unique rows per batch) * dim floats: PsClient::Pull
// and Push move every dense tensor of the schema, so each comparison size
// gets its own schema and hence its own servers. Each repetition pulls and
// pushes the next batch's unique rows and pulls and pushes the dense tensor
// once, each operation timed on its own; the table shows medians over the
// repetitions after --warmup.
//
// Every child process dies with the bench: it is stopped on every return
// path, SIGKILLed by a guardian thread on SIGINT/SIGTERM/SIGHUP or when
// --deadline_s runs out, and gets SIGKILL from the kernel (PR_SET_PDEATHSIG)
// should the bench die any other way. Every wait carries a deadline.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/random/zipf_distribution.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "common/consistency_mode.h"
#include "proto/ps.pb.h"
#include "tools/cpp/runfiles/runfiles.h"
#include "worker/client/ps_client.h"
#include "worker/unique_ids.h"

ABSL_FLAG(int, servers, 2, "ps_server shards to start (per dim).");
ABSL_FLAG(std::vector<std::string>, dims,
          std::vector<std::string>({"16", "64"}),
          "Embedding dims to measure, one sparse table (and servers) each.");
ABSL_FLAG(int64_t, vocab, 10'000'000, "Distinct feature ids (Zipf ranks).");
ABSL_FLAG(double, zipf, 1.1, "Zipf exponent of the id distribution (> 1).");
ABSL_FLAG(int64_t, batch, 4096, "Ids per batch, before de-duplication.");
ABSL_FLAG(int, repeats, 100,
          "Measured repetitions per dim (each: one fresh batch's sparse pull "
          "and push, one dense pull and push).");
ABSL_FLAG(int, warmup, 10, "Unmeasured repetitions before them.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the id stream (same for every dim).");
ABSL_FLAG(int64_t, block_elements, 0,
          "Dense schema block size; 0 splits the dense tensor evenly over "
          "the servers (one block each), as the sparse rows are.");
ABSL_FLAG(double, sparse_learning_rate, 1e-6, "Sparse SGD learning rate.");
ABSL_FLAG(double, init_scale, 0.01,
          "Sparse rows start U(-scale, scale); 0: zeros.");
ABSL_FLAG(std::string, ps_server, "",
          "ps_server binary; default: the one in this binary's runfiles.");
ABSL_FLAG(std::string, json_out, "", "Also write the JSON lines here.");
ABSL_FLAG(double, io_timeout_s, 60, "Deadline of every RPC.");
ABSL_FLAG(double, deadline_s, 900,
          "The whole run's deadline: past it every child is killed and the "
          "bench exits 3.");

namespace pstrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr absl::Duration kStartTimeout = absl::Seconds(30);
constexpr float kGradient = 1e-3f;  // small and finite

// ---------------------------------------------------------------------------
// Servers.

// `servers` ps_server shards, stopped when this goes away.
struct Cluster {
  std::vector<std::unique_ptr<ChildProcess>> shards;
  std::vector<std::string> hosts;

  std::string LogTails() {
    std::string logs;
    for (size_t s = 0; s < shards.size(); ++s) {
      absl::StrAppend(&logs, "\n--- shard ", s,
                      shards[s]->Running() ? " (running)" : " (exited)",
                      " log tail:\n", Tail(shards[s]->Log()));
    }
    return logs;
  }
};

absl::Status StartCluster(const std::string& ps_server,
                          const std::string& scratch, const std::string& tag,
                          int servers, Cluster* cluster) {
  std::vector<std::string> port_files;
  for (int s = 0; s < servers; ++s) {
    const std::string base = absl::StrCat(scratch, "/", tag, "_", s);
    port_files.push_back(absl::StrCat(base, ".port"));
    absl::StatusOr<std::unique_ptr<ChildProcess>> shard = ChildProcess::Start(
        absl::StrCat("ps_server shard ", s),
        {ps_server, "--host=127.0.0.1", "--port=0",
         absl::StrCat("--port_file=", port_files[s]),
         absl::StrCat("--shard_id=", s), absl::StrCat("--num_shards=", servers),
         "--num_workers=1", "--mode=async", "--optimizer=sgd",
         "--learning_rate=1e-6"},
        absl::StrCat(base, ".log"));
    if (!shard.ok()) return shard.status();
    cluster->shards.push_back(std::move(*shard));
  }
  for (int s = 0; s < servers; ++s) {
    absl::StatusOr<int> port =
        cluster->shards[s]->WaitForPort(port_files[s], kStartTimeout);
    if (!port.ok()) return port.status();
    cluster->hosts.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Workload and measurement.

struct Workload {
  std::vector<std::vector<uint64_t>> unique;  // per batch, first-seen order
  double mean_unique = 0;                     // over every batch
  double dedup_us = 0;                        // median per batch
  int64_t distinct_ids = 0;                   // over the whole stream
  // Unique ids per measured batch that no earlier batch had: rows the
  // servers create during that batch's pull (mean).
  double mean_new = 0;
};

// A bijection on 64 bits (splitmix64's finalizer): Zipf rank -> feature id,
// so popular ids are spread like hashed features, not clustered near 0.
uint64_t Scramble(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

Workload MakeWorkload(int warmup, int batches) {
  std::mt19937_64 random(absl::GetFlag(FLAGS_seed));
  absl::zipf_distribution<uint64_t> zipf(absl::GetFlag(FLAGS_vocab) - 1,
                                         absl::GetFlag(FLAGS_zipf), 1.0);
  Workload workload;
  IdDeduplicator dedup;
  absl::flat_hash_set<uint64_t> distinct;
  std::vector<uint64_t> ids(absl::GetFlag(FLAGS_batch));
  std::vector<double> dedup_us;
  double unique_sum = 0, new_sum = 0;
  for (int b = 0; b < batches; ++b) {
    for (uint64_t& id : ids) id = Scramble(zipf(random));
    UniqueIds unique;
    const Clock::time_point start = Clock::now();
    dedup.Run(ids, &unique);
    dedup_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - start)
            .count());
    unique_sum += static_cast<double>(unique.unique.size());
    size_t fresh = 0;
    for (uint64_t id : unique.unique) fresh += distinct.insert(id).second;
    if (b >= warmup) new_sum += static_cast<double>(fresh);
    workload.unique.push_back(std::move(unique.unique));
  }
  workload.mean_unique = unique_sum / batches;
  workload.mean_new = new_sum / (batches - warmup);
  workload.dedup_us = Median(dedup_us);
  workload.distinct_ids = static_cast<int64_t>(distinct.size());
  return workload;
}

struct DimResult {
  int64_t dim = 0;
  int64_t dense_elements = 0;
  int64_t block_elements = 0;
  // Medians over the measured repetitions.
  double sparse_pull_rows_per_s = 0, sparse_pull_gbps = 0, sparse_pull_us = 0;
  double sparse_push_rows_per_s = 0, sparse_push_gbps = 0, sparse_push_us = 0;
  double dense_pull_gbps = 0, dense_pull_us = 0;
  double dense_push_gbps = 0, dense_push_us = 0;
  // Summed over the shards at the end.
  int64_t rows = 0, rows_created = 0, memory_bytes = 0;
  std::vector<int64_t> rows_per_shard;
};

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One dim's schema: a sparse table of that dim and a dense tensor of the
// bytes a mean batch's unique rows hold. PsClient::Pull and Push move
// every dense tensor of the schema, so each dim needs a schema (and
// servers) of its own for the comparison to be of equal bytes.
ModelSchema DimSchema(const DimResult& dim_result) {
  const int64_t dim = dim_result.dim;
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(dim_result.block_elements);
  DenseTensorSpec* dense = schema.add_dense();
  dense->set_name(absl::StrCat("dense_d", dim));
  dense->add_shape(dim_result.dense_elements);
  dense->mutable_init()->set_kind(InitSpec::ZEROS);
  SparseTableSpec* table = schema.add_sparse();
  table->set_name(absl::StrCat("emb_d", dim));
  table->set_dim(dim);
  const double scale = absl::GetFlag(FLAGS_init_scale);
  table->mutable_init()->set_kind(scale > 0 ? InitSpec::UNIFORM
                                            : InitSpec::ZEROS);
  table->mutable_init()->set_scale(static_cast<float>(scale));
  table->mutable_optimizer()->set_name("sgd");
  table->mutable_optimizer()->set_learning_rate(
      static_cast<float>(absl::GetFlag(FLAGS_sparse_learning_rate)));
  return schema;
}

// The bench's one worker, registered with `schema`. The servers must run
// async: in any other mode a push could wait for other workers, and the
// times would measure the wait.
absl::StatusOr<std::unique_ptr<PsClient>> RegisterWorker(
    const std::vector<std::string>& hosts, const ModelSchema& schema,
    int64_t* start_step) {
  PsClientOptions options;
  options.hosts = hosts;
  options.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_io_timeout_s));
  options.connect_timeout = kStartTimeout;
  options.retry_window = options.rpc_timeout;
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  if (!client.ok()) return client.status();
  absl::StatusOr<Registration> registration =
      (*client)->Register(schema, /*num_workers=*/1, /*worker_id=*/0);
  if (!registration.ok()) return registration.status();
  if (registration->mode != ConsistencyMode::kAsync) {
    return absl::FailedPreconditionError(absl::StrCat(
        "servers run mode '", ConsistencyModeName(registration->mode),
        "', expected async"));
  }
  *start_step = registration->start_step;
  return client;
}

// The four measured operations on one registered worker, with the buffers
// they read and fill, allocated once so that no repetition pays for them.
class Operations {
 public:
  Operations(PsClient* client, const Workload& workload,
             const DimResult& dim_result, int64_t start_step)
      : client_(client), sparse_step_(start_step), dense_step_(start_step) {
    size_t max_rows = 0;
    for (const std::vector<uint64_t>& ids : workload.unique) {
      max_rows = std::max(max_rows, ids.size());
    }
    rows_.resize(max_rows * dim_result.dim);
    row_grads_.assign(max_rows * dim_result.dim, kGradient);
    params_.resize(dim_result.dense_elements);
    dense_grads_.assign(dim_result.dense_elements, kGradient);
  }

  absl::Status SparsePull(absl::Span<const uint64_t> ids) {
    return client_->PullSparse(0, sparse_step_, ids, rows_.data());
  }

  absl::Status SparsePush(absl::Span<const uint64_t> ids) {
    absl::StatusOr<PsClient::PushResult> pushed =
        client_->PushSparse(0, sparse_step_++, ids, row_grads_.data());
    if (!pushed.ok()) return pushed.status();
    if (pushed->blocks_duplicate != 0) {
      return absl::InternalError("a fresh sparse push was a duplicate");
    }
    return absl::OkStatus();
  }

  absl::Status DensePull() {
    return client_->Pull(dense_step_, {params_.data()}).status();
  }

  absl::Status DensePush() {
    absl::StatusOr<PsClient::PushResult> pushed =
        client_->Push(dense_step_++, {dense_grads_.data()});
    if (!pushed.ok()) return pushed.status();
    if (pushed->blocks_duplicate != 0) {
      return absl::InternalError("a fresh dense push was a duplicate");
    }
    return absl::OkStatus();
  }

 private:
  PsClient* client_;
  std::vector<float> rows_;
  std::vector<float> row_grads_;
  std::vector<float> params_;
  std::vector<float> dense_grads_;
  // Async servers ignore a push whose step is not above the worker's last,
  // per block and per table: separate counters.
  int64_t sparse_step_;
  int64_t dense_step_;
};

// Seconds each operation of one repetition took.
struct RepetitionTimes {
  double sparse_pull = 0, sparse_push = 0, dense_pull = 0, dense_push = 0;
};

// One repetition: the batch's sparse pull and push and the dense pull and
// push, each timed on its own. `sparse_first` alternates between
// repetitions so that neither kind always follows the other.
absl::Status RunRepetition(Operations& ops, absl::Span<const uint64_t> ids,
                           bool sparse_first, RepetitionTimes* times) {
  auto run_sparse = [&]() -> absl::Status {
    Clock::time_point start = Clock::now();
    if (absl::Status s = ops.SparsePull(ids); !s.ok()) return s;
    times->sparse_pull = Seconds(start);
    start = Clock::now();
    if (absl::Status s = ops.SparsePush(ids); !s.ok()) return s;
    times->sparse_push = Seconds(start);
    return absl::OkStatus();
  };
  auto run_dense = [&]() -> absl::Status {
    Clock::time_point start = Clock::now();
    if (absl::Status s = ops.DensePull(); !s.ok()) return s;
    times->dense_pull = Seconds(start);
    start = Clock::now();
    if (absl::Status s = ops.DensePush(); !s.ok()) return s;
    times->dense_push = Seconds(start);
    return absl::OkStatus();
  };
  absl::Status status = sparse_first ? run_sparse() : run_dense();
  if (status.ok()) status = sparse_first ? run_dense() : run_sparse();
  return status;
}

// The rates of every measured repetition: the table shows their medians,
// which a noisy machine's outliers move less than a mean.
struct Samples {
  std::vector<double> sp_rows, sp_gbps, sp_us, su_rows, su_gbps, su_us;
  std::vector<double> dp_gbps, dp_us, du_gbps, du_us;

  void Add(const RepetitionTimes& t, size_t unique_rows, int64_t dim,
           double dense_bytes) {
    const double n = static_cast<double>(unique_rows);
    const double row_bytes = 4.0 * static_cast<double>(dim) * n;
    sp_rows.push_back(n / t.sparse_pull);
    sp_gbps.push_back(row_bytes / t.sparse_pull / 1e9);
    sp_us.push_back(t.sparse_pull * 1e6);
    su_rows.push_back(n / t.sparse_push);
    su_gbps.push_back(row_bytes / t.sparse_push / 1e9);
    su_us.push_back(t.sparse_push * 1e6);
    dp_gbps.push_back(dense_bytes / t.dense_pull / 1e9);
    dp_us.push_back(t.dense_pull * 1e6);
    du_gbps.push_back(dense_bytes / t.dense_push / 1e9);
    du_us.push_back(t.dense_push * 1e6);
  }

  void MediansInto(DimResult* out) const {
    out->sparse_pull_rows_per_s = Median(sp_rows);
    out->sparse_pull_gbps = Median(sp_gbps);
    out->sparse_pull_us = Median(sp_us);
    out->sparse_push_rows_per_s = Median(su_rows);
    out->sparse_push_gbps = Median(su_gbps);
    out->sparse_push_us = Median(su_us);
    out->dense_pull_gbps = Median(dp_gbps);
    out->dense_pull_us = Median(dp_us);
    out->dense_push_gbps = Median(du_gbps);
    out->dense_push_us = Median(du_us);
  }
};

// The rows the servers hold at the end, summed over the shards: checked
// against the ids the stream sent, so a lost or doubled row shows.
absl::Status AddServerStats(PsClient& client, DimResult* out) {
  absl::StatusOr<std::vector<StatsResponse>> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  for (const StatsResponse& shard : *stats) {
    if (shard.sparse_size() != 1) {
      return absl::InternalError(absl::StrCat("shard ", shard.shard_id(),
                                              " reports ", shard.sparse_size(),
                                              " sparse tables, expected 1"));
    }
    out->rows += shard.sparse(0).rows();
    out->rows_created += shard.sparse(0).rows_created();
    out->memory_bytes += shard.sparse(0).memory_bytes();
    out->rows_per_shard.push_back(shard.sparse(0).rows());
  }
  return absl::OkStatus();
}

absl::Status MeasureOnCluster(const std::vector<std::string>& hosts,
                              const Workload& workload, DimResult* out) {
  int64_t start_step = 0;
  absl::StatusOr<std::unique_ptr<PsClient>> client =
      RegisterWorker(hosts, DimSchema(*out), &start_step);
  if (!client.ok()) return client.status();
  Operations ops(client->get(), workload, *out, start_step);
  const double dense_bytes = 4.0 * static_cast<double>(out->dense_elements);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  Samples samples;
  for (size_t r = 0; r < workload.unique.size(); ++r) {
    const std::vector<uint64_t>& ids = workload.unique[r];
    RepetitionTimes times;
    absl::Status status = RunRepetition(ops, ids, r % 2 == 0, &times);
    if (!status.ok()) return status;
    if (static_cast<int>(r) < warmup) continue;
    samples.Add(times, ids.size(), out->dim, dense_bytes);
  }
  samples.MediansInto(out);
  if (absl::Status status = AddServerStats(**client, out); !status.ok()) {
    return status;
  }
  return (*client)->Leave();
}

// Fresh servers for one dim (a server keeps one schema for its life).
absl::StatusOr<DimResult> MeasureDim(int64_t dim, const Workload& workload,
                                     const std::string& ps_server,
                                     const std::string& scratch) {
  const int servers = absl::GetFlag(FLAGS_servers);
  DimResult result;
  result.dim = dim;
  result.dense_elements =
      std::max<int64_t>(1, std::llround(workload.mean_unique)) * dim;
  result.block_elements = absl::GetFlag(FLAGS_block_elements);
  if (result.block_elements == 0) {
    result.block_elements = (result.dense_elements + servers - 1) / servers;
  }
  Cluster cluster;  // its destructor stops the servers on every path
  absl::Status status = StartCluster(ps_server, scratch, absl::StrCat("d", dim),
                                     servers, &cluster);
  if (status.ok()) status = MeasureOnCluster(cluster.hosts, workload, &result);
  if (!status.ok()) {
    return absl::Status(
        status.code(),
        absl::StrCat("dim ", dim, ": ", status.message(), cluster.LogTails()));
  }
  return result;
}

// ---------------------------------------------------------------------------
// Reporting.

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

std::string TableHeader() {
  return absl::StrFormat(
      "%4s %8s %8s | %26s | %15s %6s | %26s | %15s %6s | %9s\n"
      "%4s %8s %8s | %8s %8s %8s | %7s %7s %6s | %8s %8s %8s | %7s %7s %6s | "
      "%9s\n",
      "", "unique", "payload", "sparse pull", "dense pull", "pull",
      "sparse push", "dense push", "push", "rows on", "dim", "rows/bat", "KiB",
      "Mrows/s", "GB/s", "p50 us", "GB/s", "p50 us", "s/d", "Mrows/s", "GB/s",
      "p50 us", "GB/s", "p50 us", "s/d", "servers");
}

std::string TableRow(const DimResult& r, const Workload& w) {
  return absl::StrFormat(
      "%4d %8.1f %8.1f | %8.3f %8.3f %8.0f | %7.3f %7.0f %6.3f | %8.3f %8.3f "
      "%8.0f | %7.3f %7.0f %6.3f | %9d\n",
      r.dim, w.mean_unique, 4.0 * r.dense_elements / 1024,
      r.sparse_pull_rows_per_s / 1e6, r.sparse_pull_gbps, r.sparse_pull_us,
      r.dense_pull_gbps, r.dense_pull_us,
      Ratio(r.sparse_pull_gbps, r.dense_pull_gbps),
      r.sparse_push_rows_per_s / 1e6, r.sparse_push_gbps, r.sparse_push_us,
      r.dense_push_gbps, r.dense_push_us,
      Ratio(r.sparse_push_gbps, r.dense_push_gbps), r.rows);
}

std::string JsonLine(const DimResult& r, const Workload& w) {
  return absl::StrFormat(
      "{\"bench\":\"sparse_bench\",\"dim\":%d,\"servers\":%d,\"batch\":%d,"
      "\"vocab\":%d,\"zipf\":%.3f,\"unique_rows_mean\":%.1f,"
      "\"new_rows_mean\":%.1f,\"dedup_p50_us\":%.1f,\"dense_bytes\":%d,\"block_"
      "elements\":%d,"
      "\"sparse_pull_rows_per_s\":%.0f,\"sparse_pull_gbps\":%.4f,"
      "\"sparse_pull_p50_us\":%.1f,\"dense_pull_gbps\":%.4f,"
      "\"dense_pull_p50_us\":%.1f,\"ratio_pull\":%.4f,"
      "\"sparse_push_rows_per_s\":%.0f,\"sparse_push_gbps\":%.4f,"
      "\"sparse_push_p50_us\":%.1f,\"dense_push_gbps\":%.4f,"
      "\"dense_push_p50_us\":%.1f,\"ratio_push\":%.4f,"
      "\"rows_on_servers\":%d,\"rows_created\":%d,\"rows_per_shard\":[%s],"
      "\"distinct_ids_sent\":%d,\"sparse_memory_bytes\":%d,\"repeats\":%d,"
      "\"warmup\":%d}",
      r.dim, absl::GetFlag(FLAGS_servers), absl::GetFlag(FLAGS_batch),
      absl::GetFlag(FLAGS_vocab), absl::GetFlag(FLAGS_zipf), w.mean_unique,
      w.mean_new, w.dedup_us, 4 * r.dense_elements, r.block_elements,
      r.sparse_pull_rows_per_s, r.sparse_pull_gbps, r.sparse_pull_us,
      r.dense_pull_gbps, r.dense_pull_us,
      Ratio(r.sparse_pull_gbps, r.dense_pull_gbps), r.sparse_push_rows_per_s,
      r.sparse_push_gbps, r.sparse_push_us, r.dense_push_gbps, r.dense_push_us,
      Ratio(r.sparse_push_gbps, r.dense_push_gbps), r.rows, r.rows_created,
      absl::StrJoin(r.rows_per_shard, ","), w.distinct_ids, r.memory_bytes,
      absl::GetFlag(FLAGS_repeats), absl::GetFlag(FLAGS_warmup));
}

// ---------------------------------------------------------------------------
// The bench.

absl::StatusOr<std::vector<int64_t>> ParseDims() {
  std::vector<std::string> problems;
  std::vector<int64_t> dims;
  for (const std::string& text : absl::GetFlag(FLAGS_dims)) {
    int64_t dim = 0;
    if (!absl::SimpleAtoi(text, &dim) || dim < 1 || dim > 65536) {
      problems.push_back(
          absl::StrCat("--dims: '", text, "' not in [1, 65536]"));
    } else {
      dims.push_back(dim);
    }
  }
  if (dims.empty()) problems.push_back("--dims is empty");
  if (absl::GetFlag(FLAGS_servers) < 1) problems.push_back("--servers < 1");
  if (absl::GetFlag(FLAGS_vocab) < 2) problems.push_back("--vocab < 2");
  if (!(absl::GetFlag(FLAGS_zipf) > 1)) problems.push_back("--zipf <= 1");
  if (absl::GetFlag(FLAGS_batch) < 1) problems.push_back("--batch < 1");
  if (absl::GetFlag(FLAGS_repeats) < 1) problems.push_back("--repeats < 1");
  if (absl::GetFlag(FLAGS_warmup) < 0) problems.push_back("--warmup < 0");
  if (absl::GetFlag(FLAGS_block_elements) < 0) {
    problems.push_back("--block_elements < 0");
  }
  if (!(absl::GetFlag(FLAGS_sparse_learning_rate) > 0)) {
    problems.push_back("--sparse_learning_rate <= 0");
  }
  if (!(absl::GetFlag(FLAGS_init_scale) >= 0)) {
    problems.push_back("--init_scale < 0");
  }
  if (!(absl::GetFlag(FLAGS_io_timeout_s) > 0)) {
    problems.push_back("--io_timeout_s <= 0");
  }
  if (!(absl::GetFlag(FLAGS_deadline_s) > 0)) {
    problems.push_back("--deadline_s <= 0");
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
  }
  return dims;
}

// The legend, the table and the JSON lines of what was measured (also
// after a failure, for the dims done before it). Returns the JSON lines
// for --json_out.
std::string PrintReport(const std::vector<DimResult>& results,
                        const Workload& workload) {
  std::printf(
      "%s",
      absl::StrFormat(
          "\n# %d servers, batches of %d ids drawn Zipf(%.2f) over %d ids, "
          "de-duplicated: %.1f unique rows per batch (mean; %.1f of them new "
          "to "
          "the servers, created by the pull), dedup %.0f us (median, not in "
          "the "
          "rates)\n"
          "# sparse: PullSparse / PushSparse of a batch's unique rows; GB/s "
          "counts row payload only (4 * dim bytes a row, not the 8-byte ids)\n"
          "# dense: Pull / Push of one tensor of the same bytes (mean unique "
          "rows * dim floats), split over the servers\n"
          "# medians over %d repetitions after %d warm-up; s/d = sparse GB/s / "
          "dense GB/s; rows on servers: Stats().sparse(0).rows summed over "
          "shards at the end (%d distinct ids sent)\n",
          absl::GetFlag(FLAGS_servers), absl::GetFlag(FLAGS_batch),
          absl::GetFlag(FLAGS_zipf), absl::GetFlag(FLAGS_vocab),
          workload.mean_unique, workload.mean_new, workload.dedup_us,
          absl::GetFlag(FLAGS_repeats), absl::GetFlag(FLAGS_warmup),
          workload.distinct_ids)
          .c_str());
  std::printf("%s", TableHeader().c_str());
  for (const DimResult& r : results) {
    std::printf("%s", TableRow(r, workload).c_str());
  }
  std::printf("\n");
  std::string json;
  for (const DimResult& r : results) {
    absl::StrAppend(&json, JsonLine(r, workload), "\n");
  }
  std::printf("%s# load average at end: %s\n", json.c_str(),
              LoadAverage().c_str());
  std::fflush(stdout);
  return json;
}

int BenchMain(const char* argv0) {
  absl::StatusOr<std::vector<int64_t>> dims = ParseDims();
  if (!dims.ok()) {
    std::fprintf(stderr, "sparse_bench: %s\n",
                 std::string(dims.status().message()).c_str());
    return 2;
  }
  StartGuardian(absl::Seconds(absl::GetFlag(FLAGS_deadline_s)));
  absl::StatusOr<std::string> ps_server = FindPsServer(
      absl::GetFlag(FLAGS_ps_server), argv0, "//bench/sparse:sparse_bench");
  if (!ps_server.ok()) {
    std::fprintf(stderr, "sparse_bench: %s\n",
                 ps_server.status().ToString().c_str());
    return 1;
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  if (tmp == nullptr) tmp = std::getenv("TMPDIR");
  std::string scratch =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/sparse_bench.XXXXXX");
  if (mkdtemp(scratch.data()) == nullptr) {
    std::fprintf(stderr, "sparse_bench: mkdtemp %s: %s\n", scratch.c_str(),
                 std::strerror(errno));
    return 1;
  }
  Leftovers::Get().SetScratchDir(scratch);

  std::printf("%s",
              absl::StrFormat(
                  "# sparse_bench: servers %d (async, sgd, lr 1e-6), dims %s, "
                  "batch %d ids, vocab %d, zipf %.3f, repeats %d, warmup %d, "
                  "seed %d\n",
                  absl::GetFlag(FLAGS_servers),
                  absl::StrJoin(absl::GetFlag(FLAGS_dims), ","),
                  absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_vocab),
                  absl::GetFlag(FLAGS_zipf), absl::GetFlag(FLAGS_repeats),
                  absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_seed))
                  .c_str());
  std::printf("%s", MachineDescription().c_str());
  std::fflush(stdout);

  const Workload workload =
      MakeWorkload(absl::GetFlag(FLAGS_warmup),
                   absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_repeats));
  std::fprintf(stderr,
               "sparse_bench: %zu batches, %.1f unique ids per batch, %d "
               "distinct ids in all\n",
               workload.unique.size(), workload.mean_unique,
               static_cast<int>(workload.distinct_ids));

  std::vector<DimResult> results;
  absl::Status status = absl::OkStatus();
  for (int64_t dim : *dims) {
    std::fprintf(stderr, "sparse_bench: measuring dim %d\n",
                 static_cast<int>(dim));
    absl::StatusOr<DimResult> result =
        MeasureDim(dim, workload, *ps_server, scratch);
    if (!result.ok()) {
      status = result.status();
      break;
    }
    if (result->rows != workload.distinct_ids) {
      std::fprintf(stderr,
                   "sparse_bench: dim %d: servers hold %d rows, the stream "
                   "had %d distinct ids\n",
                   static_cast<int>(dim), static_cast<int>(result->rows),
                   static_cast<int>(workload.distinct_ids));
    }
    results.push_back(*std::move(result));
  }

  const std::string json = PrintReport(results, workload);

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (status.ok() && !json_out.empty()) {
    std::ofstream file(json_out, std::ios::trunc);
    file << json;
    file.close();
    if (!file) status = absl::InternalError("cannot write --json_out");
  }
  Leftovers::Get().RemoveScratch();
  if (!status.ok()) {
    std::fprintf(stderr, "sparse_bench failed: %s\n",
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace pstrain::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Sparse-table pull/push rates against dense pull/push of the same "
      "bytes on real ps_server processes.\n  sparse_bench [--servers=2] "
      "[--dims=16,64] [--batch=4096] [--vocab=10000000] [--zipf=1.1]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "sparse_bench: unexpected argument '%s'\n", rest[1]);
    return 2;
  }
  return pstrain::bench::BenchMain(argv[0]);
}
