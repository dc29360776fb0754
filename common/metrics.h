// Prometheus metrics of ps_server and worker (prometheus-cpp): the HTTP
// endpoint, a gRPC server interceptor timing and counting every RPC, a
// collector that mirrors a shard's Stats() at scrape time, and the worker's
// per-step metrics. Every name is listed in README.md ("Metrics and health").
#ifndef PSTRAIN_COMMON_METRICS_H_
#define PSTRAIN_COMMON_METRICS_H_

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "proto/ps.pb.h"

namespace pstrain {

// Serves GET /metrics over plain HTTP/1.0 for `registry()` and any other
// collectable added, from one thread of its own.
//
// Not prometheus::Exposer: Debian builds its civetweb with 100 KiB thread
// stacks, and a worker linked with cuBLAS needs more static TLS than that,
// so civetweb cannot start a single thread there (pthread_create: EINVAL).
// A scrape is one short request every few seconds; an accept loop serving
// prometheus-cpp's text format is all it takes.
class MetricsEndpoint {
 public:
  // `host` is an address (or name) to listen on; `port` 0 picks a free port
  // and port() tells which. When `port_file` is not empty the port is
  // written there (atomically) once serving.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& host, int port, const std::string& port_file);
  ~MetricsEndpoint();  // stops serving; an unfinished scrape is dropped

  int port() const { return port_; }
  prometheus::Registry& registry() { return *registry_; }
  // Collects `collectable` on every scrape from now on.
  void Add(std::shared_ptr<prometheus::Collectable> collectable);

  // The text a scrape gets (prometheus text format 0.0.4).
  std::string Scrape();

 private:
  MetricsEndpoint() = default;
  void Serve();
  void Answer(int fd);

  std::shared_ptr<prometheus::Registry> registry_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_
      ABSL_GUARDED_BY(mu_);
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Buckets of the latency histograms, 100 us to 2 min: a pull in a sync job
// waits for the slowest worker, so the tail is long.
const std::vector<double>& LatencyBuckets();

// Per-RPC metrics of a gRPC server, recorded by an interceptor:
//   pstrain_server_rpcs_total{service,method,code}
//   pstrain_server_rpc_duration_seconds{service,method}   (histogram)
//   pstrain_server_request_bytes_total{service,method}    (raw methods)
//   pstrain_server_response_bytes_total{service,method}
// Latency runs from the request's metadata arriving to the status being
// sent: a Push includes decoding and applying it (the shard applies before
// it answers), a sync Pull includes waiting for its step.
class RpcMetricsInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `raw_request_methods`: full names ("/pstrain.ParameterServer/Push") of
  // methods whose request reaches the service as a grpc::ByteBuffer, so its
  // size can be counted without knowing the message type.
  //
  // A call stream, a bidirectional method "<M>Stream" that carries calls of
  // <M> one at a time (request, then its answer), is counted as those
  // calls under <M>: one RPC and one duration per request.
  //
  // `known_methods`: full names of every method the server serves. A call
  // to any other name (clients choose the name, before any authentication)
  // is counted under service="unknown", method="unknown", so the set of
  // series is fixed here and no client can grow /metrics.
  RpcMetricsInterceptorFactory(
      prometheus::Registry& registry,
      const std::vector<std::string>& known_methods,
      const absl::flat_hash_set<std::string>& raw_request_methods);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

  // Records one call of `full_method` that reached the service another way
  // (ps_server's tensor data plane), into the same series a gRPC call of it
  // would count in, so dashboards see every push and pull.
  void RecordCall(const std::string& full_method, absl::StatusCode code,
                  absl::Duration elapsed, uint64_t request_bytes,
                  uint64_t response_bytes);

  // What the interceptor of one call records into.
  struct Method {
    prometheus::Histogram* duration = nullptr;
    prometheus::Counter* request_bytes = nullptr;  // null: not raw
    prometheus::Counter* response_bytes = nullptr;
    prometheus::Counter* by_code[17] = {};  // grpc::StatusCode 0..16
  };

