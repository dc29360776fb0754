#include "common/transport/wire.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/transport/tensor_codec.h"
#include "google/protobuf/stubs/logging.h"
#include "gtest/gtest.h"
#include "proto/ps.pb.h"

namespace pstrain {
namespace {

// --- helpers ---------------------------------------------------------------

// Raw protobuf bytes, written by hand so tests can build what no encoder
// here would: unknown fields, duplicates, malformed input.
void PutVarint(std::string* out, uint64_t value) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void PutTag(std::string* out, int field, int wire_type) {
  PutVarint(out, (static_cast<uint64_t>(field) << 3) | wire_type);
}

void PutBytes(std::string* out, int field, absl::string_view bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

std::string Varint(uint64_t value) {
  std::string out;
  PutVarint(&out, value);
  return out;
}

// Cuts `bytes` at the given offsets (sorted; repeats make empty segments).
std::vector<absl::string_view> SplitAt(absl::string_view bytes,
                                       std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<absl::string_view> out;
  size_t start = 0;
  for (size_t cut : cuts) {
    out.push_back(bytes.substr(start, cut - start));
    start = cut;
  }
  out.push_back(bytes.substr(start));
  return out;
}

std::vector<absl::string_view> RandomSplit(absl::string_view bytes,
                                           std::mt19937& rng, int max_cuts) {
  std::vector<size_t> cuts;
  const int n = std::uniform_int_distribution<int>(0, max_cuts)(rng);
  for (int i = 0; i < n; ++i) {
    cuts.push_back(std::uniform_int_distribution<size_t>(0, bytes.size())(rng));
  }
  return SplitAt(bytes, cuts);
}

std::string Concat(absl::Span<const absl::string_view> pieces) {
  std::string out;
  for (absl::string_view piece : pieces) out.append(piece.data(), piece.size());
  return out;
}

std::string Concat(const ByteSegments& segments) {
  return Concat(absl::MakeConstSpan(segments.data(), segments.size()));
}

// Parsed results as protos, so they compare with protobuf's own parse.
void ToProto(const WireBlock& in, TensorBlock* out) {
  out->set_tensor(in.tensor);
  out->set_block(in.block);
  out->set_dtype(in.dtype);
  out->set_version(in.version);
  out->set_data(Concat(in.data));
  EXPECT_EQ(in.data_size, out->data().size());
}

PushRequest ToProto(const WirePushRequest& in) {
  PushRequest out;
  out.set_protocol_version(in.protocol_version);
  out.set_worker_id(in.worker_id);
  out.set_step(in.step);
  for (const WireBlock& block : in.blocks) ToProto(block, out.add_blocks());
  for (double lr : in.group_lr) out.add_group_lr(lr);
  for (double momentum : in.group_momentum) out.add_group_momentum(momentum);
  out.set_clip_max_norm(in.clip_max_norm);
  return out;
}

PullResponse ToProto(const WirePullResponse& in) {
  PullResponse out;
  for (const WireBlock& block : in.blocks) ToProto(block, out.add_blocks());
  return out;
}

// Known fields only, in protobuf's canonical order: equal messages give
// equal strings.
template <typename Message>
std::string Canonical(Message message) {
  message.DiscardUnknownFields();
  return message.SerializeAsString();
}

template <typename Message>
void ExpectSameMessage(const Message& got, const Message& want) {
  EXPECT_EQ(Canonical(got), Canonical(want))
      << "got: " << got.ShortDebugString().substr(0, 2000)
      << "\nwant: " << want.ShortDebugString().substr(0, 2000);
}

std::string FloatBytes(const std::vector<float>& values) {
  std::string out;
  EncodeFloat32(values, &out);
  return out;
}

std::vector<float> Floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-10.0f, 10.0f);
  std::vector<float> out(n);
  for (float& v : out) v = uniform(rng);
  return out;
}

// Blocks with their payloads; `data` of each OutgoingBlock views `payloads`.
struct BlockSet {
  std::vector<std::string> names;
  std::vector<std::string> payloads;
  std::vector<OutgoingBlock> blocks;
};

void AddToSet(BlockSet* set, std::string name, int64_t block, DataType dtype,
              int64_t version, std::string payload) {
  set->names.push_back(std::move(name));
  set->payloads.push_back(std::move(payload));
  set->blocks.push_back({{"", block, dtype, version}, ""});
}

// Points the views at the strings once the vectors stop moving.
void Bind(BlockSet* set) {
  for (size_t i = 0; i < set->blocks.size(); ++i) {
    set->blocks[i].header.tensor = set->names[i];
    set->blocks[i].data = set->payloads[i];
  }
}

BlockSet RandomBlocks(std::mt19937& rng, int max_blocks, size_t max_floats) {
  BlockSet set;
  const int n = std::uniform_int_distribution<int>(0, max_blocks)(rng);
  for (int i = 0; i < n; ++i) {
    const DataType dtype =
        static_cast<DataType>(std::uniform_int_distribution<int>(0, 2)(rng));
    const size_t floats =
        std::uniform_int_distribution<size_t>(0, max_floats)(rng);
    std::string payload;
    EncodeFromFloat32(dtype, Floats(floats, rng()), &payload);
    const int64_t block =
        std::uniform_int_distribution<int>(0, 3)(rng) == 0
            ? 0
            : std::uniform_int_distribution<int64_t>(-5, 1 << 20)(rng);
    const int64_t version = std::uniform_int_distribution<int>(0, 2)(rng) == 0
                                ? 0
                                : std::uniform_int_distribution<int64_t>(
                                      std::numeric_limits<int64_t>::min(),
                                      std::numeric_limits<int64_t>::max())(rng);
    std::string name(std::uniform_int_distribution<int>(0, 40)(rng), 'a');
    for (char& c : name) c = 'a' + rng() % 26;
    AddToSet(&set, name, block, dtype, version, payload);
  }
  Bind(&set);
  return set;
}

void FillProto(const BlockSet& set,
               google::protobuf::RepeatedPtrField<TensorBlock>* out) {
  for (const OutgoingBlock& in : set.blocks) {
    TensorBlock* block = out->Add();
    block->set_tensor(std::string(in.header.tensor));
    block->set_block(in.header.block);
    block->set_dtype(in.header.dtype);
    block->set_version(in.header.version);
    block->set_data(std::string(in.data));
  }
}

PushRequest ExpectedPush(uint32_t protocol_version, int32_t worker_id,
                         int64_t step, const BlockSet& set) {
  PushRequest out;
  out.set_protocol_version(protocol_version);
  out.set_worker_id(worker_id);
  out.set_step(step);
  FillProto(set, out.mutable_blocks());
  return out;
}

PullResponse ExpectedPull(const BlockSet& set) {
  PullResponse out;
  FillProto(set, out.mutable_blocks());
  return out;
}

BlockSet SampleBlocks() {
  BlockSet set;
  AddToSet(&set, "dense/w", 0, FLOAT32, 7, FloatBytes(Floats(33, 1)));
  AddToSet(&set, "dense/b", 3, FLOAT16, 0, std::string(10, '\x3c'));
  AddToSet(&set, "", -1, BFLOAT16, -9, std::string(6, '\x01'));
  AddToSet(&set, "empty", 2, FLOAT32, 1, "");
  AddToSet(&set, "odd", 1, FLOAT32, 0, "1234567");  // not whole elements
  AddToSet(&set, "future", 4, static_cast<DataType>(7), 2, "xy");
  Bind(&set);
  return set;
}

// --- encoding --------------------------------------------------------------

TEST(WireEncodeTest, PushRequestParsesWithProtobuf) {
  const BlockSet set = SampleBlocks();
  const WireMessage message = EncodePushRequest(1, 5, 42, set.blocks);
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(message.Flatten()));
  ExpectSameMessage(parsed, ExpectedPush(1, 5, 42, set));
  EXPECT_EQ(parsed.blocks(5).dtype(), 7);  // open enum: kept as sent
  EXPECT_EQ(message.ByteSize(), message.Flatten().size());
}

