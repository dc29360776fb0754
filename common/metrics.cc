#include "common/metrics.h"

#include <dirent.h>
#include <google/protobuf/descriptor.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/interceptor.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/cli.h"
#include "common/protocol.h"
#include "glog/logging.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace pstrain {
namespace {

using grpc::experimental::InterceptionHookPoints;

const char* CodeName(int code) {
  static const char* const kNames[17] = {"OK",
                                         "CANCELLED",
                                         "UNKNOWN",
                                         "INVALID_ARGUMENT",
                                         "DEADLINE_EXCEEDED",
                                         "NOT_FOUND",
                                         "ALREADY_EXISTS",
                                         "PERMISSION_DENIED",
                                         "RESOURCE_EXHAUSTED",
                                         "FAILED_PRECONDITION",
                                         "ABORTED",
                                         "OUT_OF_RANGE",
                                         "UNIMPLEMENTED",
                                         "INTERNAL",
                                         "UNAVAILABLE",
                                         "DATA_LOSS",
                                         "UNAUTHENTICATED"};
  return code >= 0 && code < 17 ? kNames[code] : "UNKNOWN";
}

// Times and counts one call, or each call a call stream carries. gRPC
// creates one per call (stream) and deletes it when that is done.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(RpcMetricsInterceptorFactory::Method* method,
                        bool per_message)
      : method_(method),
        per_message_(per_message),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE) &&
        method_->request_bytes != nullptr) {
      const auto* request =
          static_cast<const grpc::ByteBuffer*>(methods->GetRecvMessage());
      if (request != nullptr)
        method_->request_bytes->Increment(request->Length());
    }
    if (per_message_ && methods->QueryInterceptionHookPoint(
                            InterceptionHookPoints::POST_RECV_MESSAGE)) {
      // Null: the client closed its side; no call started.
      if (methods->GetRecvMessage() != nullptr) {
        start_ = std::chrono::steady_clock::now();
        in_flight_ = true;
      }
    }
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      // Serializes the response now rather than a moment later; it is the
      // buffer that is then sent, so nothing is done twice.
      const grpc::ByteBuffer* response = methods->GetSerializedSendMessage();
      if (response != nullptr) {
        method_->response_bytes->Increment(response->Length());
      }
      if (per_message_ && in_flight_) Count(grpc::StatusCode::OK);
    }
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS) &&
        (!per_message_ || in_flight_)) {
      // A call stream ends with a status only for the call in flight, if any.
      Count(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Count(grpc::StatusCode status) {
    const std::chrono::duration<double> elapsed =
        std::chrono::steady_clock::now() - start_;
    method_->duration->Observe(elapsed.count());
    const int code = static_cast<int>(status);
    method_->by_code[code >= 0 && code < 17 ? code : 2]->Increment();
    in_flight_ = false;
  }

  RpcMetricsInterceptorFactory::Method* const method_;
  const bool per_message_;
  std::chrono::steady_clock::time_point start_;
  bool in_flight_ = false;  // per_message_: a call was read, not answered
};

prometheus::MetricFamily Family(const std::string& name,
                                const std::string& help,
                                prometheus::MetricType type, double value,
                                const std::string& shard) {
  prometheus::ClientMetric metric;
  metric.label.push_back({"shard", shard});
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return prometheus::MetricFamily{name, help, type, {metric}};
}

// How long one scrape may take to send its request or read its answer:
// the endpoint answers one connection at a time.
constexpr int kIoTimeoutSeconds = 5;

void SetTimeouts(int fd) {
  timeval timeout{kIoTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
}

void SendAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the scraper went away or timed out
    data.remove_prefix(static_cast<size_t>(n));
  }
}

