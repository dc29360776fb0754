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
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/socket.h"

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

namespace pstrain {
namespace {

constexpr int kBufferBytes = 4 << 20;  // as the data plane's sockets

struct Shard {
  int64_t begin, end;  // elements
  size_t bytes() const { return (end - begin) * sizeof(float); }
};

Shard ShardOf(int s, int servers, int64_t elements) {
  return {elements * s / servers, elements * (s + 1) / servers};
}

// Exits the child with 1 on a failed socket call, after saying why.
void Check(const absl::Status& status, const std::string& who) {
  if (status.ok()) return;
  std::fprintf(stderr, "sync_floor %s: %s\n", who.c_str(),
               status.ToString().c_str());
  _exit(1);
}

void Server(int s, ScopedFd listener, int workers, Shard shard, int steps,
            absl::Duration timeout) {
  const std::string who = absl::StrCat("server ", s);
  // accept() waits at most `timeout` too (SO_RCVTIMEO).
  Check(TuneSocket(listener.get(), kBufferBytes, timeout), who);
  std::vector<ScopedFd> from(workers);
  for (int accepted = 0; accepted < workers; ++accepted) {
    ScopedFd fd(accept(listener.get(), nullptr, nullptr));
    if (fd.get() < 0) Check(SocketError("accept", errno), who);
    Check(TuneSocket(fd.get(), kBufferBytes, timeout), who);
    int32_t worker = -1;
    Check(RecvAll(fd.get(), reinterpret_cast<char*>(&worker), sizeof(worker)),
          who);
    if (worker < 0 || worker >= workers || from[worker].get() >= 0) {
      Check(absl::InvalidArgumentError(absl::StrCat("bad worker id ", worker)),
            who);
    }
    from[worker] = std::move(fd);
  }
  const size_t n = shard.end - shard.begin;
  std::vector<float> params(n, 0.5f), grad(n), sum(n);
  for (int step = 0; step < steps; ++step) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (ScopedFd& fd : from) {
      Check(RecvAll(fd.get(), reinterpret_cast<char*>(grad.data()),
                    shard.bytes()),
            who);
      for (size_t i = 0; i < n; ++i) sum[i] += grad[i];
    }
    for (size_t i = 0; i < n; ++i) params[i] -= 1e-6f * sum[i];
    for (ScopedFd& fd : from) {
      Check(SendAll(fd.get(), reinterpret_cast<const char*>(params.data()),
                    shard.bytes()),
            who);
    }
  }
  _exit(0);
}

// Writes the worker's measured seconds per step to `report`.
void Worker(int w, const std::vector<int>& ports, int64_t elements, int warmup,
            int steps, absl::Duration timeout, int report) {
  const std::string who = absl::StrCat("worker ", w);
  const int servers = static_cast<int>(ports.size());
  std::vector<ScopedFd> to;
  for (int port : ports) {
    absl::StatusOr<ScopedFd> fd =
        ConnectTcp("127.0.0.1", port, kBufferBytes, absl::Now() + timeout);
    Check(fd.status(), who);
    Check(TuneSocket(fd->get(), kBufferBytes, timeout), who);
    const int32_t id = w;
    Check(SendAll(fd->get(), reinterpret_cast<const char*>(&id), sizeof(id)),
          who);
    to.push_back(std::move(*fd));
  }
  std::vector<float> grad(elements, 1e-3f), params(elements);
  absl::Time start;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) start = absl::Now();
    for (int s = 0; s < servers; ++s) {
      const Shard shard = ShardOf(s, servers, elements);
      Check(SendAll(to[s].get(),
                    reinterpret_cast<const char*>(grad.data() + shard.begin),
                    shard.bytes()),
            who);
    }
    for (int s = 0; s < servers; ++s) {
      const Shard shard = ShardOf(s, servers, elements);
      Check(RecvAll(to[s].get(),
                    reinterpret_cast<char*>(params.data() + shard.begin),
                    shard.bytes()),
            who);
    }
  }
  const double per_step = absl::ToDoubleSeconds(absl::Now() - start) / steps;
  // One write of 8 bytes to a pipe is atomic: the workers' reports never
  // interleave.
  if (write(report, &per_step, sizeof(per_step)) != sizeof(per_step)) {
    Check(absl::ErrnoToStatus(errno, "write to the parent"), who);
  }
  _exit(0);
}

