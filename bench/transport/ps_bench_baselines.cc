// ps_bench's baselines (ps_bench.h): (a) raw TCP and (b) the gRPC floor,
// each against a peer that is this binary re-executed in a peer role, so a
// baseline costs what a second process costs on this machine.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "bench/child_process.h"
#include "bench/transport/grpc_floor.h"
#include "bench/transport/ps_bench.h"
#include "common/cli.h"
#include "common/transport/socket.h"
#include "glog/logging.h"

namespace pstrain::bench::ps_bench {
namespace {

// The gRPC floor's message limit: the largest payload (kMaxPayload) and
// room for its framing.
constexpr int kMaxGrpcMessage = (1 << 30) + (1 << 20);

// The header a raw TCP connection starts with (the protocol: ps_bench.h).
struct TcpHeader {
  uint64_t mode;
  uint64_t bytes;
};

sockaddr_in Loopback(int port) {
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  return address;
}

// One accepted connection of the tcp_peer, on its own thread, served until
// the bench closes it.
void ServeTcpConnection(int raw_fd) {
  ScopedFd fd(raw_fd);
  TcpHeader header;
  absl::Status status =
      RecvAll(fd.get(), reinterpret_cast<char*>(&header), sizeof(header));
  if (!status.ok()) return;
  if ((header.mode != kModeEcho && header.mode != kModeAck) ||
      header.bytes == 0 || header.bytes > kMaxPayload) {
    LOG(ERROR) << "bad header: mode " << header.mode << ", " << header.bytes
               << " bytes";
    return;
  }
  std::vector<char> buffer(header.bytes);
  char ack[kAckBytes] = {};
  while (true) {
    status = RecvAll(fd.get(), buffer.data(), buffer.size());
    if (status.ok()) {
      status = header.mode == kModeEcho
                   ? SendAll(fd.get(), buffer.data(), buffer.size())
                   : SendAll(fd.get(), ack, sizeof(ack));
    }
    if (!status.ok()) break;
  }
  if (!absl::IsOutOfRange(status)) LOG(WARNING) << "connection: " << status;
}

}  // namespace

// ---------------------------------------------------------------------------
// Peers.

absl::StatusOr<std::pair<std::unique_ptr<ChildProcess>, int>> StartPeer(
    const std::string& role, const std::string& scratch) {
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) {
    return absl::InternalError(
        absl::StrCat("readlink /proc/self/exe: ", std::strerror(errno)));
  }
  self[length] = '\0';
  const std::string port_file = absl::StrCat(scratch, "/", role, ".port");
  absl::StatusOr<std::unique_ptr<ChildProcess>> peer =
      ChildProcess::Start(role,
                          {self, absl::StrCat("--role=", role),
                           absl::StrCat("--port_file=", port_file),
                           absl::StrCat("--tcp_buffer_bytes=",
                                        absl::GetFlag(FLAGS_tcp_buffer_bytes))},
                          absl::StrCat(scratch, "/", role, ".log"));
  if (!peer.ok()) return peer.status();
  absl::StatusOr<int> port = (*peer)->WaitForPort(port_file, kStartTimeout);
  if (!port.ok()) return port.status();
  return std::make_pair(std::move(*peer), *port);
}

absl::StatusOr<ScopedFd> ConnectTcpPeer(int port, uint64_t mode,
                                        uint64_t bytes) {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return SocketError("socket", errno);
  absl::Status tuned =
      TuneSocket(fd.get(), absl::GetFlag(FLAGS_tcp_buffer_bytes),
                 absl::Seconds(absl::GetFlag(FLAGS_io_timeout_s)));
  if (!tuned.ok()) return tuned;
  const sockaddr_in address = Loopback(port);
  // Bounded by SO_SNDTIMEO; on loopback it succeeds or is refused at once.
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address),
              sizeof(address)) != 0) {
    return SocketError(absl::StrCat("connect 127.0.0.1:", port), errno);
  }
  const TcpHeader header = {mode, bytes};
  absl::Status sent =
      SendAll(fd.get(), reinterpret_cast<const char*>(&header), sizeof(header));
  if (!sent.ok()) return sent;
  return fd;
}

int EffectiveBuffer(int fd, int option) {
  int value = 0;
  socklen_t length = sizeof(value);
  getsockopt(fd, SOL_SOCKET, option, &value, &length);
  return value;
}