 private:
  std::unique_ptr<Method> MakeMethod(const std::string& service,
                                     const std::string& method,
                                     bool raw_request);

  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Counter>& request_bytes_;
  prometheus::Family<prometheus::Counter>& response_bytes_;
  // Filled in the constructor, read-only after it: no lock per call.
  absl::flat_hash_map<std::string, std::unique_ptr<Method>> methods_;
  std::unique_ptr<Method> unknown_;
};

// The full names ("/pkg.Service/Method") of every method of a service known
// to the generated descriptor pool, e.g. "pstrain.ParameterServer".
std::vector<std::string> ServiceMethodNames(const std::string& service);

// The standard process metrics Prometheus' own clients export, read from
// /proc/self at scrape time: process_cpu_seconds_total,
// process_resident_memory_bytes, process_virtual_memory_bytes,
// process_start_time_seconds, process_open_fds, process_max_fds; and
// pstrain_build_info{binary,protocol_version,grpc_version,compiler} = 1.
// MetricsEndpoint::Start adds one to every endpoint.
class ProcessCollector : public prometheus::Collectable {
 public:
  explicit ProcessCollector(std::string binary) : binary_(std::move(binary)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  std::string binary_;
};

// Mirrors a shard's StatsResponse into metrics each time it is scraped (so
// the values are exactly what Stats() says, with no polling thread):
// counters pstrain_shard_*_total, gauges pstrain_shard_version (the step, in
// sync mode), _members, _waiting_pulls (queue depth), _staleness_max/_mean,
// ..., all labelled shard="i".
class ShardStatsCollector : public prometheus::Collectable {
 public:
  explicit ShardStatsCollector(std::function<StatsResponse()> stats)
      : stats_(std::move(stats)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  std::function<StatsResponse()> stats_;
};

// One training step, as the worker's trainer reports it.
struct StepSample {
  int64_t step = 0;
  int64_t steps = 0;
  double loss = 0;
  double train_accuracy = 0;
  int64_t examples = 0;
  double step_seconds = 0;
  double pull_seconds = 0;
  double push_seconds = 0;
  double compute_seconds = 0;
  double network_wait_seconds = 0;  // blocked on the pull and the pushes
  // This step's sparse rows from the servers, and from the row cache.
  int64_t sparse_rows_pulled = 0;
  int64_t sparse_cache_hits = 0;
  int64_t sparse_cache_bytes_saved = 0;
};

// The worker's metrics, labelled worker="k":
//   pstrain_worker_step, _steps (target), _loss, _train_accuracy,
//   _samples_per_second (gauges), pstrain_worker_examples_total (counter),
//   pstrain_worker_{step,pull,push,compute}_duration_seconds and
//   pstrain_worker_network_wait_seconds (histograms),
//   pstrain_worker_test_loss, _test_accuracy (the last held-out evaluation),
//   pstrain_worker_sparse_rows_pulled_total, _sparse_cache_hits_total and
//   _sparse_cache_bytes_saved_total (counters: embedding rows from the
//   servers, and from the worker's row cache).
class WorkerMetrics {
 public:
  WorkerMetrics(prometheus::Registry& registry, int worker_id);
  // Called on the training thread after every step.
  void Observe(const StepSample& sample);
  // Called after each held-out evaluation.
  void ObserveEvaluation(double test_loss, double test_accuracy);

 private:
  prometheus::Gauge& step_;
  prometheus::Gauge& steps_;
  prometheus::Gauge& loss_;
  prometheus::Gauge& accuracy_;
  prometheus::Gauge& samples_per_second_;
  prometheus::Counter& examples_;
  prometheus::Histogram& step_seconds_;
  prometheus::Histogram& pull_seconds_;
  prometheus::Histogram& push_seconds_;
  prometheus::Histogram& compute_seconds_;
  prometheus::Histogram& network_wait_seconds_;
  prometheus::Gauge& test_loss_;
  prometheus::Gauge& test_accuracy_;
  prometheus::Counter& sparse_rows_pulled_;
  prometheus::Counter& sparse_cache_hits_;
  prometheus::Counter& sparse_cache_bytes_saved_;
  // samples/s over at least one second of steps, so one slow or fast step
  // does not make the gauge jump.
  double window_examples_ = 0;
  double window_seconds_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_METRICS_H_