TEST(WireEncodeTest, PayloadsAreReferencedNotCopied) {
  const BlockSet set = SampleBlocks();
  const WireMessage message = EncodePushRequest(1, 5, 42, set.blocks);
  const std::vector<WirePiece> pieces = message.TaggedPieces();
  // Header, payload, header, payload...: the top-level fields merge into
  // the first block's header, and the empty payload adds no piece, so its
  // header merges with the next block's.
  ASSERT_EQ(pieces.size(), 10u);
  std::vector<absl::string_view> external;
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].external, i % 2 == 1) << i;
    EXPECT_FALSE(pieces[i].bytes.empty());
    if (pieces[i].external) external.push_back(pieces[i].bytes);
  }
  ASSERT_EQ(external.size(), 5u);
  size_t e = 0;
  for (const OutgoingBlock& block : set.blocks) {
    if (block.data.empty()) continue;
    EXPECT_EQ(external[e].data(), block.data.data());  // the same memory
    EXPECT_EQ(external[e].size(), block.data.size());
    ++e;
  }
  const std::vector<absl::string_view> views = message.Pieces();
  ASSERT_EQ(views.size(), pieces.size());
  for (size_t i = 0; i < views.size(); ++i) {
    EXPECT_EQ(views[i].data(), pieces[i].bytes.data());
  }
}

TEST(WireEncodeTest, SmallPayloadsAreInlinedBelowTheThreshold) {
  const BlockSet set = SampleBlocks();
  const WireMessage message =
      EncodePushRequest(1, 5, 42, set.blocks, /*inline_below_bytes=*/64);
  size_t external = 0;
  for (const WirePiece& piece : message.TaggedPieces()) {
    if (piece.external) {
      ++external;
      EXPECT_EQ(piece.bytes.data(), set.blocks[0].data.data());
    }
  }
  EXPECT_EQ(external, 1u);  // only the 132-byte payload
  EXPECT_EQ(message.num_pieces(), 3u);
  PushRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(message.Flatten()));
  ExpectSameMessage(parsed, ExpectedPush(1, 5, 42, set));
}

TEST(WireEncodeTest, ByteIdenticalToProtobufWhenVersionsAreZero) {
  // Version is the one field written out of field-number order.
  BlockSet set;
  AddToSet(&set, "a", 0, FLOAT32, 0, FloatBytes({1, 2, 3}));
  AddToSet(&set, "b", 9, BFLOAT16, 0, "\x01\x02");
  AddToSet(&set, "", 0, FLOAT32, 0, "");
  Bind(&set);
  EXPECT_EQ(EncodePushRequest(1, 2, 3, set.blocks).Flatten(),
            ExpectedPush(1, 2, 3, set).SerializeAsString());
  EXPECT_EQ(EncodePushRequest(0, 0, 0, set.blocks).Flatten(),
            ExpectedPush(0, 0, 0, set).SerializeAsString());
  EXPECT_EQ(EncodePullResponse(set.blocks).Flatten(),
            ExpectedPull(set).SerializeAsString());
  EXPECT_EQ(EncodePullResponse({}).ByteSize(), 0u);
  EXPECT_EQ(EncodePullResponse({}).num_pieces(), 0u);
}