std::string Response(absl::string_view status, absl::string_view type,
                     absl::string_view body) {
  return absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

// A shard's families as they are built: each sample labelled with the shard.
struct ShardFamilies {
  std::string shard;
  std::vector<prometheus::MetricFamily> families;

  void Add(const char* name, const char* help, prometheus::MetricType type,
           double value) {
    families.push_back(Family(name, help, type, value, shard));
  }
};

// The job's progress on this shard: membership, steps, what was applied,
// refused, lost.
void AddProgressFamilies(const StatsResponse& s, ShardFamilies& out) {
  using prometheus::MetricType;
  out.Add("pstrain_shard_model_registered", "1 once a model is registered.",
          MetricType::Gauge, s.model_registered() ? 1 : 0);
  out.Add("pstrain_shard_version",
          "Smallest block version on this shard: the step, in sync mode.",
          MetricType::Gauge, static_cast<double>(s.version()));
  out.Add("pstrain_shard_blocks", "Model blocks held by this shard.",
          MetricType::Gauge, static_cast<double>(s.num_blocks()));
  out.Add("pstrain_shard_elements", "Model elements held by this shard.",
          MetricType::Gauge, static_cast<double>(s.num_elements()));
  out.Add("pstrain_shard_members",
          "Workers whose gradients the current step waits for.",
          MetricType::Gauge, s.members());
  out.Add(
      "pstrain_shard_job_started",
      "1 once the job has started (sync/ssp: every expected worker came, or "
      "--min_workers of them by --startup_timeout_s).",
      MetricType::Gauge, s.job_start().started() ? 1 : 0);
  out.Add("pstrain_shard_workers_missing",
          "Expected workers (ids below --num_workers) never heard from: before "
          "the start, those the first step waits for.",
          MetricType::Gauge, s.job_start().missing_workers_size());
  out.Add("pstrain_shard_steps_short_total",
          "sync: steps completed with fewer than --num_workers gradients.",
          MetricType::Counter, static_cast<double>(s.steps_short()));
  out.Add("pstrain_shard_waiting_pulls",
          "Pulls waiting for their step or for slow workers (queue depth).",
          MetricType::Gauge, static_cast<double>(s.waiting_pulls()));
  out.Add("pstrain_shard_staleness_max",
          "async: largest staleness (versions) of an applied block gradient.",
          MetricType::Gauge, static_cast<double>(s.staleness_max()));
  out.Add("pstrain_shard_staleness_mean",
          "async: mean staleness (versions) of applied block gradients.",
          MetricType::Gauge, s.staleness_mean());
  out.Add("pstrain_shard_ssp_gap_max",
          "ssp: largest clock gap a pull was served with.", MetricType::Gauge,
          static_cast<double>(s.ssp_gap_max()));
  out.Add("pstrain_shard_blocks_applied_total",
          "Block gradients applied (async) or added to a step (sync).",
          MetricType::Counter, static_cast<double>(s.blocks_applied()));
  out.Add("pstrain_shard_blocks_duplicate_total",
          "Block gradients received again and not applied twice.",
          MetricType::Counter, static_cast<double>(s.blocks_duplicate()));
  out.Add("pstrain_shard_late_gradients_dropped_total",
          "sync: block gradients for a step that had completed without them.",
          MetricType::Counter, static_cast<double>(s.late_gradients_dropped()));
  out.Add("pstrain_shard_requests_rejected_total",
          "Requests refused (bad, unauthenticated, wrong schema...).",
          MetricType::Counter, static_cast<double>(s.requests_rejected()));
  out.Add("pstrain_shard_pulls_served_total", "Pull requests answered.",
          MetricType::Counter, static_cast<double>(s.pulls_served()));
  out.Add("pstrain_shard_nonfinite_gradients_skipped_total",
          "Gradients with NaN/Inf skipped (--nonfinite_gradients=skip).",
          MetricType::Counter,
          static_cast<double>(s.nonfinite_gradients_skipped()));
  out.Add("pstrain_shard_steps_lost_total",
          "Steps skipped when a restored shard caught up with the workers.",
          MetricType::Counter, static_cast<double>(s.steps_lost()));
  out.Add("pstrain_shard_gradients_lost_total",
          "sync: block gradients lost in a crash, counted as given.",
          MetricType::Counter, static_cast<double>(s.gradients_lost()));
  out.Add("pstrain_shard_updates_lost_total",
          "Block updates a restore from a checkpoint lost (every mode).",
          MetricType::Counter, static_cast<double>(s.updates_lost()));
  out.Add("pstrain_shard_internal_errors_total",
          "Applies that validation promised could not fail and failed (a bug).",
          MetricType::Counter, static_cast<double>(s.internal_errors()));
  out.Add(
      "pstrain_shard_values_copied_for_pulls_total",
      "Updates that copied a block first because a pull was still sending it.",
      MetricType::Counter, static_cast<double>(s.values_copied_for_pulls()));
  out.Add("pstrain_shard_early_gradient_bytes",
          "sync: gradient bytes held now because they came before a lower "
          "worker id's (summed in worker order).",
          MetricType::Gauge, static_cast<double>(s.early_gradient_bytes()));
  out.Add("pstrain_shard_early_gradient_bytes_peak",
          "sync: the most gradient bytes ever held at once waiting for a lower "
          "worker id's.",
          MetricType::Gauge,
          static_cast<double>(s.early_gradient_bytes_peak()));
  out.Add("pstrain_shard_data_plane_requests_total",
          "Pushes and pulls answered on the tensor data plane, not over gRPC.",
          MetricType::Counter, static_cast<double>(s.data_plane_requests()));
}

// The checkpoints this shard wrote, and how late the next one is.
void AddCheckpointFamilies(const CheckpointStats& c, ShardFamilies& out) {
  using prometheus::MetricType;
  prometheus::MetricFamily failures{
      "pstrain_checkpoint_failures_total",
      "Checkpoint tries that failed, by reason (no_space, read_only, "
      "permission, verify, io).",
      MetricType::Counter,
      {}};
  std::map<std::string, int64_t> by_reason(c.failures().begin(),
                                           c.failures().end());
  for (const auto& [reason, count] : by_reason) {
    prometheus::ClientMetric metric;
    metric.label = {{"reason", reason}, {"shard", out.shard}};
    metric.counter.value = static_cast<double>(count);
    failures.metric.push_back(std::move(metric));
  }
  out.families.push_back(std::move(failures));
  out.Add("pstrain_checkpoint_last_success_timestamp_seconds",
          "Unix time of the newest good checkpoint this shard wrote or "
          "restored from (0: none yet).",
          MetricType::Gauge, c.last_success_unix_s());
  out.Add("pstrain_checkpoint_written_total", "Checkpoints written.",
          MetricType::Counter, static_cast<double>(c.written()));
  out.Add("pstrain_checkpoint_written_bytes_total",
          "Bytes of the checkpoints written.", MetricType::Counter,
          static_cast<double>(c.bytes_written()));
  out.Add("pstrain_checkpoint_duration_seconds_total",
          "Time spent writing good checkpoints (snapshot, write, fsync, "
          "verify).",
          MetricType::Counter, c.duration_total_s());
  out.Add("pstrain_checkpoint_last_duration_seconds",
          "How long the last good checkpoint took.", MetricType::Gauge,
          c.last_duration_s());
  out.Add("pstrain_checkpoint_last_bytes", "Size of the last good checkpoint.",
          MetricType::Gauge, static_cast<double>(c.last_bytes()));
  out.Add("pstrain_checkpoint_failing_seconds",
          "How long checkpoints have been failing (0: the last try succeeded).",
          MetricType::Gauge, c.failing_s());
  out.Add("pstrain_checkpoint_interval_seconds",
          "The checkpoint interval: --checkpoint_every_s, or the time between "
          "the last two checkpoints (0: unknown or periodic checkpoints off).",
          MetricType::Gauge, c.interval_s());
}

// The transport's TLS: what each port speaks and what it refused.
void AddTlsFamilies(const StatsResponse& s, ShardFamilies& out) {
  using prometheus::MetricType;
  out.Add("pstrain_shard_data_plane_tls",
          "1 when the tensor data port speaks TLS, 0 when plaintext or off.",
          MetricType::Gauge, s.data_port_tls() ? 1 : 0);
  out.Add("pstrain_shard_data_plane_tls_refused_total",
          "TLS data-plane connections refused before their first frame (failed "
          "or stalled handshakes, plaintext clients).",
          MetricType::Counter, static_cast<double>(s.data_plane_tls_refused()));
  out.Add("pstrain_shard_grpc_tls_refused_total",
          "TLS handshakes the gRPC port refused (no or a wrongly signed client "
          "certificate, plaintext clients).",
          MetricType::Counter, static_cast<double>(s.grpc_tls_refused()));
  out.Add("pstrain_shard_data_plane_ktls_connections_total",
          "TLS data-plane connections whose records the kernel handles (kTLS).",
          MetricType::Counter,
          static_cast<double>(s.data_plane_ktls_connections()));
  out.Add("pstrain_shard_data_plane_user_tls_connections_total",
          "TLS data-plane connections whose records OpenSSL handles in user "
          "space (no kernel TLS).",
          MetricType::Counter,
          static_cast<double>(s.data_plane_user_tls_connections()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& host, int port, const std::string& port_file) {
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->registry_ = std::make_shared<prometheus::Registry>();
  endpoint->collectables_.push_back(endpoint->registry_);
  endpoint->collectables_.push_back(
      std::make_shared<ProcessCollector>(program_invocation_short_name));
  const std::string where = absl::StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* addresses = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                             absl::StrCat(port).c_str(), &hints, &addresses);
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_host=", host, ": cannot resolve: ", gai_strerror(rc)));
  }
  std::string error = "no address";
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 16) == 0) {
      endpoint->listen_fd_ = fd;
      break;
    }
    error = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(addresses);
  if (endpoint->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat(
        "--metrics_port: cannot serve metrics on ", where, ": ", error));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  getsockname(endpoint->listen_fd_, reinterpret_cast<sockaddr*>(&bound),
              &length);
  endpoint->port_ =
      ntohs(bound.ss_family == AF_INET6
                ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  endpoint->thread_ = std::thread([e = endpoint.get()] { e->Serve(); });
  if (!port_file.empty()) {
    absl::Status written =
        WriteFileAtomically(port_file, absl::StrCat(endpoint->port_, "\n"));
    if (!written.ok()) return written;
  }
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

void MetricsEndpoint::Add(
    std::shared_ptr<prometheus::Collectable> collectable) {
  absl::MutexLock lock(&mu_);
  collectables_.push_back(std::move(collectable));
}

std::string MetricsEndpoint::Scrape() {
  std::vector<prometheus::MetricFamily> families;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& collectable : collectables_) {
      std::vector<prometheus::MetricFamily> more = collectable->Collect();
      families.insert(families.end(), std::make_move_iterator(more.begin()),
                      std::make_move_iterator(more.end()));
    }
  }
  return prometheus::TextSerializer().Serialize(families);
}

