#include "tests/test_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
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

absl::StatusOr<std::unique_ptr<TestCluster>> TestCluster::Start(
    const ClusterOptions& options, const std::string& name) {
  auto cluster = std::make_unique<TestCluster>();
  cluster->options_ = options;
  cluster->dir_ = absl::StrCat(TestDir(), "/", name);
  mkdir(cluster->dir_.c_str(), 0755);
  const std::string binary = BinaryPath("ps_server/ps_server");
  for (int s = 0; s < options.num_shards; ++s) {
    const std::string port_file =
        absl::StrCat(cluster->dir_, "/ps", s, ".port");
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {
        binary,
        "--host=127.0.0.1",
        "--port=0",
        absl::StrCat("--port_file=", port_file),
        absl::StrCat("--shard_id=", s),
        absl::StrCat("--num_shards=", options.num_shards),
        absl::StrCat("--num_workers=", options.num_workers),
        absl::StrCat("--mode=", options.mode)};
    argv.insert(argv.end(), options.server_flags.begin(),
                options.server_flags.end());
    absl::StatusOr<std::unique_ptr<Process>> server =
        Process::Start(argv, cluster->dir_, absl::StrCat("ps", s));
    if (!server.ok()) return server.status();
    cluster->servers_.push_back(std::move(*server));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (int s = 0; s < options.num_shards; ++s) {
    const std::string port_file =
        absl::StrCat(cluster->dir_, "/ps", s, ".port");
    int port = 0;
    while (!absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(port_file)),
                             &port)) {
      if (!cluster->servers_[s]->running()) {
        return absl::InternalError(
            absl::StrCat("ps_server ", s, " exited before serving:\n",
                         Tail(cluster->servers_[s]->Stderr())));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("ps_server ", s, " wrote no port file in 30s"));
      }
      absl::SleepFor(kPoll);
    }
    cluster->ports_.push_back(port);
  }
  return cluster;
}

std::vector<std::string> TestCluster::HostList() const {
  std::vector<std::string> hosts;
  for (int port : ports_) hosts.push_back(absl::StrCat("127.0.0.1:", port));
  return hosts;
}

std::string TestCluster::PsHosts() const {
  return absl::StrJoin(HostList(), ",");
}

absl::StatusOr<std::vector<std::string>> TestCluster::RunWorkers(
    const std::vector<std::vector<std::string>>& worker_flags,
    absl::Duration timeout) {
  const int n = static_cast<int>(worker_flags.size());
  std::vector<std::unique_ptr<Process>> workers;
  for (int k = 0; k < n; ++k) {
    std::vector<std::string> argv = {
        BinaryPath("worker/worker"), absl::StrCat("--ps_hosts=", PsHosts()),
        absl::StrCat("--worker_id=", k), absl::StrCat("--num_workers=", n)};
    argv.insert(argv.end(), worker_flags[k].begin(), worker_flags[k].end());
    absl::StatusOr<std::unique_ptr<Process>> worker =
        Process::Start(argv, dir_, absl::StrCat("worker", k));
    if (!worker.ok()) return worker.status();
    workers.push_back(std::move(*worker));
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
