#include "common/transport/wire.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

// Protobuf wire types.
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLengthDelimited = 2;
constexpr int kStartGroup = 3;
constexpr int kEndGroup = 4;
constexpr int kFixed32 = 5;

constexpr int kMaxFieldNumber = (1 << 29) - 1;
constexpr int kMaxVarintBytes = 10;
constexpr size_t kMaxVarint32Bytes = 5;  // tags and lengths

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

size_t TagSize(int field) {
  return VarintSize(static_cast<uint64_t>(field) << 3);
}

// Protobuf encodes int32, int64 and enum values as the 64-bit two's
// complement varint, so a negative value takes 10 bytes.
uint64_t SignExtended(int64_t value) { return static_cast<uint64_t>(value); }

const char* WireTypeName(int wire_type) {
  switch (wire_type) {
    case kVarint:
      return "varint";
    case kFixed64:
      return "fixed64";
    case kLengthDelimited:
      return "length-delimited";
    case kStartGroup:
      return "start-group";
    case kEndGroup:
      return "end-group";
    case kFixed32:
      return "fixed32";
    default:
      return "invalid";
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Encoding

void WireMessage::AppendTag(int field, int wire_type) {
  assert(field >= 1 && field <= kMaxFieldNumber);
  AppendVarint((static_cast<uint64_t>(field) << 3) |
               static_cast<uint64_t>(wire_type));
}

void WireMessage::AppendVarint(uint64_t value) {
  char buffer[kMaxVarintBytes];
  size_t n = 0;
  while (value >= 0x80) {
    buffer[n++] = static_cast<char>((value & 0x7f) | 0x80);
    value >>= 7;
  }
  buffer[n++] = static_cast<char>(value);
  AppendOwned(buffer, n);
}

void WireMessage::AppendOwned(const char* data, size_t size) {
  arena_.insert(arena_.end(), data, data + size);
}

void WireMessage::OwnedAppended(size_t old_size) {
  const size_t added = arena_.size() - old_size;
  if (added == 0) return;
  byte_size_ += added;
  if (!pieces_.empty()) {
    Piece& last = pieces_.back();
    if (last.owned && last.offset + last.size == old_size) {
      last.size += added;
      return;
    }
  }
  pieces_.push_back(Piece{/*owned=*/true, old_size, added, {}});
}

void WireMessage::AppendExternal(absl::string_view data) {
  if (data.empty()) return;  // a zero-length slice would only cost
  if (data.size() < inline_below_bytes_) {
    const size_t old_size = arena_.size();
    AppendOwned(data.data(), data.size());
    OwnedAppended(old_size);
    return;
  }
  byte_size_ += data.size();
  pieces_.push_back(Piece{/*owned=*/false, 0, data.size(), data});
}

void WireMessage::AddVarint(int field, uint64_t value) {
  const size_t old_size = arena_.size();
  AppendTag(field, kVarint);
  AppendVarint(value);
  OwnedAppended(old_size);
}

void WireMessage::AddFixed64(int field, uint64_t value) {
  const size_t old_size = arena_.size();
  AppendTag(field, kFixed64);
  char bytes[8];
  for (int b = 0; b < 8; ++b) {
    bytes[b] = static_cast<char>((value >> (8 * b)) & 0xff);
  }
  AppendOwned(bytes, sizeof(bytes));
  OwnedAppended(old_size);
}

void WireMessage::AddString(int field, absl::string_view value) {
  const size_t old_size = arena_.size();
  AppendTag(field, kLengthDelimited);
  AppendVarint(value.size());
  AppendOwned(value.data(), value.size());
  OwnedAppended(old_size);
}

void WireMessage::AddExternalBytes(int field, absl::string_view data) {
  const size_t old_size = arena_.size();
  AppendTag(field, kLengthDelimited);
  AppendVarint(data.size());
  OwnedAppended(old_size);
  AppendExternal(data);
}

void WireMessage::AddBlock(int field, const BlockHeader& header,
                           absl::string_view external_data) {
  const uint64_t block = SignExtended(header.block);
  const uint64_t dtype = SignExtended(static_cast<int32_t>(header.dtype));
  const uint64_t version = SignExtended(header.version);
  // The submessage length comes first on the wire, so size it up front;
  // the fields written below must match these conditions exactly.
  size_t inner = 0;
  if (!header.tensor.empty()) {
    inner += TagSize(TensorBlock::kTensorFieldNumber) +
             VarintSize(header.tensor.size()) + header.tensor.size();
  }
  if (block != 0) {
    inner += TagSize(TensorBlock::kBlockFieldNumber) + VarintSize(block);
  }
  if (dtype != 0) {
    inner += TagSize(TensorBlock::kDtypeFieldNumber) + VarintSize(dtype);
  }
  if (version != 0) {
    inner += TagSize(TensorBlock::kVersionFieldNumber) + VarintSize(version);
  }
  if (!external_data.empty()) {
    inner += TagSize(TensorBlock::kDataFieldNumber) +
             VarintSize(external_data.size()) + external_data.size();
  }

  const size_t old_size = arena_.size();
  AppendTag(field, kLengthDelimited);
  AppendVarint(inner);
  if (!header.tensor.empty()) {
    AppendTag(TensorBlock::kTensorFieldNumber, kLengthDelimited);
    AppendVarint(header.tensor.size());
    AppendOwned(header.tensor.data(), header.tensor.size());
  }
  if (block != 0) {
    AppendTag(TensorBlock::kBlockFieldNumber, kVarint);
    AppendVarint(block);
  }
  if (dtype != 0) {
    AppendTag(TensorBlock::kDtypeFieldNumber, kVarint);
    AppendVarint(dtype);
  }
  if (version != 0) {
    AppendTag(TensorBlock::kVersionFieldNumber, kVarint);
    AppendVarint(version);
  }
  if (!external_data.empty()) {
    // Last, so the payload can be its own piece.
    AppendTag(TensorBlock::kDataFieldNumber, kLengthDelimited);
    AppendVarint(external_data.size());
  }
  OwnedAppended(old_size);
  AppendExternal(external_data);
}

std::vector<absl::string_view> WireMessage::Pieces() const {
  std::vector<absl::string_view> out;
  out.reserve(pieces_.size());
  for (const Piece& piece : pieces_) {
    out.push_back(piece.owned ? absl::string_view(arena_.data() + piece.offset,
                                                  piece.size)
                              : piece.external);
  }
  return out;
}

std::vector<WirePiece> WireMessage::TaggedPieces() const {
  std::vector<WirePiece> out;
  out.reserve(pieces_.size());
  for (const Piece& piece : pieces_) {
    if (piece.owned) {
      out.push_back(
          WirePiece{absl::string_view(arena_.data() + piece.offset, piece.size),
                    /*external=*/false});
    } else {
      out.push_back(WirePiece{piece.external, /*external=*/true});
    }
  }
  return out;
}

std::string WireMessage::Flatten() const {
  std::string out;
  out.reserve(byte_size_);
  for (const absl::string_view piece : Pieces()) {
    out.append(piece.data(), piece.size());
  }
  return out;
}

void WireMessage::Clear() {
  arena_.clear();
  pieces_.clear();
  byte_size_ = 0;
}

namespace {

void AddBlocks(int field, absl::Span<const OutgoingBlock> blocks,
               WireMessage* message) {
  for (const OutgoingBlock& block : blocks) {
    message->AddBlock(field, block.header, block.data);
  }
}

// Owned bytes per block: tags, lengths and scalars fit in 48 bytes.
size_t OwnedEstimate(absl::Span<const OutgoingBlock> blocks) {
  size_t bytes = 32;
  for (const OutgoingBlock& block : blocks) {
    bytes += 48 + block.header.tensor.size();
  }
  return bytes;
}

}  // namespace

namespace {

// A repeated double as protobuf packs it: one length-delimited run of
// little-endian fixed64s; nothing when empty.
void AddPackedDoubles(int field, absl::Span<const double> values,
                      WireMessage* message) {
  if (values.empty()) return;
  std::string packed(values.size() * sizeof(double), '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    uint64_t bits;
    std::memcpy(&bits, &values[i], sizeof(bits));
    for (int b = 0; b < 8; ++b) {
      packed[i * 8 + b] = static_cast<char>((bits >> (8 * b)) & 0xff);
    }
  }
  message->AddString(field, packed);
}

}  // namespace

WireMessage EncodePushRequest(uint32_t protocol_version, int32_t worker_id,
                              int64_t step,
                              absl::Span<const OutgoingBlock> blocks,
                              size_t inline_below_bytes,
                              const PushExtras& extras) {
  WireMessage message(inline_below_bytes);
  message.ReserveOwned(OwnedEstimate(blocks));
  if (protocol_version != 0) {
    message.AddVarint(PushRequest::kProtocolVersionFieldNumber,
                      protocol_version);
  }
  if (worker_id != 0) {
    message.AddVarint(PushRequest::kWorkerIdFieldNumber,
                      SignExtended(worker_id));
  }
  if (step != 0) {
    message.AddVarint(PushRequest::kStepFieldNumber, SignExtended(step));
  }
  AddBlocks(PushRequest::kBlocksFieldNumber, blocks, &message);
  AddPackedDoubles(PushRequest::kGroupLrFieldNumber, extras.group_lr, &message);
  AddPackedDoubles(PushRequest::kGroupMomentumFieldNumber,
                   extras.group_momentum, &message);
  if (extras.clip_max_norm != 0) {
    uint64_t bits;
    std::memcpy(&bits, &extras.clip_max_norm, sizeof(bits));
    message.AddFixed64(PushRequest::kClipMaxNormFieldNumber, bits);
  }
  return message;
}

WireMessage EncodePullResponse(absl::Span<const OutgoingBlock> blocks,
                               size_t inline_below_bytes) {
  WireMessage message(inline_below_bytes);
  message.ReserveOwned(OwnedEstimate(blocks));
  AddBlocks(PullResponse::kBlocksFieldNumber, blocks, &message);
  return message;
}

// ---------------------------------------------------------------------------
// Decoding

namespace {

// Reads protobuf primitives from a byte string given as segments, never past
// a limit (the end of the input, or of the submessage being read). Every
// read checks the bytes left first, so no input can make it read outside
// the segments. Positions in messages are absolute byte offsets.
class SegmentReader {
 public:
  explicit SegmentReader(absl::Span<const absl::string_view> segments)
      : segments_(segments) {
    for (const absl::string_view segment : segments) limit_ += segment.size();
  }

  size_t position() const { return position_; }
  size_t remaining() const { return limit_ - position_; }
  bool AtLimit() const { return position_ == limit_; }

  // Narrows the readable range to the next `length` bytes (which the caller
  // has checked are there) and returns the previous limit for PopLimit.
  size_t PushLimit(size_t length) {
    const size_t old_limit = limit_;
    limit_ = position_ + length;
    return old_limit;
  }
  void PopLimit(size_t old_limit) { limit_ = old_limit; }

  absl::Status ReadVarint(uint64_t* value) {
    const size_t start = position_;
    uint64_t result = 0;
    for (int i = 0; i < kMaxVarintBytes; ++i) {
      if (AtLimit()) {
        return absl::InvalidArgumentError(
            absl::StrCat("truncated varint at byte ", start));
      }
      const uint8_t byte = NextByte();
      // The tenth byte holds bit 63 only: anything more is not a 64-bit
      // value (and a continuation bit would make it an 11th byte).
      if (i == kMaxVarintBytes - 1 && byte > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("varint at byte ", start, " exceeds 64 bits"));
      }
      result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) {
        *value = result;
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(  // unreachable: byte > 1 above
        absl::StrCat("varint at byte ", start, " exceeds 64 bits"));
  }

  // The following take a byte count the caller has checked against
  // remaining().
  void Skip(size_t n) {
    while (n > 0) {
      SkipEmpty();
      const size_t take = std::min(n, segments_[segment_].size() - offset_);
      Advance(take);
      n -= take;
    }
  }

  // Appends views of the next n bytes to *out.
  void ReadSegments(size_t n, ByteSegments* out) {
    while (n > 0) {
      SkipEmpty();
      const size_t take = std::min(n, segments_[segment_].size() - offset_);
      out->push_back(segments_[segment_].substr(offset_, take));
      Advance(take);
      n -= take;
    }
  }

  // Replaces *out with a copy of the next n bytes.
  void ReadString(size_t n, std::string* out) {
    out->clear();
    out->reserve(n);
    while (n > 0) {
      SkipEmpty();
      const size_t take = std::min(n, segments_[segment_].size() - offset_);
      out->append(segments_[segment_].data() + offset_, take);
      Advance(take);
      n -= take;
    }
  }

 private:
  // Moves past exhausted and empty segments. Only called with bytes left
  // before the limit, so a non-empty segment is always found.
  void SkipEmpty() {
    while (offset_ == segments_[segment_].size()) {
      ++segment_;
      offset_ = 0;
    }
  }

  uint8_t NextByte() {
    SkipEmpty();
    const uint8_t byte = static_cast<uint8_t>(segments_[segment_][offset_]);
    Advance(1);
    return byte;
  }

  void Advance(size_t n) {
    offset_ += n;
    position_ += n;
  }

  absl::Span<const absl::string_view> segments_;
  size_t segment_ = 0;   // the segment holding position_ (or one before)
  size_t offset_ = 0;    // position_'s offset in segments_[segment_]
  size_t position_ = 0;  // absolute offset in the whole input
  size_t limit_ = 0;     // absolute end of the readable range
};

// One field's tag, as read.
struct Tag {
  int field = 0;
  int wire_type = 0;
  size_t position = 0;  // of the tag's first byte
};

absl::Status ReadTag(SegmentReader& reader, Tag* tag) {
  tag->position = reader.position();
  uint64_t value;
  absl::Status status = reader.ReadVarint(&value);
  if (!status.ok()) return status;
  // Protobuf reads a tag as at most 5 bytes (a padded one is refused), tags
  // are 32-bit, and field number 0 is invalid.
  if (reader.position() - tag->position > kMaxVarint32Bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tag at byte ", tag->position, " is longer than 5 bytes"));
  }
  if (value > 0xffffffffu || (value >> 3) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid tag ", value, " at byte ", tag->position));
  }
  tag->field = static_cast<int>(value >> 3);
  tag->wire_type = static_cast<int>(value & 7);
  if (tag->wire_type == kStartGroup || tag->wire_type == kEndGroup) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", tag->field, " at byte ", tag->position,
                     " is a group (wire type ", tag->wire_type,
                     "), which is not supported"));
  }
  if (tag->wire_type > kFixed32) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", tag->field, " at byte ", tag->position,
                     " has invalid wire type ", tag->wire_type));
  }
  return absl::OkStatus();
}