void MetricsEndpoint::Serve() {
  while (!stop_) {
    // Wakes up every 100 ms to notice stop_: no signal or extra fd needed.
    pollfd listening{listen_fd_, POLLIN, 0};
    if (poll(&listening, 1, 100) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    SetTimeouts(fd);
    Answer(fd);
    close(fd);
  }
}

void MetricsEndpoint::Answer(int fd) {
  // The request line and headers; the body of a GET is empty.
  std::string request;
  char buffer[2048];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos && request.size() < 16384) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    request.append(buffer, static_cast<size_t>(n));
  }
  // "GET /metrics?x HTTP/1.1"
  absl::string_view line(request);
  line = line.substr(0, line.find_first_of("\r\n"));
  const size_t space = line.find(' ');
  const absl::string_view method = line.substr(0, space);
  absl::string_view path =
      space == absl::string_view::npos ? "" : line.substr(space + 1);
  path = path.substr(0, path.find_first_of(" ?"));
  constexpr absl::string_view kText = "text/plain; charset=utf-8";
  if (method != "GET") {
    SendAll(fd, Response("405 Method Not Allowed", kText, "GET only\n"));
  } else if (path == "/metrics") {
    SendAll(fd, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                         Scrape()));
  } else {
    SendAll(fd, Response("404 Not Found", kText, "see /metrics\n"));
  }
}