TEST(WireEncodeTest, ExtremeScalarsMatchProtobuf) {
  BlockSet set;
  AddToSet(&set, std::string(300, 'n'), std::numeric_limits<int64_t>::min(),
           static_cast<DataType>(-1), std::numeric_limits<int64_t>::max(), "p");
  Bind(&set);
  for (const int32_t worker : {-1, std::numeric_limits<int32_t>::min(),
                               std::numeric_limits<int32_t>::max()}) {
    const uint32_t protocol = std::numeric_limits<uint32_t>::max();
    const int64_t step = std::numeric_limits<int64_t>::min();
    const WireMessage message =
        EncodePushRequest(protocol, worker, step, set.blocks);
    PushRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(message.Flatten()));
    ExpectSameMessage(parsed, ExpectedPush(protocol, worker, step, set));
    absl::StatusOr<WirePushRequest> ours = ParsePushRequest(message.Pieces());
    ASSERT_TRUE(ours.ok()) << ours.status();
    ExpectSameMessage(ToProto(*ours), parsed);
  }
}

TEST(WireEncodeTest, RandomMessagesParseWithProtobuf) {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 300; ++trial) {
    const BlockSet set = RandomBlocks(rng, 12, 50);
    const uint32_t protocol = rng() % 3;
    const int32_t worker = static_cast<int32_t>(rng());
    const int64_t step = static_cast<int64_t>(rng()) - (1ll << 31);
    const WireMessage push =
        EncodePushRequest(protocol, worker, step, set.blocks, rng() % 3 * 16);
    PushRequest parsed_push;
    ASSERT_TRUE(parsed_push.ParseFromString(push.Flatten()));
    ExpectSameMessage(parsed_push, ExpectedPush(protocol, worker, step, set));

    const WireMessage pull = EncodePullResponse(set.blocks);
    PullResponse parsed_pull;
    ASSERT_TRUE(parsed_pull.ParseFromString(pull.Flatten()));
    ExpectSameMessage(parsed_pull, ExpectedPull(set));
  }
}

TEST(WireEncodeTest, LowLevelFieldsAndReuse) {
  WireMessage message;
  message.ReserveOwned(4);  // force the arena to grow (and move) below
  for (int round = 0; round < 2; ++round) {
    message.Clear();
    EXPECT_EQ(message.ByteSize(), 0u);
    message.AddVarint(PushRequest::kProtocolVersionFieldNumber, 1);
    message.AddVarint(PushRequest::kWorkerIdFieldNumber,
                      static_cast<uint64_t>(int64_t{-3}));
    TensorBlock block;
    block.set_tensor("t");
    block.set_data("abc");
    message.AddString(PushRequest::kBlocksFieldNumber,
                      block.SerializeAsString());
    const std::string payload(100, 'z');
    message.AddBlock(PushRequest::kBlocksFieldNumber, {"u", 1, FLOAT16, 2},
                     payload);
    message.AddVarint(99, 5);  // a field the receiver does not know
    message.AddExternalBytes(98, payload);
    message.AddBlock(PushRequest::kBlocksFieldNumber, {"long name", 2}, "");

    PushRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(message.Flatten()));
    PushRequest want;
    want.set_protocol_version(1);
    want.set_worker_id(-3);
    *want.add_blocks() = block;
    TensorBlock* second = want.add_blocks();
    second->set_tensor("u");
    second->set_block(1);
    second->set_dtype(FLOAT16);
    second->set_version(2);
    second->set_data(payload);
    TensorBlock* third = want.add_blocks();
    third->set_tensor("long name");
    third->set_block(2);
    ExpectSameMessage(parsed, want);
    EXPECT_EQ(message.num_pieces(), 5u);

    // Copies and moves keep working (owned bytes are offsets, not views).
    const WireMessage copy = message;
    WireMessage moved = std::move(message);
    EXPECT_EQ(copy.Flatten(), moved.Flatten());
    absl::StatusOr<WirePushRequest> ours = ParsePushRequest(moved.Pieces());
    ASSERT_TRUE(ours.ok()) << ours.status();
    ExpectSameMessage(ToProto(*ours), want);
    message = std::move(moved);
  }
}

TEST(WireEncodeTest, PiecesSurviveMovingTheMessage) {
  // Short enough that a std::string would hold it inline and a move would
  // leave the views dangling.
  const std::string payload = FloatBytes({1.0f, 2.0f});
  WireMessage message =
      EncodePullResponse({OutgoingBlock{{"w", 1, FLOAT32, 0}, payload}});
  const std::vector<absl::string_view> pieces = message.Pieces();
  const std::string before = Concat(pieces);
  WireMessage moved = std::move(message);
  WireMessage assigned;
  assigned = std::move(moved);
  EXPECT_EQ(Concat(pieces), before);
  EXPECT_EQ(assigned.Pieces(), pieces);
  absl::StatusOr<WirePullResponse> parsed = ParsePullResponse(pieces);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->blocks.size(), 1u);
  EXPECT_EQ(parsed->blocks[0].tensor, "w");
}

// --- decoding --------------------------------------------------------------

TEST(WireParseTest, EmptyInputIsTheDefaultMessage) {
  absl::StatusOr<WirePushRequest> push = ParsePushRequest({});
  ASSERT_TRUE(push.ok());
  EXPECT_EQ(push->protocol_version, 0u);
  EXPECT_TRUE(push->blocks.empty());
  EXPECT_TRUE(ParsePushRequest({"", ""}).ok());
  absl::StatusOr<WirePullResponse> pull = ParsePullResponse({""});
  ASSERT_TRUE(pull.ok());
  EXPECT_TRUE(pull->blocks.empty());
}

