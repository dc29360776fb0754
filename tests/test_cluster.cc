#include "tests/test_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tools/cpp/runfiles/runfiles.h"

extern char** environ;

namespace pstrain::testing {
namespace {

using bazel::tools::cpp::runfiles::Runfiles;

// Polling interval for process exit and port files: a wait on a condition,
// always bounded by the caller's deadline.
constexpr absl::Duration kPoll = absl::Milliseconds(5);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

std::string Tail(const std::string& text, size_t max_chars = 3000) {
  return text.size() <= max_chars ? text : text.substr(text.size() - max_chars);
}

// gRPC 1.51 runs callback-API completions on a shared "callback alternative"
// completion queue here, created with the first channel that makes a
// callback call and torn down with the last one; that teardown can race
// with its own threads and abort ("assertion failed: prior > 0" in
// grpc_cq_internal_unref), which tests that create and drop clients
// repeatedly hit about once in ten runs. One channel that made a callback
// call and is never destroyed keeps the queue up for the whole process.
void KeepCallbackQueueAlive() {
  static const bool kept = [] {
    auto* channel = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
    auto* stub = new grpc::GenericStub(*channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(100));
    grpc::Slice empty;
    grpc::ByteBuffer request(&empty, 1), response;
    absl::Notification done;
    stub->UnaryCall(&context, "/keepalive/Call", grpc::StubOptions(), &request,
                    &response, [&done](grpc::Status) { done.Notify(); });
    done.WaitForNotificationWithTimeout(absl::Seconds(10));
    return true;
  }();
  (void)kept;
}

}  // namespace

std::string BinaryPath(const std::string& target_path) {
  static Runfiles* runfiles = [] {
    std::string error;
    Runfiles* r = Runfiles::CreateForTest(&error);
    if (r == nullptr) {
      std::fprintf(stderr, "runfiles: %s\n", error.c_str());
      std::abort();
    }
    return r;
  }();
  return runfiles->Rlocation(absl::StrCat("pstrain/", target_path));
}

std::string TestDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

absl::StatusOr<std::unique_ptr<Process>> Process::Start(
    const std::vector<std::string>& argv, const std::string& dir,
    const std::string& name) {
  const std::string out = absl::StrCat(dir, "/", name, ".out");
  const std::string err = absl::StrCat(dir, "/", name, ".log");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null",
                                   O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc =
      posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  return std::unique_ptr<Process>(new Process(pid, out, err));
}

Process::~Process() {
  if (running()) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

bool Process::running() {
  if (exit_code_ >= 0) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    exit_code_ =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

absl::StatusOr<int> Process::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (running()) {
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      exit_code_ = 128 + SIGKILL;
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running after ",
                       absl::FormatDuration(timeout), "; killed. stderr:\n",
                       Tail(Stderr())));
    }
    absl::SleepFor(kPoll);
  }
  return exit_code_;
}

void Process::Signal(int signal_number) {
  if (running()) kill(pid_, signal_number);
}

std::string Process::Stdout() const { return ReadFile(stdout_path_); }
std::string Process::Stderr() const { return ReadFile(stderr_path_); }

namespace {

// A free loopback port below the kernel's ephemeral range (32768-60999 by
// default): a port picked from that range (FreePort) can be taken, before
// the server binds it, by another server's data port (bound to port 0) or
// an outgoing connection; this one only by another explicit bind.
int PortBelowEphemeralRange() {
  static absl::BitGen random;
  while (true) {
    const int port = absl::Uniform(random, 20000, 32000);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(port));
    const bool free =
        bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    close(fd);
    if (free) return port;
  }
}

}  // namespace

std::string TestCluster::ReplicaAddress(int index) const {
  return absl::StrCat("127.0.0.1:", ports_[index]);
}

std::vector<std::string> TestCluster::ServerArgv(int index, int port) const {
  const int shard = index / options_.replicas;
  std::vector<std::string> argv = {
      BinaryPath("ps_server/ps_server"),
      "--host=127.0.0.1",
      absl::StrCat("--port=", port),
      absl::StrCat("--port_file=", dir_, "/ps", index, ".port"),
      absl::StrCat("--shard_id=", shard),
      absl::StrCat("--num_shards=", options_.num_shards),
      absl::StrCat("--num_workers=", options_.num_workers),
      absl::StrCat("--mode=", options_.mode)};
  if (options_.replicas > 1) {
    std::vector<std::string> set;
    for (int r = 0; r < options_.replicas; ++r) {
      set.push_back(ReplicaAddress(shard * options_.replicas + r));
    }
    argv.push_back(absl::StrCat("--replicas=", options_.replicas));
    argv.push_back(absl::StrCat("--replica_index=", index % options_.replicas));
    argv.push_back(absl::StrCat("--replica_hosts=", absl::StrJoin(set, ",")));
  }
  argv.insert(argv.end(), options_.server_flags.begin(),
              options_.server_flags.end());
  return argv;
}

