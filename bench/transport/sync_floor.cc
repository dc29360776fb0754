// sync_floor: how long a synchronous data-parallel step's exchange takes on
// this machine with nothing but raw TCP in the way: the baseline for a sync
// job's network wait (issue 11). A parameter server over TCP adds protocol,
// validation and optimizer state to this; it cannot skip the kernel's
// copies measured here. (Not a proof of a lower bound: it is the plain
// blocking schedule below, every worker sending to all shards, then
// reading all answers.)
//
//   sync_floor [--servers=2] [--workers=2] [--elements=235146] [--steps=2000]
//
// S server processes and W worker processes on loopback, one TCP
// connection per (worker, server) pair, blocking sockets, no framing. A
// step: every worker sends each server its share of a float32 gradient of
// --elements, each server waits for all W shares, adds them and applies
// SGD to its share of the parameters (the least update there is), then
// sends the share back to every worker, and each worker waits for all S
// answers. That is the sync job's exchange with nothing else: no compute,
// no protocol, no optimizer state. Prints the median step time over the
// workers and a JSON line.
//
// The servers and workers are this binary re-executed with --role=server
// or --role=worker (bench/child_process.h): they never outlive the bench.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "common/cli.h"
#include "common/transport/socket.h"

ABSL_FLAG(int, servers, 2, "Server processes (the job's shards).");
ABSL_FLAG(int, workers, 2, "Worker processes.");
ABSL_FLAG(int64_t, elements, 235146,
          "Model size in float32 elements (default: the Fashion-MNIST MLP "
          "784-256-128-10).");
ABSL_FLAG(int, steps, 2000, "Measured steps.");
ABSL_FLAG(int, warmup, 100, "Unmeasured steps first.");
ABSL_FLAG(int, timeout_s, 120,
          "Every socket read and write must progress within this; the whole "
          "run is killed past 10x it.");
// Roles of the re-executed children.
ABSL_FLAG(std::string, role, "bench", "bench, server or worker.");
ABSL_FLAG(int, index, 0, "Child roles: which server or worker this is.");
ABSL_FLAG(std::string, port_file, "",
          "Server role: where the chosen port is written once listening.");
ABSL_FLAG(std::vector<std::string>, ports, {},
          "Worker role: the servers' ports, in shard order.");
ABSL_FLAG(std::string, result_file, "",
          "Worker role: where its measured seconds per step are written.");