TEST(WireParseTest, EverySingleSplit) {
  const BlockSet set = SampleBlocks();
  const PushRequest push = ExpectedPush(1, -5, 42, set);
  const std::string wire = push.SerializeAsString();
  for (size_t cut = 0; cut <= wire.size(); ++cut) {
    absl::StatusOr<WirePushRequest> parsed =
        ParsePushRequest(SplitAt(wire, {cut}));
    ASSERT_TRUE(parsed.ok()) << cut << ": " << parsed.status();
    ExpectSameMessage(ToProto(*parsed), push);
    ASSERT_EQ(parsed->worker_id, -5);
    // The float32 payload decodes to the original values wherever it is cut.
    std::vector<float> values(33);
    ASSERT_TRUE(DecodeSegments(parsed->blocks[0].dtype, parsed->blocks[0].data,
                               absl::MakeSpan(values), false)
                    .ok());
    ASSERT_EQ(values, Floats(33, 1));
  }
  const PullResponse pull = ExpectedPull(set);
  const std::string pull_wire = pull.SerializeAsString();
  for (size_t cut = 0; cut <= pull_wire.size(); ++cut) {
    absl::StatusOr<WirePullResponse> parsed =
        ParsePullResponse(SplitAt(pull_wire, {cut}));
    ASSERT_TRUE(parsed.ok()) << cut << ": " << parsed.status();
    ExpectSameMessage(ToProto(*parsed), pull);
  }
}

TEST(WireParseTest, EveryPairOfSplitsOfASmallMessage) {
  BlockSet set;
  AddToSet(&set, "w", 300, FLOAT16, 70000, std::string(12, '\x11'));
  AddToSet(&set, "b", 1, FLOAT32, 1, FloatBytes({1.5f, -2.5f}));
  Bind(&set);
  const PushRequest push = ExpectedPush(1, 300, 1 << 20, set);
  const std::string wire = push.SerializeAsString();
  const std::string want = Canonical(push);
  for (size_t a = 0; a <= wire.size(); ++a) {
    for (size_t b = a; b <= wire.size(); ++b) {
      absl::StatusOr<WirePushRequest> parsed =
          ParsePushRequest(SplitAt(wire, {a, b}));
      ASSERT_TRUE(parsed.ok()) << a << "," << b << ": " << parsed.status();
      ASSERT_EQ(Canonical(ToProto(*parsed)), want) << a << "," << b;
    }
  }
}

TEST(WireParseTest, RandomMessagesAndRandomSplits) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    const BlockSet set = RandomBlocks(rng, 8, 300);
    const PushRequest push =
        ExpectedPush(rng() % 2, static_cast<int32_t>(rng()), rng(), set);
    const std::string wire = push.SerializeAsString();
    const std::vector<absl::string_view> segments = RandomSplit(wire, rng, 30);
    absl::StatusOr<WirePushRequest> parsed = ParsePushRequest(segments);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ExpectSameMessage(ToProto(*parsed), push);
    for (size_t i = 0; i < parsed->blocks.size(); ++i) {
      const WireBlock& block = parsed->blocks[i];
      const int64_t e = WireElementBytes(block.dtype);
      std::vector<float> got(block.data_size / e);
      std::vector<float> want(got.size());
      ASSERT_TRUE(
          DecodeSegments(block.dtype, block.data, absl::MakeSpan(got), false)
              .ok());
      ASSERT_TRUE(DecodeToFloat32(block.dtype, push.blocks(i).data(),
                                  absl::MakeSpan(want))
                      .ok());
      if (got.empty()) continue;  // memcmp wants non-null pointers
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));
    }

    const PullResponse pull = ExpectedPull(set);
    const std::string pull_wire = pull.SerializeAsString();
    absl::StatusOr<WirePullResponse> parsed_pull =
        ParsePullResponse(RandomSplit(pull_wire, rng, 30));
    ASSERT_TRUE(parsed_pull.ok()) << parsed_pull.status();
    ExpectSameMessage(ToProto(*parsed_pull), pull);
  }
}

TEST(WireParseTest, OwnEncodingRoundTripsThroughItsPieces) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const BlockSet set = RandomBlocks(rng, 10, 100);
    const WireMessage message = EncodePullResponse(set.blocks);
    absl::StatusOr<WirePullResponse> parsed =
        ParsePullResponse(message.Pieces());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ExpectSameMessage(ToProto(*parsed), ExpectedPull(set));
    // Zero copy on both ends: a payload that was one piece is viewed as it.
    for (size_t i = 0; i < set.blocks.size(); ++i) {
      if (set.blocks[i].data.empty()) continue;
      ASSERT_EQ(parsed->blocks[i].data.size(), 1u);
      EXPECT_EQ(parsed->blocks[i].data[0].data(), set.blocks[i].data.data());
    }
  }
}

TEST(WireParseTest, LargeBlock) {
  const std::vector<float> values = Floats(1 << 20, 3);
  BlockSet set;
  AddToSet(&set, "big", 0, FLOAT32, 12, FloatBytes(values));
  AddToSet(&set, "small", 1, FLOAT32, 12, FloatBytes({1.0f}));
  Bind(&set);
  const WireMessage message = EncodePushRequest(1, 0, 5, set.blocks);
  const std::string wire = message.Flatten();
  std::mt19937 rng(5);
  // gRPC-like 8 KiB slices starting at an odd offset, and random cuts.
  std::vector<size_t> slices;
  for (size_t at = 4097; at < wire.size(); at += 8192) slices.push_back(at);
  for (const std::vector<absl::string_view>& segments :
       {SplitAt(wire, slices), RandomSplit(wire, rng, 100)}) {
    absl::StatusOr<WirePushRequest> parsed = ParsePushRequest(segments);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ASSERT_EQ(parsed->blocks.size(), 2u);
    const WireBlock& big = parsed->blocks[0];
    EXPECT_EQ(big.tensor, "big");
    EXPECT_EQ(big.version, 12);
    EXPECT_EQ(big.data_size, values.size() * 4);
    std::vector<float> out(values.size());
    ASSERT_TRUE(
        DecodeSegments(big.dtype, big.data, absl::MakeSpan(out), false).ok());
    ASSERT_EQ(out, values);
    ASSERT_TRUE(
        DecodeSegments(big.dtype, big.data, absl::MakeSpan(out), true).ok());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 2 * values[i]);
    EXPECT_EQ(FindNonFiniteSegments(big.dtype, big.data), -1);
  }
}

