// ChangeGate (ps_server/replication.h): what passes while a replica catches
// up, and the order of a pull's answer after the forwards before it.
#include <atomic>
#include <optional>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "ps_server/replication.h"

namespace pstrain {
namespace {

absl::Time Soon() { return absl::Now() + absl::Milliseconds(50); }

TEST(ChangeGateTest, AHeldSyncGateLetsTheStepUnderWayAndStepLessChangesFinish) {
  ChangeGate gate;
  gate.Hold(/*finish_step=*/true, /*step_under_way=*/5);
  EXPECT_TRUE(gate.Enter(5, Soon()).ok());   // the step under way
  EXPECT_TRUE(gate.Enter(3, Soon()).ok());   // a resend of an old one
  EXPECT_TRUE(gate.Enter(-1, Soon()).ok());  // a registration, a leave
  absl::StatusOr<ChangeGate::Pass> next = gate.Enter(6, Soon());
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable);
  gate.Release();
  EXPECT_TRUE(gate.Enter(6, Soon()).ok());
}

TEST(ChangeGateTest, AStepInFlightWhenHeldMayFinish) {
  ChangeGate gate;
  std::optional<ChangeGate::Pass> early;
  early.emplace(*gate.Enter(7, Soon()));  // ahead of the shard's step 6
  gate.Hold(/*finish_step=*/true, /*step_under_way=*/6);
  EXPECT_TRUE(gate.Enter(7, Soon()).ok());
}

TEST(ChangeGateTest, QuietWaitsForChangesInFlightThenClosesTheGate) {
  ChangeGate gate;
  std::optional<ChangeGate::Pass> in_flight;
  in_flight.emplace(*gate.Enter(2, Soon()));
  gate.Hold(/*finish_step=*/true, /*step_under_way=*/2);
  EXPECT_FALSE(gate.AwaitQuiet([] { return true; }, Soon()));
  bool quiet_now = false;
  EXPECT_FALSE(gate.AwaitQuiet([&] { return quiet_now; }, Soon()));
  in_flight.reset();
  EXPECT_FALSE(gate.AwaitQuiet([&] { return quiet_now; }, Soon()));
  quiet_now = true;
  EXPECT_TRUE(gate.AwaitQuiet([&] { return quiet_now; }, Soon()));
  // Closed: nothing passes, not even a change of no step.
  EXPECT_FALSE(gate.Enter(-1, Soon()).ok());
  EXPECT_FALSE(gate.Enter(2, Soon()).ok());
  gate.Release();
  EXPECT_TRUE(gate.Enter(-1, Soon()).ok());
}

TEST(ChangeGateTest, AnAnswerWaitsForTheChangesBeforeItOnly) {
  ChangeGate gate;
  std::optional<ChangeGate::Pass> first;
  first.emplace(*gate.Enter(0, Soon()));
  std::atomic<bool> answered{false};
  gate.AfterChangesInFlight([&] { answered = true; });
  // A change after the answer was asked for does not hold it.
  std::optional<ChangeGate::Pass> later;
  later.emplace(*gate.Enter(0, Soon()));
  EXPECT_FALSE(answered.load());
  first.reset();
  EXPECT_TRUE(answered.load());
  bool at_once = false;
  ChangeGate idle;
  idle.AfterChangesInFlight([&] { at_once = true; });
  EXPECT_TRUE(at_once);
}

}  // namespace
}  // namespace pstrain