// Known fields must arrive with the wire type of their declaration.
absl::Status ExpectWireType(const Tag& tag, int wire_type,
                            absl::string_view name) {
  if (tag.wire_type == wire_type) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "field ", tag.field, " (", name, ") at byte ", tag.position,
      " has wire type ", tag.wire_type, " (", WireTypeName(tag.wire_type),
      "), expected ", wire_type, " (", WireTypeName(wire_type), ")"));
}

// Reads the length of a length-delimited field and checks that many bytes
// are left.
absl::Status ReadLength(SegmentReader& reader, const Tag& tag, size_t* length) {
  const size_t start = reader.position();
  uint64_t value;
  absl::Status status = reader.ReadVarint(&value);
  if (!status.ok()) return status;
  // Like tags, protobuf reads lengths as at most 5 bytes.
  if (reader.position() - start > kMaxVarint32Bytes) {
    return absl::InvalidArgumentError(absl::StrCat("field ", tag.field,
                                                   " length at byte ", start,
                                                   " is longer than 5 bytes"));
  }
  if (value > reader.remaining()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field ", tag.field, " length ", value, " exceeds remaining ",
        reader.remaining(), " bytes (tag at byte ", tag.position, ")"));
  }
  *length = static_cast<size_t>(value);
  return absl::OkStatus();
}

