#include "common/transport/data_plane.h"

#include "absl/strings/str_cat.h"

namespace pstrain {
namespace data_plane {
namespace {

// "PSQ1" and "PSR1" as little-endian words: a stray HTTP/2 preface, TLS
// hello or port scan is refused on its first four bytes.
constexpr uint32_t kRequestMagic = 0x31515350;
constexpr uint32_t kResponseMagic = 0x31525350;

void Store32(uint32_t value, char* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(value >> (8 * i));
}
void Store64(uint64_t value, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(value >> (8 * i));
}
uint32_t Load32(const char* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) {
    value |= static_cast<uint32_t>(static_cast<unsigned char>(in[i]))
             << (8 * i);
  }
  return value;
}
uint64_t Load64(const char* in) {
  return Load32(in) | static_cast<uint64_t>(Load32(in + 4)) << 32;
}

}  // namespace

void EncodeLengthPrefix(uint32_t meta_bytes, char out[kLengthPrefixBytes]) {
  Store32(meta_bytes, out);
}

uint32_t DecodeLengthPrefix(const char in[kLengthPrefixBytes]) {
  return Load32(in);
}

absl::StatusOr<LengthPrefixed> SplitLengthPrefixed(absl::string_view bytes,
                                                   absl::string_view what) {
  if (bytes.size() < kLengthPrefixBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is shorter than its length prefix"));
  }
  const uint32_t head_bytes = Load32(bytes.data());
  bytes.remove_prefix(kLengthPrefixBytes);
  if (head_bytes > bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " says its first part is ", head_bytes,
                     " bytes; only ", bytes.size(), " follow"));
  }
  return LengthPrefixed{bytes.substr(0, head_bytes), bytes.substr(head_bytes)};
}

// Request: magic 0..3, method 4, flags 5 (bit 0: payloads apart),
// reserved 6..7, timeout_ms 8..11, reserved 12..15, body_bytes 16..23.
void EncodeRequestHeader(const RequestHeader& header,
                         char out[kRequestHeaderBytes]) {
  Store32(kRequestMagic, out);
  out[4] = static_cast<char>(header.method);
  out[5] = header.payloads_apart ? 1 : 0;
  out[6] = out[7] = 0;
  Store32(header.timeout_ms, out + 8);
  Store32(0, out + 12);
  Store64(header.body_bytes, out + 16);
}

// Response: magic 0..3, code 4..7, body_bytes 8..15.
void EncodeResponseHeader(const ResponseHeader& header,
                          char out[kResponseHeaderBytes]) {
  Store32(kResponseMagic, out);
  Store32(static_cast<uint32_t>(header.code), out + 4);
  Store64(header.body_bytes, out + 8);
}

bool HasRequestMagic(absl::string_view bytes) {
  return bytes.size() >= 4 && Load32(bytes.data()) == kRequestMagic;
}

absl::StatusOr<RequestHeader> DecodeRequestHeader(
    const char in[kRequestHeaderBytes], uint64_t max_body_bytes) {
  // A TLS record of type handshake (22), version 3.x: a ClientHello.
  if (in[0] == 0x16 && in[1] == 0x03) {
    return absl::InvalidArgumentError(
        "not a data-plane request (bad magic): a TLS client on a plaintext "
        "data port (this server has no --tls_cert)");
  }
  if (Load32(in) != kRequestMagic) {
    return absl::InvalidArgumentError(
        "not a data-plane request (bad magic): is this a gRPC or TLS client "
        "on the data port?");
  }
  const uint8_t method = static_cast<uint8_t>(in[4]);
  if (method < static_cast<uint8_t>(Method::kHello) ||
      method > static_cast<uint8_t>(Method::kForward)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown data-plane method ", method));
  }
  if ((in[5] & ~1) != 0 || in[6] != 0 || in[7] != 0 || Load32(in + 12) != 0) {
    return absl::InvalidArgumentError(
        "reserved bytes of a data-plane request header are not zero");
  }
  RequestHeader header;
  header.method = static_cast<Method>(method);
  header.payloads_apart = in[5] == 1;
  if (header.payloads_apart && header.method != Method::kPull &&
      header.method != Method::kPushPull) {
    return absl::InvalidArgumentError(
        "only a Pull or PushPull can ask for its payloads apart");
  }
  header.timeout_ms = Load32(in + 8);
  header.body_bytes = Load64(in + 16);
  if (header.body_bytes > max_body_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data-plane request of ", header.body_bytes,
        " bytes is over the limit of ", max_body_bytes, " (--max_message_mb)"));
  }
  return header;
}

absl::StatusOr<ResponseHeader> DecodeResponseHeader(
    const char in[kResponseHeaderBytes], uint64_t max_body_bytes) {
  if (Load32(in) != kResponseMagic) {
    return absl::DataLossError("not a data-plane response (bad magic)");
  }
  const uint32_t code = Load32(in + 4);
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::DataLossError(
        absl::StrCat("data-plane response with unknown status code ", code));
  }
  ResponseHeader header;
  header.code = static_cast<absl::StatusCode>(code);
  header.body_bytes = Load64(in + 8);
  if (header.body_bytes > max_body_bytes) {
    return absl::DataLossError(
        absl::StrCat("data-plane response of ", header.body_bytes,
                     " bytes is over the limit of ", max_body_bytes));
  }
  return header;
}

}  // namespace data_plane
}  // namespace pstrain
