// ReplicaSet on its own: how a starting replica decides its role when a
// peer is up but does not answer, and what a primary acknowledges while a
// peer catches up.
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/transport/socket.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
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

// A replica 1 that came up after its primary took the model: it answers
// probes "catching_up" and refuses forwards as a new process until it has
// been sent the state (the "state" message), as a real one does.
class CatchingUpPeer : public ParameterServer::Service {
 public:
  CatchingUpPeer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~CatchingUpPeer() override { server_->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int forwards_refused() const { return refused_.load(); }

  grpc::Status Replicate(grpc::ServerContext*, const ReplicateRequest* request,
                         ReplicateResponse* response) override {
    response->set_epoch(request->epoch());
    response->set_role(caught_up_ ? "backup" : "catching_up");
    if (request->method() == "probe") return grpc::Status::OK;
    if (request->method() == "state") {
      caught_up_ = true;
      return grpc::Status::OK;
    }
    if (!caught_up_) {
      refused_.fetch_add(1);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "new process: replica 1 of shard 0 is catching up "
                          "from the primary");
    }
    return grpc::Status::OK;
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> caught_up_{false};
  std::atomic<int> refused_{0};
};

// Replica 0 of a set whose replica 1 is a CatchingUpPeer, started: the
// primary, with replica 1 in its set.
class ReplicaSetCatchUpTest : public ::testing::Test {
 protected:
  std::unique_ptr<ReplicaSet> StartPrimary(absl::Duration forward_timeout) {
    ReplicaOptions options = FirstOfTwo(peer_.address());
    options.forward_timeout = forward_timeout;
    auto set = std::make_unique<ReplicaSet>(options, [] { return true; });
    set->Start();
    EXPECT_EQ(Role(*set), "primary");
    return set;
  }

