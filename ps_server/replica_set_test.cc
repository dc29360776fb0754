// ReplicaSet::Start on its own: how a starting replica decides its role when
// a peer is up but does not answer.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/transport/socket.h"
#include "gtest/gtest.h"
#include "proto/ps.pb.h"
#include "ps_server/replication.h"

namespace pstrain {
namespace {

// A listening socket nothing reads from: a peer whose port accepts
// connections and which never answers.
struct SilentPeer {
  SilentPeer() {
    absl::StatusOr<ScopedFd> listening = ListenTcp("127.0.0.1", 0, 0, &port);
    EXPECT_TRUE(listening.ok()) << listening.status();
    if (listening.ok()) fd = std::move(*listening);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  int port = 0;
  ScopedFd fd;
};

// Replica 0 of a set of two whose replica 1 is at `peer`.
ReplicaOptions FirstOfTwo(const std::string& peer) {
  ReplicaOptions options;
  options.replica_index = 0;
  options.addresses = {"127.0.0.1:1", peer};
  options.takeover_after_silence = absl::Milliseconds(300);
  return options;
}

std::string Role(const ReplicaSet& set) {
  StatsResponse stats;
  set.AddStats(&stats);
  return stats.replica_role();
}

// A replica 1 whose replica 0 accepts connections and never answers (its
// gRPC handlers all busy) but has forwarded it a change: replica 0 serves
// the job and holds its state, so replica 1 catches up from it at once
// instead of waiting out its silence. (At the job's start the
// first registrations wait in replica 0's handlers for every replica to stop
// joining, while a joining replica waited for replica 0's answer: both
// waited until the silence ran out, 3.3 s on a 2-core machine.)
TEST(ReplicaSetStartTest, AReplicaThatForwardedToAJoiningOneIsItsPrimary) {
  SilentPeer silent;
  ReplicaOptions options;
  options.replica_index = 1;
  // Replica 1's own address is never called.
  options.addresses = {silent.address(), "127.0.0.1:1"};
  // A silent peer is waited for up to startup_wait.
  options.startup_wait = absl::Seconds(30);
  ReplicaSet set(options, [] { return false; });

  ReplicateRequest forward;
  forward.set_method("RegisterModel");
  forward.set_from_replica(0);
  forward.set_epoch(0);
  const absl::Status joining = set.AdmitForward(forward);
  EXPECT_TRUE(absl::IsUnavailable(joining)) << joining;

  const absl::Time start = absl::Now();
  set.Start();
  // Well inside the 30 s a silent peer alone would be waited for.
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_EQ(Role(set), "catching_up");
  set.Stop();
}

// A replica 0 whose replica 1 accepts connections and never answers (frozen,
// or a primary too busy to answer) may be starting without the job's
// state: it does not become the primary of an empty shard, but stale, and
// says so (the server then exits for a restart).
TEST(ReplicaSetStartTest, ASilentPeerIsNotTakenForAbsent) {
  SilentPeer silent;
  ReplicaOptions options = FirstOfTwo(silent.address());
  options.startup_wait = absl::Seconds(2);
  ReplicaSet set(options, [] { return false; });
  bool stale = false;
  set.set_on_stale([&stale] { stale = true; });
  set.Start();
  EXPECT_EQ(Role(set), "stale");
  EXPECT_TRUE(stale);
  set.Stop();
}

// The replica that took over from a silent primary tells it "deposed" at
// the new epoch: a primary of an older epoch steps down; one of the same
// epoch (a new process at that address that the new primary already
// counts as its own) does not.
TEST(ReplicaSetDeposedTest, OnlyAPrimaryOfAnOlderEpochStepsDown) {
  // Replica 1 is not up: replica 0 starts as the primary.
  ReplicaSet set(FirstOfTwo("127.0.0.1:1"), [] { return false; });
  bool stale = false;
  set.set_on_stale([&stale] { stale = true; });
  set.Start();
  ASSERT_EQ(Role(set), "primary");
  ReplicateRequest deposed;
  deposed.set_method("deposed");
  deposed.set_from_replica(1);
  deposed.set_epoch(0);
  set.Answer(deposed);
  EXPECT_EQ(Role(set), "primary");
  deposed.set_epoch(1);
  set.Answer(deposed);
  EXPECT_EQ(Role(set), "stale");
  EXPECT_TRUE(stale);
  set.Stop();
}

}  // namespace
}  // namespace pstrain