namespace pstrain {
namespace {

using bench::ChildProcess;

constexpr int kBufferBytes = 4 << 20;  // as the data plane's sockets

struct Shard {
  int64_t begin, end;  // elements
  size_t bytes() const { return (end - begin) * sizeof(float); }
};

Shard ShardOf(int s, int servers, int64_t elements) {
  return {elements * s / servers, elements * (s + 1) / servers};
}

struct Config {
  int servers, workers, steps, warmup;
  int64_t elements;
  absl::Duration timeout;
};

absl::Status Serve(const Config& config, int s, const std::string& port_file) {
  int port = 0;
  absl::StatusOr<ScopedFd> listener =
      ListenTcp("127.0.0.1", 0, kBufferBytes, &port);
  if (!listener.ok()) return listener.status();
  // accept() waits at most the timeout too (SO_RCVTIMEO).
  if (absl::Status st =
          TuneSocket(listener->get(), kBufferBytes, config.timeout);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = WriteFileAtomically(port_file, absl::StrCat(port));
      !st.ok()) {
    return st;
  }
  std::vector<ScopedFd> from(config.workers);
  for (int accepted = 0; accepted < config.workers; ++accepted) {
    ScopedFd fd(accept(listener->get(), nullptr, nullptr));
    if (fd.get() < 0) return SocketError("accept", errno);
    if (absl::Status st = TuneSocket(fd.get(), kBufferBytes, config.timeout);
        !st.ok()) {
      return st;
    }
    int32_t worker = -1;
    if (absl::Status st =
            RecvAll(fd.get(), reinterpret_cast<char*>(&worker), sizeof(worker));
        !st.ok()) {
      return st;
    }
    if (worker < 0 || worker >= config.workers || from[worker].get() >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad worker id ", worker));
    }
    from[worker] = std::move(fd);
  }
  const Shard shard = ShardOf(s, config.servers, config.elements);
  const size_t n = shard.end - shard.begin;
  std::vector<float> params(n, 0.5f), grad(n), sum(n);
  for (int step = 0; step < config.warmup + config.steps; ++step) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (ScopedFd& fd : from) {
      if (absl::Status st = RecvAll(
              fd.get(), reinterpret_cast<char*>(grad.data()), shard.bytes());
          !st.ok()) {
        return st;
      }
      for (size_t i = 0; i < n; ++i) sum[i] += grad[i];
    }
    for (size_t i = 0; i < n; ++i) params[i] -= 1e-6f * sum[i];
    for (ScopedFd& fd : from) {
      if (absl::Status st =
              SendAll(fd.get(), reinterpret_cast<const char*>(params.data()),
                      shard.bytes());
          !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Work(const Config& config, int w, const std::vector<int>& ports,
                  const std::string& result_file) {
  std::vector<ScopedFd> to;
  for (int port : ports) {
    absl::StatusOr<ScopedFd> fd = ConnectTcp("127.0.0.1", port, kBufferBytes,
                                             absl::Now() + config.timeout);
    if (!fd.ok()) return fd.status();
    if (absl::Status st = TuneSocket(fd->get(), kBufferBytes, config.timeout);
        !st.ok()) {
      return st;
    }
    const int32_t id = w;
    if (absl::Status st =
            SendAll(fd->get(), reinterpret_cast<const char*>(&id), sizeof(id));
        !st.ok()) {
      return st;
    }
    to.push_back(std::move(*fd));
  }
  std::vector<float> grad(config.elements, 1e-3f), params(config.elements);
  absl::Time start;
  for (int step = 0; step < config.warmup + config.steps; ++step) {
    if (step == config.warmup) start = absl::Now();
    for (int s = 0; s < config.servers; ++s) {
      const Shard shard = ShardOf(s, config.servers, config.elements);
      if (absl::Status st =
              SendAll(to[s].get(),
                      reinterpret_cast<const char*>(grad.data() + shard.begin),
                      shard.bytes());
          !st.ok()) {
        return st;
      }
    }
    for (int s = 0; s < config.servers; ++s) {
      const Shard shard = ShardOf(s, config.servers, config.elements);
      if (absl::Status st = RecvAll(
              to[s].get(), reinterpret_cast<char*>(params.data() + shard.begin),
              shard.bytes());
          !st.ok()) {
        return st;
      }
    }
  }
  const double per_step =
      absl::ToDoubleSeconds(absl::Now() - start) / config.steps;
  return WriteFileAtomically(result_file, absl::StrCat(per_step));
}

// Starts the servers, then the workers, and waits for every worker's
// result; any failure stops the rest (ChildProcess's destructor).
absl::StatusOr<std::vector<double>> RunChildren(const Config& config,
                                                const std::string& scratch) {
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) return absl::ErrnoToStatus(errno, "readlink /proc/self/exe");
  self[length] = '\0';
  const std::vector<std::string> common = {
      absl::StrCat("--servers=", config.servers),
      absl::StrCat("--workers=", config.workers),
      absl::StrCat("--elements=", config.elements),
      absl::StrCat("--steps=", config.steps),
      absl::StrCat("--warmup=", config.warmup),
      absl::StrCat("--timeout_s=", absl::ToInt64Seconds(config.timeout))};
  auto start = [&](const std::string& name, std::vector<std::string> args) {
    args.insert(args.begin(), self);
    args.insert(args.end(), common.begin(), common.end());
    return ChildProcess::Start(name, args,
                               absl::StrCat(scratch, "/", name, ".log"));
  };
  std::vector<std::unique_ptr<ChildProcess>> servers, workers;
  std::vector<std::string> ports;
  for (int s = 0; s < config.servers; ++s) {
    const std::string name = absl::StrCat("server", s);
    const std::string port_file = absl::StrCat(scratch, "/", name, ".port");
    absl::StatusOr<std::unique_ptr<ChildProcess>> server =
        start(name, {"--role=server", absl::StrCat("--index=", s),
                     absl::StrCat("--port_file=", port_file)});
    if (!server.ok()) return server.status();
    absl::StatusOr<int> port =
        (*server)->WaitForPort(port_file, config.timeout);
    if (!port.ok()) return port.status();
    ports.push_back(absl::StrCat(*port));
    servers.push_back(std::move(*server));
  }
  for (int w = 0; w < config.workers; ++w) {
    const std::string name = absl::StrCat("worker", w);
    absl::StatusOr<std::unique_ptr<ChildProcess>> worker = start(
        name, {"--role=worker", absl::StrCat("--index=", w),
               absl::StrCat("--ports=", absl::StrJoin(ports, ",")),
               absl::StrCat("--result_file=", scratch, "/", name, ".result")});
    if (!worker.ok()) return worker.status();
    workers.push_back(std::move(*worker));
  }
  std::vector<double> per_step;
  for (int w = 0; w < config.workers; ++w) {
    // The run's whole budget: its deadline is the guardian's.
    absl::StatusOr<int> code = workers[w]->WaitForExit(10 * config.timeout);
    if (!code.ok()) return code.status();
    double seconds = 0;
    if (*code != 0 ||
        !absl::SimpleAtod(absl::StripAsciiWhitespace(bench::ReadFile(
                              absl::StrCat(scratch, "/worker", w, ".result"))),
                          &seconds)) {
      return absl::InternalError(absl::StrCat(
          "worker ", w, " exited with ", *code, " and no result; its log:\n",
          bench::Tail(workers[w]->Log())));
    }
    per_step.push_back(seconds);
  }
  return per_step;
}

int Run() {
  Config config;
  config.servers = absl::GetFlag(FLAGS_servers);
  config.workers = absl::GetFlag(FLAGS_workers);
  config.elements = absl::GetFlag(FLAGS_elements);
  config.steps = absl::GetFlag(FLAGS_steps);
  config.warmup = absl::GetFlag(FLAGS_warmup);
  const int timeout_s = absl::GetFlag(FLAGS_timeout_s);
  auto at_least = [](const char* flag, int64_t value, int64_t low) {
    return value >= low
               ? absl::OkStatus()
               : absl::InvalidArgumentError(absl::StrCat(
                     "--", flag, " must be >= ", low, ", got ", value));
  };
  ExitOnFlagErrors(
      {at_least("servers", config.servers, 1),
       at_least("workers", config.workers, 1),
       at_least("elements", config.elements, std::max(config.servers, 1)),
       at_least("steps", config.steps, 1), at_least("warmup", config.warmup, 0),
       at_least("timeout_s", timeout_s, 1)});
  config.timeout = absl::Seconds(timeout_s);

  const std::string role = absl::GetFlag(FLAGS_role);
  const int index = absl::GetFlag(FLAGS_index);
  absl::Status done;
  if (role == "server") {
    done = Serve(config, index, absl::GetFlag(FLAGS_port_file));
  } else if (role == "worker") {
    std::vector<int> ports;
    for (const std::string& text : absl::GetFlag(FLAGS_ports)) {
      int port = 0;
      if (!absl::SimpleAtoi(text, &port)) {
        done =
            absl::InvalidArgumentError(absl::StrCat("bad port '", text, "'"));
      }
      ports.push_back(port);
    }
    if (done.ok() && static_cast<int>(ports.size()) != config.servers) {
      done = absl::InvalidArgumentError("--ports must name every server");
    }
    if (done.ok()) {
      done = Work(config, index, ports, absl::GetFlag(FLAGS_result_file));
    }
  } else if (role != "bench") {
    ExitOnFlagErrors({absl::InvalidArgumentError(absl::StrCat(
        "--role must be bench, server or worker, got '", role, "'"))});
  }
  if (role != "bench") {
    if (!done.ok()) {
      std::fprintf(stderr, "sync_floor %s %d: %s\n", role.c_str(), index,
                   done.ToString().c_str());
    }
    return done.ok() ? 0 : 1;
  }

  bench::StartGuardian(10 * config.timeout);
  char scratch_template[] = "/tmp/sync_floor.XXXXXX";
  if (mkdtemp(scratch_template) == nullptr) {
    std::perror("sync_floor: mkdtemp");
    return 1;
  }
  const std::string scratch = scratch_template;
  bench::Leftovers::Get().SetScratchDir(scratch);
  absl::StatusOr<std::vector<double>> per_step = RunChildren(config, scratch);
  bench::Leftovers::Get().RemoveScratch();
  if (!per_step.ok()) {
    std::fprintf(stderr, "sync_floor: %s\n",
                 per_step.status().ToString().c_str());
    return 1;
  }
  std::sort(per_step->begin(), per_step->end());
  const double median_ms = 1e3 * (*per_step)[per_step->size() / 2];
  const double step_bytes = 2.0 * config.workers *
                            static_cast<double>(config.elements) *
                            sizeof(float);
  std::printf(
      "sync_floor: %d servers x %d workers, %lld elements (%.2f MB pushed and "
      "pulled per worker), %d steps: %.3f ms/step (median worker), %.2f GB/s "
      "through loopback\n",
      config.servers, config.workers, static_cast<long long>(config.elements),
      config.elements * sizeof(float) / 1e6, config.steps, median_ms,
      step_bytes / (median_ms * 1e-3) / 1e9);
  std::printf(
      "{\"bench\":\"sync_floor\",\"servers\":%d,\"workers\":%d,"
      "\"elements\":%lld,\"steps\":%d,\"step_ms\":%.4f,\"loopback_gbps\":%.3f}"
      "\n",
      config.servers, config.workers, static_cast<long long>(config.elements),
      config.steps, median_ms, step_bytes / (median_ms * 1e-3) / 1e9);
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "sync_floor [--servers=2] [--workers=2] "
                       "[--elements=235146] [--steps=2000]");
  return pstrain::Run();
}
