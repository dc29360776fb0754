// Writes the seed corpus of the push/pull fuzz target: one file per named
// case, each a valid input (push_pull_fuzz.h) covering one path of the
// request handling, good or bad. The checked-in corpus/ was made with
//
//   bazel run //ps_server/fuzz:make_seed_corpus -- "$PWD/ps_server/fuzz/corpus"
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "common/transport/tensor_codec.h"
#include "proto/ps.pb.h"
#include "ps_server/fuzz/push_pull_fuzz.h"

namespace pstrain::fuzz {
namespace {

struct Block {
  std::string tensor;
  int64_t block;
  int64_t length;
};

// The blocks of FuzzSchema(): w has blocks of 4, 4 and 2 elements, b one of
// 3. With two shards, shard 0 holds w/0 and w/2, shard 1 w/1 and b/0.
std::vector<Block> AllBlocks() {
  return {{"w", 0, 4}, {"w", 1, 4}, {"w", 2, 2}, {"b", 0, 3}};
}
std::vector<Block> Shard0Of2() { return {{"w", 0, 4}, {"w", 2, 2}}; }

PushRequest Push(int worker, int64_t step, const std::vector<Block>& blocks,
                 float value = 1.0f, DataType dtype = FLOAT32) {
  PushRequest push;
  push.set_protocol_version(kProtocolVersion);
  push.set_worker_id(worker);
  push.set_step(step);
  for (const Block& b : blocks) {
    TensorBlock* block = push.add_blocks();
    block->set_tensor(b.tensor);
    block->set_block(b.block);
    block->set_dtype(dtype);
    EncodeFromFloat32(dtype, std::vector<float>(b.length, value),
                      block->mutable_data());
  }
  return push;
}

PullRequest Pull(
    int worker, int64_t step,
    const std::vector<std::pair<std::string, int64_t>>& refs = {}) {
  PullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(worker);
  pull.set_step(step);
  for (const auto& [tensor, block] : refs) {
    BlockRef* ref = pull.add_blocks();
    ref->set_tensor(tensor);
    ref->set_block(block);
  }
  return pull;
}

RegisterModelRequest Register(int worker, int num_shards = 1) {
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = FuzzSchema();
  request.set_num_shards(num_shards);
  request.set_num_workers(2);
  request.set_worker_id(worker);
  request.set_incarnation(42);
  return request;
}

FuzzHeader Header(RpcKind kind, int mode = 0,
                  Prelude prelude = Prelude::kNone) {
  FuzzHeader h;
  h.kind = kind;
  h.mode = mode;
  h.prelude = prelude;
  return h;
}

// The corpus in the making: (file name, input) in the order written.
class Seeds {
 public:
  void Add(const std::string& name, const FuzzHeader& h,
           const std::string& message) {
    seeds_.emplace_back(name, EncodeFuzzInput(h, message));
  }
  const std::vector<std::pair<std::string, std::string>>& list() const {
    return seeds_;
  }

