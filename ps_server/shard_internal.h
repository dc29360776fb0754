// Private to the shard library (ps_server/shard*.cc): the definitions of the
// Shard's nested types that shard.h only declares, and the helpers that more
// than one of its files shares. Not in the library's hdrs: nothing outside
// the shard may depend on these.
#ifndef PSTRAIN_PS_SERVER_SHARD_INTERNAL_H_
#define PSTRAIN_PS_SERVER_SHARD_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "proto/ps.pb.h"
#include "ps_server/shard.h"

namespace pstrain {
namespace shard_internal {

inline constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

// How long a sync worker that left stopping (LeaveRequest.stopping) stays a
// member while another still trains, beyond the grace its stop gave its
// step (LeaveRequest.stopping_grace_s, the others' grace too): the others'
// step waits this long for it, then completes without it. Long enough for
// every worker of a stopping job to hear its signal (the launcher, scancel
// and Kubernetes signal them within a moment of each other) and leave once
// its grace is over; what one SIGTERMed worker in a running job costs the
// others.
inline constexpr absl::Duration kStoppingHold = absl::Seconds(2);
// The stopping grace a worker may tell (LeaveRequest.stopping_grace_s), in
// seconds: a number, at least 0 and at most this (NaN is not).
inline constexpr double kMaxStoppingGraceS = 1e6;
inline bool ValidStoppingGrace(double seconds) {
  return seconds >= 0 && seconds <= kMaxStoppingGraceS;
}

// Raises `target` to `value` if it is larger (a peak gauge).
inline void AtomicMax(std::atomic<int64_t>& target, int64_t value) {
  int64_t current = target.load();
  while (value > current && !target.compare_exchange_weak(current, value)) {
  }
}

// Whether a sync step at `version` (of a block or a table) may be applied.
// It needs at least one gradient, and then every member counted in the
// step's quorum must have given its own (a count is not enough: gradients
// of workers whose lease lapsed since are in the sum too), unless
// --replicas_to_aggregate gradients are in. When every member has lapsed,
// the gradients already in are the quorum: waiting for nobody would hold
// the step, and every pull of the next one, forever.
inline bool QuorumMet(int64_t version, int contributors,
                      const std::vector<int64_t>& last_contributed,
                      const std::vector<int64_t>& membership,
                      int replicas_to_aggregate) {
  if (contributors == 0) return false;
  if (replicas_to_aggregate > 0 && contributors >= replicas_to_aggregate) {
    return true;
  }
  for (size_t w = 0; w < membership.size(); ++w) {
    if (membership[w] <= version && last_contributed[w] != version) {
      return false;
    }
  }
  return true;
}

// What a sync step at `version` still waits for, e.g. "the step 3
// gradients of workers [1]"; `what` names a contribution ("gradients").
inline std::string DescribeMissing(int64_t version,
                                   const std::vector<int64_t>& last_contributed,
                                   const std::vector<int64_t>& membership,
                                   absl::string_view what) {
  std::vector<int> missing;
  for (size_t w = 0; w < membership.size(); ++w) {
    if (membership[w] <= version && last_contributed[w] != version) {
      missing.push_back(static_cast<int>(w));
    }
  }
  if (missing.empty()) {
    return absl::StrCat("a first step ", version, " ", what,
                        ": no member is left in its quorum, the next worker "
                        "to push it completes it");
  }
  return absl::StrCat("the step ", version, " ", what, " of workers [",
                      absl::StrJoin(missing, ", "), "]");
}

}  // namespace shard_internal

struct Shard::Model {
  ModelSchema schema;
  Partition partition;
  std::vector<std::unique_ptr<SparseState>> sparse;  // schema order
  absl::flat_hash_map<std::string, int> sparse_index;
  std::vector<std::unique_ptr<Block>> blocks;  // this shard's, global order
  std::vector<int> local_of_global;            // -1 when on another shard
  // Per dense tensor: its torch.optim rule, null for the server's own.
  std::vector<std::unique_ptr<Optimizer>> tensor_optimizers;
  int64_t num_elements = 0;
};

// A pull waiting for its step: for dense blocks `locals`, or for sparse
// table `sparse`. `answer` is called once, with OK when the pull may proceed
// (it then copies what was asked for) or with why it may not.
struct Shard::Waiter {
  std::vector<int> locals;
  int sparse = -1;
  // A ClipNorm: waits until the clipped step `step` of every block is in.
  bool clip = false;
  // A backup's read (Shard::PullOnBackup).
  bool replica_read = false;
  int64_t step = 0;
  absl::Time deadline;
  std::function<void(absl::Status)> answer;
};

struct Shard::WorkerState {
  bool member = false;   // counted in quorums from joined_at
  bool pending = false;  // (re)joining: a member from its next pull
  int64_t joined_at = shard_internal::kNever;
  uint64_t incarnation = 0;  // 0: not yet registered
  bool seen = false;         // any contact, ever: its lease has started
  // Left while stopping (LeaveRequest.stopping): still a member, so that the
  // step under way is not completed without it while every member is
  // stopping; its lease runs out StoppingHold() after the leave.
  bool stopping = false;
  absl::Duration stopping_grace;  // LeaveRequest.stopping_grace_s
  absl::Duration StoppingHold() const {
    return shard_internal::kStoppingHold + stopping_grace;
  }
  absl::Time last_seen;  // on the lease clock (Shard::LeaseNow)
  // One past the last step pushed here: the ssp clock, and where a
  // restarted async/ssp worker resumes so its pushes are not repeats.
  int64_t next_step = 0;
  // The furthest step it asked this process to pull (-1: none): whether
  // its final model came from this process or from one before it.
  int64_t pulled_in_this_life = -1;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SHARD_INTERNAL_H_
