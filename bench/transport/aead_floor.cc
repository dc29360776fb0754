// The floor under the TLS data plane (issue 25): what a round trip of N
// bytes each way costs over loopback TCP when both ends seal and open every
// byte with AES-128-GCM (OpenSSL EVP, 16 KiB records, as TLS 1.3 does),
// against the same round trip in plaintext, in one run. No framing, no
// handshake, no parameter server: records are sealed as they are sent and
// opened as they arrive, so the four cipher passes of a PushPull (client
// seal, server open, server seal, client open) overlap as well as a record
// layer can. Split over --connections, each with a client and a server
// thread of its own, as the data plane spreads block groups over its
// connections.
//
//   aead_floor --sizes=1048576,4194304,16777216 --connections=1,4
//       --seconds=1 --repeats=5 [--batch_records=16]
//
// Prints, per size and connection count, the median round trip in
// microseconds and goodput (2N per round trip) for plaintext and AES-GCM,
// and their ratio, plus the process CPU seconds per round trip.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"

namespace {

constexpr size_t kRecord = 16 << 10;
constexpr size_t kTag = 16;

void Die(const char* what) {
  std::perror(what);
  std::exit(1);
}

void SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n <= 0) Die("send");
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void RecvAll(int fd, char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = recv(fd, data, size, 0);
    if (n <= 0) Die("recv");
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// One direction's cipher state, as a TLS record layer keeps it: the key
// schedule is set up once, and each record only sets its IV (the record
// counter).
class Aead {
 public:
  Aead() : ctx_(EVP_CIPHER_CTX_new()) {
    std::memset(key_, 7, sizeof(key_));
    std::memset(iv_, 9, sizeof(iv_));
  }
  ~Aead() { EVP_CIPHER_CTX_free(ctx_); }
  // Seals `size` bytes of `in` into out (size + kTag bytes).
  void Seal(const char* in, size_t size, char* out) {
    if (!keyed_) {
      EVP_EncryptInit_ex(ctx_, EVP_aes_128_gcm(), nullptr, key_, nullptr);
      keyed_ = true;
    }
    int len = 0;
    EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, NextIv());
    EVP_EncryptUpdate(ctx_, reinterpret_cast<unsigned char*>(out), &len,
                      reinterpret_cast<const unsigned char*>(in),
                      static_cast<int>(size));
    EVP_EncryptFinal_ex(ctx_, reinterpret_cast<unsigned char*>(out) + len,
                        &len);
    EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, kTag, out + size);
  }
  // Opens a sealed record of `size` plaintext bytes into out.
  void Open(const char* in, size_t size, char* out) {
    if (!keyed_) {
      EVP_DecryptInit_ex(ctx_, EVP_aes_128_gcm(), nullptr, key_, nullptr);
      keyed_ = true;
    }
    int len = 0;
    EVP_DecryptInit_ex(ctx_, nullptr, nullptr, nullptr, NextIv());
    EVP_DecryptUpdate(ctx_, reinterpret_cast<unsigned char*>(out), &len,
                      reinterpret_cast<const unsigned char*>(in),
                      static_cast<int>(size));
    EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_TAG, kTag,
                        const_cast<char*>(in) + size);
    if (EVP_DecryptFinal_ex(ctx_, reinterpret_cast<unsigned char*>(out) + len,
                            &len) != 1) {
      std::fprintf(stderr, "record failed authentication\n");
      std::exit(1);
    }
  }

 private:
  const unsigned char* NextIv() {
    ++counter_;
    std::memcpy(iv_, &counter_, sizeof(counter_));
    return iv_;
  }
  EVP_CIPHER_CTX* ctx_;
  bool keyed_ = false;
  unsigned char key_[16];
  unsigned char iv_[12];
  uint64_t counter_ = 0;
};

// Records go to the socket in batches of this many records (--batch_records;
// the data plane's TLS write buffer holds 16 of them), so a batch travels
// while the next is sealed.
size_t batch_records = 16;

