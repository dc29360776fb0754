#include "ps_server/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "glog/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/checkpoint.pb.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// 13 blocks of 4 elements, with short tails: w = 30 elements (8 blocks, the
// last of 2), b = 3 (1 block), emb = 14 (4 blocks, the last of 2).
ModelSchema TestSchema(uint64_t seed = 7) {
  ModelSchema schema;
  schema.set_seed(seed);
  schema.set_block_elements(4);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(10);
  w->add_shape(3);
  w->mutable_init()->set_kind(InitSpec::UNIFORM);
  w->mutable_init()->set_scale(0.5f);
  DenseTensorSpec* b = schema.add_dense();
  b->set_name("b");
  b->add_shape(3);
  DenseTensorSpec* emb = schema.add_dense();
  emb->set_name("emb");
  emb->add_shape(7);
  emb->add_shape(2);
  return schema;
}
constexpr int kTestBlocks = 13;

// A fresh, empty directory per test.
std::string TestDir() {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = absl::StrCat(info->test_suite_name(), "_", info->name());
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  std::string tmp = ::testing::TempDir();
  while (tmp.size() > 1 && tmp.back() == '/') tmp.pop_back();
  const std::string dir = absl::StrCat(tmp, "/ckpt_", name);
  fs::remove_all(dir);
  return dir;
}

// Every value is a function of (global block, element, salt), so a restored
// block says which checkpoint it came from.
float ValueOf(int64_t g, int64_t k, int salt) {
  return static_cast<float>(g * 1000 + k) + 0.125f * salt + 1e-3f;
}
float StateOf(int64_t g, int64_t k, int salt) {
  return -static_cast<float>(g * 100 + k) - 0.5f * salt;
}
int64_t VersionOf(int64_t g, int salt) { return 1000 * salt + g; }

BlockSnapshot MakeBlock(const BlockLocation& loc, int64_t g, int salt,
                        int state_per_element) {
  BlockSnapshot block;
  block.global_block = g;
  block.version = VersionOf(g, salt);
  for (int64_t k = 0; k < loc.length; ++k) {
    block.value.push_back(ValueOf(g, k, salt));
  }
  for (int64_t k = 0; k < state_per_element * loc.length; ++k) {
    block.optimizer_state.push_back(StateOf(g, k, salt));
  }
  block.last_step = {g, salt, -1, 1LL << 40};
  return block;
}

ShardSnapshot MakeSnapshot(const ModelSchema& schema, int shard_id,
                           int num_shards, int64_t sequence, int salt,
                           int state_per_element = 2) {
  absl::StatusOr<Partition> partition = Partition::Create(schema, num_shards);
  EXPECT_TRUE(partition.ok()) << partition.status();
  ShardSnapshot snapshot;
  snapshot.schema = schema;
  snapshot.mode = "sync";
  snapshot.optimizer = "adam";
  snapshot.shard_id = shard_id;
  snapshot.num_shards = num_shards;
  snapshot.sequence = sequence;
  for (int g : partition->BlocksOfShard(shard_id)) {
    snapshot.blocks.push_back(
        MakeBlock(partition->blocks()[g], g, salt, state_per_element));
  }
  return snapshot;
}

void WriteLayout(CheckpointStore& store, const ModelSchema& schema,
                 int num_shards, int64_t sequence, int salt) {
  for (int i = 0; i < num_shards; ++i) {
    ASSERT_TRUE(
        store.Write(MakeSnapshot(schema, i, num_shards, sequence, salt)).ok());
  }
}

std::string FilePath(const std::string& dir, int shard_id, int num_shards,
                     int64_t sequence) {
  return absl::StrFormat("%s/shard-%d-of-%d/ckpt-%012d.pstrain", dir, shard_id,
                         num_shards, sequence);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), bytes.size());
  ASSERT_TRUE(out.good()) << path;
}

uint64_t HeaderLength(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= uint64_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
  }
  return n;
}

// An independent encoder of the documented format, for files Write would
// refuse to produce.
std::string EncodeFile(const CheckpointHeader& header,
                       const std::vector<float>& payload) {
  std::string header_bytes;
  header.SerializeToString(&header_bytes);
  std::string out = "PSCKPT01";
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>(uint64_t{header_bytes.size()} >> (8 * i)));
  }
  out += header_bytes;
  out.append(reinterpret_cast<const char*>(payload.data()),
             payload.size() * sizeof(float));
  const uint32_t crc =
      crc32_z(crc32_z(0, Z_NULL, 0), reinterpret_cast<const Bytef*>(out.data()),
              out.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(crc >> (8 * i)));
  return out + "END1";
}

