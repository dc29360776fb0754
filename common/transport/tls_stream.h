// TLS for the tensor data plane (common/transport/data_plane.h), through
// OpenSSL: the same certificate files, CA and mutual-TLS rule as the gRPC port
// (common/transport/tls.h), TLS 1.3 only. A TlsContext is made once per process
// from the flags; a TlsSession is one connection's TLS state over a TCP socket
// it does not own.
//
// Kernel TLS: with `ktls`, OpenSSL 3 (SSL_OP_ENABLE_KTLS) hands the record
// layer to the kernel's `tls` module after the handshake, where the kernel
// has it and supports the cipher; otherwise records stay in user space.
// Either way the bytes on the wire are the same TLS, so the two ends need
// not agree; TlsSession says which one each direction got.
#ifndef PSTRAIN_COMMON_TRANSPORT_TLS_STREAM_H_
#define PSTRAIN_COMMON_TRANSPORT_TLS_STREAM_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/transport/tls.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace pstrain {

class TlsContext {
 public:
  // The server's context: presents --tls_cert/--tls_key and, with
  // --tls_client_ca, requires a client certificate signed by it. The files
  // must name a certificate and key (checked as MakeServerCredentials does).
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForServer(
      const ServerTlsFiles& files, bool ktls);
  // The client's context: verifies servers against --tls_ca (empty: the
  // system's roots) and presents --tls_cert/--tls_key when given. Null when
  // every field is empty (plaintext).
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForClient(
      const ClientTlsFiles& files, bool ktls);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  bool is_server() const { return server_; }
  bool ktls() const { return ktls_; }
  // Client: the name to check in server certificates ("" : the host).
  const std::string& server_name() const { return server_name_; }
  SSL_CTX* ctx() const { return ctx_; }

 private:
  TlsContext(SSL_CTX* ctx, bool server, bool ktls, std::string server_name)
      : ctx_(ctx),
        server_(server),
        ktls_(ktls),
        server_name_(std::move(server_name)) {}
  SSL_CTX* const ctx_;
  const bool server_;
  const bool ktls_;
  const std::string server_name_;
};

class TlsSession {
 public:
  // Runs the handshake on the connected socket `fd` by `deadline` (the
  // socket is non-blocking meanwhile and gets its old flags back). A
  // refused or failed handshake is UNAVAILABLE, a stalled one
  // DEADLINE_EXCEEDED; the message says why (OpenSSL's reason and, for a
  // certificate, the verification error). `peer` names the other end in
  // messages. The client checks the server's certificate for the
  // context's server name, or else `host` (a name or an IP address).
  static absl::StatusOr<std::unique_ptr<TlsSession>> Accept(
      std::shared_ptr<const TlsContext> context, int fd,
      const std::string& peer, absl::Time deadline);
  static absl::StatusOr<std::unique_ptr<TlsSession>> Connect(
      std::shared_ptr<const TlsContext> context, int fd,
      const std::string& host, const std::string& peer, absl::Time deadline);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // Whether the kernel took the record layer of each direction.
  bool ktls_send() const { return ktls_send_; }
  bool ktls_recv() const { return ktls_recv_; }
  // "TLSv1.3 TLS_AES_128_GCM_SHA256, records in user space" or "..., kernel
  // TLS send and receive" / "kernel TLS send, receive in user space".
  std::string Describe() const;

  // One read or write of up to `size` bytes. On a non-blocking socket, 0
  // bytes and *want = POLLIN or POLLOUT mean: wait for that, then call
  // again (a write with the same bytes). On a blocking socket with
  // SO_RCVTIMEO/SO_SNDTIMEO, a timeout is DEADLINE_EXCEEDED. OUT_OF_RANGE:
  // the peer closed; UNAVAILABLE: any other failure (the session is then
  // unusable).
  absl::StatusOr<size_t> Read(char* data, size_t size, short* want);
  absl::StatusOr<size_t> Write(const char* data, size_t size, short* want);
  // Sends what Write left buffered (records are gathered into fewer system
  // calls): true when nothing is left, false with *want = POLLOUT when the
  // socket is full (call again once writable).
  absl::StatusOr<bool> Flush(short* want);

  // Blocking socket: writes every piece in order. Pieces under 16 KiB are
  // gathered into one write, so a small message is one TLS record and one
  // system call rather than one per piece.
  absl::Status WriteAll(absl::Span<const absl::string_view> pieces);
  // Blocking socket: reads exactly `size` bytes. DEADLINE_EXCEEDED when
  // SO_RCVTIMEO passed first; OUT_OF_RANGE when the peer closed.
  absl::Status ReadAll(char* data, size_t size);

 private:
  TlsSession(std::shared_ptr<const TlsContext> context, SSL* ssl,
             std::string peer)
      : context_(std::move(context)), ssl_(ssl), peer_(std::move(peer)) {}
  absl::Status Handshake(int fd, absl::Time deadline);
  absl::Status Failure(absl::string_view what, int result);

  std::shared_ptr<const TlsContext> context_;
  SSL* ssl_;
  const std::string peer_;
  bool ktls_send_ = false;
  bool ktls_recv_ = false;
  std::vector<char> gather_;  // WriteAll's small pieces
};

// Whether this kernel can take TLS records (the `tls` upper-layer protocol
// on a TCP socket); "" when it can, otherwise why not. For the logs: what
// `ktls` will come to on this machine.
std::string KernelTlsUnavailableReason();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_TLS_STREAM_H_
