// delay_proxy: a TCP relay that holds every chunk of bytes for a delay with
// jitter before passing it on, for the netns lab (tests/netns/lab.sh). This
// kernel has no netem, so delay, jitter and the reordering of messages on
// different connections are made here, in user space.
//
//   delay_proxy --listen_host=10.231.7.10 --ports=7000,7001
//               --target_host=127.0.0.1 --delay_ms=20 --jitter_ms=10
//
// Each port is relayed to the same port on --target_host. Bytes of one
// connection keep their order (TCP never shows an application anything
// else): a chunk is released at max(arrival + delay + jitter, the release of
// the chunk before it). Chunks on different connections are delayed
// independently, so with jitter a later message on one connection can
// overtake an earlier one on another (a worker's gRPC call and its data-plane
// frame, or two workers' pushes). --duration_s bounds the proxy's life.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

ABSL_FLAG(std::string, listen_host, "", "Address to accept connections on.");
ABSL_FLAG(std::string, ports, "", "Comma-separated ports to relay.");
ABSL_FLAG(std::string, target_host, "127.0.0.1",
          "Where each port is relayed to (same port).");
ABSL_FLAG(double, delay_ms, 20, "Delay added to every chunk, each way.");
ABSL_FLAG(double, jitter_ms, 0,
          "Uniform jitter in [-jitter, +jitter] added to the delay.");
ABSL_FLAG(double, duration_s, 600, "The proxy exits after this long.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the jitter.");

namespace {

using Clock = std::chrono::steady_clock;

struct Chunk {
  Clock::time_point release;
  std::string bytes;  // empty: the sender closed its side
};

// One direction of a relayed connection: a reader fills the queue, a writer
// drains it at each chunk's release time. The queue is bounded so a slow
// receiver slows the sender, as a real link's buffer would.
class Pipe {
 public:
  Pipe(int from, int to, uint64_t seed) : from_(from), to_(to), rng_(seed) {}

  void Run() {
    std::thread writer([this] { Write(); });
    Read();
    writer.join();
  }

 private:
  static constexpr size_t kMaxQueuedBytes = 8 << 20;

  void Read() {
    const double delay = absl::GetFlag(FLAGS_delay_ms);
    const double jitter = absl::GetFlag(FLAGS_jitter_ms);
    std::uniform_real_distribution<double> noise(-jitter, jitter);
    Clock::time_point last = Clock::now();
    std::vector<char> buffer(256 << 10);
    for (;;) {
      const ssize_t n = read(from_, buffer.data(), buffer.size());
      const double ms = std::max(0.0, delay + noise(rng_));
      Clock::time_point release =
          Clock::now() +
          std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
      if (release < last) release = last;
      last = release;
      std::unique_lock<std::mutex> lock(mu_);
      if (n <= 0) {
        queue_.push_back({release, std::string()});
        cv_.notify_all();
        return;
      }
      cv_.wait(lock,
               [&] { return queued_bytes_ < kMaxQueuedBytes || broken_; });
      if (broken_) return;
      queue_.push_back({release, std::string(buffer.data(), n)});
      queued_bytes_ += n;
      cv_.notify_all();
    }
  }

  void Write() {
    for (;;) {
      Chunk chunk;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        chunk = std::move(queue_.front());
        queue_.pop_front();
        queued_bytes_ -= chunk.bytes.size();
        cv_.notify_all();
      }
      std::this_thread::sleep_until(chunk.release);
      if (chunk.bytes.empty()) {
        shutdown(to_, SHUT_WR);
        return;
      }
      size_t sent = 0;
      while (sent < chunk.bytes.size()) {
        const ssize_t n = send(to_, chunk.bytes.data() + sent,
                               chunk.bytes.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) {
          // The receiver is gone: stop reading too, so both ends close.
          std::lock_guard<std::mutex> lock(mu_);
          broken_ = true;
          shutdown(from_, SHUT_RD);
          cv_.notify_all();
          return;
        }
        sent += n;
      }
    }
  }

  const int from_, to_;
  std::mt19937_64 rng_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk> queue_;
  size_t queued_bytes_ = 0;
  bool broken_ = false;
};

int Connect(const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void Relay(int client, int port, uint64_t seed) {
  const int server = Connect(absl::GetFlag(FLAGS_target_host), port);
  if (server < 0) {
    close(client);
    return;
  }
  for (int fd : {client, server}) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  Pipe up(client, server, seed), down(server, client, seed + 1);
  std::thread up_thread([&] { up.Run(); });
  down.Run();
  up_thread.join();
  close(client);
  close(server);
}

int Listen(const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
      bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 128) != 0) {
    std::fprintf(stderr, "delay_proxy: cannot listen on %s:%d: %m\n",
                 host.c_str(), port);
    std::exit(1);
  }
  return fd;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> ports;
  for (absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_ports), ',', absl::SkipEmpty())) {
    int port;
    if (!absl::SimpleAtoi(p, &port) || port <= 0 || port > 65535) {
      std::fprintf(stderr, "delay_proxy: bad port '%s' in --ports\n",
                   std::string(p).c_str());
      return 2;
    }
    ports.push_back(port);
  }
  if (ports.empty() || absl::GetFlag(FLAGS_listen_host).empty()) {
    std::fprintf(stderr,
                 "delay_proxy: --listen_host and --ports are required\n");
    return 2;
  }
  std::vector<pollfd> listeners;
  for (int port : ports) {
    listeners.push_back(
        {Listen(absl::GetFlag(FLAGS_listen_host), port), POLLIN, 0});
  }
  const Clock::time_point end =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(
                         absl::GetFlag(FLAGS_duration_s) * 1000));
  uint64_t seed = absl::GetFlag(FLAGS_seed);
  while (Clock::now() < end) {
    if (poll(listeners.data(), listeners.size(), 200) <= 0) continue;
    for (size_t i = 0; i < listeners.size(); ++i) {
      if (!(listeners[i].revents & POLLIN)) continue;
      const int client = accept(listeners[i].fd, nullptr, nullptr);
      if (client < 0) continue;
      seed += 2;
      std::thread(Relay, client, ports[i], seed).detach();
    }
  }
  return 0;
}