// The header and payload Write would produce for `snapshot`.
void ToHeader(const ShardSnapshot& snapshot, CheckpointHeader* header,
              std::vector<float>* payload) {
  *header->mutable_schema() = snapshot.schema;
  header->set_mode(snapshot.mode);
  header->set_optimizer(snapshot.optimizer);
  header->set_shard_id(snapshot.shard_id);
  header->set_num_shards(snapshot.num_shards);
  header->set_sequence(snapshot.sequence);
  for (const BlockSnapshot& b : snapshot.blocks) {
    CheckpointBlock* hb = header->add_blocks();
    hb->set_global_block(b.global_block);
    hb->set_version(b.version);
    hb->set_value_count(b.value.size());
    hb->set_state_count(b.optimizer_state.size());
    for (int64_t s : b.last_step) hb->add_last_step(s);
    payload->insert(payload->end(), b.value.begin(), b.value.end());
    payload->insert(payload->end(), b.optimizer_state.begin(),
                    b.optimizer_state.end());
  }
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectBlockEq(const BlockSnapshot& actual, const BlockSnapshot& expected) {
  EXPECT_EQ(actual.global_block, expected.global_block);
  EXPECT_EQ(actual.version, expected.version) << actual.global_block;
  EXPECT_TRUE(SameBits(actual.value, expected.value)) << actual.global_block;
  EXPECT_TRUE(SameBits(actual.optimizer_state, expected.optimizer_state))
      << actual.global_block;
  EXPECT_EQ(actual.last_step, expected.last_step) << actual.global_block;
}

// Checks that `restored` holds exactly `expected`'s blocks, bit for bit.
void ExpectBlocksOf(const RestoredShard& restored,
                    const ShardSnapshot& expected) {
  ASSERT_EQ(restored.blocks.size(), expected.blocks.size());
  for (size_t k = 0; k < expected.blocks.size(); ++k) {
    ExpectBlockEq(restored.blocks[k], expected.blocks[k]);
  }
}

// Checks that `restored` holds exactly the blocks shard `shard_id` of
// `num_shards` owns, with the values written with `salt`.
void ExpectShardFromSalt(const RestoredShard& restored,
                         const ModelSchema& schema, int shard_id,
                         int num_shards, int salt) {
  ExpectBlocksOf(restored, MakeSnapshot(schema, shard_id, num_shards, 0, salt));
}

TEST(CheckpointTest, RoundTripIsExact) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  EXPECT_EQ(store.dir(), dir);
  const ModelSchema schema = TestSchema();
  std::vector<ShardSnapshot> written;
  for (int i = 0; i < 3; ++i) {
    written.push_back(MakeSnapshot(schema, i, 3, 5, 1));
  }
  // Values that only survive a bit-exact round trip.
  std::vector<float>& special = written[1].blocks[0].value;
  special[0] = -0.0f;
  special[1] = std::numeric_limits<float>::denorm_min();
  special[2] = std::numeric_limits<float>::quiet_NaN();
  special[3] = -std::numeric_limits<float>::infinity();
  written[2].blocks[0].last_step.clear();  // may be empty
  written[0].mode = "async";
  written[1].mode = "async";
  written[2].mode = "async";
  for (const ShardSnapshot& s : written) ASSERT_TRUE(store.Write(s).ok());

  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<RestoredShard> restored = store.LoadForShard(i, 3);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->schema.SerializeAsString(), schema.SerializeAsString());
    EXPECT_EQ(restored->mode, "async");
    EXPECT_EQ(restored->optimizer, "adam");
    EXPECT_EQ(restored->old_num_shards, 3);
    EXPECT_EQ(restored->next_sequence, 6);
    EXPECT_TRUE(restored->files_skipped.empty());
    ASSERT_EQ(restored->files_used.size(), 3u);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(restored->files_used[j], FilePath(dir, j, 3, 5));
    }
    ASSERT_EQ(restored->blocks.size(), written[i].blocks.size());
    for (size_t k = 0; k < written[i].blocks.size(); ++k) {
      ExpectBlockEq(restored->blocks[k], written[i].blocks[k]);
    }
  }
}

// SGD keeps no optimizer state: its empty vectors (null data()) must not
// disturb the running checksum.
TEST(CheckpointTest, RoundTripWithoutOptimizerState) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  ShardSnapshot written =
      MakeSnapshot(schema, 0, 1, 0, 1, /*state_per_element=*/0);
  written.optimizer = "sgd";
  ASSERT_TRUE(store.Write(written).ok());
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(restored->files_skipped.empty());
  ASSERT_EQ(restored->blocks.size(), written.blocks.size());
  for (size_t k = 0; k < written.blocks.size(); ++k) {
    ExpectBlockEq(restored->blocks[k], written.blocks[k]);
  }
}

TEST(CheckpointTest, FileFollowsTheDocumentedFormat) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ShardSnapshot snapshot = MakeSnapshot(TestSchema(), 1, 3, 42, 1);
  ASSERT_TRUE(store.Write(snapshot).ok());
  const std::string bytes = ReadBytes(FilePath(dir, 1, 3, 42));

  CheckpointHeader header;
  std::vector<float> payload;
  ToHeader(snapshot, &header, &payload);
  // Byte for byte what an independent encoder of the format produces.
  EXPECT_EQ(bytes, EncodeFile(header, payload));
  ASSERT_GT(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(0, 8), "PSCKPT01");
  EXPECT_EQ(bytes.substr(bytes.size() - 4), "END1");
  const uint64_t h = HeaderLength(bytes);
  EXPECT_EQ(bytes.size(), 24 + h + 4 * payload.size());
  CheckpointHeader parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes.substr(16, h)));
  EXPECT_EQ(parsed.sequence(), 42);
  EXPECT_EQ(parsed.shard_id(), 1);
  EXPECT_EQ(parsed.num_shards(), 3);
  EXPECT_EQ(parsed.blocks_size(), 4);  // blocks 1, 4, 7, 10
}

TEST(CheckpointTest, LargeBlocksPassTheBufferedPaths) {
  // Blocks bigger than the 1 MiB I/O buffer go straight to and from disk.
  ModelSchema schema;
  schema.set_block_elements(300000);
  DenseTensorSpec* t = schema.add_dense();
  t->set_name("big");
  t->add_shape(1000);
  t->add_shape(701);
  const std::string dir = TestDir();
  CheckpointStore store(dir, 1);
  const ShardSnapshot snapshot = MakeSnapshot(schema, 0, 1, 0, 3, 1);
  ASSERT_TRUE(store.Write(snapshot).ok());
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->blocks.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    ExpectBlockEq(restored->blocks[k], snapshot.blocks[k]);
  }
}