absl::Status SkipField(SegmentReader& reader, const Tag& tag) {
  switch (tag.wire_type) {
    case kVarint: {
      uint64_t ignored;
      return reader.ReadVarint(&ignored);
    }
    case kLengthDelimited: {
      size_t length;
      absl::Status status = ReadLength(reader, tag, &length);
      if (!status.ok()) return status;
      reader.Skip(length);
      return absl::OkStatus();
    }
    case kFixed64:
    case kFixed32: {
      const size_t size = tag.wire_type == kFixed64 ? 8 : 4;
      if (reader.remaining() < size) {
        return absl::InvalidArgumentError(
            absl::StrCat("truncated ", WireTypeName(tag.wire_type), " field ",
                         tag.field, " at byte ", tag.position, ": ",
                         reader.remaining(), " bytes remain"));
      }
      reader.Skip(size);
      return absl::OkStatus();
    }
    default:  // ReadTag refused every other wire type
      return absl::InternalError("unexpected wire type");
  }
}

// Reads a varint field's value after checking its wire type.
absl::Status ReadVarintField(SegmentReader& reader, const Tag& tag,
                             absl::string_view name, uint64_t* value) {
  absl::Status status = ExpectWireType(tag, kVarint, name);
  if (!status.ok()) return status;
  return reader.ReadVarint(value);
}

