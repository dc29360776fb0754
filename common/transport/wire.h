// Zero-copy encoding and decoding of the tensor-carrying messages of
// proto/ps.proto (PushRequest, PullResponse), below the protobuf runtime.
//
// Sending: a WireMessage is the protobuf encoding of a message as a list of
// pieces: small header bytes it owns, and "external" views of tensor memory
// that the caller keeps alive (and unchanged) until the transport is done
// with them. The gRPC glue turns each piece into a slice of one ByteBuffer;
// the concatenation is always a valid protobuf encoding of the message, so
// ParseFromString and standard tools still read it.
//
// Receiving: ParsePushRequest/ParsePullResponse read the message straight
// from the slices it arrived in (ByteBuffer::Dump), cut at arbitrary byte
// boundaries, and return each block's payload as views into those slices.
//
// This file knows nothing of gRPC: input and output are plain byte views, so
// it can be unit-tested and fuzzed on its own.
//
// Encoding conventions (both valid protobuf; chosen to match what protobuf
// itself emits as closely as possible):
//   * The message builders (Encode*) omit proto3 default values: a zero
//     scalar, FLOAT32 dtype, an empty tensor name or an empty payload is not
//     written, exactly as SerializeAsString() would. The low-level Add*
//     calls always write what they are given.
//   * Top-level fields and block fields are written in field-number order,
//     except that a TensorBlock's `data` (4) comes after `version` (5), so
//     the payload is the last piece of its block. Hence a message whose
//     blocks all have version 0 is byte-identical to SerializeAsString().
//
// Decoding conventions:
//   * Protobuf semantics: fields may come in any order; for a scalar or
//     string field seen twice the last one wins; each occurrence of a
//     repeated `blocks` field is one more block; unknown fields (including
//     the reserved numbers) are skipped by wire type; integer fields are
//     truncated from the 64-bit varint as protobuf does (a negative int32 is
//     a 10-byte varint).
//   * Stricter than protobuf, because none of these can come from a correct
//     peer of this protocol (field numbers are never reused): a known field
//     with the wrong wire type, a group (wire types 3/4), a varint longer
//     than 10 bytes or with bits beyond 64, a tag above 32 bits, and field
//     number 0 are all InvalidArgument rather than skipped or tolerated.
//     As in protobuf, a tag or a length longer than 5 bytes is refused.
//     Hence whatever this parser accepts, ParseFromString accepts with the
//     same field values (checked by differential tests and fuzzing), except
//     that protobuf also refuses a tensor name that is not UTF-8, which is
//     not checked here (such a name simply matches no tensor).
//   * `dtype` is kept as the raw enum value, as proto3 open enums are: an
//     unknown value (say 7) parses, and the caller rejects it, which
//     DecodeSegments/WireElementBytes do ("unsupported wire type 7").
//   * Nothing is allocated from a claimed size before it is checked against
//     the bytes actually present, and no byte outside the segments is read,
//     whatever the input.
#ifndef PSTRAIN_COMMON_TRANSPORT_WIRE_H_
#define PSTRAIN_COMMON_TRANSPORT_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/transport/tensor_codec.h"
#include "proto/ps.pb.h"

namespace pstrain {

// The scalar fields of a TensorBlock. `tensor` is copied when encoded.
struct BlockHeader {
  absl::string_view tensor;
  int64_t block = 0;
  DataType dtype = FLOAT32;
  int64_t version = 0;
};

// One block to send: its header, and its payload (already in wire format,
// e.g. from EncodeFromFloat32 or the float32 tensor memory itself), which is
// referenced, not copied.
struct OutgoingBlock {
  BlockHeader header;
  absl::string_view data;
};

// One piece of a WireMessage: `external` when it is a caller's view (tensor
// payload), otherwise bytes owned by the WireMessage.
struct WirePiece {
  absl::string_view bytes;
  bool external = false;
};

// A protobuf encoding built as a sequence of owned and external pieces.
// Adjacent owned bytes are merged into one piece, so a message of n blocks
// has at most 2n + 1 pieces, alternating headers and payloads.
//
// Views returned by Pieces()/TaggedPieces() into owned bytes stay valid until
// the message is next modified or destroyed. Moving the message keeps them
// valid (the owned buffer moves with it, never inline like a short
// std::string's), so a message may be moved into whatever keeps it alive
// after its pieces were handed to the transport.
class WireMessage {
 public:
  // A payload shorter than `inline_below_bytes` is copied into the owned
  // bytes instead of becoming its own piece: for tiny blocks (a bias vector)
  // a copy is cheaper than a slice. 0, the default, never copies.
  explicit WireMessage(size_t inline_below_bytes = 0)
      : inline_below_bytes_(inline_below_bytes) {}

  // Field numbers must be in [1, 2^29 - 1] (checked in debug builds only:
  // they come from this code, not from input).