TEST(CheckpointTest, KeepLastDeletesOnlyThisShardsOlderFiles) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 2);
  const ModelSchema schema = TestSchema();
  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 1, 2, 1, 1)).ok());
  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 3, 1, 1)).ok());
  for (int seq = 1; seq <= 5; ++seq) {
    ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 2, seq, seq)).ok());
  }
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir + "/shard-0-of-2")) {
    left.insert(e.path().filename().string());
  }
  EXPECT_EQ(left, (std::set<std::string>{"ckpt-000000000004.pstrain",
                                         "ckpt-000000000005.pstrain"}));
  EXPECT_TRUE(fs::exists(FilePath(dir, 1, 2, 1)));
  EXPECT_TRUE(fs::exists(FilePath(dir, 0, 3, 1)));

  // keep_last <= 0 keeps everything.
  CheckpointStore keep_all(dir, 0);
  ASSERT_TRUE(keep_all.Write(MakeSnapshot(schema, 1, 2, 2, 2)).ok());
  ASSERT_TRUE(keep_all.Write(MakeSnapshot(schema, 1, 2, 3, 3)).ok());
  EXPECT_TRUE(fs::exists(FilePath(dir, 1, 2, 1)));
}

TEST(CheckpointTest, WriteRefusesANonIncreasingSequence) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 1, 7, 1)).ok());
  for (int64_t seq : {7, 6}) {
    const absl::Status s = store.Write(MakeSnapshot(schema, 0, 1, seq, 2));
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("ckpt-000000000007.pstrain"));
  }
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectShardFromSalt(*restored, schema, 0, 1, 1);
}

TEST(CheckpointTest, WriteRefusesSnapshotsThatCouldNotBeRestored) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  struct Case {
    std::string name;
    std::function<void(ShardSnapshot&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"shard out of range", [](ShardSnapshot& s) { s.shard_id = 3; },
       "0 <= shard_id < num_shards"},
      {"negative sequence", [](ShardSnapshot& s) { s.sequence = -1; },
       "sequence -1"},
      {"13-digit sequence",
       [](ShardSnapshot& s) { s.sequence = 1000000000000; }, "sequence"},
      {"no mode", [](ShardSnapshot& s) { s.mode.clear(); }, "mode"},
      {"bad schema", [](ShardSnapshot& s) { s.schema.set_block_elements(0); },
       "bad schema"},
      {"missing block", [](ShardSnapshot& s) { s.blocks.pop_back(); },
       "the shard owns 5"},
      {"foreign block", [](ShardSnapshot& s) { s.blocks[1].global_block = 4; },
       "is global block 4, expected 3"},
      {"short value", [](ShardSnapshot& s) { s.blocks[0].value.pop_back(); },
       "3 values, the block has 4"},
      {"odd state",
       [](ShardSnapshot& s) { s.blocks[2].optimizer_state.resize(4); },
       "optimizer state"},
  };
  for (const Case& c : cases) {
    ShardSnapshot snapshot = MakeSnapshot(schema, 0, 3, 1, 1);
    c.mutate(snapshot);
    const absl::Status s = store.Write(snapshot);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
  }
  EXPECT_EQ(store.LoadForShard(0, 3).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, WriteErrorsNameThePathAndErrno) {
  const std::string dir = TestDir();
  fs::create_directories(dir);
  WriteBytes(dir + "/shard-0-of-1", "a file where a directory should be");
  CheckpointStore store(dir, 3);
  const absl::Status s = store.Write(MakeSnapshot(TestSchema(), 0, 1, 1, 1));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr(dir + "/shard-0-of-1"));
  EXPECT_THAT(s.message(), HasSubstr("directory"));
}

TEST(CheckpointTest, WriteInfoGivesTheExactSize) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  CheckpointWriteInfo info;
  ASSERT_TRUE(store.Write(MakeSnapshot(TestSchema(), 0, 1, 1, 1), &info).ok());
  EXPECT_TRUE(info.written);
  EXPECT_FALSE(info.no_room);
  EXPECT_GT(info.free_bytes, 0);
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(FilePath(dir, 0, 1, 1))),
            info.bytes);
}

// A write that fails part way (here the file size limit: EFBIG, as ENOSPC
// would) leaves no temporary file, and the last good checkpoint stays even
// with keep_last 1.
TEST(CheckpointTest, FailedWriteLeavesNoTemporaryFileAndKeepsTheLastGood) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 1);
  const ModelSchema schema = TestSchema();
  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 1, 1, 1)).ok());

  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  struct rlimit small = saved;
  small.rlim_cur = 100;
  void (*saved_handler)(int) = ::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  CheckpointWriteInfo info;
  const absl::Status s = store.Write(MakeSnapshot(schema, 0, 1, 2, 2), &info);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  ::signal(SIGXFSZ, saved_handler);

  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("File too large"));
  EXPECT_FALSE(info.written);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir + "/shard-0-of-1")) {
    left.insert(e.path().filename().string());
  }
  EXPECT_EQ(left, (std::set<std::string>{"ckpt-000000000001.pstrain"}));
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectShardFromSalt(*restored, schema, 0, 1, 1);
}

TEST(CheckpointTest, ProbeCreatesTheDirectoryAndLeavesNothing) {
  const std::string dir = TestDir() + "/a/b";
  ASSERT_TRUE(ProbeCheckpointDir(dir).ok());
  EXPECT_TRUE(fs::is_directory(dir));
  EXPECT_TRUE(fs::is_empty(dir));

  const std::string file = dir + "/file";
  WriteBytes(file, "x");
  const absl::Status s = ProbeCheckpointDir(file + "/sub");
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("--checkpoint_dir=" + file + "/sub"));
  EXPECT_THAT(s.message(), HasSubstr("Not a directory"));
}