const std::vector<double>& LatencyBuckets() {
  static const auto* buckets = new std::vector<double>{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
      0.25,   0.5,     1,      2.5,   5,      10,    30,   60,    120};
  return *buckets;
}

RpcMetricsInterceptorFactory::RpcMetricsInterceptorFactory(
    prometheus::Registry& registry,
    const std::vector<std::string>& known_methods,
    const absl::flat_hash_set<std::string>& raw_request_methods)
    : rpcs_(prometheus::BuildCounter()
                .Name("pstrain_server_rpcs_total")
                .Help("RPCs answered, by method and status code (calls to "
                      "methods the server does not have: method=\"unknown\").")
                .Register(registry)),
      duration_(prometheus::BuildHistogram()
                    .Name("pstrain_server_rpc_duration_seconds")
                    .Help("Time from a request's arrival to its status being "
                          "sent (Push: includes applying it; sync Pull: "
                          "includes waiting for the step).")
                    .Register(registry)),
      request_bytes_(prometheus::BuildCounter()
                         .Name("pstrain_server_request_bytes_total")
                         .Help("Request message bytes received (Push and "
                               "Pull).")
                         .Register(registry)),
      response_bytes_(prometheus::BuildCounter()
                          .Name("pstrain_server_response_bytes_total")
                          .Help("Response message bytes sent.")
                          .Register(registry)) {
  for (const std::string& full_name : known_methods) {
    // "/package.Service/Method" -> service, method.
    absl::string_view name(full_name);
    absl::ConsumePrefix(&name, "/");
    const size_t slash = name.find('/');
    if (slash == absl::string_view::npos) continue;
    methods_[full_name] = MakeMethod(std::string(name.substr(0, slash)),
                                     std::string(name.substr(slash + 1)),
                                     raw_request_methods.contains(full_name));
  }
  unknown_ = MakeMethod("unknown", "unknown", /*raw_request=*/false);
}

