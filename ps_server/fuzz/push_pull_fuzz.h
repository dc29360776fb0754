// The input format of the push/pull fuzz target (push_pull_fuzz.cc), shared
// by the target, its seed-corpus generator and its GoogleTest smoke run.
//
// An input is a 9-byte header followed by one request's bytes:
//
//   byte 0  bits 0-2  the RPC: 0 Push, 1 Pull, 2 RegisterModel, 3 Heartbeat,
//                     4 Leave, 5-7 Push again (the busiest path)
//           bits 3-4  mode: 0 sync, 1 async, 2 ssp, 3 sync with
//                     --replicas_to_aggregate=1 (backup workers)
//           bit 5     --nonfinite_gradients=skip (else reject)
//           bit 6     elastic: --max_workers=4 (else num_workers = 2)
//           bit 7     two shards (else one)
//   byte 1  bits 0-1  the message is cut into 1 + this many segments
//           bits 2-4  prelude: valid requests run before the fuzzed one, to
//                     reach states other than a fresh shard (see Prelude)
//           bit 5     with two shards: this is shard 1 (else shard 0)
//           bit 6     a Pull that has to wait gets a 1 ms deadline and is
//                     answered by the reaper (else it is answered when the
//                     harness shuts the shard down)
//           bit 7     no model registered before the request
//   byte 2  bits 0-1  optimizer: 0 sgd, 1 momentum, 2 adam, 3 sgd
//   bytes 3-8         three little-endian uint16 cut points, each taken
//                     modulo (message size + 1)
//   bytes 9-          the request: a PushRequest (parsed by the zero-copy
//                     wire parser from the segments), or the protobuf
//                     encoding of a PullRequest, RegisterModelRequest,
//                     HeartbeatRequest or LeaveRequest.
//
// The registered model ("w": 2x5, block_elements 4, so blocks of 4, 4 and 2
// elements; "b": 3 elements) is FuzzSchema().
#ifndef PSTRAIN_PS_SERVER_FUZZ_PUSH_PULL_FUZZ_H_
#define PSTRAIN_PS_SERVER_FUZZ_PUSH_PULL_FUZZ_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "proto/ps.pb.h"

namespace pstrain::fuzz {

enum class RpcKind {
  kPush = 0,
  kPull = 1,
  kRegister = 2,
  kHeartbeat = 3,
  kLeave = 4
};

// What runs before the fuzzed request (each must succeed).
enum class Prelude {
  kNone = 0,
  kWorker0PushesStep0 = 1,
  kBothPushStep0 = 2,  // sync: step 0 completes
  kBothStep0ThenW0Step1 = 3,
  kWorker1Leaves = 4,
  kWorker0Restarts = 5,  // re-registers with a new incarnation
  kHeartbeatsAndPull = 6,
  kHighWorkerJoins = 7,  // the highest worker id registers and pulls
};

inline constexpr size_t kHeaderBytes = 9;

struct FuzzHeader {
  RpcKind kind = RpcKind::kPush;
  int mode = 0;  // 0 sync, 1 async, 2 ssp, 3 sync with backup workers
  bool skip_nonfinite = false;
  bool elastic = false;
  bool two_shards = false;
  int extra_segments = 0;  // 0-3
  Prelude prelude = Prelude::kNone;
  int shard_id = 0;
  bool pull_waits_for_deadline = false;
  bool unregistered = false;
  int optimizer = 0;
  uint16_t cuts[3] = {0, 0, 0};
};

// The model every input's shard registers.
ModelSchema FuzzSchema();

// Header bytes followed by `message`.
std::string EncodeFuzzInput(const FuzzHeader& header,
                            absl::string_view message);

}  // namespace pstrain::fuzz

// The libFuzzer entry point; also called by the smoke test.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

#endif  // PSTRAIN_PS_SERVER_FUZZ_PUSH_PULL_FUZZ_H_