// flock locks belong to an open file description: a second Acquire in this
// process conflicts with the first as another process's would.
TEST(CheckpointTest, AShardsCheckpointsHaveOneHolderAtATime) {
  const std::string dir = TestDir() + "/locked";
  ASSERT_TRUE(ProbeCheckpointDir(dir).ok());
  absl::StatusOr<std::unique_ptr<CheckpointDirLock>> held =
      CheckpointDirLock::Acquire(dir, 0, absl::ZeroDuration());
  ASSERT_TRUE(held.ok()) << held.status();

  absl::StatusOr<std::unique_ptr<CheckpointDirLock>> second =
      CheckpointDirLock::Acquire(dir, 0, absl::Milliseconds(120));
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition)
      << second.status();
  EXPECT_THAT(second.status().message(),
              HasSubstr("--checkpoint_dir=" + dir + ": shard 0's"));
  EXPECT_THAT(second.status().message(),
              HasSubstr(absl::StrCat("held by another ps_server (pid ",
                                     ::getpid(), " on ")));
  // Another shard's are another lock.
  absl::StatusOr<std::unique_ptr<CheckpointDirLock>> other =
      CheckpointDirLock::Acquire(dir, 1, absl::ZeroDuration());
  EXPECT_TRUE(other.ok()) << other.status();

  held->reset();
  second = CheckpointDirLock::Acquire(dir, 0, absl::ZeroDuration());
  EXPECT_TRUE(second.ok()) << second.status();
}

struct Corruption {
  std::string name;
  std::function<void(std::string&)> apply;
  std::string reason;  // expected in files_skipped
};

std::vector<Corruption> Corruptions() {
  std::vector<Corruption> c;
  // Truncation everywhere: inside the magic, the length, the header, the
  // payload, and the trailer.
  for (int keep : {0, 5, 12, 20}) {
    c.push_back({absl::StrCat("truncated to ", keep),
                 [keep](std::string& b) { b.resize(keep); }, "truncated"});
  }
  c.push_back({"truncated mid-header",
               [](std::string& b) { b.resize(16 + HeaderLength(b) / 2); },
               "truncated"});
  c.push_back({"truncated mid-payload",
               [](std::string& b) { b.resize(16 + HeaderLength(b) + 10); },
               "truncated"});
  for (int cut : {1, 4, 8}) {
    c.push_back({absl::StrCat("last ", cut, " bytes cut"),
                 [cut](std::string& b) { b.resize(b.size() - cut); },
                 "truncated"});
  }
  c.push_back({"flipped payload byte",
               [](std::string& b) { b[16 + HeaderLength(b) + 9] ^= 0x10; },
               "CRC-32 mismatch"});
  c.push_back({"flipped last payload byte",
               [](std::string& b) { b[b.size() - 9] ^= 0x01; },
               "CRC-32 mismatch"});
  c.push_back({"flipped crc byte", [](std::string& b) { b[b.size() - 7] ^= 1; },
               "CRC-32 mismatch"});
  c.push_back({"bad magic", [](std::string& b) { b[3] = 'X'; }, "bad magic"});
  c.push_back({"huge header length", [](std::string& b) { b[14] = 0x7f; },
               "header length"});
  c.push_back({"garbage appended", [](std::string& b) { b += "more bytes"; },
               "end marker"});
  c.push_back({"zeroed header",
               [](std::string& b) {
                 std::fill(b.begin() + 16, b.begin() + 16 + HeaderLength(b),
                           '\0');
               },
               ""});
  return c;
}

TEST(CheckpointTest, CorruptOrTruncatedNewestFileFallsBackToThePrevious) {
  const ModelSchema schema = TestSchema();
  for (const Corruption& corruption : Corruptions()) {
    SCOPED_TRACE(corruption.name);
    const std::string dir = TestDir();
    CheckpointStore store(dir, 3);
    WriteLayout(store, schema, 2, 1, 1);
    WriteLayout(store, schema, 2, 2, 2);
    const std::string bad = FilePath(dir, 1, 2, 2);
    std::string bytes = ReadBytes(bad);
    corruption.apply(bytes);
    WriteBytes(bad, bytes);

    for (int shard = 0; shard < 2; ++shard) {
      absl::StatusOr<RestoredShard> restored = store.LoadForShard(shard, 2);
      ASSERT_TRUE(restored.ok()) << restored.status();
      ASSERT_EQ(restored->files_skipped.size(), 1u);
      EXPECT_THAT(restored->files_skipped[0], HasSubstr(bad + ": "));
      EXPECT_THAT(restored->files_skipped[0], HasSubstr(corruption.reason));
      EXPECT_EQ(restored->files_used,
                (std::vector<std::string>{FilePath(dir, 0, 2, 2),
                                          FilePath(dir, 1, 2, 1)}));
      // Shard 0's blocks from its newest file, shard 1's from its previous.
      ExpectShardFromSalt(*restored, schema, shard, 2, shard == 0 ? 2 : 1);
      EXPECT_EQ(restored->next_sequence, 3);
    }
  }
}

TEST(CheckpointTest, EveryFlippedByteAndEveryTruncationIsDetected) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 1, 1, 1);
  WriteLayout(store, schema, 1, 2, 2);
  const std::string newest = FilePath(dir, 0, 1, 2);
  const std::string good = ReadBytes(newest);
  std::vector<std::string> variants;
  for (size_t i = 0; i < good.size(); ++i) {
    std::string flipped = good;
    flipped[i] ^= static_cast<char>(1 << (i % 8));
    variants.push_back(std::move(flipped));
  }
  for (size_t n = 0; n < good.size(); ++n)
    variants.push_back(good.substr(0, n));
  // ~2000 skipped files: keep their warnings out of the test log.
  const int min_log_level = FLAGS_minloglevel;
  FLAGS_minloglevel = google::GLOG_ERROR;
  for (size_t v = 0; v < variants.size(); ++v) {
    WriteBytes(newest, variants[v]);
    absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
    ASSERT_TRUE(restored.ok()) << v << ": " << restored.status();
    ASSERT_EQ(restored->files_skipped.size(), 1u) << v;
    ASSERT_EQ(restored->files_used[0], FilePath(dir, 0, 1, 1)) << v;
  }
  FLAGS_minloglevel = min_log_level;
  WriteBytes(newest, good);
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(restored->files_skipped.empty());
  ExpectShardFromSalt(*restored, schema, 0, 1, 2);
}

