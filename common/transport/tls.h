// gRPC credentials from the TLS flags of ps_server and worker, with the files
// checked up front (readable, PEM, key matching its certificate) so that a
// wrong path is one clear start-up error rather than failed handshakes later.
//
//   server: --tls_cert --tls_key [--tls_client_ca: require and verify client
//           certificates signed by it (mutual TLS)]
//   worker: --tls_ca [--tls_cert --tls_key: present a client certificate]
//           [--tls_server_name: expect this name in the servers'
//           certificates instead of the host dialled]
//
// The shared bearer token (--auth_token_file) is separate: it works with or
// without TLS, though without TLS anyone on the path can read it.
#ifndef PSTRAIN_COMMON_TRANSPORT_TLS_H_
#define PSTRAIN_COMMON_TRANSPORT_TLS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pstrain {

struct ServerTlsFiles {
  std::string cert;       // PEM certificate chain of this server
  std::string key;        // PEM private key of `cert`
  std::string client_ca;  // PEM CA bundle; set: clients must present a
                          // certificate it signed
};

// Plaintext (InsecureServerCredentials) when every file is empty.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files);

struct ClientTlsFiles {
  std::string ca;    // PEM CA bundle the servers' certificates must chain to
                     // (empty: the system's roots)
  std::string cert;  // PEM client certificate (mutual TLS), with `key`
  std::string key;
  std::string server_name;  // name checked in the server certificate
                            // (empty: the host of each address)
};

// Null (plaintext, as PsClientOptions::credentials expects) when every field
// is empty; TLS otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const ClientTlsFiles& files);

// Whether the certificate in `cert_path` (--`flag`) may be presented as a
// client's: no extended key usage, or one that includes clientAuth (a
// replica calls the other replicas of its shard with its server
// certificate). InvalidArgument saying what to do otherwise.
absl::Status CheckClientAuthUsage(const std::string& flag,
                                  const std::string& cert_path);

// The token in `path` with surrounding whitespace removed (so a trailing
// newline from `echo` does not matter); "" when `path` is empty. An empty
// file or one with inner whitespace or control characters is an error: the
// token goes into an HTTP/2 header.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_TLS_H_