TEST(WireParseTest, ManyBlocks) {
  BlockSet set;
  for (int i = 0; i < 5000; ++i) {
    AddToSet(&set, absl::StrCat("t", i % 7), i, FLOAT32, i,
             FloatBytes(Floats(i % 5, i)));
  }
  Bind(&set);
  const WireMessage message = EncodePushRequest(1, 2, 3, set.blocks);
  EXPECT_LE(message.num_pieces(), 2 * set.blocks.size());
  std::mt19937 rng(1);
  const std::string wire = message.Flatten();
  absl::StatusOr<WirePushRequest> parsed =
      ParsePushRequest(RandomSplit(wire, rng, 500));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameMessage(ToProto(*parsed), ExpectedPush(1, 2, 3, set));
}

// Unknown fields of every wire type, before, between and inside blocks.
TEST(WireParseTest, UnknownFieldsAreSkipped) {
  const std::string payload = FloatBytes({1.0f, 2.0f, 3.0f});
  std::string block;
  PutTag(&block, 9, 0);  // unknown varint, before the known fields
  PutVarint(&block, ~uint64_t{0});
  PutBytes(&block, TensorBlock::kTensorFieldNumber, "w");
  PutTag(&block, 6, 1);  // unknown fixed64
  block.append("12345678");
  PutTag(&block, TensorBlock::kBlockFieldNumber, 0);
  PutVarint(&block, 4);
  PutBytes(&block, 7, "ignored sub-bytes");
  PutBytes(&block, TensorBlock::kDataFieldNumber, payload);
  PutTag(&block, 1000, 5);  // unknown fixed32, after the payload
  block.append("abcd");
  PutTag(&block, TensorBlock::kVersionFieldNumber, 0);
  PutVarint(&block, 77);

  std::string wire;
  PutTag(&wire, 4, 0);  // reserved (the old pulled_version)
  PutVarint(&wire, 123);
  PutTag(&wire, PushRequest::kStepFieldNumber, 0);
  PutVarint(&wire, 8);
  PutBytes(&wire, PushRequest::kBlocksFieldNumber, block);
  PutTag(&wire, 536870911, 1);  // the largest field number, fixed64
  wire.append("\xff\xff\xff\xff\xff\xff\xff\xff");
  PutBytes(&wire, 12, "");  // empty length-delimited
  PutBytes(&wire, PushRequest::kBlocksFieldNumber, block);
  PutTag(&wire, 13, 5);
  wire.append("\x00\x00\x00\x00", 4);

  PushRequest reference;
  ASSERT_TRUE(reference.ParseFromString(wire));
  ASSERT_EQ(reference.blocks_size(), 2);
  EXPECT_EQ(reference.blocks(0).version(), 77);
  for (size_t cut = 0; cut <= wire.size(); ++cut) {
    absl::StatusOr<WirePushRequest> parsed =
        ParsePushRequest(SplitAt(wire, {cut, cut, wire.size() - cut}));
    ASSERT_TRUE(parsed.ok()) << cut << ": " << parsed.status();
    ExpectSameMessage(ToProto(*parsed), reference);
  }
  // PullResponse: its reserved field 1, then unknowns around a block.
  std::string pull_wire;
  PutTag(&pull_wire, 1, 0);
  PutVarint(&pull_wire, 5);
  PutBytes(&pull_wire, PullResponse::kBlocksFieldNumber, block);
  PutBytes(&pull_wire, 3, block);  // a block-shaped unknown field
  PullResponse pull_reference;
  ASSERT_TRUE(pull_reference.ParseFromString(pull_wire));
  absl::StatusOr<WirePullResponse> pull = ParsePullResponse({pull_wire});
  ASSERT_TRUE(pull.ok()) << pull.status();
  ASSERT_EQ(pull->blocks.size(), 1u);
  ExpectSameMessage(ToProto(*pull), pull_reference);
}