TEST(CheckpointTest, LyingLengthsAreRefusedBeforeAllocating) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 1, 1, 1);
  const ShardSnapshot snapshot = MakeSnapshot(schema, 0, 1, 2, 2);
  // A well-formed, correctly checksummed file whose header claims ~2^60
  // floats for one block: a reader trusting it would try to allocate them.
  CheckpointHeader header;
  std::vector<float> payload;
  ToHeader(snapshot, &header, &payload);
  header.mutable_blocks(0)->set_value_count(int64_t{1} << 60);
  WriteBytes(FilePath(dir, 0, 1, 2), EncodeFile(header, payload));
  // And one whose counts are negative.
  header.mutable_blocks(0)->set_value_count(-4);
  header.set_sequence(3);
  WriteBytes(FilePath(dir, 0, 1, 3), EncodeFile(header, payload));

  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->files_skipped.size(), 2u);
  EXPECT_THAT(restored->files_skipped[0], HasSubstr("claims -4 values"));
  EXPECT_THAT(restored->files_skipped[1], HasSubstr("claims"));
  ExpectShardFromSalt(*restored, schema, 0, 1, 1);
}

TEST(CheckpointTest, IntactButInconsistentFilesAreSkipped) {
  const ModelSchema schema = TestSchema();
  struct Case {
    std::string name;
    std::function<void(CheckpointHeader&)> mutate;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"wrong shard", [](CheckpointHeader& h) { h.set_shard_id(0); },
       "header says shard 0 of 2"},
      {"wrong sequence", [](CheckpointHeader& h) { h.set_sequence(9); },
       "sequence 9"},
      {"foreign block",
       [](CheckpointHeader& h) { h.mutable_blocks(1)->set_global_block(4); },
       "belongs to shard 0"},
      {"block beyond the model",
       [](CheckpointHeader& h) { h.mutable_blocks(1)->set_global_block(15); },
       "outside the schema"},
      {"duplicate block",
       [](CheckpointHeader& h) { h.mutable_blocks(1)->set_global_block(1); },
       "listed twice"},
      {"bad schema",
       [](CheckpointHeader& h) { h.mutable_schema()->clear_dense(); },
       "bad schema"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = TestDir();
    CheckpointStore store(dir, 3);
    WriteLayout(store, schema, 2, 1, 1);
    CheckpointHeader header;
    std::vector<float> payload;
    ToHeader(MakeSnapshot(schema, 1, 2, 2, 2), &header, &payload);
    c.mutate(header);
    const std::string bad = FilePath(dir, 1, 2, 2);
    WriteBytes(bad, EncodeFile(header, payload));
    absl::StatusOr<RestoredShard> restored = store.LoadForShard(1, 2);
    ASSERT_TRUE(restored.ok()) << restored.status();
    ASSERT_EQ(restored->files_skipped.size(), 1u);
    EXPECT_THAT(restored->files_skipped[0], HasSubstr(bad + ": "));
    EXPECT_THAT(restored->files_skipped[0], HasSubstr(c.reason));
    ExpectShardFromSalt(*restored, schema, 1, 2, 1);
  }
}

TEST(CheckpointTest, ShardWithNoValidFileIsDataLossNamingIt) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 3, 1, 1);
  const std::string bad = FilePath(dir, 2, 3, 1);
  std::string bytes = ReadBytes(bad);
  bytes.resize(bytes.size() / 2);
  WriteBytes(bad, bytes);
  for (int shard = 0; shard < 3; ++shard) {
    const absl::StatusOr<RestoredShard> restored = store.LoadForShard(shard, 3);
    EXPECT_EQ(restored.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(restored.status().message(),
                HasSubstr("shard-2-of-3 has no valid checkpoint file (1 "
                          "invalid ones skipped)"));
  }
  // A shard that never wrote anything is just as lost.
  fs::remove_all(dir + "/shard-2-of-3");
  const absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 2);
  EXPECT_EQ(restored.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(restored.status().message(),
              HasSubstr("shard-2-of-3 has no valid checkpoint file (0"));
}

// A shard killed before its first checkpoint was complete (a temporary file
// at most) while the others have theirs starts fresh, like a shard without
// --checkpoint_dir (the workers' steps it lacks are skipped and counted),
// and does not hold the others back: in their own layout each restores its
// own files. Restoring into another shard count still needs every file.
TEST(CheckpointTest, AShardThatNeverWroteOneStartsFreshInItsOwnLayout) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 3, 1, 1);
  fs::remove_all(dir + "/shard-2-of-3");
  fs::create_directories(dir + "/shard-2-of-3");
  WriteBytes(dir + "/shard-2-of-3/.ckpt-000000000001.pstrain.tmp-123", "part");
  const absl::StatusOr<RestoredShard> fresh = store.LoadForShard(2, 3);
  EXPECT_EQ(fresh.status().code(), absl::StatusCode::kNotFound)
      << fresh.status();
  EXPECT_THAT(fresh.status().message(),
              HasSubstr("no checkpoint of shard 2 of 3"));
  for (int shard = 0; shard < 2; ++shard) {
    const absl::StatusOr<RestoredShard> other = store.LoadForShard(shard, 3);
    ASSERT_TRUE(other.ok()) << other.status();
    ExpectShardFromSalt(*other, schema, shard, 3, 1);
  }
  const absl::StatusOr<RestoredShard> resharded = store.LoadForShard(0, 2);
  EXPECT_EQ(resharded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(resharded.status().message(),
              HasSubstr("shard-2-of-3 has no valid checkpoint file (0"));
}