 private:
  std::vector<std::pair<std::string, std::string>> seeds_;
};

// The header's mode values (push_pull_fuzz.h), named for the seeds below.
constexpr int kSync = 0, kAsync = 1, kSsp = 2, kBackup = 3;

// Well-formed pushes from registered members: in every mode, cut at
// several places, and the duplicate, late and two-shard answers they get.
void AddGoodPushes(Seeds* seeds) {
  for (int mode : {kSync, kAsync, kSsp, kBackup}) {
    seeds->Add(absl::StrCat("push_ok_mode", mode), Header(RpcKind::kPush, mode),
               Push(0, 0, AllBlocks()).SerializeAsString());
  }
  {
    FuzzHeader h = Header(RpcKind::kPush, kAsync);
    h.extra_segments = 3;
    h.cuts[0] = 3;
    h.cuts[1] = 17;
    h.cuts[2] = 30;
    seeds->Add("push_async_four_segments", h,
               Push(1, 5, AllBlocks(), 0.25f).SerializeAsString());
    h.extra_segments = 1;
    h.cuts[0] = 0;
    seeds->Add("push_async_empty_first_segment", h,
               Push(1, 5, AllBlocks(), 0.25f).SerializeAsString());
  }
  seeds->Add("push_sync_duplicate",
             Header(RpcKind::kPush, kSync, Prelude::kWorker0PushesStep0),
             Push(0, 0, AllBlocks()).SerializeAsString());
  seeds->Add("push_async_duplicate",
             Header(RpcKind::kPush, kAsync, Prelude::kWorker0PushesStep0),
             Push(0, 0, AllBlocks()).SerializeAsString());
  seeds->Add("push_backup_late",
             Header(RpcKind::kPush, kBackup, Prelude::kWorker0PushesStep0),
             Push(1, 0, AllBlocks()).SerializeAsString());
  seeds->Add("push_sync_step1",
             Header(RpcKind::kPush, kSync, Prelude::kBothPushStep0),
             Push(1, 1, AllBlocks()).SerializeAsString());
  seeds->Add("push_sync_completes_after_leave",
             Header(RpcKind::kPush, kSync, Prelude::kWorker1Leaves),
             Push(0, 0, AllBlocks()).SerializeAsString());
  seeds->Add("push_fp16", Header(RpcKind::kPush, kAsync),
             Push(0, 0, AllBlocks(), 0.5f, FLOAT16).SerializeAsString());
  seeds->Add("push_bf16", Header(RpcKind::kPush, kSync),
             Push(0, 0, AllBlocks(), 0.5f, BFLOAT16).SerializeAsString());
  {
    FuzzHeader h = Header(RpcKind::kPush, kSync);
    h.two_shards = true;
    seeds->Add("push_two_shards_ok", h,
               Push(0, 0, Shard0Of2()).SerializeAsString());
    seeds->Add("push_two_shards_foreign_block", h,
               Push(0, 0, AllBlocks()).SerializeAsString());
  }
}

// Pushes that parse but are refused: each is one check of the shard's
// validation, which must leave the model alone.
void AddRefusedPushes(Seeds* seeds) {
  seeds->Add("push_nan", Header(RpcKind::kPush, kSync),
             Push(0, 0, AllBlocks(), std::numeric_limits<float>::quiet_NaN())
                 .SerializeAsString());
  {
    FuzzHeader h = Header(RpcKind::kPush, kAsync);
    h.skip_nonfinite = true;
    seeds->Add("push_inf_skipped", h,
               Push(0, 0, AllBlocks(), std::numeric_limits<float>::infinity())
                   .SerializeAsString());
  }
  seeds->Add("push_short_payload", Header(RpcKind::kPush, kSync),
             Push(0, 0, {{"w", 0, 3}}).SerializeAsString());
  seeds->Add("push_unknown_tensor", Header(RpcKind::kPush, kSync),
             Push(0, 0, {{"v", 0, 4}}).SerializeAsString());
  seeds->Add("push_unknown_block", Header(RpcKind::kPush, kSync),
             Push(0, 0, {{"w", 7, 4}}).SerializeAsString());
  seeds->Add("push_same_block_twice", Header(RpcKind::kPush, kAsync),
             Push(0, 0, {{"w", 0, 4}, {"w", 0, 4}}).SerializeAsString());
  seeds->Add("push_negative_step", Header(RpcKind::kPush, kSync),
             Push(0, -3, AllBlocks()).SerializeAsString());
  seeds->Add("push_future_step", Header(RpcKind::kPush, kSync),
             Push(0, int64_t{1} << 40, AllBlocks()).SerializeAsString());
  seeds->Add("push_worker_minus5", Header(RpcKind::kPush, kAsync),
             Push(-5, 0, AllBlocks()).SerializeAsString());
  seeds->Add("push_worker_int_max", Header(RpcKind::kPush, kAsync),
             Push(std::numeric_limits<int32_t>::max(), 0, AllBlocks())
                 .SerializeAsString());
  {
    PushRequest bad_version = Push(0, 0, AllBlocks());
    bad_version.set_protocol_version(99);
    seeds->Add("push_protocol_99", Header(RpcKind::kPush, kSync),
               bad_version.SerializeAsString());
    PushRequest negative_pulled = Push(0, 0, AllBlocks());
    negative_pulled.mutable_blocks(1)->set_version(-1);
    seeds->Add("push_negative_pulled_version", Header(RpcKind::kPush, kAsync),
               negative_pulled.SerializeAsString());
    PushRequest dtype7 = Push(0, 0, {{"w", 0, 4}});
    dtype7.mutable_blocks(0)->set_dtype(static_cast<DataType>(7));
    seeds->Add("push_dtype_7", Header(RpcKind::kPush, kSync),
               dtype7.SerializeAsString());
  }
  {
    FuzzHeader h = Header(RpcKind::kPush, kSync);
    h.unregistered = true;
    seeds->Add("push_unregistered", h,
               Push(0, 0, AllBlocks()).SerializeAsString());
  }
}

// Malformed protobuf: the wire parser's own refusals, before the shard.
void AddMalformedPushes(Seeds* seeds) {
  seeds->Add("push_truncated_varint", Header(RpcKind::kPush, kSync),
             std::string("\x08\x01\x18\xff\xff", 5));
  seeds->Add("push_length_2_60", Header(RpcKind::kPush, kSync),
             std::string("\x2a\x80\x80\x80\x80\x80\x80\x80\x80\x10", 10));
  seeds->Add("push_wrong_wire_type", Header(RpcKind::kPush, kSync),
             std::string("\x0d\x01\x00\x00\x00", 5));  // field 1 as fixed32
  seeds->Add("push_group", Header(RpcKind::kPush, kSync),
             std::string("\x2b\x2c", 2));
  seeds->Add("push_garbage", Header(RpcKind::kPush, kAsync),
             std::string("\xde\xad\xbe\xef\x00\x01\x02", 7));
}

// Pulls: answered at once, after a step, when the shard shuts down, at
// their deadline, and refused.
void AddPulls(Seeds* seeds) {
  seeds->Add("pull_all", Header(RpcKind::kPull, kSync),
             Pull(0, 0).SerializeAsString());
  seeds->Add("pull_some_blocks", Header(RpcKind::kPull, kAsync),
             Pull(1, 3, {{"b", 0}, {"w", 1}}).SerializeAsString());
  seeds->Add("pull_step1_after_step",
             Header(RpcKind::kPull, kSync, Prelude::kBothPushStep0),
             Pull(0, 1).SerializeAsString());
  seeds->Add("pull_step1_waits_shutdown", Header(RpcKind::kPull, kSync),
             Pull(0, 1).SerializeAsString());
  {
    FuzzHeader h = Header(RpcKind::kPull, kSync, Prelude::kWorker0PushesStep0);
    h.pull_waits_for_deadline = true;
    seeds->Add("pull_step1_deadline", h, Pull(0, 1).SerializeAsString());
    h = Header(RpcKind::kPull, kSsp, Prelude::kHeartbeatsAndPull);
    h.pull_waits_for_deadline = true;
    seeds->Add("pull_ssp_too_far_ahead", h, Pull(0, 9).SerializeAsString());
  }
  seeds->Add("pull_sync_out_of_range", Header(RpcKind::kPull, kSync),
             Pull(0, 5).SerializeAsString());
  seeds->Add("pull_duplicate_block", Header(RpcKind::kPull, kAsync),
             Pull(0, 0, {{"w", 0}, {"w", 0}}).SerializeAsString());
  seeds->Add("pull_unknown_block", Header(RpcKind::kPull, kAsync),
             Pull(0, 0, {{"w", -1}}).SerializeAsString());
  {
    FuzzHeader h = Header(RpcKind::kPull, kSync);
    h.two_shards = true;
    h.shard_id = 1;
    seeds->Add("pull_foreign_block", h,
               Pull(0, 0, {{"w", 0}}).SerializeAsString());
  }
  seeds->Add("pull_observer_minus2", Header(RpcKind::kPull, kAsync),
             Pull(-2, 0).SerializeAsString());
  seeds->Add("pull_garbage", Header(RpcKind::kPull, kAsync),
             std::string("\x22\x05\x0a\x01", 4));
}

// Regressions: the two known findings (README.md), kept so that a fix
// is seen to hold.
void AddKnownFindings(Seeds* seeds) {
  seeds->Add("known1_push_async_step_int64_max", Header(RpcKind::kPush, kAsync),
             Push(0, std::numeric_limits<int64_t>::max(), AllBlocks())
                 .SerializeAsString());
  seeds->Add("known2_pull_completes_step_after_leave",
             Header(RpcKind::kPull, kSync, Prelude::kWorker1Leaves),
             Pull(0, 1).SerializeAsString());
  seeds->Add("known2_pull_ahead_drops_own_gradient",
             Header(RpcKind::kPull, kSync, Prelude::kWorker0PushesStep0),
             Pull(1, 1).SerializeAsString());
}

// Registration: the same member again, a restart, mismatches, and the
// first registration that installs the model.
void AddRegistrations(Seeds* seeds) {
  seeds->Add("register_same", Header(RpcKind::kRegister, kSync),
             Register(0).SerializeAsString());
  seeds->Add("register_restart_mid_step",
             Header(RpcKind::kRegister, kSync, Prelude::kWorker0PushesStep0),
             Register(1).SerializeAsString());
  {
    RegisterModelRequest other = Register(0);
    other.mutable_schema()->mutable_dense(0)->set_shape(1, 6);
    seeds->Add("register_schema_mismatch", Header(RpcKind::kRegister, kAsync),
               other.SerializeAsString());
    RegisterModelRequest version = Register(0);
    version.set_protocol_version(2);
    seeds->Add("register_protocol_2", Header(RpcKind::kRegister, kSync),
               version.SerializeAsString());
    seeds->Add("register_wrong_shards", Header(RpcKind::kRegister, kSync),
               Register(0, 3).SerializeAsString());
    FuzzHeader h = Header(RpcKind::kRegister, kSsp);
    h.unregistered = true;
    seeds->Add("register_installs", h, Register(1).SerializeAsString());
    h = Header(RpcKind::kRegister, kAsync);
    h.elastic = true;
    seeds->Add("register_elastic_worker3", h, Register(3).SerializeAsString());
  }
}

// Heartbeat and Leave, good and with a worker id out of range.
void AddHeartbeatsAndLeaves(Seeds* seeds) {
  {
    HeartbeatRequest heartbeat;
    heartbeat.set_worker_id(1);
    heartbeat.set_incarnation(5);
    seeds->Add("heartbeat_ok", Header(RpcKind::kHeartbeat, kSsp),
               heartbeat.SerializeAsString());
    heartbeat.set_worker_id(-5);
    seeds->Add("heartbeat_bad_worker", Header(RpcKind::kHeartbeat, kSync),
               heartbeat.SerializeAsString());
    LeaveRequest leave;
    leave.set_worker_id(1);
    seeds->Add("leave_completes_step",
               Header(RpcKind::kLeave, kSync, Prelude::kWorker0PushesStep0),
               leave.SerializeAsString());
    leave.set_worker_id(std::numeric_limits<int32_t>::max());
    seeds->Add("leave_bad_worker", Header(RpcKind::kLeave, kAsync),
               leave.SerializeAsString());
  }
}

// One file per seed under `dir`; 1 (after saying which) if one cannot be
// written.
int WriteSeeds(const Seeds& seeds, const std::string& dir) {
  for (const auto& [name, bytes] : seeds.list()) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", seeds.list().size(), dir.c_str());
  return 0;
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seed_corpus OUTPUT_DIR\n");
    return 2;
  }
  Seeds seeds;
  AddGoodPushes(&seeds);
  AddRefusedPushes(&seeds);
  AddMalformedPushes(&seeds);
  AddPulls(&seeds);
  AddKnownFindings(&seeds);
  AddRegistrations(&seeds);
  AddHeartbeatsAndLeaves(&seeds);
  return WriteSeeds(seeds, argv[1]);
}

}  // namespace
}  // namespace pstrain::fuzz

int main(int argc, char** argv) { return pstrain::fuzz::Main(argc, argv); }