// Repeated scalars: the last wins; repeated data: the last wins, as in
// protobuf; non-canonical varints (padded, or 64-bit for an int32) are
// truncated like protobuf does.
TEST(WireParseTest, DuplicatesAndNonCanonicalVarintsMatchProtobuf) {
  std::string block;
  PutBytes(&block, TensorBlock::kDataFieldNumber, "first");
  PutBytes(&block, TensorBlock::kTensorFieldNumber, "x");
  PutBytes(&block, TensorBlock::kTensorFieldNumber, "y");
  PutBytes(&block, TensorBlock::kDataFieldNumber, "second");
  PutTag(&block, TensorBlock::kDtypeFieldNumber, 0);
  PutVarint(&block, (uint64_t{1} << 32) | 2);  // truncated to 2
  PutTag(&block, TensorBlock::kBlockFieldNumber, 0);
  block.append("\x85\x80\x80\x00", 4);  // 5, padded to four bytes

  std::string wire;
  PutTag(&wire, PushRequest::kWorkerIdFieldNumber, 0);
  PutVarint(&wire, 1);
  PutTag(&wire, PushRequest::kWorkerIdFieldNumber, 0);
  PutVarint(&wire, 0xfffffffffffffffeu);  // -2 as protobuf writes it
  PutTag(&wire, PushRequest::kProtocolVersionFieldNumber, 0);
  PutVarint(&wire, (uint64_t{3} << 32) | 9);  // uint32: truncated to 9
  PutBytes(&wire, PushRequest::kBlocksFieldNumber, block);

  PushRequest reference;
  ASSERT_TRUE(reference.ParseFromString(wire));
  absl::StatusOr<WirePushRequest> parsed = ParsePushRequest({wire});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSameMessage(ToProto(*parsed), reference);
  EXPECT_EQ(parsed->worker_id, -2);
  EXPECT_EQ(parsed->protocol_version, 9u);
  ASSERT_EQ(parsed->blocks.size(), 1u);
  EXPECT_EQ(parsed->blocks[0].tensor, "y");
  EXPECT_EQ(Concat(parsed->blocks[0].data), "second");
  EXPECT_EQ(parsed->blocks[0].data_size, 6u);
  EXPECT_EQ(parsed->blocks[0].dtype, BFLOAT16);
  EXPECT_EQ(parsed->blocks[0].block, 5);
}

TEST(WireParseTest, UnknownDtypeIsKeptForTheCallerToRefuse) {
  std::string block;
  PutTag(&block, TensorBlock::kDtypeFieldNumber, 0);
  PutVarint(&block, 7);
  PutBytes(&block, TensorBlock::kDataFieldNumber, "abcd");
  std::string wire;
  PutBytes(&wire, PullResponse::kBlocksFieldNumber, block);
  absl::StatusOr<WirePullResponse> parsed = ParsePullResponse({wire});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->blocks.size(), 1u);
  EXPECT_EQ(static_cast<int>(parsed->blocks[0].dtype), 7);
  std::vector<float> out(1);
  const absl::Status status =
      DecodeSegments(parsed->blocks[0].dtype, parsed->blocks[0].data,
                     absl::MakeSpan(out), false);
  EXPECT_EQ(status.message(), "unsupported wire type 7");
}

// --- malformed input -------------------------------------------------------