// Restores every shard of `new_shards` from a checkpoint taken on 3 and
// checks that every block of the model comes back exactly once, on the
// shard that Partition says owns it, with the saved values.
void ExpectReshard(int new_shards) {
  SCOPED_TRACE(absl::StrCat("3 -> ", new_shards));
  const std::string dir =
      absl::StrCat(TestDir(), "_", new_shards);  // TestDir is per test
  fs::remove_all(dir);
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 3, 1, 1);
  WriteLayout(store, schema, 3, 2, 2);
  absl::StatusOr<Partition> partition = Partition::Create(schema, new_shards);
  ASSERT_TRUE(partition.ok());
  std::map<int64_t, int> seen;
  for (int shard = 0; shard < new_shards; ++shard) {
    absl::StatusOr<RestoredShard> restored =
        store.LoadForShard(shard, new_shards);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->old_num_shards, 3);
    EXPECT_EQ(restored->next_sequence, 3);
    EXPECT_EQ(restored->files_used.size(), 3u);
    std::vector<int64_t> got;
    for (const BlockSnapshot& b : restored->blocks) {
      got.push_back(b.global_block);
      ++seen[b.global_block];
    }
    const std::vector<int>& owned = partition->BlocksOfShard(shard);
    EXPECT_EQ(got, std::vector<int64_t>(owned.begin(), owned.end()));
    ExpectShardFromSalt(*restored, schema, shard, new_shards, 2);
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(kTestBlocks));
  for (const auto& [g, count] : seen) EXPECT_EQ(count, 1) << g;
}

// `s` as a shard holds it when each tensor has its own optimizer: w's blocks
// with two state floats per element (Adam), b's with none (a STATE tensor
// such as BatchNorm's running mean), emb's with one.
ShardSnapshot WithStatePerTensor(ShardSnapshot s) {
  constexpr int kStateOfTensor[] = {2, 0, 1};
  absl::StatusOr<Partition> partition = Partition::Create(s.schema, 1);
  EXPECT_TRUE(partition.ok()) << partition.status();
  for (BlockSnapshot& b : s.blocks) {
    const int tensor = partition->blocks()[b.global_block].tensor;
    b.optimizer_state.resize(kStateOfTensor[tensor] * b.value.size());
  }
  return s;
}

TEST(CheckpointTest, TensorsWithTheirOwnOptimizerStateRestoreIntoAnyCount) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  for (int shard = 0; shard < 2; ++shard) {
    const absl::Status written =
        store.Write(WithStatePerTensor(MakeSnapshot(schema, shard, 2, 1, 1)));
    ASSERT_TRUE(written.ok()) << written;
  }
  for (int new_shards : {2, 3, 1}) {
    for (int shard = 0; shard < new_shards; ++shard) {
      SCOPED_TRACE(absl::StrCat("shard ", shard, " of ", new_shards));
      absl::StatusOr<RestoredShard> restored =
          store.LoadForShard(shard, new_shards);
      ASSERT_TRUE(restored.ok()) << restored.status();
      EXPECT_TRUE(restored->files_skipped.empty());
      ExpectBlocksOf(*restored, WithStatePerTensor(MakeSnapshot(
                                    schema, shard, new_shards, 0, 1)));
    }
  }
}

TEST(CheckpointTest, RestoresIntoFewerShards) {
  ExpectReshard(2);
  ExpectReshard(1);
}

TEST(CheckpointTest, RestoresIntoMoreShards) {
  ExpectReshard(4);
  ExpectReshard(20);  // more shards than blocks: some shards restore nothing
}

// --- sparse tables ----------------------------------------------------------

ModelSchema SparseSchema() {
  ModelSchema schema = TestSchema();
  for (const auto& [name, dim] :
       {std::pair<const char*, int>{"user", 3}, {"item", 2}}) {
    SparseTableSpec* table = schema.add_sparse();
    table->set_name(name);
    table->set_dim(dim);
    table->mutable_optimizer()->set_name("adam");
  }
  return schema;
}
constexpr uint64_t kSparseIds = 200;

float RowValueOf(int t, uint64_t id, int64_t k) {
  return 0.5f * t + static_cast<float>(id) + 0.01f * k;
}

// Shard `shard_id` of `num_shards` holding, of ids 0..kSparseIds-1 of every
// table, those SparseShardOf places on it; table t at version 40 + t +
// shard_id (shards may be a step apart).
ShardSnapshot MakeSparseSnapshot(int shard_id, int num_shards,
                                 int64_t sequence) {
  const ModelSchema schema = SparseSchema();
  ShardSnapshot snapshot = MakeSnapshot(schema, shard_id, num_shards, sequence,
                                        /*salt=*/1);
  for (int t = 0; t < schema.sparse_size(); ++t) {
    const SparseTableSpec& spec = schema.sparse(t);
    SparseTableSnapshot& table = snapshot.sparse.emplace_back();
    table.name = spec.name();
    table.dim = spec.dim();
    table.state_floats = 2 * spec.dim();
    table.version = 40 + t + shard_id;
    for (uint64_t id = 0; id < kSparseIds; ++id) {
      if (SparseShardOf(spec.name(), id, num_shards) != shard_id) continue;
      table.ids.push_back(id);
      table.update_counts.push_back(static_cast<int64_t>(id % 7) + 1);
      for (int64_t k = 0; k < table.dim; ++k) {
        table.values.push_back(RowValueOf(t, id, k));
        table.states.push_back(-RowValueOf(t, id, k));
        table.states.push_back(RowValueOf(t, id, k) * 2);
      }
    }
  }
  return snapshot;
}

