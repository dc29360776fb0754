#include "common/transport/connection_check.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

// The HTTP/2 client preface: a plaintext gRPC server answers it with a
// SETTINGS frame; a TLS server takes it for a broken ClientHello and
// answers with an alert or closes.
constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr unsigned char kFrameSettings = 0x04;
constexpr unsigned char kTlsHandshake = 0x16;
constexpr unsigned char kTlsAlert = 0x15;

int Milliseconds(absl::Duration d) {
  return static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// Connects within `timeout`; -1 with `error` set otherwise.
int Connect(const addrinfo& a, absl::Duration timeout, std::string* error) {
  const int fd = socket(
      a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol);
  if (fd < 0) {
    *error = std::strerror(errno);
    return -1;
  }
  if (connect(fd, a.ai_addr, a.ai_addrlen) != 0 && errno != EINPROGRESS) {
    *error = std::strerror(errno);
    close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  if (poll(&p, 1, Milliseconds(timeout)) != 1) {
    *error = "no answer (a firewall, or the wrong address?)";
    close(fd);
    return -1;
  }
  int so_error = 0;
  socklen_t length = sizeof(so_error);
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &length);
  if (so_error != 0) {
    *error = std::strerror(so_error);
    close(fd);
    return -1;
  }
  return fd;
}

// The first bytes the server sends after the preface (empty: it closed or
// said nothing within `timeout`).
std::string FirstBytes(int fd, absl::Duration timeout) {
  if (send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL) < 0) return "";
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, Milliseconds(timeout)) != 1) return "";
  char buffer[16];
  const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
}

}  // namespace

std::string DiagnoseConnection(const std::string& host_port, bool client_tls,
                               absl::Duration timeout) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return absl::StrCat(host_port, ": not host:port");
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = host_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (const int rc =
          getaddrinfo(host.c_str(), port.c_str(), &hints, &addresses);
      rc != 0) {
    return absl::StrCat(host_port, ": cannot resolve ", host, ": ",
                        gai_strerror(rc));
  }
  std::string error = "no address";
  int fd = -1;
  for (addrinfo* a = addresses; a != nullptr && fd < 0; a = a->ai_next) {
    fd = Connect(*a, timeout, &error);
  }
  freeaddrinfo(addresses);
  if (fd < 0) {
    return absl::StrCat(host_port, ": cannot connect: ", error,
                        " (is ps_server running there, on that port?)");
  }
  const std::string answer = FirstBytes(fd, timeout);
  close(fd);
  const bool plaintext_grpc =
      answer.size() >= 4 &&
      static_cast<unsigned char>(answer[3]) == kFrameSettings;
  const bool tls = answer.empty() ||
                   static_cast<unsigned char>(answer[0]) == kTlsAlert ||
                   static_cast<unsigned char>(answer[0]) == kTlsHandshake;
  if (client_tls && plaintext_grpc) {
    return absl::StrCat(host_port,
                        ": the server speaks plaintext gRPC but this client "
                        "dials TLS (drop the --tls_* flags, or start the "
                        "servers with --tls_cert/--tls_key)");
  }
  if (!client_tls && !plaintext_grpc && tls) {
    return absl::StrCat(host_port,
                        ": the server does not answer plaintext gRPC; it "
                        "likely expects TLS (give --tls_ca, and "
                        "--tls_cert/--tls_key if it wants client "
                        "certificates)");
  }
  if (!plaintext_grpc && !tls) {
    return absl::StrCat(host_port,
                        ": something listens there but does not speak gRPC "
                        "(the wrong port?)");
  }
  return "";
}

}  // namespace pstrain