// Parses the fields of a TensorBlock up to the reader's limit.
absl::Status ParseBlockFields(SegmentReader& reader, WireBlock* block) {
  while (!reader.AtLimit()) {
    Tag tag;
    absl::Status status = ReadTag(reader, &tag);
    if (!status.ok()) return status;
    uint64_t value = 0;
    size_t length = 0;
    switch (tag.field) {
      case TensorBlock::kTensorFieldNumber:
        status = ExpectWireType(tag, kLengthDelimited, "tensor");
        if (status.ok()) status = ReadLength(reader, tag, &length);
        if (status.ok()) reader.ReadString(length, &block->tensor);
        break;
      case TensorBlock::kBlockFieldNumber:
        status = ReadVarintField(reader, tag, "block", &value);
        block->block = static_cast<int64_t>(value);
        break;
      case TensorBlock::kDtypeFieldNumber:
        // Enums are int32 on the wire, kept as received (open enum).
        status = ReadVarintField(reader, tag, "dtype", &value);
        block->dtype = static_cast<DataType>(static_cast<int32_t>(value));
        break;
      case TensorBlock::kDataFieldNumber:
        status = ExpectWireType(tag, kLengthDelimited, "data");
        if (status.ok()) status = ReadLength(reader, tag, &length);
        if (status.ok()) {
          block->data.clear();  // last one wins, as in protobuf
          reader.ReadSegments(length, &block->data);
          block->data_size = length;
        }
        break;
      case TensorBlock::kVersionFieldNumber:
        status = ReadVarintField(reader, tag, "version", &value);
        block->version = static_cast<int64_t>(value);
        break;
      default:
        status = SkipField(reader, tag);
        break;
    }
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// Parses one length-delimited TensorBlock occurrence and appends it.
absl::Status ParseBlock(SegmentReader& reader, const Tag& tag,
                        std::vector<WireBlock>* blocks) {
  absl::Status status = ExpectWireType(tag, kLengthDelimited, "blocks");
  if (!status.ok()) return status;
  size_t length;
  status = ReadLength(reader, tag, &length);
  if (!status.ok()) return status;
  const size_t index = blocks->size();
  const size_t old_limit = reader.PushLimit(length);
  blocks->emplace_back();
  status = ParseBlockFields(reader, &blocks->back());
  reader.PopLimit(old_limit);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("blocks[", index, "]: ", status.message()));
  }
  return absl::OkStatus();
}