std::unique_ptr<RpcMetricsInterceptorFactory::Method>
RpcMetricsInterceptorFactory::MakeMethod(const std::string& service,
                                         const std::string& method_name,
                                         bool raw_request) {
  const std::map<std::string, std::string> labels = {{"service", service},
                                                     {"method", method_name}};
  auto method = std::make_unique<Method>();
  method->duration = &duration_.Add(labels, LatencyBuckets());
  method->response_bytes = &response_bytes_.Add(labels);
  if (raw_request) method->request_bytes = &request_bytes_.Add(labels);
  for (int code = 0; code < 17; ++code) {
    std::map<std::string, std::string> with_code = labels;
    with_code["code"] = CodeName(code);
    method->by_code[code] = &rpcs_.Add(with_code);
  }
  return method;
}

grpc::experimental::Interceptor*
RpcMetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  absl::string_view name = info->method() == nullptr ? "" : info->method();
  const bool call_stream =
      info->type() == grpc::experimental::ServerRpcInfo::Type::BIDI_STREAMING &&
      absl::ConsumeSuffix(&name, "Stream");
  const auto known = methods_.find(name);
  Method* method =
      known == methods_.end() ? unknown_.get() : known->second.get();
  // A made-up "<M>Stream" is not a call stream of anything.
  return new RpcMetricsInterceptor(method,
                                   call_stream && method != unknown_.get());
}

void RpcMetricsInterceptorFactory::RecordCall(const std::string& full_method,
                                              absl::StatusCode code,
                                              absl::Duration elapsed,
                                              uint64_t request_bytes,
                                              uint64_t response_bytes) {
  const auto known = methods_.find(full_method);
  Method* method =
      known == methods_.end() ? unknown_.get() : known->second.get();
  if (method->request_bytes != nullptr) {
    method->request_bytes->Increment(static_cast<double>(request_bytes));
  }
  method->response_bytes->Increment(static_cast<double>(response_bytes));
  method->duration->Observe(absl::ToDoubleSeconds(elapsed));
  // absl and gRPC number their status codes alike.
  const int number = static_cast<int>(code);
  method->by_code[number >= 0 && number < 17 ? number : 2]->Increment();
}

