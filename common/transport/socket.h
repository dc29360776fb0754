// Plain TCP sockets: an owning descriptor and the few blocking helpers the
// tensor data plane (common/transport/data_plane.h) and the transport benchmark
// share. Every error is an absl::Status: a peer that vanished or a socket error
// is UNAVAILABLE, a timeout (SO_RCVTIMEO/SO_SNDTIMEO or a deadline) is
// DEADLINE_EXCEEDED.
#ifndef PSTRAIN_COMMON_TRANSPORT_SOCKET_H_
#define PSTRAIN_COMMON_TRANSPORT_SOCKET_H_

#include <sys/uio.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace pstrain {

// Owns a file descriptor; closes it when destroyed or reset.
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) : fd_(other.fd_) { other.fd_ = -1; }
  ScopedFd& operator=(ScopedFd&& other);
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset();

 private:
  int fd_;
};

// `what: strerror(error)`, DEADLINE_EXCEEDED for EAGAIN (a socket timeout),
// UNAVAILABLE otherwise.
absl::Status SocketError(absl::string_view what, int error);

// TCP_NODELAY, and SO_SNDBUF/SO_RCVBUF when `buffer_bytes` > 0 (set them
// before connect/listen, so the window scale covers them), and
// SO_SNDTIMEO/SO_RCVTIMEO when `timeout` > 0.
absl::Status TuneSocket(int fd, int buffer_bytes, absl::Duration timeout);

// Bytes received from a stream and not yet taken: one buffer that keeps its
// memory from one message to the next, so reads can take whatever has
// arrived (a header and its body, or the next message's start) in one
// system call.
class ReceiveBuffer {
 public:
  absl::string_view available() const {
    return absl::string_view(data_.get() + begin_, end_ - begin_);
  }
  void Consume(size_t bytes) {
    begin_ += bytes;
    if (begin_ == end_) begin_ = end_ = 0;
  }
  // Room for a message of `bytes` from the front, keeping what has
  // arrived; at least 256 KiB, so small messages are read ahead.
  void MakeRoom(size_t bytes);
  // Where the next bytes go, how many fit, and how many came.
  char* free_begin() { return data_.get() + end_; }
  size_t free_bytes() const { return capacity_ - end_; }
  void Produced(size_t bytes) { end_ += bytes; }

 private:
  std::unique_ptr<char[]> data_;
  size_t capacity_ = 0;
  size_t begin_ = 0;
  size_t end_ = 0;
};

// After a writev/sendmsg of iov[*first..] sent `sent` bytes: moves *first
// past the pieces sent whole and trims the one sent in part.
void ConsumeIovecs(size_t sent, std::vector<iovec>& iov, size_t* first);

// Writes every byte of `pieces`, in order, with as few system calls as the
// kernel allows (writev of up to IOV_MAX pieces). Blocking; MSG_NOSIGNAL, so
// a vanished peer is an error, not SIGPIPE.
absl::Status SendAll(int fd, absl::Span<const absl::string_view> pieces);
absl::Status SendAll(int fd, const char* data, size_t size);

// Reads exactly `size` bytes. OUT_OF_RANGE when the peer closed cleanly
// before the first byte; DATA_LOSS when it closed part way.
absl::Status RecvAll(int fd, char* data, size_t size);

// Whether a connected socket's two ends have the same IP address: a
// connection to this host, through loopback or one of its own addresses.
// False when either end cannot be read.
bool ConnectsToThisHost(int fd);

// A connected, tuned TCP socket to host:port (a name or an address;
// IPv4 or IPv6), given up at `deadline`.
absl::StatusOr<ScopedFd> ConnectTcp(const std::string& host, int port,
                                    int buffer_bytes, absl::Time deadline);

// A listening TCP socket on host:port (port 0: the kernel picks one); the
// port it got is written to *bound_port. Accepted sockets inherit
// `buffer_bytes`.
absl::StatusOr<ScopedFd> ListenTcp(const std::string& host, int port,
                                   int buffer_bytes, int* bound_port);

// Splits "host:port" or "[v6]:port" into its host (brackets removed) and
// port.
absl::Status SplitHostPort(absl::string_view address, std::string* host,
                           int* port);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_SOCKET_H_