// A repeated double: packed (one length-delimited run of fixed64s) or one
// fixed64 per occurrence, as protobuf accepts either.
absl::Status ParseDoubles(SegmentReader& reader, const Tag& tag,
                          absl::string_view name, std::vector<double>* out) {
  size_t length = 8;
  if (tag.wire_type == kLengthDelimited) {
    absl::Status status = ReadLength(reader, tag, &length);
    if (!status.ok()) return status;
    if (length % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", tag.field, " (", name, ") at byte ", tag.position,
          ": packed length ", length, " is not a multiple of 8"));
    }
  } else if (absl::Status status = ExpectWireType(tag, kFixed64, name);
             !status.ok()) {
    return status;
  } else if (reader.remaining() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncated fixed64 field ", tag.field, " at byte ",
                     tag.position, ": ", reader.remaining(), " bytes remain"));
  }
  std::string bytes;
  reader.ReadString(length, &bytes);
  for (size_t i = 0; i < length; i += 8) {
    uint64_t bits = 0;
    for (int b = 7; b >= 0; --b) {
      bits = (bits << 8) | static_cast<uint8_t>(bytes[i + b]);
    }
    double value;
    std::memcpy(&value, &bits, sizeof(value));
    out->push_back(value);
  }
  return absl::OkStatus();
}