// A message cut short parses only where it is cut between two top-level
// fields (a shorter but valid message); anywhere else, and in particular
// anywhere inside a block, it is an error. Protobuf agrees on every cut.
TEST(WireMalformedTest, EveryTruncation) {
  const BlockSet set = SampleBlocks();
  WireMessage message;
  std::set<size_t> boundaries = {0};
  message.AddVarint(PushRequest::kProtocolVersionFieldNumber, 1);
  boundaries.insert(message.ByteSize());
  message.AddVarint(PushRequest::kWorkerIdFieldNumber,
                    static_cast<uint64_t>(int64_t{-7}));
  boundaries.insert(message.ByteSize());
  message.AddVarint(PushRequest::kStepFieldNumber, 300);
  boundaries.insert(message.ByteSize());
  for (const OutgoingBlock& block : set.blocks) {
    message.AddBlock(PushRequest::kBlocksFieldNumber, block.header, block.data);
    boundaries.insert(message.ByteSize());
  }
  const std::string wire = message.Flatten();
  std::mt19937 rng(3);
  for (size_t length = 0; length <= wire.size(); ++length) {
    const absl::string_view prefix = absl::string_view(wire).substr(0, length);
    PushRequest reference;
    const bool reference_ok = reference.ParseFromString(std::string(prefix));
    absl::StatusOr<WirePushRequest> parsed =
        ParsePushRequest(RandomSplit(prefix, rng, 3));
    const bool boundary = boundaries.count(length) > 0;
    ASSERT_EQ(parsed.ok(), boundary) << length << ": " << parsed.status();
    ASSERT_EQ(reference_ok, boundary) << length;
    if (parsed.ok()) {
      ExpectSameMessage(ToProto(*parsed), reference);
    } else {
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }

  WireMessage pull = EncodePullResponse({});
  boundaries = {0};
  for (const OutgoingBlock& block : set.blocks) {
    pull.AddBlock(PullResponse::kBlocksFieldNumber, block.header, block.data);
    boundaries.insert(pull.ByteSize());
  }
  const std::string pull_wire = pull.Flatten();
  for (size_t length = 0; length <= pull_wire.size(); ++length) {
    const absl::string_view prefix =
        absl::string_view(pull_wire).substr(0, length);
    PullResponse reference;
    const bool reference_ok = reference.ParseFromString(std::string(prefix));
    absl::StatusOr<WirePullResponse> parsed =
        ParsePullResponse(RandomSplit(prefix, rng, 3));
    const bool boundary = boundaries.count(length) > 0;
    ASSERT_EQ(parsed.ok(), boundary) << length << ": " << parsed.status();
    ASSERT_EQ(reference_ok, boundary) << length;
    if (parsed.ok()) ExpectSameMessage(ToProto(*parsed), reference);
  }
}

struct MalformedCase {
  const char* name;
  std::string bytes;
  std::string error;  // the exact message, after "PushRequest: "
};

std::string Block(absl::string_view contents) {
  std::string out;
  PutBytes(&out, PushRequest::kBlocksFieldNumber, contents);
  return out;
}

TEST(WireMalformedTest, PreciseErrors) {
  const std::vector<MalformedCase> cases = {
      {"missing varint", "\x08", "truncated varint at byte 1"},
      {"cut varint", "\x08\x80", "truncated varint at byte 1"},
      {"cut tag", "\x08\x01\x80", "truncated varint at byte 2"},
      {"11-byte varint", "\x08" + std::string(10, '\x80') + "\x01",
       "varint at byte 1 exceeds 64 bits"},
      {"bits beyond 64", "\x08" + std::string(9, '\xff') + "\x02",
       "varint at byte 1 exceeds 64 bits"},
      {"padded tag", std::string("\x08\x01\x88\x80\x80\x80\x80\x00\x01", 9),
       "tag at byte 2 is longer than 5 bytes"},
      {"padded length", std::string("\x2a\x80\x80\x80\x80\x80\x00", 7),
       "field 5 length at byte 1 is longer than 5 bytes"},
      {"tag zero", std::string("\x00\x01", 2), "invalid tag 0 at byte 0"},
      {"field zero", std::string("\x02\x00", 2), "invalid tag 2 at byte 0"},
      {"tag beyond 32 bits", Varint(uint64_t{1} << 34) + "\x01",
       "invalid tag 17179869184 at byte 0"},
      {"start group", "\x08\x01\x0b",
       "field 1 at byte 2 is a group (wire type 3), which is not supported"},
      {"end group", "\x0c",
       "field 1 at byte 0 is a group (wire type 4), which is not supported"},
      {"wire type 6", "\x0e", "field 1 at byte 0 has invalid wire type 6"},
      {"wire type 7", "\x7f", "field 15 at byte 0 has invalid wire type 7"},
      {"protocol_version as bytes", std::string("\x0a\x00", 2),
       "field 1 (protocol_version) at byte 0 has wire type 2 "
       "(length-delimited), expected 0 (varint)"},
      {"step as fixed64", "\x19" + std::string(8, '\0'),
       "field 3 (step) at byte 0 has wire type 1 (fixed64), expected 0 "
       "(varint)"},
      {"blocks as varint", "\x28\x01",
       "field 5 (blocks) at byte 0 has wire type 0 (varint), expected 2 "
       "(length-delimited)"},
      {"block past the end", "\x08\x01\x2a\x05\x08",
       "field 5 length 5 exceeds remaining 1 bytes (tag at byte 2)"},
      {"huge block length", "\x2a" + Varint((uint64_t{1} << 35) - 1) + "abc",
       "field 5 length 34359738367 exceeds remaining 3 bytes (tag at byte "
       "0)"},
      {"64-bit length", "\x62" + Varint(~uint64_t{0}),
       "field 12 length at byte 1 is longer than 5 bytes"},
      {"cut fixed64", "\x49" + std::string(7, 'x'),
       "truncated fixed64 field 9 at byte 0: 7 bytes remain"},
      {"cut fixed32", std::string("\x08\x01\x4d\x00", 4),
       "truncated fixed32 field 9 at byte 2: 1 bytes remain"},
      // Inside a block: the block's end is the limit, even with more
      // message after it.
      {"tensor past the block",
       Block("\x0a\x05"
             "ab") +
           "\x18\x01",
       "blocks[0]: field 1 length 5 exceeds remaining 2 bytes (tag at byte "
       "2)"},
      {"varint across the block end", Block("\x10\x80") + "\x18\x01",
       "blocks[0]: truncated varint at byte 3"},
      {"fixed32 across the block end",
       Block(std::string("\x4d\x00", 2)) + "\x18\x01",
       "blocks[0]: truncated fixed32 field 9 at byte 2: 1 bytes remain"},
      {"data as varint", Block("\x20\x01"),
       "blocks[0]: field 4 (data) at byte 2 has wire type 0 (varint), "
       "expected 2 (length-delimited)"},
      {"tensor as fixed32",
       Block("\x0d"
             "abcd"),
       "blocks[0]: field 1 (tensor) at byte 2 has wire type 5 (fixed32), "
       "expected 2 (length-delimited)"},
      {"dtype as bytes", Block(std::string("\x1a\x00", 2)),
       "blocks[0]: field 3 (dtype) at byte 2 has wire type 2 "
       "(length-delimited), expected 0 (varint)"},
      {"version overlong", Block("\x28" + std::string(10, '\xff')),
       "blocks[0]: varint at byte 3 exceeds 64 bits"},
      {"group in block", Block("\x10\x01\x33\x34"),
       "blocks[0]: field 6 at byte 4 is a group (wire type 3), which is not "
       "supported"},
      {"second block bad", Block("") + Block("\x10"),
       "blocks[1]: truncated varint at byte 5"},
  };
  for (const MalformedCase& c : cases) {
    for (size_t cut = 0; cut <= c.bytes.size(); ++cut) {
      absl::StatusOr<WirePushRequest> parsed =
          ParsePushRequest(SplitAt(c.bytes, {cut}));
      ASSERT_FALSE(parsed.ok()) << c.name;
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
      ASSERT_EQ(std::string(parsed.status().message()),
                "PushRequest: " + c.error)
          << c.name << ", cut at " << cut;
    }
  }
}

TEST(WireMalformedTest, PullResponseErrors) {
  absl::StatusOr<WirePullResponse> parsed = ParsePullResponse({"\x10\x01"});
  EXPECT_EQ(parsed.status().message(),
            "PullResponse: field 2 (blocks) at byte 0 has wire type 0 "
            "(varint), expected 2 (length-delimited)");
  parsed = ParsePullResponse({"\x12\x03\x08\x01"});
  EXPECT_EQ(parsed.status().message(),
            "PullResponse: field 2 length 3 exceeds remaining 2 bytes (tag at "
            "byte 0)");
}

// Mutated valid messages: whatever we accept, protobuf accepts with the
// same content (we are only ever stricter), and nothing crashes.
bool utf8_error = false;

void NoteUtf8Error(google::protobuf::LogLevel, const char*, int,
                   const std::string& message) {
  if (message.find("UTF-8") != std::string::npos) utf8_error = true;
}

// Routes protobuf's log to NoteUtf8Error while in scope.
class Utf8ErrorWatch {
 public:
  Utf8ErrorWatch()
      : previous_(google::protobuf::SetLogHandler(NoteUtf8Error)) {}
  ~Utf8ErrorWatch() { google::protobuf::SetLogHandler(previous_); }

 private:
  google::protobuf::LogHandler* previous_;
};

TEST(WireMalformedTest, MutationsNeverDisagreeWithProtobuf) {
  const Utf8ErrorWatch watch;
  std::mt19937 rng(12345);
  int accepted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const BlockSet set = RandomBlocks(rng, 4, 6);
    std::string wire = ExpectedPush(1, static_cast<int32_t>(rng()), rng(), set)
                           .SerializeAsString();
    const int mutations = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int m = 0; m < mutations && !wire.empty(); ++m) {
      const size_t at = rng() % wire.size();
      switch (rng() % 5) {
        case 0:
          wire[at] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 1:
          wire[at] = static_cast<char>(rng());
          break;
        case 2:
          wire.insert(wire.begin() + at, static_cast<char>(rng()));
          break;
        case 3:
          wire.erase(at, 1);
          break;
        default:
          wire.resize(at);
          break;
      }
    }
    absl::StatusOr<WirePushRequest> parsed =
        ParsePushRequest(RandomSplit(wire, rng, 4));
    absl::StatusOr<WirePullResponse> pull =
        ParsePullResponse(RandomSplit(wire, rng, 4));
    if (!parsed.ok()) continue;
    PushRequest reference;
    utf8_error = false;
    const bool reference_ok = reference.ParseFromString(wire);
    // Protobuf also refuses proto3 strings that are not UTF-8 (even one a
    // later occurrence replaces); we do not look, as a bad name fails the
    // partition lookup anyway.
    if (utf8_error) continue;
    ++accepted;
    ASSERT_TRUE(reference_ok) << trial;
    ExpectSameMessage(ToProto(*parsed), reference);
  }
  EXPECT_GT(accepted, 1000);  // the test exercised the success path too
}