std::vector<std::string> ServiceMethodNames(const std::string& service) {
  std::vector<std::string> names;
  const google::protobuf::ServiceDescriptor* descriptor =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          service);
  if (descriptor == nullptr) return names;
  for (int i = 0; i < descriptor->method_count(); ++i) {
    names.push_back(
        absl::StrCat("/", service, "/", descriptor->method(i)->name()));
  }
  return names;
}

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> families;
  auto add = [&](const char* name, const char* help, MetricType type,
                 double value) {
    prometheus::ClientMetric metric;
    if (type == MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    families.push_back({name, help, type, {metric}});
  };
  {
    prometheus::ClientMetric info;
    info.label = {{"binary", binary_},
                  {"protocol_version", absl::StrCat(kProtocolVersion)},
                  {"grpc_version", grpc::Version()},
                  {"compiler", __VERSION__}};
    info.gauge.value = 1;
    families.push_back({"pstrain_build_info",
                        "What this binary is built from (value 1).",
                        MetricType::Gauge,
                        {info}});
  }
  // /proc/self/stat: the fields after the command name, which is in
  // parentheses and may itself hold spaces.
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)),
                   std::istreambuf_iterator<char>());
  const size_t after_name = stat.rfind(')');
  if (after_name != std::string::npos) {
    const std::vector<std::string> fields =
        absl::StrSplit(absl::string_view(stat).substr(after_name + 2), ' ');
    // proc(5) numbers fields from 1 and the state is field 3: field n is
    // fields[n - 3].
    auto field = [&](int n) -> double {
      double value = 0;
      if (n - 3 < static_cast<int>(fields.size())) {
        (void)absl::SimpleAtod(fields[n - 3], &value);
      }
      return value;
    };
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    add("process_cpu_seconds_total", "User and system CPU time spent.",
        MetricType::Counter, (field(14) + field(15)) / ticks);
    add("process_virtual_memory_bytes", "Virtual memory size.",
        MetricType::Gauge, field(23));
    add("process_resident_memory_bytes", "Resident memory size.",
        MetricType::Gauge,
        field(24) * static_cast<double>(sysconf(_SC_PAGESIZE)));
    std::ifstream proc_stat("/proc/stat");
    std::string line;
    while (std::getline(proc_stat, line)) {
      absl::string_view rest(line);
      if (!absl::ConsumePrefix(&rest, "btime ")) continue;
      double boot_time = 0;
      if (absl::SimpleAtod(absl::StripAsciiWhitespace(rest), &boot_time)) {
        add("process_start_time_seconds",
            "Start time of the process since the Unix epoch.",
            MetricType::Gauge, boot_time + field(22) / ticks);
      }
      break;
    }
  }
  int open_fds = 0;
  if (DIR* fds = opendir("/proc/self/fd"); fds != nullptr) {
    while (dirent* entry = readdir(fds)) {
      if (entry->d_name[0] != '.') ++open_fds;
    }
    closedir(fds);
    add("process_open_fds", "Open file descriptors.", MetricType::Gauge,
        open_fds - 1);  // less the one reading the directory
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    add("process_max_fds", "Most file descriptors the process may open.",
        MetricType::Gauge, static_cast<double>(limit.rlim_cur));
  }
  return families;
}

