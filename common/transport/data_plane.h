// The tensor data plane: Push and Pull of dense blocks over plain TCP,
// beside gRPC, which keeps every other method (registration, heartbeats,
// stats, sparse tables, checkpoints, health).
//
// Why: on loopback with 2 vCPUs, gRPC moved a 4 MiB push+pull at 0.54-0.70x
// of raw TCP even with nothing but the transport in the way (the "gRPC
// floor" in bench/transport); the kernel's per-byte path is the same for
// both, and what gRPC adds is HTTP/2 framing, flow control and thread
// hand-offs. This plane carries the same protobuf encodings as the gRPC
// Push and Pull (common/transport/wire.h), so parsing, validation and
// exactly-once handling are shared; only the framing around them differs.
//
// A connection starts with a Hello (the bearer token, if the servers want
// one); then each request is answered in order by one response:
//
//   request  = RequestHeader (24 bytes) + body
//   response = ResponseHeader (16 bytes) + body
//
// All integers little-endian. A request body is a PushRequest or PullRequest
// encoding; an OK response body is a PushResponse or PullResponse encoding,
// an error's is its message (UTF-8 text). A Pull may ask for its payloads
// apart (RequestHeader.payloads_apart): its OK answer's body is then
//
//   u32 meta_bytes + meta + payload of block 0 + payload of block 1 ...
//
// where meta is a PullResponse whose blocks carry no data, and each payload
// is its block's float32 values, so the client can read them straight into
// the tensor instead of copying them out of a message. After an error the
// connection stays usable unless the error was in the framing itself (bad
// magic, method or size), after which the server closes it.
//
// A PushPull is a Push and then a Pull in one round trip, for a worker
// whose next step needs the model its push completes (ps-lite's
// ZPushPull): the server applies the push and answers the pull as if the
// two had come one after the other on this connection, so a retried
// PushPull is as safe as a retried Push. Its request body is
//
//   u32 push_bytes + PushRequest + PullRequest
//
// and its OK answer is the Pull's (inline, or with payloads apart when the
// header asks), with the PullResponse part (the inline body, or the meta)
// preceded by u32 push_response_bytes + PushResponse. A push the server
// refuses is answered with its error and the pull is not run. An error
// answer may also follow an applied push (the pull failed, e.g. its step
// timed out): a retry then reports that push's blocks as duplicates. A
// server says it takes PushPull in RegisterModelResponse.data_push_pull.
//
// A Forward is one replica's forward to another (ps_server/replication.h):
// a request the primary applied, sent on to a backup before the worker's
// answer. Its body is
//
//   u32 meta_bytes + ReplicateRequest (its request field empty) + request
//
// where request is the worker's request as it came (a PushRequest's
// encoding, not copied into the message); an OK answer's body is a
// ReplicateResponse.
//
// TLS: a server with --tls_cert serves this plane inside TLS 1.3 (common/
// tls_stream.h) with the gRPC port's certificates and client-certificate
// rule, and says so in RegisterModelResponse.data_port_tls; the framing
// inside is the same. A client with TLS credentials uses only a data port
// announced as TLS, a plaintext client only one that is not; otherwise its
// tensors go over gRPC. Servers from before TLS here announce no data port
// when they have TLS, and clients from before it never use the data plane
// with TLS, so mixed versions meet over gRPC.
#ifndef PSTRAIN_COMMON_TRANSPORT_DATA_PLANE_H_
#define PSTRAIN_COMMON_TRANSPORT_DATA_PLANE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain {
namespace data_plane {

enum class Method : uint8_t {
  kHello = 1,
  kPush = 2,
  kPull = 3,
  kPushPull = 4,
  kForward = 5,
};

inline constexpr size_t kRequestHeaderBytes = 24;
inline constexpr size_t kResponseHeaderBytes = 16;

// Socket buffers of both ends: ps_bench's raw TCP baseline uses the same,
// and a 4 MiB tensor then crosses loopback without waiting on the window.
inline constexpr int kSocketBufferBytes = 4 << 20;

// Once a request's first byte is in, each further read of it must make
// progress within this, so a stalled or hostile peer cannot hold a server
// thread mid-frame for long.
inline constexpr int kFrameTimeoutSeconds = 30;

struct RequestHeader {
  Method method = Method::kHello;
  // How long the client waits for the answer (a sync pull waits for its
  // step no longer than this; the server also caps it).
  uint32_t timeout_ms = 0;
  uint64_t body_bytes = 0;
  // Pull only: answer with the payloads after the metadata (see above).
  bool payloads_apart = false;
};

struct ResponseHeader {
  absl::StatusCode code = absl::StatusCode::kOk;
  uint64_t body_bytes = 0;
};

// The u32 length that opens an OK answer with payloads apart (its meta's
// bytes) and the two parts of a PushPull (see above).
inline constexpr size_t kLengthPrefixBytes = 4;
void EncodeLengthPrefix(uint32_t bytes, char out[kLengthPrefixBytes]);
uint32_t DecodeLengthPrefix(const char in[kLengthPrefixBytes]);

// `bytes` as u32 length + head + rest: head and rest, or InvalidArgument
// naming `what` when the length runs past the end.
struct LengthPrefixed {
  absl::string_view head;
  absl::string_view rest;
};
absl::StatusOr<LengthPrefixed> SplitLengthPrefixed(absl::string_view bytes,
                                                   absl::string_view what);

void EncodeRequestHeader(const RequestHeader& header,
                         char out[kRequestHeaderBytes]);
void EncodeResponseHeader(const ResponseHeader& header,
                          char out[kResponseHeaderBytes]);

// Whether `bytes` (at least 4) open with a request header's magic: a
// plaintext data-plane client.
bool HasRequestMagic(absl::string_view bytes);

// InvalidArgument naming what is wrong: not this protocol's magic, an
// unknown method, a reserved byte set, or a body over `max_body_bytes`.
absl::StatusOr<RequestHeader> DecodeRequestHeader(
    const char in[kRequestHeaderBytes], uint64_t max_body_bytes);
// DataLoss for a header no correct server sends.
absl::StatusOr<ResponseHeader> DecodeResponseHeader(
    const char in[kResponseHeaderBytes], uint64_t max_body_bytes);

}  // namespace data_plane
}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_DATA_PLANE_H_