TEST(WireMalformedTest, RandomBytesNeverCrash) {
  std::mt19937 rng(99);
  // Bytes drawn mostly from tag-like values so parsing gets past byte 0.
  const std::string alphabet = std::string(
      "\x08\x10\x18\x2a\x12\x0a\x22\x28"
      "\x80\xff\x01\x02\x05\x00\x49\x4d",
      16);
  for (int trial = 0; trial < 50000; ++trial) {
    std::string wire(rng() % 40, '\0');
    for (char& c : wire) {
      c = rng() % 4 == 0 ? static_cast<char>(rng())
                         : alphabet[rng() % alphabet.size()];
    }
    const std::vector<absl::string_view> segments = RandomSplit(wire, rng, 5);
    absl::StatusOr<WirePushRequest> push = ParsePushRequest(segments);
    absl::StatusOr<WirePullResponse> pull = ParsePullResponse(segments);
    if (push.ok()) {
      for (const WireBlock& block : push->blocks) {
        size_t total = 0;
        for (absl::string_view s : block.data) total += s.size();
        ASSERT_EQ(total, block.data_size);
      }
    } else {
      ASSERT_EQ(push.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

}  // namespace
}  // namespace pstrain

namespace pstrain {
namespace {

// The rates, momentums and clip a push carries (PushExtras) are protobuf's
// encoding: protobuf reads them, and so does ParsePushRequest.
TEST(WireExtrasTest, GroupRatesAndClipRoundTrip) {
  const std::vector<double> rates = {0.1, 1e-3, 0.0};
  const std::vector<double> momentums = {0.9, 0.85, 0.0};
  const std::string data(8, 'x');
  const OutgoingBlock block{{"w", 0, FLOAT32, 0}, data};
  const WireMessage message =
      EncodePushRequest(1, 2, 3, {block}, 0, PushExtras{rates, momentums, 0.5});
  PushRequest proto;
  ASSERT_TRUE(proto.ParseFromString(message.Flatten()));
  EXPECT_EQ(
      std::vector<double>(proto.group_lr().begin(), proto.group_lr().end()),
      rates);
  EXPECT_EQ(std::vector<double>(proto.group_momentum().begin(),
                                proto.group_momentum().end()),
            momentums);
  EXPECT_EQ(proto.clip_max_norm(), 0.5);
  const std::string flat = message.Flatten();
  const absl::string_view view = flat;
  absl::StatusOr<WirePushRequest> parsed =
      ParsePushRequest(absl::MakeConstSpan(&view, 1));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->group_lr, rates);
  EXPECT_EQ(parsed->group_momentum, momentums);
  EXPECT_EQ(parsed->clip_max_norm, 0.5);
  // Unpacked doubles (one fixed64 per value), as protobuf also accepts.
  PushRequest unpacked;
  unpacked.add_group_lr(0.25);
  std::string bytes = unpacked.SerializeAsString();  // packed by protobuf
  // Field 6, wire type 1 (fixed64), then 8 bytes.
  std::string single = "\x31";
  double value = 0.75;
  single.append(reinterpret_cast<const char*>(&value), 8);
  const absl::string_view pieces[] = {bytes, single};
  parsed = ParsePushRequest(absl::MakeConstSpan(pieces));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->group_lr, (std::vector<double>{0.25, 0.75}));
}

}  // namespace
}  // namespace pstrain