// --replicas > 1 (ps_server/replication.h): where this replica stands.
void AddReplicaFamilies(const StatsResponse& s, ShardFamilies& out) {
  using prometheus::MetricType;
  prometheus::ClientMetric role;
  role.label = {{"shard", out.shard},
                {"replica", absl::StrCat(s.replica_index())},
                {"role", s.replica_role()}};
  role.gauge.value = 1;
  out.families.push_back({"pstrain_replica_info",
                          "This process's place in its shard's replica set "
                          "and its role (value 1).",
                          MetricType::Gauge,
                          {role}});
  out.Add("pstrain_replica_epoch",
          "The epoch this replica is at (one more for every takeover).",
          MetricType::Gauge, static_cast<double>(s.replica_epoch()));
  out.Add("pstrain_replica_forwards_total",
          "Changes this replica forwarded to its backups as primary.",
          MetricType::Counter, static_cast<double>(s.replica_forwards()));
  out.Add("pstrain_replica_takeovers_total",
          "Times this replica took over as primary.", MetricType::Counter,
          static_cast<double>(s.replica_takeovers()));
  out.Add("pstrain_replica_dropped_total",
          "Backups this replica dropped from its set (dead, or disagreeing).",
          MetricType::Counter, static_cast<double>(s.replicas_dropped()));
  out.Add("pstrain_replica_catchups_total",
          "Replicas brought into the set by state transfer, as primary.",
          MetricType::Counter, static_cast<double>(s.replica_catchups()));
  out.Add("pstrain_replica_catchup_last_seconds",
          "How long the last catch-up took (sent, or received).",
          MetricType::Gauge, s.replica_catchup_seconds());
  out.Add("pstrain_replica_step_record_sends_total",
          "Step-record messages the backups confirmed, as primary (sync).",
          MetricType::Counter, static_cast<double>(s.step_record_sends()));
  out.Add("pstrain_replica_step_record_send_seconds_total",
          "Time the step-record calls to the backups took, as primary.",
          MetricType::Counter, s.step_record_send_seconds());
  out.Add("pstrain_replica_step_record_confirm_seconds_total",
          "Per step-record message, the time from the making of its newest "
          "record to its confirmation by every backup (a pull may wait "
          "longer, for an older message still out), as primary.",
          MetricType::Counter, s.step_record_confirm_seconds());
  out.Add("pstrain_replica_step_record_applies_total",
          "Step-record messages applied, as backup.", MetricType::Counter,
          static_cast<double>(s.step_record_applies()));
  out.Add("pstrain_replica_step_record_apply_seconds_total",
          "Time applying step-record messages took, as backup.",
          MetricType::Counter, s.step_record_apply_seconds());
}

std::vector<prometheus::MetricFamily> ShardStatsCollector::Collect() const {
  const StatsResponse s = stats_();
  ShardFamilies out{absl::StrCat(s.shard_id()), {}};
  prometheus::ClientMetric info;
  info.label = {{"shard", out.shard},
                {"num_shards", absl::StrCat(s.num_shards())},
                {"mode", s.mode()}};
  info.gauge.value = 1;
  out.families.push_back({"pstrain_shard_info",
                          "This shard's place in the job (value 1).",
                          prometheus::MetricType::Gauge,
                          {info}});
  AddProgressFamilies(s, out);
  // Only with --checkpoint_dir: a server that never checkpoints has no
  // checkpoint to be late.
  if (s.checkpoint().enabled()) AddCheckpointFamilies(s.checkpoint(), out);
  if (s.replicas() > 1) AddReplicaFamilies(s, out);
  AddTlsFamilies(s, out);
  return std::move(out.families);
}