// Sends `size` bytes, sealed record by record when `aead` is set.
void SendMessage(int fd, const char* data, size_t size, Aead* aead,
                 std::vector<char>& scratch) {
  if (aead == nullptr) return SendAll(fd, data, size);
  scratch.resize(batch_records * (kRecord + kTag));
  size_t filled = 0;
  for (size_t at = 0; at < size; at += kRecord) {
    const size_t n = std::min(kRecord, size - at);
    aead->Seal(data + at, n, scratch.data() + filled);
    filled += n + kTag;
    if (filled + kRecord + kTag > scratch.size() || at + n == size) {
      SendAll(fd, scratch.data(), filled);
      filled = 0;
    }
  }
}

// Receives a batch at a time and opens its records straight into `data`.
void RecvMessage(int fd, char* data, size_t size, Aead* aead,
                 std::vector<char>& scratch) {
  if (aead == nullptr) return RecvAll(fd, data, size);
  scratch.resize(batch_records * (kRecord + kTag));
  for (size_t at = 0; at < size;) {
    const size_t records =
        std::min(batch_records, (size - at + kRecord - 1) / kRecord);
    const size_t plain = std::min(records * kRecord, size - at);
    RecvAll(fd, scratch.data(), plain + records * kTag);
    const char* sealed = scratch.data();
    for (size_t done = 0; done < plain; done += kRecord) {
      const size_t n = std::min(kRecord, plain - done);
      aead->Open(sealed, n, data + at + done);
      sealed += n + kTag;
    }
    at += plain;
  }
}

void Tune(int fd) {
  int one = 1;
  int buffer = 8 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
  // No wait without a deadline: a peer that stops answering fails the run
  // (SendAll/RecvAll die on the error) instead of hanging it.
  timeval timeout = {30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
}

// A connected pair of loopback TCP sockets.
void Pair(int* client, int* server) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    Die("listen");
  }
  *client = socket(AF_INET, SOCK_STREAM, 0);
  Tune(*client);
  if (connect(*client, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    Die("connect");
  }
  *server = accept(listener, nullptr, nullptr);
  if (*server < 0) Die("accept");
  Tune(*server);
  close(listener);
}