int Run() {
  const int servers = absl::GetFlag(FLAGS_servers);
  const int workers = absl::GetFlag(FLAGS_workers);
  const int64_t elements = absl::GetFlag(FLAGS_elements);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int timeout_s = absl::GetFlag(FLAGS_timeout_s);
  auto at_least = [](const char* flag, int64_t value, int64_t low) {
    return value >= low
               ? absl::OkStatus()
               : absl::InvalidArgumentError(absl::StrCat(
                     "--", flag, " must be >= ", low, ", got ", value));
  };
  // Workers report through one pipe, read once they are all done.
  const absl::Status workers_fit =
      workers <= 1024 ? absl::OkStatus()
                      : absl::InvalidArgumentError(absl::StrCat(
                            "--workers must be <= 1024, got ", workers));
  ExitOnFlagErrors({at_least("servers", servers, 1),
                    at_least("workers", workers, 1), workers_fit,
                    at_least("elements", elements, std::max(servers, 1)),
                    at_least("steps", steps, 1), at_least("warmup", warmup, 0),
                    at_least("timeout_s", timeout_s, 1)});
  const absl::Duration timeout = absl::Seconds(timeout_s);

  // Listening before any fork: a worker never races its server's start.
  std::vector<ScopedFd> listeners;
  std::vector<int> ports;
  for (int s = 0; s < servers; ++s) {
    int port = 0;
    absl::StatusOr<ScopedFd> listener =
        ListenTcp("127.0.0.1", 0, kBufferBytes, &port);
    if (!listener.ok()) {
      std::fprintf(stderr, "sync_floor: %s\n",
                   listener.status().ToString().c_str());
      return 1;
    }
    listeners.push_back(std::move(*listener));
    ports.push_back(port);
  }
  int report[2];
  if (pipe(report) != 0) {
    std::perror("sync_floor: pipe");
    return 1;
  }
  std::vector<pid_t> children;
  const pid_t parent = getpid();
  auto spawn = [&](auto body) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);   // never outlive the bench,
      if (getppid() != parent) _exit(1);  // even one gone before prctl
      alarm(10 * timeout_s);              // nor run forever
      body();
    }
    if (pid > 0) children.push_back(pid);
    return pid > 0;
  };
  bool started = true;
  for (int s = 0; s < servers && started; ++s) {
    started = spawn([&, s] {
      // Only its own port: a dead server's port must refuse connections.
      ScopedFd mine = std::move(listeners[s]);
      listeners.clear();
      Server(s, std::move(mine), workers, ShardOf(s, servers, elements),
             warmup + steps, timeout);
    });
  }
  listeners.clear();
  for (int w = 0; w < workers && started; ++w) {
    started = spawn([&, w] {
      Worker(w, ports, elements, warmup, steps, timeout, report[1]);
    });
  }
  close(report[1]);
  // The first child to fail ends the run: the others would only wait on
  // it until their socket timeouts.
  bool ok = started;
  if (!ok) {
    for (pid_t pid : children) kill(pid, SIGKILL);
  }
  for (size_t left = children.size(); left > 0; --left) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      if (ok) {
        for (pid_t other : children) kill(other, SIGKILL);
      }
      ok = false;
    }
  }
  // Every child has exited: their reports are all in the pipe.
  std::vector<double> per_step(workers);
  const size_t want = per_step.size() * sizeof(double);
  const bool read_all = ok && read(report[0], per_step.data(), want) ==
                                  static_cast<ssize_t>(want);
  close(report[0]);
  if (!read_all) {
    std::fprintf(stderr, "sync_floor: %s\n",
                 ok ? "a worker did not report" : "a child failed");
    return 1;
  }
  std::sort(per_step.begin(), per_step.end());
  const double median_ms = 1e3 * per_step[per_step.size() / 2];
  const double step_bytes =
      2.0 * workers * static_cast<double>(elements) * sizeof(float);
  std::printf(
      "sync_floor: %d servers x %d workers, %lld elements (%.2f MB pushed and "
      "pulled per worker), %d steps: %.3f ms/step (median worker), %.2f GB/s "
      "through loopback\n",
      servers, workers, static_cast<long long>(elements),
      elements * sizeof(float) / 1e6, steps, median_ms,
      step_bytes / (median_ms * 1e-3) / 1e9);
  std::printf(
      "{\"bench\":\"sync_floor\",\"servers\":%d,\"workers\":%d,"
      "\"elements\":%lld,\"steps\":%d,\"step_ms\":%.4f,\"loopback_gbps\":%.3f}"
      "\n",
      servers, workers, static_cast<long long>(elements), steps, median_ms,
      step_bytes / (median_ms * 1e-3) / 1e9);
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