int TcpPeerMain() {
  ScopedFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) {
    LOG(ERROR) << SocketError("socket", errno);
    return 1;
  }
  const int one = 1;
  setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // Accepted sockets inherit the buffer sizes set on the listener.
  absl::Status tuned =
      TuneSocket(listener.get(), absl::GetFlag(FLAGS_tcp_buffer_bytes),
                 absl::ZeroDuration());
  sockaddr_in address = Loopback(0);
  socklen_t length = sizeof(address);
  if (!tuned.ok() ||
      bind(listener.get(), reinterpret_cast<sockaddr*>(&address),
           sizeof(address)) != 0 ||
      listen(listener.get(), 64) != 0 ||
      getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address),
                  &length) != 0) {
    LOG(ERROR) << "cannot listen on 127.0.0.1: " << tuned << " "
               << std::strerror(errno);
    return 1;
  }
  absl::Status written =
      WriteFileAtomically(absl::GetFlag(FLAGS_port_file),
                          absl::StrCat(ntohs(address.sin_port), "\n"));
  if (!written.ok()) {
    LOG(ERROR) << written;
    return 1;
  }
  while (true) {
    const int fd = accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      LOG(ERROR) << SocketError("accept", errno);
      return 1;
    }
    const int nodelay = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof(nodelay));
    std::thread(ServeTcpConnection, fd).detach();
  }
}

int GrpcFloorMain() {
  GrpcFloorService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(kMaxGrpcMessage);
  builder.SetMaxSendMessageSize(kMaxGrpcMessage);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port <= 0) {
    LOG(ERROR) << "cannot serve gRPC on 127.0.0.1";
    return 1;
  }
  absl::Status written = WriteFileAtomically(absl::GetFlag(FLAGS_port_file),
                                             absl::StrCat(port, "\n"));
  if (!written.ok()) {
    LOG(ERROR) << written;
    return 1;
  }
  server->Wait();  // until SIGTERM (default action) or the bench's death
  return 0;
}

// ---------------------------------------------------------------------------
// Measurement.

absl::Status MeasureTcp(int port, int clients, SizeResult* out) {
  const int64_t size = out->size;
  std::vector<std::vector<char>> buffers(clients, std::vector<char>(size, 'x'));
  for (uint64_t mode : {kModeEcho, kModeAck}) {
    std::vector<ScopedFd> fds;
    for (int c = 0; c < clients; ++c) {
      absl::StatusOr<ScopedFd> fd = ConnectTcpPeer(port, mode, size);
      if (!fd.ok()) return fd.status();
      fds.push_back(std::move(*fd));
    }
    if (mode == kModeEcho) {
      absl::StatusOr<PhaseResult> result =
          MeasurePhase("tcp push+pull", size, clients, [&](int c) {
            absl::Status sent = SendAll(fds[c].get(), buffers[c].data(), size);
            if (!sent.ok()) return sent;
            return RecvAll(fds[c].get(), buffers[c].data(), size);
          });
      if (!result.ok()) return result.status();
      out->tcp_pushpull = std::move(*result);
    } else {
      absl::StatusOr<PhaseResult> result =
          MeasurePhase("tcp rtt", size, clients, [&](int c) {
            absl::Status sent = SendAll(fds[c].get(), buffers[c].data(), size);
            if (!sent.ok()) return sent;
            char ack[kAckBytes];
            return RecvAll(fds[c].get(), ack, sizeof(ack));
          });
      if (!result.ok()) return result.status();
      out->tcp_rtt = std::move(*result);
    }
  }
  return absl::OkStatus();
}

absl::Status MeasureGrpcFloor(
    const std::vector<std::unique_ptr<GrpcFloorClient>>& clients,
    SizeResult* out) {
  const int64_t size = out->size;
  std::vector<std::vector<char>> tensors(clients.size(),
                                         std::vector<char>(size, 'g'));
  absl::StatusOr<PhaseResult> result = MeasurePhase(
      "grpc floor p+p", size, static_cast<int>(clients.size()), [&](int c) {
        absl::Status pushed = clients[c]->Push(tensors[c]);
        return pushed.ok() ? clients[c]->Pull(absl::MakeSpan(tensors[c]))
                           : pushed;
      });
  if (!result.ok()) return result.status();
  out->grpc_floor = std::move(*result);
  return absl::OkStatus();
}

}  // namespace pstrain::bench::ps_bench
