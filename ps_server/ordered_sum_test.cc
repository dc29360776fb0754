#include "ps_server/ordered_sum.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

// Values whose float sum depends on the order they are added in.
const std::vector<float> kValues = {1e8f,  1.0f, -1e8f, 0.5f,
                                    3e-8f, 7.0f, -2.5f, 1e-3f};

// Adds the values of the workers in `arrival` (worker w gives kValues[w])
// through InWorkerOrder, and finishes the step.
float SumArriving(const std::vector<int>& arrival) {
  InWorkerOrder<float> order;
  float sum = 0;
  bool started = false;
  auto add = [&](float value) {
    sum = started ? sum + value : value;
    started = true;
  };
  int held = 0, released = 0;
  auto release = [&](float) { ++released; };
  for (int worker : arrival) {
    if (order.IsNext(worker)) {
      add(kValues[worker]);
      order.Added(worker, add, release);
    } else {
      order.Hold(worker, kValues[worker]);
      ++held;
    }
  }
  order.AddRest(add, release);
  EXPECT_EQ(order.num_held(), 0u);
  EXPECT_EQ(released, held);  // every held one came back for reuse
  return sum;
}

float SumInIdOrder(std::vector<int> workers) {
  std::sort(workers.begin(), workers.end());
  float sum = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    sum = i == 0 ? kValues[workers[i]] : sum + kValues[workers[i]];
  }
  return sum;
}

TEST(InWorkerOrderTest, EveryArrivalOrderGivesTheSumInIdOrder) {
  std::vector<int> arrival(kValues.size());
  std::iota(arrival.begin(), arrival.end(), 0);
  const float expected = SumInIdOrder(arrival);
  // Not vacuous: the arrival order changes a plain float sum.
  std::vector<float> sums;
  std::mt19937 random(1);
  for (int trial = 0; trial < 200; ++trial) {
    std::shuffle(arrival.begin(), arrival.end(), random);
    float plain = 0;
    for (int w : arrival) plain += kValues[w];
    sums.push_back(plain);
    EXPECT_EQ(SumArriving(arrival), expected);
  }
  EXPECT_NE(*std::min_element(sums.begin(), sums.end()),
            *std::max_element(sums.begin(), sums.end()));
}

TEST(InWorkerOrderTest, AMissingWorkerLeavesTheRestInIdOrder) {
  // Workers 0 and 3 never come (a lapsed lease, backup workers): the step
  // completes with the others, still summed in id order.
  std::vector<int> arrival = {6, 2, 5, 1, 7, 4};
  std::mt19937 random(2);
  const float expected = SumInIdOrder(arrival);
  for (int trial = 0; trial < 50; ++trial) {
    std::shuffle(arrival.begin(), arrival.end(), random);
    EXPECT_EQ(SumArriving(arrival), expected);
  }
}

TEST(InWorkerOrderTest, InOrderArrivalsHoldNothing) {
  InWorkerOrder<int> order;
  for (int w = 0; w < 4; ++w) {
    ASSERT_TRUE(order.IsNext(w));
    order.Added(
        w, [](int) {}, [](int) {});
    EXPECT_EQ(order.num_held(), 0u);
  }
}

TEST(InWorkerOrderTest, WorkerOneNeverWaitsForWorkerZero) {
  // g1 + g0 is g0 + g1 bit for bit: nothing is held with two workers.
  InWorkerOrder<int> order;
  ASSERT_TRUE(order.IsNext(1));
  order.Added(
      1, [](int) {}, [](int) {});
  EXPECT_FALSE(order.IsNext(1));
  EXPECT_FALSE(order.IsNext(2));  // after 0, whose sum with 1 comes first
  ASSERT_TRUE(order.IsNext(0));
  order.Added(
      0, [](int) {}, [](int) {});
  EXPECT_TRUE(order.IsNext(2));
  EXPECT_EQ(order.num_held(), 0u);
}

TEST(InWorkerOrderTest, ResetDropsWhatIsHeldAndStartsAtWorkerZero) {
  InWorkerOrder<int> order;
  order.Hold(3, 30);
  order.Hold(2, 20);
  std::vector<int> released;
  order.Reset([&](int v) { released.push_back(v); });
  EXPECT_EQ(released, (std::vector<int>{20, 30}));
  EXPECT_EQ(order.num_held(), 0u);
  EXPECT_TRUE(order.IsNext(0));
  EXPECT_FALSE(order.IsNext(2));
}

TEST(InWorkerOrderTest, AnEarlyContributionIsAddedWhenItsTurnComes) {
  InWorkerOrder<int> order;
  std::vector<int> added;
  auto add = [&](int v) { added.push_back(v); };
  order.Hold(2, 2);
  order.Hold(4, 4);
  ASSERT_TRUE(order.IsNext(0));
  added.push_back(0);
  order.Added(0, add, [](int) {});
  EXPECT_EQ(added, (std::vector<int>{0}));
  ASSERT_TRUE(order.IsNext(1));
  added.push_back(1);
  order.Added(1, add, [](int) {});
  // Worker 2 was waiting for 1; 4 still waits for 3.
  EXPECT_EQ(added, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(order.num_held(), 1u);
  ASSERT_TRUE(order.IsNext(3));
  added.push_back(3);
  order.Added(3, add, [](int) {});
  EXPECT_EQ(added, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(order.num_held(), 0u);
}

TEST(GradientBufferPoolTest, CountsHeldBytesAndReusesBuffers) {
  GradientBufferPool pool;
  std::string a = pool.Take();
  a.assign(1000, 'x');
  pool.CountHeld(1000);
  std::string b = pool.Take();
  b.assign(500, 'y');
  pool.CountHeld(500);
  EXPECT_EQ(pool.held_bytes(), 1500);
  pool.Give(std::move(a));
  EXPECT_EQ(pool.held_bytes(), 500);
  pool.Give(std::move(b));
  EXPECT_EQ(pool.held_bytes(), 0);
  EXPECT_EQ(pool.peak_held_bytes(), 1500);
  // A returned buffer comes back empty, with its capacity.
  std::string c = pool.Take();
  EXPECT_TRUE(c.empty());
  EXPECT_GE(c.capacity(), 500u);
}

}  // namespace
}  // namespace pstrain