// Rows saved on 3 shards come back on any number of shards: each on the
// shard SparseShardOf names for the new count, exactly once, with its
// values, state and update count; a table's step is the smallest saved.
TEST(CheckpointTest, SparseRowsRoundTripIntoAnyShardCount) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(store.Write(MakeSparseSnapshot(i, 3, 1)).ok());
  }
  const ModelSchema schema = SparseSchema();
  for (int new_shards : {3, 1, 2, 5}) {
    SCOPED_TRACE(absl::StrCat("3 -> ", new_shards));
    std::vector<std::map<uint64_t, int>> seen(schema.sparse_size());
    for (int shard = 0; shard < new_shards; ++shard) {
      absl::StatusOr<RestoredShard> restored =
          store.LoadForShard(shard, new_shards);
      ASSERT_TRUE(restored.ok()) << restored.status();
      ASSERT_EQ(restored->sparse.size(), 2u);
      for (int t = 0; t < 2; ++t) {
        const SparseTableSnapshot& table = restored->sparse[t];
        EXPECT_EQ(table.name, schema.sparse(t).name());
        EXPECT_EQ(table.version, 40 + t);
        ASSERT_EQ(table.update_counts.size(), table.ids.size());
        ASSERT_EQ(table.values.size(), table.ids.size() * table.dim);
        ASSERT_EQ(table.states.size(), table.ids.size() * 2 * table.dim);
        for (size_t r = 0; r < table.ids.size(); ++r) {
          const uint64_t id = table.ids[r];
          EXPECT_EQ(SparseShardOf(table.name, id, new_shards), shard) << id;
          ++seen[t][id];
          EXPECT_EQ(table.update_counts[r], static_cast<int64_t>(id % 7) + 1);
          for (int64_t k = 0; k < table.dim; ++k) {
            EXPECT_EQ(table.values[r * table.dim + k], RowValueOf(t, id, k));
            EXPECT_EQ(table.states[r * 2 * table.dim + 2 * k],
                      -RowValueOf(t, id, k));
          }
        }
      }
    }
    for (int t = 0; t < 2; ++t) {
      ASSERT_EQ(seen[t].size(), kSparseIds) << t;
      for (const auto& [id, count] : seen[t]) EXPECT_EQ(count, 1) << id;
    }
  }
}

TEST(CheckpointTest, SparseRowsAreCoveredByTheChecksumAndTheLengthCheck) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  ASSERT_TRUE(store.Write(MakeSparseSnapshot(0, 1, 1)).ok());
  ASSERT_TRUE(store.Write(MakeSparseSnapshot(0, 1, 2)).ok());
  const std::string path = FilePath(dir, 0, 1, 2);
  std::string bytes = ReadBytes(path);
  bytes[bytes.size() - 8 - 3] ^= 0x10;  // inside the last table's state
  WriteBytes(path, bytes);
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->files_skipped.size(), 1u);
  EXPECT_THAT(restored->files_skipped[0], HasSubstr("CRC-32 mismatch"));

  // A checksummed header claiming 2^40 rows is refused before allocating.
  ShardSnapshot snapshot = MakeSparseSnapshot(0, 1, 3);
  CheckpointHeader header;
  std::vector<float> payload;
  ToHeader(snapshot, &header, &payload);
  *header.mutable_schema() = SparseSchema();
  CheckpointSparseTable* table = header.add_sparse();
  table->set_name("user");
  table->set_row_count(int64_t{1} << 40);
  table->set_value_floats(3);
  table->set_state_floats(6);
  WriteBytes(FilePath(dir, 0, 1, 3), EncodeFile(header, payload));
  restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->files_skipped.size(), 2u);
  EXPECT_THAT(restored->files_skipped[0],
              HasSubstr("claims 1099511627776 rows"));
}

void SetMtime(const std::string& path, int64_t seconds) {
  struct timespec times[2] = {{seconds, 0}, {seconds, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
}

// A job that went 3 -> 2 shards and then back to 3 (or on to 4) continues
// from the newest files, those of 2 shards, not from its own layout's
// older ones: restoring those would go back to an earlier step unnoticed.
TEST(CheckpointTest, RestoresTheNewestCompleteLayoutMatchingOrNot) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 3, 1, 3);  // an older job on 3 shards
  WriteLayout(store, schema, 2, 2, 2);  // resumed on 2
  // File times say otherwise (a copied directory): the sequence decides.
  for (int i = 0; i < 3; ++i) SetMtime(FilePath(dir, i, 3, 1), 2000);
  for (int i = 0; i < 2; ++i) SetMtime(FilePath(dir, i, 2, 2), 1000);

  for (int shards : {3, 2, 4}) {
    absl::StatusOr<RestoredShard> restored =
        store.LoadForShard(shards - 1, shards);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->old_num_shards, 2) << "into " << shards;
    ExpectShardFromSalt(*restored, schema, shards - 1, shards, 2);
    EXPECT_EQ(restored->next_sequence, 3);
  }

  // The newest layout incomplete: the older complete one.
  const std::string bad = FilePath(dir, 0, 2, 2);
  WriteBytes(bad, "not a checkpoint");
  SetMtime(bad, 3000);
  for (int shards : {2, 3, 4}) {
    absl::StatusOr<RestoredShard> fallback = store.LoadForShard(0, shards);
    ASSERT_TRUE(fallback.ok()) << fallback.status();
    EXPECT_EQ(fallback->old_num_shards, 3);
    ExpectShardFromSalt(*fallback, schema, 0, shards, 3);
    ASSERT_EQ(fallback->files_skipped.size(), 1u);
    EXPECT_THAT(fallback->files_skipped[0], HasSubstr(bad));
  }
}

TEST(CheckpointTest, DisagreeingShardsAreFailedPrecondition) {
  const ModelSchema schema = TestSchema();
  {
    const std::string dir = TestDir() + "_schema";
    fs::remove_all(dir);
    CheckpointStore store(dir, 3);
    ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 2, 1, 1)).ok());
    ASSERT_TRUE(store.Write(MakeSnapshot(TestSchema(8), 1, 2, 1, 1)).ok());
    const absl::Status s = store.LoadForShard(0, 2).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("seed 7 vs 8"));
    EXPECT_THAT(s.message(), HasSubstr(FilePath(dir, 1, 2, 1)));
  }
  {
    const std::string dir = TestDir() + "_optimizer";
    fs::remove_all(dir);
    CheckpointStore store(dir, 3);
    ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 2, 1, 1)).ok());
    ShardSnapshot other = MakeSnapshot(schema, 1, 2, 1, 1);
    other.optimizer = "sgd";
    ASSERT_TRUE(store.Write(other).ok());
    const absl::Status s = store.LoadForShard(1, 3).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("optimizer 'adam' vs 'sgd'"));
  }
  {
    const std::string dir = TestDir() + "_mode";
    fs::remove_all(dir);
    CheckpointStore store(dir, 3);
    ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 2, 1, 1)).ok());
    ShardSnapshot other = MakeSnapshot(schema, 1, 2, 1, 1);
    other.mode = "ssp";
    ASSERT_TRUE(store.Write(other).ok());
    const absl::Status s = store.LoadForShard(0, 1).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("mode 'sync' vs 'ssp'"));
  }
}