absl::Status WithContext(absl::string_view message, const absl::Status& s) {
  return absl::InvalidArgumentError(absl::StrCat(message, ": ", s.message()));
}

}  // namespace

absl::StatusOr<WirePushRequest> ParsePushRequest(
    absl::Span<const absl::string_view> segments) {
  WirePushRequest request;
  SegmentReader reader(segments);
  while (!reader.AtLimit()) {
    Tag tag;
    absl::Status status = ReadTag(reader, &tag);
    uint64_t value = 0;
    if (status.ok()) {
      switch (tag.field) {
        case PushRequest::kProtocolVersionFieldNumber:
          status = ReadVarintField(reader, tag, "protocol_version", &value);
          request.protocol_version = static_cast<uint32_t>(value);
          break;
        case PushRequest::kWorkerIdFieldNumber:
          status = ReadVarintField(reader, tag, "worker_id", &value);
          request.worker_id = static_cast<int32_t>(value);
          break;
        case PushRequest::kStepFieldNumber:
          status = ReadVarintField(reader, tag, "step", &value);
          request.step = static_cast<int64_t>(value);
          break;
        case PushRequest::kBlocksFieldNumber:
          status = ParseBlock(reader, tag, &request.blocks);
          break;
        case PushRequest::kGroupLrFieldNumber:
          status = ParseDoubles(reader, tag, "group_lr", &request.group_lr);
          break;
        case PushRequest::kGroupMomentumFieldNumber:
          status = ParseDoubles(reader, tag, "group_momentum",
                                &request.group_momentum);
          break;
        case PushRequest::kClipMaxNormFieldNumber: {
          if (tag.wire_type != kFixed64) {
            status = ExpectWireType(tag, kFixed64, "clip_max_norm");
            break;
          }
          std::vector<double> one;
          status = ParseDoubles(reader, tag, "clip_max_norm", &one);
          if (status.ok()) request.clip_max_norm = one.front();
          break;
        }
        default:
          status = SkipField(reader, tag);
          break;
      }
    }
    if (!status.ok()) return WithContext("PushRequest", status);
  }
  return request;
}

absl::StatusOr<WirePullResponse> ParsePullResponse(
    absl::Span<const absl::string_view> segments) {
  WirePullResponse response;
  SegmentReader reader(segments);
  while (!reader.AtLimit()) {
    Tag tag;
    absl::Status status = ReadTag(reader, &tag);
    if (status.ok()) {
      if (tag.field == PullResponse::kBlocksFieldNumber) {
        status = ParseBlock(reader, tag, &response.blocks);
      } else {
        status = SkipField(reader, tag);
      }
    }
    if (!status.ok()) return WithContext("PullResponse", status);
  }
  return response;
}

}  // namespace pstrain
