#include "common/transport/tls_stream.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/transport/socket.h"

#ifndef TCP_ULP
#define TCP_ULP 31
#endif

namespace pstrain {
namespace {

// AES-128-GCM first: the cheapest suite on CPUs with AES instructions and
// one the kernel's tls module takes; the others stay for peers that want
// them. TLS 1.3 suites only: the context refuses older versions.
constexpr char kSuites[] =
    "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
    "TLS_CHACHA20_POLY1305_SHA256";

// OpenSSL reads this much per recv when bytes are waiting, so a large
// answer costs one system call per several records instead of one each.
constexpr long kReadBufferBytes = 128 << 10;

// Gathered pieces are written as one record up to this size.
constexpr size_t kGatherBytes = 16 << 10;

// Records are written to the socket in batches of up to this many bytes.
constexpr long kWriteBufferBytes = 256 << 10;

// OpenSSL's queued errors as "reason; reason", then cleared.
std::string OpenSslErrors() {
  std::vector<std::string> reasons;
  while (const unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    reasons.push_back(reason != nullptr ? reason
                                        : absl::StrCat("OpenSSL error ", e));
  }
  return absl::StrJoin(reasons, "; ");
}

absl::Status ContextError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", OpenSslErrors()));
}

SSL_CTX* NewContext(bool server, bool ktls) {
  SSL_CTX* ctx =
      SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) return nullptr;
  SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(ctx, TLS1_3_VERSION);
  SSL_CTX_set_ciphersuites(ctx, kSuites);
  // A peer that closes without close_notify ends the stream like a plain
  // TCP close: every data-plane frame carries its length, so a truncated
  // one is found by the framing, not by TLS.
  uint64_t options = SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION;
  if (server) options |= SSL_OP_CIPHER_SERVER_PREFERENCE;
  if (ktls) options |= SSL_OP_ENABLE_KTLS;
  SSL_CTX_set_options(ctx, options);
  // Non-blocking writes may return part way and resume from a moved buffer.
  SSL_CTX_set_mode(
      ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, kReadBufferBytes);
  // Links live for the job: no resumption, so no tickets to send or keep.
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  if (server) SSL_CTX_set_num_tickets(ctx, 0);
  return ctx;
}

bool IsIpAddress(const std::string& host) {
  unsigned char buffer[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buffer) == 1 ||
         inet_pton(AF_INET6, host.c_str(), buffer) == 1;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForServer(
    const ServerTlsFiles& files, bool ktls) {
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError(
        "the data plane's TLS needs --tls_cert and --tls_key");
  }
  ERR_clear_error();
  SSL_CTX* ctx = NewContext(/*server=*/true, ktls);
  if (ctx == nullptr) return ContextError("SSL_CTX_new");
  std::shared_ptr<const TlsContext> context(
      new TlsContext(ctx, /*server=*/true, ktls, ""));
  if (SSL_CTX_use_certificate_chain_file(ctx, files.cert.c_str()) != 1) {
    return ContextError(absl::StrCat("--tls_cert=", files.cert));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, files.key.c_str(), SSL_FILETYPE_PEM) !=
          1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    return ContextError(absl::StrCat("--tls_key=", files.key));
  }
  if (!files.client_ca.empty()) {
    STACK_OF(X509_NAME)* names =
        SSL_load_client_CA_file(files.client_ca.c_str());
    if (names == nullptr || SSL_CTX_load_verify_locations(
                                ctx, files.client_ca.c_str(), nullptr) != 1) {
      if (names != nullptr) sk_X509_NAME_pop_free(names, X509_NAME_free);
      return ContextError(absl::StrCat("--tls_client_ca=", files.client_ca));
    }
    SSL_CTX_set_client_CA_list(ctx, names);
    // The gRPC port's rule (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_
    // AND_VERIFY): no certificate, or one the CA did not sign, is refused.
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT,
                       nullptr);
  }
  return context;
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForClient(
    const ClientTlsFiles& files, bool ktls) {
  if (files.ca.empty() && files.cert.empty() && files.key.empty()) {
    return std::shared_ptr<const TlsContext>();
  }
  ERR_clear_error();
  SSL_CTX* ctx = NewContext(/*server=*/false, ktls);
  if (ctx == nullptr) return ContextError("SSL_CTX_new");
  std::shared_ptr<const TlsContext> context(
      new TlsContext(ctx, /*server=*/false, ktls, files.server_name));
  const int loaded = files.ca.empty() ? SSL_CTX_set_default_verify_paths(ctx)
                                      : SSL_CTX_load_verify_locations(
                                            ctx, files.ca.c_str(), nullptr);
  if (loaded != 1) {
    return ContextError(absl::StrCat("--tls_ca=", files.ca));
  }
  if (!files.cert.empty() || !files.key.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, files.cert.c_str()) != 1) {
      return ContextError(absl::StrCat("--tls_cert=", files.cert));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, files.key.c_str(), SSL_FILETYPE_PEM) !=
            1 ||
        SSL_CTX_check_private_key(ctx) != 1) {
      return ContextError(absl::StrCat("--tls_key=", files.key));
    }
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  return context;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

