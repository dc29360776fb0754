#include "common/transport/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace pstrain {
namespace {

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

absl::StatusOr<std::string> ReadFile(const std::string& flag,
                                     const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

BioPtr MemoryBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM text; errors name the flag.
absl::StatusOr<X509Ptr> FirstCertificate(const std::string& flag,
                                         const std::string& path,
                                         const std::string& pem) {
  BioPtr bio = MemoryBio(pem);
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", path, ": no PEM certificate in the file"));
  }
  return cert;
}

// Reads a certificate (chain) and its key and checks they belong together.
absl::Status ReadKeyPair(const std::string& cert_flag,
                         const std::string& cert_path,
                         const std::string& key_flag,
                         const std::string& key_path, std::string* cert_pem,
                         std::string* key_pem) {
  if (cert_path.empty() != key_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", cert_flag, " and --", key_flag, " must be given together"));
  }
  absl::StatusOr<std::string> cert_text = ReadFile(cert_flag, cert_path);
  if (!cert_text.ok()) return cert_text.status();
  absl::StatusOr<std::string> key_text = ReadFile(key_flag, key_path);
  if (!key_text.ok()) return key_text.status();
  absl::StatusOr<X509Ptr> cert =
      FirstCertificate(cert_flag, cert_path, *cert_text);
  if (!cert.ok()) return cert.status();
  BioPtr bio = MemoryBio(*key_text);
  KeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", key_flag, "=", key_path,
                     ": no PEM private key in the file (or it is encrypted)"));
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--", key_flag, "=", key_path, " is not the key of --",
                     cert_flag, "=", cert_path));
  }
  *cert_pem = std::move(*cert_text);
  *key_pem = std::move(*key_text);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadCaBundle(const std::string& flag,
                                         const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(flag, path);
  if (!text.ok()) return text.status();
  if (absl::Status s = FirstCertificate(flag, path, *text).status(); !s.ok()) {
    return s;
  }
  return text;
}

// RFC 6125 style: exact (case-insensitive) match, or "*.b.c" matching one
// left-most label.
bool NameMatches(absl::string_view pattern, absl::string_view name) {
  if (absl::EqualsIgnoreCase(pattern, name)) return true;
  if (!absl::StartsWith(pattern, "*.")) return false;
  const size_t dot = name.find('.');
  return dot != absl::string_view::npos && dot > 0 &&
         absl::EqualsIgnoreCase(pattern.substr(1), name.substr(dot));
}

// Checks the server certificate (whose chain gRPC has already verified
// against the roots) names `name_`, whatever address was dialled: what
// GRPC_SSL_TARGET_NAME_OVERRIDE_ARG does, without needing a channel
// argument (the channels are made by PsClient, from credentials alone).
class ServerNameVerifier final
    : public grpc::experimental::ExternalCertificateVerifier {
 public:
  explicit ServerNameVerifier(std::string name) : name_(std::move(name)) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/,
              grpc::Status* sync_status) override {
    bool any_san = false;
    for (const auto& names : {request->dns_names(), request->ip_names()}) {
      for (const grpc::string_ref& san : names) {
        any_san = true;
        if (NameMatches(absl::string_view(san.data(), san.size()), name_)) {
          *sync_status = grpc::Status::OK;
          return true;
        }
      }
    }
    // Only certificates without any name entry fall back to the CN.
    const grpc::string_ref cn = request->common_name();
    if (!any_san &&
        NameMatches(absl::string_view(cn.data(), cn.size()), name_)) {
      *sync_status = grpc::Status::OK;
      return true;
    }
    *sync_status =
        grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                     absl::StrCat("server certificate does not name '", name_,
                                  "' (--tls_server_name)"));
    return true;
  }

  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest*) override {
  }

 private:
  const std::string name_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files) {
  if (files.cert.empty() && files.key.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS "
          "plus client certificates)");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  if (absl::Status s = ReadKeyPair("tls_cert", files.cert, "tls_key", files.key,
                                   &pair.cert_chain, &pair.private_key);
      !s.ok()) {
    return s;
  }
  grpc::SslServerCredentialsOptions options(
      files.client_ca.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> ca =
        ReadCaBundle("tls_client_ca", files.client_ca);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = std::move(*ca);
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MakeChannelCredentials(const ClientTlsFiles& files) {
  if (files.ca.empty() && files.cert.empty() && files.key.empty()) {
    if (!files.server_name.empty()) {
      return absl::InvalidArgumentError(
          "--tls_server_name needs TLS (--tls_ca, or --tls_cert/--tls_key)");
    }
    return std::shared_ptr<grpc::ChannelCredentials>();
  }
  std::string ca, cert, key;
  if (!files.ca.empty()) {
    absl::StatusOr<std::string> bundle = ReadCaBundle("tls_ca", files.ca);
    if (!bundle.ok()) return bundle.status();
    ca = std::move(*bundle);
  }
  if (!files.cert.empty() || !files.key.empty()) {
    if (absl::Status s = ReadKeyPair("tls_cert", files.cert, "tls_key",
                                     files.key, &cert, &key);
        !s.ok()) {
      return s;
    }
  }
  if (files.server_name.empty()) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = std::move(ca);  // empty: the system's roots
    options.pem_private_key = std::move(key);
    options.pem_cert_chain = std::move(cert);
    return grpc::SslCredentials(options);
  }
  // A name other than the dialled host: the TLS credentials API, whose
  // verifier hook replaces the host name check.
  std::vector<grpc::experimental::IdentityKeyCertPair> identity;
  if (!cert.empty()) identity.push_back({std::move(key), std::move(cert)});
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (!ca.empty() || !identity.empty()) {
    options.set_certificate_provider(
        std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
            ca, identity));
  }
  if (!ca.empty()) options.watch_root_certs();
  if (!identity.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_check_call_host(false);
  options.set_certificate_verifier(
      grpc::experimental::ExternalCertificateVerifier::Create<
          ServerNameVerifier>(files.server_name));
  return grpc::experimental::TlsCredentials(options);
}

absl::Status CheckClientAuthUsage(const std::string& flag,
                                  const std::string& cert_path) {
  absl::StatusOr<std::string> text = ReadFile(flag, cert_path);
  if (!text.ok()) return text.status();
  absl::StatusOr<X509Ptr> cert = FirstCertificate(flag, cert_path, *text);
  if (!cert.ok()) return cert.status();
  // Sets the extension flags X509_get_extended_key_usage reads.
  X509_check_purpose(cert->get(), -1, 0);
  if ((X509_get_extension_flags(cert->get()) & EXFLAG_XKUSAGE) != 0 &&
      (X509_get_extended_key_usage(cert->get()) & XKU_SSL_CLIENT) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", cert_path,
        " is not good for client authentication (its extendedKeyUsage lacks "
        "clientAuth), and replicas present it to each other: make it again "
        "with deploy/tls/make_certs.sh, or add clientAuth"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> text = ReadFile("auth_token_file", path);
  if (!text.ok()) return text.status();
  const std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_token_file=", path, ": the file is empty"));
  }
  for (char c : token) {
    if (c <= ' ' || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_token_file=", path,
                       ": the token must be one word of printable characters"));
    }
  }
  return token;
}

}  // namespace pstrain