  // A varint field (int32/int64/uint32/uint64/bool/enum). A negative int32
  // or int64 must be passed sign-extended to 64 bits, as protobuf encodes it:
  // static_cast<uint64_t>(static_cast<int64_t>(v)).
  void AddVarint(int field, uint64_t value);

  // A fixed64 field (double, fixed64): 8 little-endian bytes.
  void AddFixed64(int field, uint64_t value);

  // A length-delimited field (string, bytes, or an encoded submessage),
  // copied into the owned bytes.
  void AddString(int field, absl::string_view value);

  // A bytes field whose tag and length are owned and whose contents are the
  // external view `data` (unless shorter than the inline threshold).
  void AddExternalBytes(int field, absl::string_view data);

  // A TensorBlock submessage as field `field`: tensor (1), block (2),
  // dtype (3) and version (5) as owned bytes, omitting proto3 defaults, then
  // the tag and length of data (4), then `external_data` as the last piece.
  // Empty data is omitted altogether (the proto3 default).
  void AddBlock(int field, const BlockHeader& header,
                absl::string_view external_data);

  // The pieces in order; their concatenation is the encoded message.
  std::vector<absl::string_view> Pieces() const;
  std::vector<WirePiece> TaggedPieces() const;
  size_t num_pieces() const { return pieces_.size(); }

  // The length of the encoded message (the sum of all piece sizes).
  size_t ByteSize() const { return byte_size_; }

  // The encoded message as one string (a copy: tests and debugging).
  std::string Flatten() const;

  // Empties the message, keeping the owned buffer's capacity for reuse.
  void Clear();

  // Reserves room for `bytes` owned (header) bytes.
  void ReserveOwned(size_t bytes) { arena_.reserve(bytes); }

 private:
  // An owned piece is arena_[offset, offset + size); an external one is
  // `external`. Owned bytes are addressed by offset because arena_
  // reallocates when it grows.
  struct Piece {
    bool owned;
    size_t offset;
    size_t size;
    absl::string_view external;
  };

  void AppendOwned(const char* data, size_t size);
  // Records that arena_ grew from `old_size` to its current size.
  void OwnedAppended(size_t old_size);
  void AppendExternal(absl::string_view data);
  void AppendTag(int field, int wire_type);
  void AppendVarint(uint64_t value);

  std::vector<char> arena_;
  std::vector<Piece> pieces_;
  size_t byte_size_ = 0;
  size_t inline_below_bytes_ = 0;
};

// What a push carries beside its blocks (PushRequest fields 6 to 8): the
// param groups' rates and momentums, and a clipped step's max norm.
struct PushExtras {
  absl::Span<const double> group_lr;
  absl::Span<const double> group_momentum;
  double clip_max_norm = 0;
};

// A PushRequest: protocol_version (1), worker_id (2), step (3), then one
// TensorBlock per entry of `blocks` as field 5, in order, then `extras`:
// group_lr (6) and group_momentum (7) packed when not empty, clip_max_norm
// (8) when not 0.
WireMessage EncodePushRequest(uint32_t protocol_version, int32_t worker_id,
                              int64_t step,
                              absl::Span<const OutgoingBlock> blocks,
                              size_t inline_below_bytes = 0,
                              const PushExtras& extras = {});

// A PullResponse: one TensorBlock per entry of `blocks` as field 2.
WireMessage EncodePullResponse(absl::Span<const OutgoingBlock> blocks,
                               size_t inline_below_bytes = 0);

// A decoded TensorBlock. `data` views the input segments (no copy): it is
// valid as long as they are. `data_size` is the sum of its sizes.
struct WireBlock {
  std::string tensor;
  int64_t block = 0;
  DataType dtype = FLOAT32;  // raw value: may be outside DataType's values
  int64_t version = 0;
  ByteSegments data;
  size_t data_size = 0;
};

struct WirePushRequest {
  uint32_t protocol_version = 0;
  int32_t worker_id = 0;
  int64_t step = 0;
  std::vector<WireBlock> blocks;
  // Each param group's current rate and momentum (PushRequest.group_lr,
  // group_momentum), packed or not on the wire as protobuf allows.
  std::vector<double> group_lr;
  std::vector<double> group_momentum;
  double clip_max_norm = 0;  // PushRequest.clip_max_norm
};

struct WirePullResponse {
  std::vector<WireBlock> blocks;
};

// Parse the encoding given as consecutive segments (any boundaries, empty
// segments allowed). Malformed input is InvalidArgument naming the message,
// the block, the field and the byte offset, e.g.
//   "PushRequest: blocks[2]: field 4 length 1000 exceeds remaining 12 bytes
//    (tag at byte 57)".
absl::StatusOr<WirePushRequest> ParsePushRequest(
    absl::Span<const absl::string_view> segments);
absl::StatusOr<WirePullResponse> ParsePullResponse(
    absl::Span<const absl::string_view> segments);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_WIRE_H_