absl::StatusOr<std::unique_ptr<TlsSession>> TlsSession::Accept(
    std::shared_ptr<const TlsContext> context, int fd, const std::string& peer,
    absl::Time deadline) {
  ERR_clear_error();
  SSL* ssl = SSL_new(context->ctx());
  if (ssl == nullptr) return absl::InternalError(OpenSslErrors());
  std::unique_ptr<TlsSession> session(
      new TlsSession(std::move(context), ssl, peer));
  SSL_set_fd(ssl, fd);
  SSL_set_accept_state(ssl);
  if (absl::Status s = session->Handshake(fd, deadline); !s.ok()) return s;
  return session;
}

absl::StatusOr<std::unique_ptr<TlsSession>> TlsSession::Connect(
    std::shared_ptr<const TlsContext> context, int fd, const std::string& host,
    const std::string& peer, absl::Time deadline) {
  ERR_clear_error();
  SSL* ssl = SSL_new(context->ctx());
  if (ssl == nullptr) return absl::InternalError(OpenSslErrors());
  const std::string name =
      context->server_name().empty() ? host : context->server_name();
  std::unique_ptr<TlsSession> session(
      new TlsSession(std::move(context), ssl, peer));
  SSL_set_fd(ssl, fd);
  SSL_set_connect_state(ssl);
  // The name the gRPC channel checks: --tls_server_name, else the host
  // dialled (an IP address must be among the certificate's IP entries).
  if (IsIpAddress(name)) {
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), name.c_str());
  } else {
    SSL_set_tlsext_host_name(ssl, name.c_str());
    SSL_set1_host(ssl, name.c_str());
  }
  if (absl::Status s = session->Handshake(fd, deadline); !s.ok()) return s;
  return session;
}

TlsSession::~TlsSession() { SSL_free(ssl_); }

absl::Status TlsSession::Failure(absl::string_view what, int result) {
  const int error = SSL_get_error(ssl_, result);
  const int saved_errno = errno;
  std::string why = OpenSslErrors();
  const long verify = SSL_get_verify_result(ssl_);
  if (verify != X509_V_OK) {
    absl::StrAppend(&why, why.empty() ? "" : "; ",
                    "certificate: ", X509_verify_cert_error_string(verify));
  }
  if (error == SSL_ERROR_SYSCALL && why.empty()) {
    why = saved_errno != 0 ? std::strerror(saved_errno)
                           : "connection closed by the peer";
  }
  if (error == SSL_ERROR_ZERO_RETURN || (why.empty())) {
    return absl::OutOfRangeError(
        absl::StrCat(what, " with ", peer_, ": connection closed"));
  }
  return absl::UnavailableError(absl::StrCat(what, " with ", peer_, ": ", why));
}