  CatchingUpPeer peer_;
  const absl::string_view push_ = "a push";
};

// An update forwarded while a replica of the set catches up is held by the
// primary alone: acknowledging it would lose it to a kill -9 of the primary
// before the joiner holds it (a job's start, where a backup came up after
// the primary registered the model: 2 of 30 trials lost every update since
// the primary's checkpoint that way). No update is acknowledged until the
// joiner asks for the state (changes are then held until it has it).
TEST_F(ReplicaSetCatchUpTest, NoUpdateIsAcknowledgedBeforeAJoinerAsks) {
  std::unique_ptr<ReplicaSet> set = StartPrimary(absl::Seconds(30));
  const absl::Status first = set->Forward("Push", {push_});
  EXPECT_TRUE(absl::IsUnavailable(first)) << first;
  EXPECT_EQ(peer_.forwards_refused(), 1);
  // Dropped from the set, but awaited: the next update is not acknowledged
  // either, and not sent to it. A heartbeat (no update) is: the joiner's
  // catch-up waits for the workers' steps to begin.
  const absl::Status second = set->Forward("SparsePush", {push_});
  EXPECT_TRUE(absl::IsUnavailable(second)) << second;
  EXPECT_NE(second.message().find("catching up"), std::string::npos) << second;
  EXPECT_TRUE(set->Forward("Heartbeat", {push_}).ok());
  EXPECT_EQ(peer_.forwards_refused(), 1);

  // The joiner asked: the state goes to it (with changes held), and the
  // updates after it are acknowledged once it has them.
  ReplicaStateExport state;
  state.chunks.resize(1);
  state.floats.resize(1);
  ASSERT_TRUE(set->SendState(1, state).ok());
  EXPECT_TRUE(set->Forward("Push", {push_}).ok());
  EXPECT_EQ(peer_.forwards_refused(), 1);
  set->Stop();
}

// A joiner that never asks is waited for up to forward_timeout; then the
// job goes on without it (logged).
TEST_F(ReplicaSetCatchUpTest, AJoinerThatNeverAsksIsWaitedForOnlyForAWhile) {
  const absl::Duration forward_timeout = absl::Milliseconds(300);
  std::unique_ptr<ReplicaSet> set = StartPrimary(forward_timeout);
  const absl::Time refused_at = absl::Now();
  EXPECT_TRUE(absl::IsUnavailable(set->Forward("Push", {push_})));
  absl::Status retried;
  do {
    retried = set->Forward("Push", {push_});
  } while (!retried.ok() && absl::Now() - refused_at < absl::Seconds(10));
  EXPECT_TRUE(retried.ok()) << retried;
  EXPECT_GE(absl::Now() - refused_at, forward_timeout);
  EXPECT_EQ(peer_.forwards_refused(), 1);
  set->Stop();
}

// The promise a primary makes a joiner (start_afresh_ms) while it has
// acknowledged nothing a fresh shard lacks: a joiner in its set, or awaited,
// is not left out of any update for that long. Registrations keep it; an
// update acknowledged without the joiner (its wait ran out) ends it.
TEST_F(ReplicaSetCatchUpTest, APrimaryPromisesAFreshStartUntilItAcknowledges) {
  const absl::Duration forward_timeout = absl::Milliseconds(500);
  std::unique_ptr<ReplicaSet> set = StartPrimary(forward_timeout);
  ReplicateRequest probe;
  probe.set_method("probe");
  probe.set_from_replica(1);
  EXPECT_EQ(set->Answer(probe).start_afresh_ms(), 500);  // in the set
  // The registration's forward finds it catching up: awaited from now.
  EXPECT_TRUE(set->Forward("RegisterModel", {push_}).ok());
  EXPECT_EQ(peer_.forwards_refused(), 1);
  const int64_t awaited = set->Answer(probe).start_afresh_ms();
  EXPECT_GT(awaited, 0);
  EXPECT_LE(awaited, 500);
  EXPECT_TRUE(absl::IsUnavailable(set->Forward("Assign", {push_})));
  EXPECT_GT(set->Answer(probe).start_afresh_ms(), 0);

  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  absl::Status pushed;
  do {
    pushed = set->Forward("Push", {push_});
  } while (!pushed.ok() && absl::Now() < give_up);
  ASSERT_TRUE(pushed.ok()) << pushed;  // acknowledged alone
  EXPECT_EQ(set->Answer(probe).start_afresh_ms(), 0);
  set->Stop();
}

// A primary that answers as the fake's flags say, and holds the model.
class FakePrimary : public ParameterServer::Service {
 public:
  explicit FakePrimary(int64_t start_afresh_ms)
      : start_afresh_ms_(start_afresh_ms) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakePrimary() override { Die(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int joins() const { return joins_.load(); }
  // Its port refuses connections from here on.
  void Die() {
    if (server_ == nullptr) return;
    server_->Shutdown();
    server_.reset();
  }

  grpc::Status Replicate(grpc::ServerContext*, const ReplicateRequest* request,
                         ReplicateResponse* response) override {
    if (request->method() == "join") joins_.fetch_add(1);
    response->set_epoch(0);
    response->set_role("primary");
    response->set_model_registered(true);
    response->set_start_afresh_ms(start_afresh_ms_);
    return grpc::Status::OK;
  }

 private:
  const int64_t start_afresh_ms_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<int> joins_{0};
};

// Replica 1 of two, started while `primary` holds the model: it catches up.
std::unique_ptr<ReplicaSet> StartJoiner(const FakePrimary& primary) {
  ReplicaOptions options;
  options.replica_index = 1;
  options.addresses = {primary.address(), "127.0.0.1:1"};
  auto set = std::make_unique<ReplicaSet>(options, [] { return false; });
  set->Start();
  EXPECT_EQ(Role(*set), "catching_up");
  return set;
}

// Kills `primary` once the replica catching up has asked it to join.
void DiesAfterTheFirstJoin(FakePrimary& primary) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (primary.joins() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GT(primary.joins(), 0);
  primary.Die();
}

// Replica `set`'s role once it is not `role`, or after `timeout`.
std::string RoleAfter(const ReplicaSet& set, const std::string& role,
                      absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (Role(set) == role && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  return Role(set);
}

// A job's start: the primary took the model, a backup came up after it and
// catches up, and the primary dies before the backup holds the state. The
// primary had promised that it acknowledged nothing without the backup, so
// the backup starts the shard afresh (the workers register again) rather
// than wait for a primary that may never come back: the job goes on, and
// loses nothing.
TEST(ReplicaSetFreshStartTest, AJoinerStartsAfreshWhenItsPrimaryPromised) {
  FakePrimary primary(/*start_afresh_ms=*/30000);
  std::unique_ptr<ReplicaSet> joiner = StartJoiner(primary);
  DiesAfterTheFirstJoin(primary);
  EXPECT_EQ(RoleAfter(*joiner, "catching_up", absl::Seconds(10)), "primary");
  StatsResponse stats;
  joiner->AddStats(&stats);
  EXPECT_EQ(stats.replica_epoch(), 1);
  EXPECT_EQ(stats.replica_takeovers(), 1);
  joiner->Stop();
}

// Without the promise (the primary may have acknowledged updates the joiner
// lacks), a fresh start would lose them: the joiner waits for the primary
// to come back from its checkpoint.
TEST(ReplicaSetFreshStartTest, WithoutThePromiseAJoinerWaitsForItsPrimary) {
  FakePrimary primary(/*start_afresh_ms=*/0);
  std::unique_ptr<ReplicaSet> joiner = StartJoiner(primary);
  DiesAfterTheFirstJoin(primary);
  // With the promise it takes over within 2 s (the test above).
  EXPECT_EQ(RoleAfter(*joiner, "catching_up", absl::Seconds(5)), "catching_up");
  joiner->Stop();
}

}  // namespace
}  // namespace pstrain