WorkerMetrics::WorkerMetrics(prometheus::Registry& registry, int worker_id)
    : step_(prometheus::BuildGauge()
                .Name("pstrain_worker_step")
                .Help("Steps done (the step the model is at).")
                .Register(registry)
                .Add({{"worker", absl::StrCat(worker_id)}})),
      steps_(prometheus::BuildGauge()
                 .Name("pstrain_worker_steps")
                 .Help("Steps this job trains for.")
                 .Register(registry)
                 .Add({{"worker", absl::StrCat(worker_id)}})),
      loss_(prometheus::BuildGauge()
                .Name("pstrain_worker_loss")
                .Help("Training loss of the last step's batch.")
                .Register(registry)
                .Add({{"worker", absl::StrCat(worker_id)}})),
      accuracy_(prometheus::BuildGauge()
                    .Name("pstrain_worker_train_accuracy")
                    .Help("Accuracy on the last step's batch.")
                    .Register(registry)
                    .Add({{"worker", absl::StrCat(worker_id)}})),
      samples_per_second_(
          prometheus::BuildGauge()
              .Name("pstrain_worker_samples_per_second")
              .Help("Training examples per second over the last second or "
                    "more of steps.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}})),
      examples_(prometheus::BuildCounter()
                    .Name("pstrain_worker_examples_total")
                    .Help("Training examples processed.")
                    .Register(registry)
                    .Add({{"worker", absl::StrCat(worker_id)}})),
      step_seconds_(
          prometheus::BuildHistogram()
              .Name("pstrain_worker_step_duration_seconds")
              .Help("Wall time of a step, pull to push.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}}, LatencyBuckets())),
      pull_seconds_(
          prometheus::BuildHistogram()
              .Name("pstrain_worker_pull_duration_seconds")
              .Help("Time to pull the model, every shard at once.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}}, LatencyBuckets())),
      push_seconds_(
          prometheus::BuildHistogram()
              .Name("pstrain_worker_push_duration_seconds")
              .Help("From a step's first gradient push to its last "
                    "answer (overlapping backward).")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}}, LatencyBuckets())),
      compute_seconds_(
          prometheus::BuildHistogram()
              .Name("pstrain_worker_compute_duration_seconds")
              .Help("Batch, forward and backward of a step.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}}, LatencyBuckets())),
      network_wait_seconds_(
          prometheus::BuildHistogram()
              .Name("pstrain_worker_network_wait_seconds")
              .Help("Time a step was blocked on the network: the pull and "
                    "pushes still in flight after backward.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}}, LatencyBuckets())),
      test_loss_(prometheus::BuildGauge()
                     .Name("pstrain_worker_test_loss")
                     .Help("Held-out loss at the last evaluation.")
                     .Register(registry)
                     .Add({{"worker", absl::StrCat(worker_id)}})),
      test_accuracy_(prometheus::BuildGauge()
                         .Name("pstrain_worker_test_accuracy")
                         .Help("Held-out accuracy at the last evaluation.")
                         .Register(registry)
                         .Add({{"worker", absl::StrCat(worker_id)}})),
      sparse_rows_pulled_(
          prometheus::BuildCounter()
              .Name("pstrain_worker_sparse_rows_pulled_total")
              .Help("Embedding rows pulled from the servers while training.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}})),
      sparse_cache_hits_(
          prometheus::BuildCounter()
              .Name("pstrain_worker_sparse_cache_hits_total")
              .Help("Embedding rows the worker's row cache served instead "
                    "(--sparse_cache_steps).")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}})),
      sparse_cache_bytes_saved_(
          prometheus::BuildCounter()
              .Name("pstrain_worker_sparse_cache_bytes_saved_total")
              .Help("Row bytes the row cache kept off the network.")
              .Register(registry)
              .Add({{"worker", absl::StrCat(worker_id)}})) {}

void WorkerMetrics::ObserveEvaluation(double test_loss, double test_accuracy) {
  test_loss_.Set(test_loss);
  test_accuracy_.Set(test_accuracy);
}

void WorkerMetrics::Observe(const StepSample& sample) {
  step_.Set(static_cast<double>(sample.step));
  steps_.Set(static_cast<double>(sample.steps));
  loss_.Set(sample.loss);
  accuracy_.Set(sample.train_accuracy);
  examples_.Increment(static_cast<double>(sample.examples));
  step_seconds_.Observe(sample.step_seconds);
  pull_seconds_.Observe(sample.pull_seconds);
  push_seconds_.Observe(sample.push_seconds);
  compute_seconds_.Observe(sample.compute_seconds);
  network_wait_seconds_.Observe(sample.network_wait_seconds);
  sparse_rows_pulled_.Increment(static_cast<double>(sample.sparse_rows_pulled));
  sparse_cache_hits_.Increment(static_cast<double>(sample.sparse_cache_hits));
  sparse_cache_bytes_saved_.Increment(
      static_cast<double>(sample.sparse_cache_bytes_saved));
  window_examples_ += static_cast<double>(sample.examples);
  window_seconds_ += sample.step_seconds;
  // Shown from the first step on, then refreshed once a second of steps.
  if (window_seconds_ >= 1.0 || samples_per_second_.Value() == 0) {
    if (window_seconds_ > 0) {
      samples_per_second_.Set(window_examples_ / window_seconds_);
    }
    if (window_seconds_ >= 1.0) window_examples_ = window_seconds_ = 0;
  }
}

}  // namespace pstrain