absl::Status TlsSession::Handshake(int fd, absl::Time deadline) {
  const int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  absl::Cleanup restore = [fd, flags] { fcntl(fd, F_SETFL, flags); };
  while (true) {
    ERR_clear_error();
    const int result = SSL_do_handshake(ssl_);
    if (result == 1) break;
    const int error = SSL_get_error(ssl_, result);
    short want;
    if (error == SSL_ERROR_WANT_READ) {
      want = POLLIN;
    } else if (error == SSL_ERROR_WANT_WRITE) {
      want = POLLOUT;
    } else {
      absl::Status failed = Failure("TLS handshake", result);
      // A peer that hung up mid-handshake refused it as well.
      return absl::IsOutOfRange(failed)
                 ? absl::UnavailableError(failed.message())
                 : failed;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "TLS handshake with ", peer_, " not finished by its deadline"));
    }
    pollfd wait = {fd, want, 0};
    const int timeout_ms = static_cast<int>(std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
        INT_MAX));
    if (poll(&wait, 1, timeout_ms) < 0 && errno != EINTR) {
      return SocketError("poll", errno);
    }
  }
  ktls_send_ = BIO_get_ktls_send(SSL_get_wbio(ssl_));
  ktls_recv_ = BIO_get_ktls_recv(SSL_get_rbio(ssl_));
  if (!ktls_send_) {
    // OpenSSL writes each 16 KiB record with its own system call; a
    // buffering BIO in front of the socket gathers records into one write
    // per kWriteBufferBytes (Flush sends the rest). Kernel TLS writes
    // straight to the socket and has no such cost.
    BIO* socket_bio = SSL_get_wbio(ssl_);
    BIO* buffer = BIO_new(BIO_f_buffer());
    if (buffer != nullptr &&
        BIO_set_write_buffer_size(buffer, kWriteBufferBytes) == 1) {
      BIO_up_ref(socket_bio);  // the chain's own reference
      BIO_push(buffer, socket_bio);
      SSL_set0_wbio(ssl_, buffer);
    } else {
      BIO_free(buffer);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> TlsSession::Flush(short* want) {
  *want = 0;
  BIO* wbio = SSL_get_wbio(ssl_);
  if (BIO_wpending(wbio) == 0) return true;
  ERR_clear_error();
  errno = 0;
  if (BIO_flush(wbio) == 1) return true;
  if (BIO_should_retry(wbio)) {
    *want = POLLOUT;
    return false;
  }
  const int error = errno;
  return absl::UnavailableError(
      absl::StrCat("TLS write to ", peer_, ": ",
                   error != 0 ? std::strerror(error) : OpenSslErrors()));
}

std::string TlsSession::Describe() const {
  std::string layer;
  if (ktls_send_ && ktls_recv_) {
    layer = "kernel TLS send and receive";
  } else if (ktls_send_) {
    layer = "kernel TLS send, receive in user space";
  } else if (ktls_recv_) {
    layer = "kernel TLS receive, send in user space";
  } else {
    layer = "records in user space";
  }
  return absl::StrCat(SSL_get_version(ssl_), " ", SSL_get_cipher_name(ssl_),
                      ", ", layer);
}

absl::StatusOr<size_t> TlsSession::Read(char* data, size_t size, short* want) {
  *want = 0;
  ERR_clear_error();
  errno = 0;
  size_t got = 0;
  const int result = SSL_read_ex(ssl_, data, size, &got);
  if (result == 1) return got;
  const int error = SSL_get_error(ssl_, result);
  if (error == SSL_ERROR_WANT_READ) {
    *want = POLLIN;
    return 0;
  }
  if (error == SSL_ERROR_WANT_WRITE) {
    *want = POLLOUT;
    return 0;
  }
  return Failure("TLS read", result);
}

absl::StatusOr<size_t> TlsSession::Write(const char* data, size_t size,
                                         short* want) {
  *want = 0;
  ERR_clear_error();
  errno = 0;
  size_t sent = 0;
  const int result = SSL_write_ex(ssl_, data, size, &sent);
  if (result == 1) return sent;
  const int error = SSL_get_error(ssl_, result);
  if (error == SSL_ERROR_WANT_WRITE) {
    *want = POLLOUT;
    return 0;
  }
  if (error == SSL_ERROR_WANT_READ) {
    *want = POLLIN;
    return 0;
  }
  absl::Status failed = Failure("TLS write", result);
  return absl::IsOutOfRange(failed) ? absl::UnavailableError(failed.message())
                                    : failed;
}

absl::Status TlsSession::WriteAll(absl::Span<const absl::string_view> pieces) {
  auto write_fully = [this](const char* data, size_t size) -> absl::Status {
    while (size > 0) {
      short want;
      absl::StatusOr<size_t> sent = Write(data, size, &want);
      if (!sent.ok()) return sent.status();
      // A blocking socket only wants more when SO_SNDTIMEO passed.
      if (*sent == 0) {
        return absl::DeadlineExceededError(
            absl::StrCat("TLS write to ", peer_, " timed out"));
      }
      data += *sent;
      size -= *sent;
    }
    return absl::OkStatus();
  };
  gather_.clear();
  for (absl::string_view piece : pieces) {
    if (piece.size() < kGatherBytes &&
        gather_.size() + piece.size() <= kGatherBytes) {
      gather_.insert(gather_.end(), piece.begin(), piece.end());
      continue;
    }
    if (!gather_.empty()) {
      if (absl::Status s = write_fully(gather_.data(), gather_.size());
          !s.ok()) {
        return s;
      }
      gather_.clear();
    }
    if (piece.size() < kGatherBytes) {
      gather_.assign(piece.begin(), piece.end());
    } else if (absl::Status s = write_fully(piece.data(), piece.size());
               !s.ok()) {
      return s;
    }
  }
  if (!gather_.empty()) {
    if (absl::Status s = write_fully(gather_.data(), gather_.size()); !s.ok()) {
      return s;
    }
  }
  short want;
  absl::StatusOr<bool> flushed = Flush(&want);
  if (!flushed.ok()) return flushed.status();
  if (!*flushed) {
    return absl::DeadlineExceededError(
        absl::StrCat("TLS write to ", peer_, " timed out"));
  }
  return absl::OkStatus();
}

absl::Status TlsSession::ReadAll(char* data, size_t size) {
  while (size > 0) {
    short want;
    absl::StatusOr<size_t> got = Read(data, size, &want);
    if (!got.ok()) return got.status();
    // A blocking socket only wants more when SO_RCVTIMEO passed.
    if (*got == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("TLS read from ", peer_, " timed out"));
    }
    data += *got;
    size -= *got;
  }
  return absl::OkStatus();
}

std::string KernelTlsUnavailableReason() {
  static const std::string* const reason = [] {
    int port = 0;
    absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0, 0, &port);
    if (!listener.ok()) return new std::string(listener.status().ToString());
    absl::StatusOr<ScopedFd> client =
        ConnectTcp("127.0.0.1", port, 0, absl::Now() + absl::Seconds(2));
    if (!client.ok()) return new std::string(client.status().ToString());
    if (setsockopt(client->get(), IPPROTO_TCP, TCP_ULP, "tls", 3) == 0) {
      return new std::string();
    }
    const int error = errno;
    return new std::string(
        error == ENOENT
            ? "the kernel has no tls module loaded (modprobe tls)"
            : absl::StrCat("setsockopt(TCP_ULP, tls): ", std::strerror(error)));
  }();
  return *reason;
}

}  // namespace pstrain