absl::Status TestCluster::WaitForPortFile(int shard, absl::Duration timeout) {
  const std::string port_file = absl::StrCat(dir_, "/ps", shard, ".port");
  const absl::Time deadline = absl::Now() + timeout;
  int port = 0;
  while (!absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(port_file)),
                           &port)) {
    if (!servers_[shard]->running()) {
      return absl::InternalError(absl::StrCat("ps_server ", shard,
                                              " exited before serving:\n",
                                              Tail(servers_[shard]->Stderr())));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("ps_server ", shard, " wrote no port file in ",
                       absl::FormatDuration(timeout)));
    }
    absl::SleepFor(kPoll);
  }
  ports_[shard] = port;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Start(
    const ClusterOptions& options, const std::string& name) {
  KeepCallbackQueueAlive();
  auto cluster = std::make_unique<TestCluster>();
  cluster->options_ = options;
  cluster->dir_ = absl::StrCat(TestDir(), "/", name);
  mkdir(cluster->dir_.c_str(), 0755);
  const int servers = options.num_shards * options.replicas;
  cluster->ports_.assign(servers, 0);
  // Replicas must know each other's ports before they start.
  if (options.replicas > 1) {
    for (size_t i = 0; i < cluster->ports_.size(); ++i) {
      do {
        cluster->ports_[i] = PortBelowEphemeralRange();
      } while (std::count(cluster->ports_.begin(), cluster->ports_.begin() + i,
                          cluster->ports_[i]) > 0);
    }
  }
  auto started_later = [&](int s) {
    return std::find(
               options.started_later.begin(), options.started_later.end(),
               std::make_pair(s / options.replicas, s % options.replicas)) !=
           options.started_later.end();
  };
  for (int s = 0; s < servers; ++s) {
    std::remove(absl::StrCat(cluster->dir_, "/ps", s, ".port").c_str());
    if (started_later(s)) {
      cluster->servers_.push_back(nullptr);
      continue;
    }
    absl::StatusOr<std::unique_ptr<Process>> server =
        Process::Start(cluster->ServerArgv(s, cluster->ports_[s]),
                       cluster->dir_, absl::StrCat("ps", s));
    if (!server.ok()) return server.status();
    cluster->servers_.push_back(std::move(*server));
  }
  for (int s = 0; s < servers; ++s) {
    if (started_later(s)) continue;
    if (absl::Status st = cluster->WaitForPortFile(s, absl::Seconds(30));
        !st.ok()) {
      return st;
    }
  }
  return cluster;
}

void TestCluster::KillServer(int shard) { KillReplica(shard, 0); }

void TestCluster::KillReplica(int shard, int replica) {
  if (servers_[shard * options_.replicas + replica] == nullptr) return;
  Process& server = *servers_[shard * options_.replicas + replica];
  server.Signal(SIGKILL);
  server.Wait(absl::Seconds(10)).IgnoreError();
}

absl::StatusOr<StatsResponse> TestCluster::ReplicaStats(int shard,
                                                        int replica) {
  PsClientOptions options;
  options.hosts = {ReplicaAddress(shard * options_.replicas + replica)};
  options.rpc_timeout = absl::Seconds(5);
  options.retry_window = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  if (!client.ok()) return client.status();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*client)->Stats();
  if (!stats.ok()) return stats.status();
  return stats->front();
}

absl::Status TestCluster::StopServer(int shard) {
  servers_[shard]->Signal(SIGTERM);
  absl::StatusOr<int> code = servers_[shard]->Wait(absl::Seconds(30));
  if (!code.ok()) return code.status();
  if (*code != 0) {
    return absl::InternalError(absl::StrCat("ps_server ", shard, " exited ",
                                            *code, ":\n",
                                            Tail(servers_[shard]->Stderr())));
  }
  return absl::OkStatus();
}

absl::Status TestCluster::RestartServer(
    int shard, const std::vector<std::string>& extra_flags) {
  return RestartReplica(shard, 0, extra_flags);
}

absl::Status TestCluster::RestartReplica(
    int shard, int replica, const std::vector<std::string>& extra_flags) {
  return RestartReplicas(shard, {replica}, extra_flags);
}