TEST(CheckpointTest, MissingBlockIsFailedPreconditionNamingIt) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 2, 1, 1)).ok());
  // An intact file of shard 1 of 2 that lacks its last block (global 11,
  // 'emb' block 2): a writer bug, not corruption, so no older file is tried.
  ShardSnapshot partial = MakeSnapshot(schema, 1, 2, 1, 1);
  partial.blocks.pop_back();
  CheckpointHeader header;
  std::vector<float> payload;
  ToHeader(partial, &header, &payload);
  WriteBytes(FilePath(dir, 1, 2, 1), EncodeFile(header, payload));

  // Shards that do not own block 11 restore fine.
  EXPECT_TRUE(store.LoadForShard(0, 2).ok());
  EXPECT_TRUE(store.LoadForShard(0, 3).ok());
  for (const auto& [shard, shards] : {std::pair{1, 2}, std::pair{2, 3}}) {
    const absl::Status s = store.LoadForShard(shard, shards).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(),
                HasSubstr("global block 11 (tensor 'emb' block 2) is missing "
                          "from " +
                          FilePath(dir, 1, 2, 1)));
  }
}

TEST(CheckpointTest, LeftoverTempFileIsIgnoredAndCleanedUp) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 1, 1, 1);
  // What a write that crashed before its rename leaves behind, plus a file
  // whose name is not canonical.
  const std::string temp =
      dir + "/shard-0-of-1/.ckpt-000000000002.pstrain.tmp-4242";
  std::string bytes = ReadBytes(FilePath(dir, 0, 1, 1));
  bytes.resize(bytes.size() / 3);
  WriteBytes(temp, bytes);
  WriteBytes(dir + "/shard-0-of-1/ckpt-9.pstrain", "stray");
  WriteBytes(dir + "/shard-00-of-1/ckpt-000000000009.pstrain", "stray");

  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(restored->files_skipped.empty());
  EXPECT_EQ(restored->next_sequence, 2);
  ExpectShardFromSalt(*restored, schema, 0, 1, 1);

  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 1, 2, 2)).ok());
  EXPECT_FALSE(fs::exists(temp));
  for (const auto& e : fs::directory_iterator(dir + "/shard-0-of-1")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos)
        << e.path();
  }
  restored = store.LoadForShard(0, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectShardFromSalt(*restored, schema, 0, 1, 2);
}

TEST(CheckpointTest, NotFoundWithoutAnyCheckpoint) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  EXPECT_EQ(store.LoadForShard(0, 1).status().code(),
            absl::StatusCode::kNotFound);  // no directory
  fs::create_directories(dir);
  EXPECT_EQ(store.LoadForShard(0, 1).status().code(),
            absl::StatusCode::kNotFound);  // empty
  WriteBytes(dir + "/shard-0-of-1/.ckpt-000000000001.pstrain.tmp-1", "x");
  const absl::Status s = store.LoadForShard(0, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);  // only a temp file
  EXPECT_THAT(s.message(), HasSubstr(dir));
}

TEST(CheckpointTest, LoadRefusesABadShard) {
  CheckpointStore store(TestDir(), 3);
  for (const auto& [shard, shards] :
       {std::pair{0, 0}, std::pair{2, 2}, std::pair{-1, 2}}) {
    EXPECT_EQ(store.LoadForShard(shard, shards).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// 2 -> 3 -> 2 shards, shard 1 killed before its first file since: its own
// layout's file predates the 3-shard files, so it restores from those (the
// job's later state) instead of going back to before them; shard 0, whose
// file is the newest, keeps its own.
TEST(CheckpointTest, AFileOlderThanAnotherLayoutsIsPassedOver) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 2, 1, 1);
  WriteLayout(store, schema, 3, 2, 2);
  ASSERT_TRUE(store.Write(MakeSnapshot(schema, 0, 2, 3, 3)).ok());

  absl::StatusOr<RestoredShard> behind = store.LoadForShard(1, 2);
  ASSERT_TRUE(behind.ok()) << behind.status();
  EXPECT_EQ(behind->old_num_shards, 3);
  ExpectShardFromSalt(*behind, schema, 1, 2, 2);
  absl::StatusOr<RestoredShard> ahead = store.LoadForShard(0, 2);
  ASSERT_TRUE(ahead.ok()) << ahead.status();
  EXPECT_EQ(ahead->old_num_shards, 2);
  ExpectShardFromSalt(*ahead, schema, 0, 2, 3);
}

TEST(CheckpointTest, NextSequenceIsAboveEveryLayout) {
  const std::string dir = TestDir();
  CheckpointStore store(dir, 3);
  const ModelSchema schema = TestSchema();
  WriteLayout(store, schema, 2, 40, 1);
  WriteLayout(store, schema, 3, 7, 1);
  // The 2-shard layout's (newer) file of shard 0 cut short: the 3-shard
  // layout is restored, and the next file is still above the other's 40.
  WriteBytes(FilePath(dir, 0, 2, 40), "cut");
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 3);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->old_num_shards, 3);
  EXPECT_EQ(restored->next_sequence, 41);
  // And the restored shard can keep checkpointing from there.
  ShardSnapshot next = MakeSnapshot(schema, 0, 3, restored->next_sequence, 5);
  EXPECT_TRUE(store.Write(next).ok());
}

}  // namespace
}  // namespace pstrain