double CpuSeconds() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
         1e-6 * (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

struct Result {
  double us_per_trip;
  double cpu_us_per_trip;
};

// `trips` round trips of `size` bytes each way, split over `connections`.
Result Run(size_t size, int connections, bool aead, int trips) {
  const size_t share = size / connections;
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<int> clients(connections), servers(connections);
  for (int c = 0; c < connections; ++c) Pair(&clients[c], &servers[c]);
  for (int c = 0; c < connections; ++c) {
    threads.emplace_back([&, c] {  // server: open the push, seal the answer
      Aead in, out;
      std::vector<char> buffer(share), scratch;
      for (int t = 0; t < trips; ++t) {
        RecvMessage(servers[c], buffer.data(), share, aead ? &in : nullptr,
                    scratch);
        SendMessage(servers[c], buffer.data(), share, aead ? &out : nullptr,
                    scratch);
      }
    });
  }
  const double cpu_start = CpuSeconds();
  const auto start = std::chrono::steady_clock::now();
  for (int c = 0; c < connections; ++c) {
    threads.emplace_back([&, c] {  // client: seal the push, open the answer
      Aead out, in;
      std::vector<char> push(share, 1), pull(share), scratch;
      for (int t = 0; t < trips; ++t) {
        SendMessage(clients[c], push.data(), share, aead ? &out : nullptr,
                    scratch);
        RecvMessage(clients[c], pull.data(), share, aead ? &in : nullptr,
                    scratch);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const double cpu = CpuSeconds() - cpu_start;
  for (int c = 0; c < connections; ++c) {
    close(clients[c]);
    close(servers[c]);
  }
  return {1e6 * seconds / trips, 1e6 * cpu / trips};
}

// Positive whole numbers from a flag's comma-separated list; exits 2 naming
// the flag and the value otherwise.
std::vector<long> PositiveList(const char* flag,
                               const std::vector<std::string>& items) {
  std::vector<long> values;
  for (const std::string& item : items) {
    long value = 0;
    if (!absl::SimpleAtoi(item, &value) || value <= 0) {
      std::fprintf(stderr,
                   "aead_floor: --%s must be positive whole numbers, got "
                   "'%s'\n",
                   flag, item.c_str());
      std::exit(2);
    }
    values.push_back(value);
  }
  if (values.empty()) {
    std::fprintf(stderr, "aead_floor: --%s is empty\n", flag);
    std::exit(2);
  }
  return values;
}

}  // namespace

ABSL_FLAG(std::vector<std::string>, sizes,
          (std::vector<std::string>{"1048576", "4194304", "16777216"}),
          "Bytes each way per round trip, comma-separated.");
ABSL_FLAG(std::vector<std::string>, connections,
          (std::vector<std::string>{"1", "4"}),
          "Connection counts to split each round trip over, comma-separated.");
ABSL_FLAG(double, seconds, 1, "About this long per size and count (> 0).");
ABSL_FLAG(int, repeats, 5, "Repeats; medians are printed (>= 1).");
ABSL_FLAG(int, batch_records, 16,
          "Records sealed before each send() (>= 1; the data plane's TLS "
          "write buffer holds 16).");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::vector<long> sizes =
      PositiveList("sizes", absl::GetFlag(FLAGS_sizes));
  const std::vector<long> connections =
      PositiveList("connections", absl::GetFlag(FLAGS_connections));
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (!(seconds > 0) || repeats < 1 || absl::GetFlag(FLAGS_batch_records) < 1) {
    std::fprintf(stderr,
                 "aead_floor: --seconds must be > 0 and --repeats and "
                 "--batch_records >= 1\n");
    return 2;
  }
  batch_records = static_cast<size_t>(absl::GetFlag(FLAGS_batch_records));
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  std::printf(
      "# aead_floor: loopback TCP round trip of N each way, "
      "plaintext vs AES-128-GCM in 16 KiB records on both ends, sent %zu "
      "records at a time\n"
      "# nproc %ld, load average at start %.2f %.2f %.2f; medians of "
      "%d repeats, each ~%.2f s per mode\n",
      batch_records, sysconf(_SC_NPROCESSORS_ONLN), load[0], load[1], load[2],
      repeats, seconds / 2);
  std::printf("%8s %5s | %10s %10s | %8s %8s | %8s | %10s %10s\n", "size",
              "conns", "plain us", "AES us", "plain", "AES", "AES/", "plain",
              "AES");
  std::printf("%8s %5s | %10s %10s | %8s %8s | %8s | %10s %10s\n", "", "",
              "per trip", "per trip", "GB/s", "GB/s", "plain", "CPU us",
              "CPU us");
  for (long size : sizes) {
    for (long c : connections) {
      // Trips for about seconds/2 per mode, from one plaintext trial.
      const Result probe = Run(size, c, false, 3);
      const int trips = std::max<int>(
          5,
          static_cast<int>(0.5e6 * seconds / std::max(probe.us_per_trip, 1.0)));
      std::vector<double> plain, aead, ratio, plain_cpu, aead_cpu;
      for (int r = 0; r < repeats; ++r) {
        const Result p = Run(size, c, false, trips);
        const Result a = Run(size, c, true, trips);
        plain.push_back(p.us_per_trip);
        aead.push_back(a.us_per_trip);
        ratio.push_back(p.us_per_trip / a.us_per_trip);
        plain_cpu.push_back(p.cpu_us_per_trip);
        aead_cpu.push_back(a.cpu_us_per_trip);
      }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      const double pm = median(plain), am = median(aead);
      std::printf(
          "%8ld %5ld | %10.0f %10.0f | %8.3f %8.3f | %8.3f | %10.0f "
          "%10.0f\n",
          size, c, pm, am, 2e-3 * size / pm, 2e-3 * size / am, median(ratio),
          median(plain_cpu), median(aead_cpu));
    }
  }
  getloadavg(load, 3);
  std::printf("# load average at end %.2f %.2f %.2f\n", load[0], load[1],
              load[2]);
  return 0;
}