absl::Status TestCluster::RestartReplicas(
    int shard, const std::vector<int>& replicas,
    const std::vector<std::string>& extra_flags) {
  std::vector<int> started;
  for (int replica : replicas) {
    const int index = shard * options_.replicas + replica;
    const std::string port_file = absl::StrCat(dir_, "/ps", index, ".port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = ServerArgv(index, ports_[index]);
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    absl::StatusOr<std::unique_ptr<Process>> server = Process::Start(
        argv, dir_, absl::StrCat("ps", index, "_restart", ++restarts_));
    if (!server.ok()) return server.status();
    servers_[index] = std::move(*server);
    started.push_back(index);
  }
  // The observer's connection to the old process may not have noticed it
  // closed: its next Stats would fail with "Socket closed".
  observer_.reset();
  for (int index : started) {
    if (absl::Status s = WaitForPortFile(index, absl::Seconds(30)); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Process>> TestCluster::StartWorker(
    int worker_id, int num_workers, const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {BinaryPath("worker/worker"),
                                   absl::StrCat("--ps_hosts=", PsHosts()),
                                   absl::StrCat("--worker_id=", worker_id),
                                   absl::StrCat("--num_workers=", num_workers)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return Process::Start(argv, dir_,
                        absl::StrCat("worker", worker_id, "_", ++restarts_));
}

absl::StatusOr<std::vector<StatsResponse>> TestCluster::Stats() {
  if (observer_ == nullptr) {
    PsClientOptions options;
    options.hosts = HostList();
    options.rpc_timeout = absl::Seconds(5);
    options.retry_window = absl::ZeroDuration();
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(options);
    if (!client.ok()) return client.status();
    observer_ = std::move(*client);
  }
  return observer_->Stats();
}

absl::Status TestCluster::WaitForStats(
    const std::function<bool(const StatsResponse&)>& done,
    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last;
  while (absl::Now() < deadline) {
    absl::StatusOr<std::vector<StatsResponse>> stats = Stats();
    if (stats.ok()) {
      bool all = true;
      last.clear();
      for (const StatsResponse& shard : *stats) {
        all &= done(shard);
        absl::StrAppend(&last, shard.ShortDebugString(), "\n");
      }
      if (all) return absl::OkStatus();
    } else {
      last = std::string(stats.status().message());
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("condition on the servers' stats not met in ",
                   absl::FormatDuration(timeout), "; last seen:\n", last));
}

std::vector<std::string> TestCluster::HostList() const {
  std::vector<std::string> hosts;
  for (int s = 0; s < options_.num_shards; ++s) {
    std::vector<std::string> set;
    for (int r = 0; r < options_.replicas; ++r) {
      set.push_back(ReplicaAddress(s * options_.replicas + r));
    }
    hosts.push_back(absl::StrJoin(set, "|"));
  }
  return hosts;
}

std::string TestCluster::PsHosts() const {
  return absl::StrJoin(HostList(), ",");
}

absl::StatusOr<std::vector<std::string>> TestCluster::RunWorkers(
    const std::vector<std::vector<std::string>>& worker_flags,
    absl::Duration timeout, const std::vector<absl::Duration>& start_delays) {
  const int n = static_cast<int>(worker_flags.size());
  std::vector<int> order(n);
  for (int k = 0; k < n; ++k) order[k] = k;
  if (!start_delays.empty()) {
    if (static_cast<int>(start_delays.size()) != n) {
      return absl::InvalidArgumentError("one start delay per worker");
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return start_delays[a] < start_delays[b];
    });
  }
  const absl::Time begin = absl::Now();
  std::vector<std::unique_ptr<Process>> workers(n);
  for (int k : order) {
    if (!start_delays.empty()) {
      absl::SleepFor(begin + start_delays[k] - absl::Now());
    }
    absl::StatusOr<std::unique_ptr<Process>> worker =
        StartWorker(k, n, worker_flags[k]);
    if (!worker.ok()) return worker.status();
    workers[k] = std::move(*worker);
  }
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::string> outputs;
  for (int k = 0; k < n; ++k) {
    absl::StatusOr<int> code =
        workers[k]->Wait(std::max(deadline - absl::Now(), absl::Seconds(1)));
    if (!code.ok()) return code.status();
    if (*code != 0) {
      return absl::InternalError(absl::StrCat("worker ", k, " exited with ",
                                              *code, ":\n",
                                              Tail(workers[k]->Stderr())));
    }
    outputs.push_back(workers[k]->Stdout());
  }
  return outputs;
}

absl::Status MakeTestCerts(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Process>> script =
      Process::Start({"/bin/bash", BinaryPath("deploy/tls/make_certs.sh"), dir,
                      "localhost", "127.0.0.1"},
                     TestDir(), "make_certs");
  if (!script.ok()) return script.status();
  absl::StatusOr<int> code = (*script)->Wait(absl::Seconds(30));
  if (!code.ok()) return code.status();
  if (*code != 0) {
    return absl::InternalError(absl::StrCat("make_certs.sh exited ", *code,
                                            ": ", (*script)->Stderr()));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> FinalJsonNumber(const std::string& worker_stdout,
                                       const std::string& key) {
  const size_t line = worker_stdout.rfind("{\"event\":\"final\"");
  if (line == std::string::npos) {
    return absl::NotFoundError("no final JSON line in worker output");
  }
  const std::string quoted = absl::StrCat("\"", key, "\":");
  const size_t at = worker_stdout.find(quoted, line);
  if (at == std::string::npos) {
    return absl::NotFoundError(absl::StrCat("no '", key, "' in final JSON"));
  }
  const size_t start = at + quoted.size();
  const size_t end = worker_stdout.find_first_of(",}", start);
  double value = 0;
  if (!absl::SimpleAtod(worker_stdout.substr(start, end - start), &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", key, "' is not a number"));
  }
  return value;
}

}  // namespace pstrain::testing
