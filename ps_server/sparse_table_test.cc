#include "ps_server/sparse_table.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/init.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

InitSpec Spec(InitSpec::Kind kind, float scale, float value = 0) {
  InitSpec spec;
  spec.set_kind(kind);
  spec.set_scale(scale);
  spec.set_value(value);
  return spec;
}

SparseTableOptions Options(const std::string& optimizer, int64_t dim) {
  SparseTableOptions o;
  o.name = "emb";
  o.dim = dim;
  o.seed = 7;
  o.init = Spec(InitSpec::UNIFORM, 0.5f);
  o.optimizer.name = optimizer;
  return o;
}

std::unique_ptr<SparseTable> Make(const SparseTableOptions& options) {
  absl::StatusOr<std::unique_ptr<SparseTable>> t = SparseTable::Create(options);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<float> PullRows(SparseTable& t, const std::vector<uint64_t>& ids) {
  std::vector<float> out(ids.size() * t.dim());
  absl::Status s = t.Pull(ids, absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::vector<float> PullRow(SparseTable& t, uint64_t id) {
  return PullRows(t, {id});
}

std::vector<float> Initial(const SparseTable& t, uint64_t id) {
  std::vector<float> v(t.dim());
  t.InitialValue(id, absl::MakeSpan(v));
  return v;
}

struct Row {
  std::vector<float> value, state;
  int64_t update_count;
  bool operator==(const Row& o) const {
    return value == o.value && state == o.state &&
           update_count == o.update_count;
  }
};

std::map<uint64_t, Row> Dump(const SparseTable& t) {
  std::map<uint64_t, Row> rows;
  t.ForEachRow([&](uint64_t id, absl::Span<const float> value,
                   absl::Span<const float> state, int64_t count) {
    EXPECT_EQ(rows.count(id), 0u) << "row " << id << " visited twice";
    rows[id] =
        Row{{value.begin(), value.end()}, {state.begin(), state.end()}, count};
  });
  return rows;
}

std::set<uint64_t> Resident(const SparseTable& t) {
  std::set<uint64_t> ids;
  for (const auto& [id, row] : Dump(t)) ids.insert(id);
  return ids;
}

// ---------------------------------------------------------------------------
// Initial values.

TEST(SparseTableInitTest, PureFunctionOfSeedTableIdAndElement) {
  constexpr int64_t kDim = 8;
  const uint64_t limit = DenseCompatibleIdLimit(kDim);  // 2^60
  ASSERT_EQ(limit, uint64_t{1} << 60);
  std::vector<uint64_t> ids = {0,
                               1,
                               2,
                               5,
                               12345,
                               limit - 1,
                               limit,
                               limit + 1,
                               5 + limit,
                               ~0ULL,
                               ~0ULL - 1,
                               1ULL << 61,
                               5 + (1ULL << 61)};
  // Table a: 64 stripes, ids in order, one call.
  SparseTableOptions oa = Options("sgd", kDim);
  auto a = Make(oa);
  const std::vector<float> va = PullRows(*a, ids);
  // Table b: 7 stripes, reverse order, one id per call, with repeats.
  SparseTableOptions ob = oa;
  ob.num_stripes = 7;
  auto b = Make(ob);
  std::vector<uint64_t> reversed(ids.rbegin(), ids.rend());
  for (uint64_t id : reversed) PullRow(*b, id);
  const std::vector<float> vb = PullRows(*b, ids);
  EXPECT_EQ(va, vb);
  EXPECT_EQ(Dump(*a), Dump(*b));

  for (size_t i = 0; i < ids.size(); ++i) {
    const uint64_t id = ids[i];
    std::vector<float> expected(kDim);
    if (id < limit) {
      // Row id of a dense [vocab, 8] tensor "emb": elements id*8 .. id*8+7.
      FillInitialValues(oa.init, oa.seed, "emb", static_cast<int64_t>(id) * 8,
                        absl::MakeSpan(expected));
    } else {
      FillInitialValues(oa.init, oa.seed, absl::StrCat("emb#", id), 0,
                        absl::MakeSpan(expected));
    }
    EXPECT_EQ(
        std::vector<float>(va.begin() + i * kDim, va.begin() + (i + 1) * kDim),
        expected)
        << "id " << id;
    EXPECT_EQ(Initial(*a, id), expected);
  }
  // Distinct ids get distinct rows (no aliasing of id and id + 2^k).
  std::set<std::vector<float>> distinct;
  for (size_t i = 0; i < ids.size(); ++i) {
    distinct.insert(
        std::vector<float>(va.begin() + i * kDim, va.begin() + (i + 1) * kDim));
  }
  EXPECT_EQ(distinct.size(), ids.size());

  // The seed and the table name change the values.
  SparseTableOptions oc = oa;
  oc.seed = 8;
  SparseTableOptions od = oa;
  od.name = "emb2";
  EXPECT_NE(PullRows(*Make(oc), ids), va);
  EXPECT_NE(PullRows(*Make(od), ids), va);
}

TEST(SparseTableInitTest, MatchesADenseTensorOfTheSameName) {
  // A [vocab, dim] dense tensor and the sparse table start identical, whatever
  // the InitSpec.
  for (InitSpec spec :
       {Spec(InitSpec::NORMAL, 0.1f), Spec(InitSpec::CONSTANT, 0, 0.25f),
        Spec(InitSpec::ZEROS, 0)}) {
    SparseTableOptions o = Options("adagrad", 3);
    o.init = spec;
    auto t = Make(o);
    std::vector<float> dense(10 * 3);
    FillInitialValues(spec, o.seed, "emb", 0, absl::MakeSpan(dense));
    std::vector<uint64_t> ids = {9, 3, 0, 7, 1, 2, 8, 4, 6, 5};
    const std::vector<float> rows = PullRows(*t, ids);
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int j = 0; j < 3; ++j) {
        EXPECT_EQ(rows[i * 3 + j], dense[ids[i] * 3 + j]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Pull, push and the optimizers.

// FindDuplicateId against the plainest check (a sorted copy), on pushes of
// every size a bucket boundary could hide a duplicate at: unique ids give
// none, and one id repeated anywhere is found.
TEST(FindDuplicateIdTest, FindsTheRepeatedIdAtAnySizeAndPlace) {
  std::mt19937_64 random(7);
  for (size_t n : {0, 1, 2, 3, 15, 16, 17, 31, 64, 1000, 4096, 100000}) {
    std::set<uint64_t> distinct;
    while (distinct.size() < n) distinct.insert(random());
    std::vector<uint64_t> ids(distinct.begin(), distinct.end());
    std::shuffle(ids.begin(), ids.end(), random);
    EXPECT_FALSE(FindDuplicateId(ids).has_value()) << n << " unique ids";
    if (n < 2) continue;
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<uint64_t> with_dup = ids;
      const size_t from = random() % n;
      size_t to = random() % n;
      if (to == from) to = (to + 1) % n;
      with_dup[to] = with_dup[from];
      std::optional<uint64_t> found = FindDuplicateId(with_dup);
      ASSERT_TRUE(found.has_value()) << n << " ids, trial " << trial;
      EXPECT_EQ(*found, with_dup[from]);
    }
  }
}

TEST(SparseTableTest, PullCreatesRowsOnce) {
  auto t = Make(Options("sgd", 4));
  EXPECT_EQ(t->Stats().rows, 0);
  const std::vector<float> first = PullRows(*t, {10, 20, 10, 30});
  SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 3);
  EXPECT_EQ(st.rows_created, 3);
  EXPECT_GT(st.memory_bytes, 0);
  EXPECT_EQ(PullRows(*t, {10, 20, 10, 30}), first);
  EXPECT_EQ(t->Stats().rows_created, 3);
  const std::map<uint64_t, Row> rows = Dump(*t);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows.at(20).value, Initial(*t, 20));
  EXPECT_EQ(rows.at(20).update_count, 0);
  EXPECT_TRUE(rows.at(20).state.empty());

  std::vector<float> wrong(5);
  EXPECT_EQ(t->Pull({10, 20}, absl::MakeSpan(wrong)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SparseTableTest, SgdPushIsExact) {
  SparseTableOptions o = Options("sgd", 3);
  o.init = Spec(InitSpec::CONSTANT, 0, 1.0f);
  o.optimizer.learning_rate = 0.5f;
  auto t = Make(o);
  PullRows(*t, {4});
  // Row 9 was never pulled: created from its initial value, then updated.
  ASSERT_TRUE(t->Push({4, 9}, {2, -4, 0.5f, 1, 1, 1}).ok());
  EXPECT_EQ(PullRows(*t, {4, 9}),
            (std::vector<float>{0, 3, 0.75f, 0.5f, 0.5f, 0.5f}));
  ASSERT_TRUE(t->Push({9}, {1, 0, -1}).ok());
  EXPECT_EQ(PullRow(*t, 9), (std::vector<float>{0, 0.5f, 1}));
  EXPECT_EQ(Dump(*t).at(9).update_count, 2);
  EXPECT_TRUE(t->Push({}, {}).ok());
}

TEST(SparseTableTest, AdagradMatchesClosedForm) {
  // acc_0 = a0; per step: acc_t = acc_{t-1} + g_t^2,
  //                       w_t = w_{t-1} - lr * g_t / sqrt(acc_t)
  // so w_T = w_0 - lr * sum_t g_t / sqrt(a0 + sum_{s<=t} g_s^2).
  SparseTableOptions o = Options("adagrad", 2);
  o.optimizer.learning_rate = 0.3f;
  o.optimizer.initial_accumulator = 0.2f;
  auto t = Make(o);
  const std::vector<uint64_t> ids = {11, 1ULL << 62};
  const std::vector<float> w0 = PullRows(*t, ids);
  const std::vector<std::vector<float>> grads = {{1.0f, -2.0f, 0.5f, 0.0f},
                                                 {-0.25f, 3.0f, 0.5f, 1.5f},
                                                 {2.0f, 0.125f, -4.0f, -1.0f},
                                                 {0.75f, -0.5f, 0.0f, 2.5f}};
  for (const auto& g : grads) ASSERT_TRUE(t->Push(ids, g).ok());
  const std::map<uint64_t, Row> rows = Dump(*t);
  for (size_t r = 0; r < ids.size(); ++r) {
    const Row& row = rows.at(ids[r]);
    EXPECT_EQ(row.update_count, 4);
    for (int j = 0; j < 2; ++j) {
      double acc = 0.2, w = w0[r * 2 + j];
      for (const auto& g : grads) {
        const double gj = g[r * 2 + j];
        acc += gj * gj;
        w -= 0.3 * gj / std::sqrt(acc);
      }
      EXPECT_NEAR(row.value[j], w, 1e-5) << "row " << ids[r] << " elem " << j;
      EXPECT_NEAR(row.state[j], acc, 1e-5);
    }
  }
}

TEST(SparseTableTest, FtrlMatchesClosedForm) {
  // FTRL-proximal per coordinate, z_0 = n_0 = 0 (so w_0 = 0 whatever init):
  //   sigma = (sqrt(n + g^2) - sqrt(n)) / alpha
  //   z += g - sigma * w;  n += g^2
  //   w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((beta + sqrt(n))/alpha + l2)
  // First step from zero: n = g^2, z = g, w = -(g - sign(g) l1) /
  // ((beta + |g|)/alpha + l2) when |g| > l1.
  SparseTableOptions o = Options("ftrl", 3);
  o.optimizer.ftrl_alpha = 0.1f;
  o.optimizer.ftrl_beta = 1.0f;
  o.optimizer.ftrl_l1 = 0.3f;
  o.optimizer.ftrl_l2 = 0.5f;
  auto t = Make(o);
  ASSERT_EQ(t->state_per_element(), 2);
  // Initial weights are 0 by definition; the UNIFORM init is not used.
  EXPECT_EQ(PullRows(*t, {1, 2}), std::vector<float>(6, 0.0f));

  ASSERT_TRUE(t->Push({1}, {2.0f, -0.2f, -1.0f}).ok());
  const double denom = (1.0 + 2.0) / 0.1 + 0.5;
  EXPECT_NEAR(PullRow(*t, 1)[0], -(2.0 - 0.3) / denom, 1e-7);
  EXPECT_EQ(PullRow(*t, 1)[1], 0.0f);  // |z| = 0.2 <= l1

  const std::vector<std::vector<float>> grads = {
      {-0.5f, 0.4f, 0.1f}, {1.5f, 0.3f, -2.0f}, {0.0f, -1.0f, 0.7f}};
  for (const auto& g : grads) ASSERT_TRUE(t->Push({1}, g).ok());
  const Row row = Dump(*t).at(1);
  std::vector<std::vector<float>> all = {{2.0f, -0.2f, -1.0f}};
  all.insert(all.end(), grads.begin(), grads.end());
  int zeros = 0;
  for (int j = 0; j < 3; ++j) {
    double z = 0, n = 0, w = 0;
    for (const auto& g : all) {
      const double gj = g[j];
      const double sigma = (std::sqrt(n + gj * gj) - std::sqrt(n)) / 0.1;
      z += gj - sigma * w;
      n += gj * gj;
      w = std::fabs(z) <= 0.3 ? 0.0
                              : -(z - std::copysign(0.3, z)) /
                                    ((1.0 + std::sqrt(n)) / 0.1 + 0.5);
    }
    zeros += w == 0.0;
    EXPECT_NEAR(row.value[j], w, 1e-6) << "elem " << j;
    EXPECT_NEAR(row.state[j], z, 1e-5) << "z " << j;
    EXPECT_NEAR(row.state[3 + j], n, 1e-5) << "n " << j;
  }
  EXPECT_LT(zeros, 3);  // the test exercises the non-zero branch
  EXPECT_EQ(Dump(*t).at(2).update_count, 0);
}

TEST(SparseTableTest, LazyAdamMovesOnlyPushedRowsWithPerRowStepCount) {
  SparseTableOptions o = Options("adam", 2);
  o.optimizer.learning_rate = 0.01f;
  auto t = Make(o);
  const std::vector<float> init = PullRows(*t, {1, 2, 3});
  const std::vector<std::vector<float>> grads = {
      {0.5f, -1.0f}, {2.0f, 0.25f}, {-1.0f, 1.0f}};
  for (const auto& g : grads) ASSERT_TRUE(t->Push({1}, g).ok());
  std::map<uint64_t, Row> rows = Dump(*t);
  // Row 2 was never pushed: value, state and step count untouched.
  EXPECT_EQ(rows.at(2).value, Initial(*t, 2));
  EXPECT_EQ(rows.at(2).state, std::vector<float>(4, 0.0f));
  EXPECT_EQ(rows.at(2).update_count, 0);
  // Row 1 against the bias-corrected reference, t = 1, 2, 3.
  for (int j = 0; j < 2; ++j) {
    double m = 0, v = 0, w = init[j];
    for (int step = 1; step <= 3; ++step) {
      const double g = grads[step - 1][j];
      m = 0.9 * m + 0.1 * g;
      v = 0.999 * v + 0.001 * g * g;
      const double mhat = m / (1 - std::pow(0.9, step));
      const double vhat = v / (1 - std::pow(0.999, step));
      w -= 0.01 * mhat / (std::sqrt(vhat) + 1e-8);
    }
    EXPECT_NEAR(rows.at(1).value[j], w, 1e-6);
    EXPECT_NEAR(rows.at(1).state[j], m, 1e-6);
    EXPECT_NEAR(rows.at(1).state[2 + j], v, 1e-7);
  }
  EXPECT_EQ(rows.at(1).update_count, 3);
  // Row 3's first push uses its own t = 1 (m_hat = g, v_hat = g^2), so it
  // moves by lr * sign(g); a global step count (t = 4) would not.
  ASSERT_TRUE(t->Push({3}, {3.0f, -0.5f}).ok());
  rows = Dump(*t);
  EXPECT_NEAR(rows.at(3).value[0], init[4] - 0.01, 1e-6);
  EXPECT_NEAR(rows.at(3).value[1], init[5] + 0.01, 1e-6);
  EXPECT_EQ(rows.at(3).update_count, 1);
  EXPECT_EQ(rows.at(2).value, Initial(*t, 2));
}

// Adam's bias corrections come from a table made once per process and
// (lr, beta1, beta2), up to where they stop changing: a row pushed many times
// gets, at every count, exactly the update the two pow calls per push gave (the
// reference below, bit for bit), also past the table's end. Betas 0.5 and 0.9
// reach their limits in float within a few hundred counts.
TEST(SparseTableTest, AdamBiasCorrectionsAreThoseOfEveryCount) {
  SparseTableOptions o = Options("adam", 1);
  o.optimizer.learning_rate = 0.01f;
  o.optimizer.beta1 = 0.5f;
  o.optimizer.beta2 = 0.9f;
  auto t = Make(o);
  const float init = PullRows(*t, {7})[0];
  float w = init, m = 0, v = 0;
  const SparseOptimizerConfig& c = o.optimizer;
  for (int step = 1; step <= 400; ++step) {
    const float g = (step % 3 == 0 ? -0.25f : 0.5f) / step;
    ASSERT_TRUE(t->Push({7}, {g}).ok());
    const double td = static_cast<double>(step);
    const float step_size =
        c.learning_rate / static_cast<float>(1 - std::pow(c.beta1, td));
    const float inv_sqrt_c2 =
        1.0f / std::sqrt(static_cast<float>(1 - std::pow(c.beta2, td)));
    m = c.beta1 * m + (1 - c.beta1) * g;
    v = c.beta2 * v + (1 - c.beta2) * g * g;
    w -= step_size * m / (std::sqrt(v) * inv_sqrt_c2 + c.epsilon);
    ASSERT_EQ(Dump(*t).at(7).value[0], w) << "count " << step;
  }
}

TEST(SparseTableTest, BadPushesAreRejectedBeforeAnythingChanges) {
  auto t = Make(Options("adagrad", 2));
  PullRows(*t, {1, 2, 3});
  const std::map<uint64_t, Row> before = Dump(*t);
  const SparseTableStats st = t->Stats();

  absl::Status dup = t->Push({1, 2, 1}, {1, 1, 1, 1, 1, 1});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.message().find("more than once"), absl::string_view::npos)
      << dup;
  // A duplicate of a new id creates nothing either.
  EXPECT_EQ(t->Push({9, 3, 9}, {1, 1, 1, 1, 1, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Push({1, 2}, {1, 1, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Push({1, 5}, {1, 1, 1, NAN}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Push({1, 5}, {1, 1, INFINITY, 1}).code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(Dump(*t), before);
  EXPECT_EQ(t->Stats().rows, st.rows);
  EXPECT_EQ(t->Stats().rows_created, st.rows_created);
}

// ---------------------------------------------------------------------------
// Eviction.

TEST(SparseTableLruTest, OneStripeIsExactGlobalLru) {
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 5;
  o.num_stripes = 1;
  auto t = Make(o);
  for (uint64_t id = 0; id < 10; ++id) PullRow(*t, id);
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{5, 6, 7, 8, 9}));
  PullRow(*t, 5);                          // touch by pull
  ASSERT_TRUE(t->Push({6}, {1, 1}).ok());  // touch by push
  PullRow(*t, 10);                         // evicts 7
  PullRow(*t, 11);                         // evicts 8
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{5, 6, 9, 10, 11}));
  // ForEachRow visits least to most recently used.
  std::vector<uint64_t> order;
  t->ForEachRow([&](uint64_t id, auto, auto, int64_t) { order.push_back(id); });
  EXPECT_EQ(order, (std::vector<uint64_t>{9, 5, 6, 10, 11}));
  const SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 5);
  EXPECT_EQ(st.rows_created, 12);
  EXPECT_EQ(st.rows_evicted, 7);
}

TEST(SparseTableLruTest, StripesAreExactLruOverTheirShare) {
  // Guarantee: each stripe keeps exactly the StripeCapacity() most recently
  // touched ids that hash to it; the shares sum to max_rows. Checked against
  // a model over a random stream of pulls and pushes.
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 43;
  o.num_stripes = 8;
  auto t = Make(o);
  ASSERT_EQ(t->num_stripes(), 8);
  int64_t total = 0, min_share = o.max_rows;
  for (int s = 0; s < 8; ++s) {
    total += t->StripeCapacity(s);
    min_share = std::min(min_share, t->StripeCapacity(s));
  }
  EXPECT_EQ(total, 43);
  std::vector<std::list<uint64_t>> model(8);  // front = most recent
  auto touch = [&](uint64_t id) {
    auto& l = model[t->StripeOf(id)];
    l.remove(id);
    l.push_front(id);
    if (static_cast<int64_t>(l.size()) > t->StripeCapacity(t->StripeOf(id))) {
      l.pop_back();
    }
  };
  std::mt19937_64 rng(3);
  std::vector<uint64_t> recent;
  for (int step = 0; step < 3000; ++step) {
    const uint64_t id = rng() % 300;
    if (step % 3 == 0) {
      ASSERT_TRUE(t->Push({id}, {1, 1}).ok());
    } else {
      PullRow(*t, id);
    }
    touch(id);
    recent.erase(std::remove(recent.begin(), recent.end(), id), recent.end());
    recent.push_back(id);
    ASSERT_LE(t->Stats().rows, 43);
  }
  std::set<uint64_t> expected;
  for (const auto& l : model) expected.insert(l.begin(), l.end());
  EXPECT_EQ(Resident(*t), expected);
  EXPECT_EQ(t->Stats().rows, 43);
  // Corollary: the min_share most recently used ids are always resident.
  const std::set<uint64_t> resident = Resident(*t);
  for (int64_t k = 1; k <= min_share; ++k) {
    EXPECT_EQ(resident.count(recent[recent.size() - k]), 1u);
  }
}

TEST(SparseTableLruTest, FewerRowsThanStripesLowersTheStripeCount) {
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 3;
  auto t = Make(o);
  EXPECT_EQ(t->num_stripes(), 3);
  for (uint64_t id = 0; id < 100; ++id) PullRow(*t, id);
  EXPECT_EQ(t->Stats().rows, 3);
  EXPECT_EQ(Resident(*t).count(99), 1u);
}

// Stripes by the machine only where they change nothing but speed: a table
// whose rows can leave or wait for admission keeps 64 on every host, so
// that two replicas or a restore elsewhere evict and admit alike.
TEST(SparseTableLruTest, TheDefaultStripesFollowTheMachineOnlyWhenUnbounded) {
  const SparseTableOptions unbounded = Options("adagrad", 4);
  EXPECT_EQ(SparseTable::DefaultStripes(unbounded, 1), 8);
  EXPECT_EQ(SparseTable::DefaultStripes(unbounded, 2), 8);
  EXPECT_EQ(SparseTable::DefaultStripes(unbounded, 3), 16);
  EXPECT_EQ(SparseTable::DefaultStripes(unbounded, 16), 64);
  EXPECT_EQ(SparseTable::DefaultStripes(unbounded, 256), 64);
  EXPECT_EQ(SparseTable::DefaultStripes(unbounded, 0), 8);  // unknown
  SparseTableOptions o = unbounded;
  o.max_rows = 1000;
  EXPECT_EQ(SparseTable::DefaultStripes(o, 2), 64);
  o = unbounded;
  o.max_bytes = 1 << 20;
  EXPECT_EQ(SparseTable::DefaultStripes(o, 2), 64);
  o = unbounded;
  o.ttl = absl::Seconds(5);
  EXPECT_EQ(SparseTable::DefaultStripes(o, 2), 64);
  o = unbounded;
  o.ttl_steps = 3;
  EXPECT_EQ(SparseTable::DefaultStripes(o, 2), 64);
  o = unbounded;
  o.admit_after = 2;
  EXPECT_EQ(SparseTable::DefaultStripes(o, 2), 64);

  ASSERT_EQ(unbounded.num_stripes, 0);  // the default is "by the machine"
  EXPECT_EQ(
      Make(unbounded)->num_stripes(),
      SparseTable::DefaultStripes(
          unbounded, static_cast<int>(std::thread::hardware_concurrency())));
  o = unbounded;
  o.num_stripes = -1;
  const absl::Status refused = SparseTable::Create(o).status();
  EXPECT_NE(refused.message().find("num_stripes must be in [1, 4096] or 0"),
            absl::string_view::npos)
      << refused;
}

TEST(SparseTableLruTest, EvictedRowComesBackFromItsInitialValue) {
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 1;
  auto t = Make(o);
  ASSERT_TRUE(t->Push({1}, {1, 1}).ok());
  EXPECT_NE(PullRow(*t, 1), Initial(*t, 1));
  PullRow(*t, 2);  // evicts 1: value and state are lost
  EXPECT_EQ(PullRow(*t, 1), Initial(*t, 1));
  // A push to an evicted row re-creates it, then applies.
  ASSERT_TRUE(t->Push({2}, {1, -2}).ok());
  const std::vector<float> init2 = Initial(*t, 2);
  EXPECT_EQ(PullRow(*t, 2),
            (std::vector<float>{init2[0] - 0.05f * 1, init2[1] - 0.05f * -2}));
}

TEST(SparseTableLruTest, APushThatEvictsItsOwnRowsUpdatesEachFirst) {
  // A push and a pull look every id up before they touch any row, unless a
  // row they make could evict one found before it: then each row is
  // updated (or read) before the next is looked up. 1 is made, updated,
  // then evicted by 2; 2 by 3.
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 1;
  auto t = Make(o);
  ASSERT_TRUE(t->Push({1, 2, 3}, {1, 1, 2, 2, 3, 3}).ok());
  EXPECT_EQ(t->Stats().rows_evicted, 2);
  const std::vector<float> init3 = Initial(*t, 3);
  EXPECT_EQ(PullRow(*t, 3),
            (std::vector<float>{init3[0] - 0.05f * 3, init3[1] - 0.05f * 3}));
  std::vector<float> out(6);
  ASSERT_TRUE(t->Pull({4, 5, 3}, absl::MakeSpan(out)).ok());
  const std::vector<float> init4 = Initial(*t, 4), init5 = Initial(*t, 5);
  EXPECT_EQ(out, (std::vector<float>{init4[0], init4[1], init5[0], init5[1],
                                     init3[0], init3[1]}));
}

// ---------------------------------------------------------------------------
// Byte budget.

TEST(SparseTableBudgetTest, AByteBudgetBoundsTheRowsAndTheMemory) {
  SparseTableOptions o = Options("adagrad", 16);
  const int64_t row_bytes = SparseTable::BytesPerRow(16, "adagrad");
  EXPECT_GE(row_bytes, 16 * 2 * 4);  // values and accumulators at least
  o.max_bytes = 1000 * row_bytes + row_bytes / 2;
  o.num_stripes = 4;
  auto t = Make(o);
  for (uint64_t first = 0; first < 5000; first += 500) {
    std::vector<uint64_t> ids(500);
    for (uint64_t k = 0; k < 500; ++k) ids[k] = first + k;
    PullRows(*t, ids);
  }
  const SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 1000);
  EXPECT_EQ(st.rows_evicted, 4000);
  // Measured, not modelled: within the budget but for the table's fixed
  // parts (an empty table's), which no row count changes.
  EXPECT_LE(st.memory_bytes - Make(o)->Stats().memory_bytes, o.max_bytes);
}

TEST(SparseTableBudgetTest,
     MaxRowsBindsWhenSmallerAndABudgetBelowOneRowIsRefused) {
  SparseTableOptions o = Options("sgd", 4);
  const int64_t row_bytes = SparseTable::BytesPerRow(4, "sgd");
  o.max_bytes = 10 * row_bytes;
  o.max_rows = 5;
  o.num_stripes = 1;
  auto t = Make(o);
  PullRows(*t, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  EXPECT_EQ(t->Stats().rows, 5);

  o.max_rows = 0;
  o.max_bytes = row_bytes - 1;
  absl::StatusOr<std::unique_ptr<SparseTable>> refused = SparseTable::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                absl::StrCat("holds no row: one row of dim 4 with sgd takes "
                             "up to ",
                             row_bytes, " bytes")),
            absl::string_view::npos)
      << refused.status();
  o.max_bytes = -1;
  EXPECT_FALSE(SparseTable::Create(o).ok());
  EXPECT_EQ(SparseTable::BytesPerRow(4, "rmsprop"), 0);
}

TEST(SparseTableBudgetTest, TheEvictionLogStaysWithinTheBudget) {
  SparseTableOptions o = Options("adagrad", 16);
  const int64_t row_bytes = SparseTable::BytesPerRow(16, "adagrad");
  o.max_bytes = 4000 * row_bytes;
  o.num_stripes = 4;
  auto t = Make(o);
  ASSERT_TRUE(t->MarkChanges().ok());  // evictions logged from here on
  for (uint64_t first = 0; first < 40000; first += 500) {
    std::vector<uint64_t> ids(500);
    for (uint64_t k = 0; k < 500; ++k) ids[k] = first + k;
    PullRows(*t, ids);
  }
  EXPECT_EQ(t->Stats().rows_evicted, 36000);
  EXPECT_LE(t->Stats().memory_bytes - Make(o)->Stats().memory_bytes,
            o.max_bytes);
}

// ---------------------------------------------------------------------------
// Change marks.

// A clock the test moves.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1000);
  std::function<absl::Time()> Get() {
    return [this] { return now; };
  }
};

struct Changes {
  std::map<uint64_t, std::vector<float>> rows;
  std::multiset<uint64_t> evicted;
};

uint32_t Mark(SparseTable& t) {
  absl::StatusOr<uint32_t> mark = t.MarkChanges();
  EXPECT_TRUE(mark.ok()) << mark.status();
  return mark.value_or(0);
}

// Every page of the changes since `mark`, about `max_bytes` at a time.
Changes ChangesSince(const SparseTable& t, uint32_t mark,
                     int64_t max_bytes = 1 << 30) {
  Changes out;
  SparseTable::ChangesCursor cursor;
  for (bool done = false; !done;) {
    absl::StatusOr<SparseTable::ChangesPage> page =
        t.ChangesSince(mark, cursor, max_bytes);
    EXPECT_TRUE(page.ok()) << page.status();
    if (!page.ok()) break;
    const int64_t row_bytes = t.dim() * 4 + 8;
    EXPECT_LE(static_cast<int64_t>(page->ids.size()) * row_bytes,
              std::max(max_bytes, row_bytes));
    for (size_t i = 0; i < page->ids.size(); ++i) {
      EXPECT_EQ(out.rows.count(page->ids[i]), 0u)
          << "row " << page->ids[i] << " in two pages";
      out.rows[page->ids[i]] = {page->values.begin() + i * t.dim(),
                                page->values.begin() + (i + 1) * t.dim()};
    }
    out.evicted.insert(page->evicted_ids.begin(), page->evicted_ids.end());
    cursor = page->next;
    done = page->done;
  }
  return out;
}

std::set<uint64_t> Ids(const Changes& c) {
  std::set<uint64_t> ids;
  for (const auto& [id, row] : c.rows) ids.insert(id);
  return ids;
}

TEST(SparseTableChangesTest, ChangesSinceAMarkAreTheRowsWrittenAfterIt) {
  auto t = Make(Options("sgd", 4));
  PullRows(*t, {1, 2, 3, 4, 5});
  const uint32_t first = Mark(*t);
  EXPECT_TRUE(ChangesSince(*t, first).rows.empty());
  ASSERT_TRUE(t->Push({2, 5}, std::vector<float>(8, 0.5f)).ok());
  PullRows(*t, {3, 9});  // a read changes nothing; a new row is a change
  Changes changes = ChangesSince(*t, first);
  EXPECT_EQ(Ids(changes), (std::set<uint64_t>{2, 5, 9}));
  EXPECT_EQ(changes.rows[5], PullRow(*t, 5));
  EXPECT_TRUE(changes.evicted.empty());

  const uint32_t second = Mark(*t);
  EXPECT_GT(second, first);
  EXPECT_TRUE(ChangesSince(*t, second).rows.empty());
  const std::map<uint64_t, Row> rows = Dump(*t);
  const Row& row = rows.at(3);
  ASSERT_TRUE(t->LoadRow(3, row.value, row.state, row.update_count).ok());
  EXPECT_EQ(Ids(ChangesSince(*t, second)), (std::set<uint64_t>{3}));
  EXPECT_EQ(Ids(ChangesSince(*t, first)), (std::set<uint64_t>{2, 3, 5, 9}));
}

TEST(SparseTableChangesTest, RowsEvictedSinceAMarkAreReported) {
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 4;
  o.num_stripes = 1;
  auto t = Make(o);
  PullRows(*t, {1, 2, 3, 4});
  const uint32_t mark = Mark(*t);
  PullRows(*t, {5, 6});  // evicts 1 and 2
  Changes changes = ChangesSince(*t, mark);
  EXPECT_EQ(Ids(changes), (std::set<uint64_t>{5, 6}));
  EXPECT_EQ(changes.evicted, (std::multiset<uint64_t>{1, 2}));
  PullRows(*t, {1});  // back, evicting 3
  changes = ChangesSince(*t, mark);
  EXPECT_EQ(Ids(changes), (std::set<uint64_t>{1, 5, 6}));
  EXPECT_EQ(changes.evicted, (std::multiset<uint64_t>{1, 2, 3}));
}

TEST(SparseTableChangesTest, PagesCoverEveryChangedRowExactlyOnce) {
  SparseTableOptions o = Options("sgd", 3);
  o.num_stripes = 8;
  auto t = Make(o);
  std::vector<uint64_t> all(1000);
  for (uint64_t i = 0; i < all.size(); ++i) all[i] = i * 7919;
  PullRows(*t, all);
  const uint32_t mark = Mark(*t);
  std::vector<uint64_t> pushed;
  for (uint64_t i = 0; i < all.size(); i += 3) pushed.push_back(all[i]);
  ASSERT_TRUE(
      t->Push(pushed, std::vector<float>(pushed.size() * 3, 1.0f)).ok());
  for (int64_t page_bytes : {1, 7 * 20, 64 * 20, 1 << 30}) {
    const Changes changes = ChangesSince(*t, mark, page_bytes);
    EXPECT_EQ(Ids(changes), std::set<uint64_t>(pushed.begin(), pushed.end()))
        << page_bytes << " bytes a page";
  }
}

TEST(SparseTableChangesTest, APageScansAboutItsBudgetOfUnchangedRows) {
  SparseTableOptions o = Options("sgd", 2);
  o.num_stripes = 1;
  auto t = Make(o);
  std::vector<uint64_t> ids(10000);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
  PullRows(*t, ids);
  const uint32_t mark = Mark(*t);
  ASSERT_TRUE(t->Push({9999}, {1.0f, 1.0f}).ok());  // the last slot
  absl::StatusOr<SparseTable::ChangesPage> first =
      t->ChangesSince(mark, {}, 100);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->done);
  EXPECT_TRUE(first->ids.empty());
  EXPECT_EQ(first->next.slot, 100u);  // a byte a slot looked at
  EXPECT_EQ(Ids(ChangesSince(*t, mark, 100)), (std::set<uint64_t>{9999}));
}

TEST(SparseTableChangesTest, ARowMovedBetweenPagesComesAgainNewer) {
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 4;
  o.num_stripes = 1;
  auto t = Make(o);
  const uint32_t mark = Mark(*t);
  PullRows(*t, {1, 2, 3, 4});
  absl::StatusOr<SparseTable::ChangesPage> first =
      t->ChangesSince(mark, {}, 1);  // one row: id 1 in slot 0
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->ids, std::vector<uint64_t>{1});
  PullRow(*t, 5);  // evicts 1 (least recently used), 5 takes its slot
  PullRow(*t, 1);  // 1 comes back in the slot of 2, after the cursor
  ASSERT_TRUE(t->Push({1}, {3.0f, 3.0f}).ok());
  absl::StatusOr<SparseTable::ChangesPage> rest =
      t->ChangesSince(mark, first->next, 1 << 20);
  ASSERT_TRUE(rest.ok()) << rest.status();
  const auto again = std::find(rest->ids.begin(), rest->ids.end(), 1u);
  ASSERT_NE(again, rest->ids.end());
  const size_t at = again - rest->ids.begin();
  EXPECT_EQ(std::vector<float>(rest->values.begin() + 2 * at,
                               rest->values.begin() + 2 * at + 2),
            PullRow(*t, 1));
}

TEST(SparseTableChangesTest, ExpiriesOfAnUnboundedTableAreReported) {
  FakeClock clock;
  SparseTableOptions o = Options("sgd", 2);
  o.num_stripes = 4;
  o.ttl = absl::Seconds(1);
  o.clock = clock.Get();
  auto t = Make(o);
  const uint32_t mark = Mark(*t);
  std::vector<uint64_t> old_ids(100);
  for (uint64_t i = 0; i < old_ids.size(); ++i) old_ids[i] = i;
  PullRows(*t, old_ids);
  clock.now += absl::Seconds(5);
  std::vector<uint64_t> new_ids(4000);
  for (uint64_t i = 0; i < new_ids.size(); ++i) new_ids[i] = 10000 + i;
  PullRows(*t, new_ids);  // every stripe touched: the old rows expire
  ASSERT_EQ(t->Stats().rows_expired, 100);
  const Changes changes = ChangesSince(*t, mark);
  EXPECT_EQ(changes.evicted,
            std::multiset<uint64_t>(old_ids.begin(), old_ids.end()));
  EXPECT_EQ(Ids(changes), std::set<uint64_t>(new_ids.begin(), new_ids.end()));
}

TEST(SparseTableChangesTest, ChangesCoverWritesRacingTheMark) {
  constexpr int kDim = 2;
  SparseTableOptions o = Options("sgd", kDim);
  o.num_stripes = 16;
  auto t = Make(o);
  std::vector<uint64_t> ids(200);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
  PullRows(*t, ids);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> pushes{0};
  std::thread writer([&] {
    std::mt19937_64 rng(1);
    while (!stop.load()) {
      pushes.fetch_add(1);
      std::set<uint64_t> some;
      for (int k = 0; k < 16; ++k) some.insert(rng() % ids.size());
      std::vector<uint64_t> push(some.begin(), some.end());
      ASSERT_TRUE(
          t->Push(push, std::vector<float>(push.size() * kDim, 0.25f)).ok());
    }
  });
  // An export: a mark, then a read of every row while pushes go on (until
  // some pushes surely overlapped the read).
  while (pushes.load() < 10) std::this_thread::yield();
  const uint32_t mark = Mark(*t);
  const int64_t pushes_at_mark = pushes.load();
  const std::map<uint64_t, Row> base = Dump(*t);
  while (pushes.load() < pushes_at_mark + 10) std::this_thread::yield();
  stop.store(true);
  writer.join();
  const Changes changes = ChangesSince(*t, mark);
  for (const auto& [id, row] : Dump(*t)) {
    const auto in_base = base.find(id);
    if (in_base != base.end() && in_base->second.value == row.value) continue;
    EXPECT_EQ(changes.rows.count(id), 1u)
        << "row " << id << " changed after the base read, not reported";
  }
}

TEST(SparseTableChangesTest, AForgottenEvictionOrABadMarkIsRefused) {
  SparseTableOptions o = Options("sgd", 2);
  o.max_rows = 8;
  o.num_stripes = 1;
  auto t = Make(o);
  const uint32_t mark = Mark(*t);
  for (uint64_t id = 0; id < 200; ++id) PullRow(*t, id);  // 192 evictions
  absl::StatusOr<SparseTable::ChangesPage> page =
      t->ChangesSince(mark, {}, 100);
  ASSERT_FALSE(page.ok());
  EXPECT_EQ(page.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(page.status().message().find("take a whole export"),
            absl::string_view::npos)
      << page.status();
  const uint32_t later = Mark(*t);
  PullRow(*t, 500);
  EXPECT_EQ(ChangesSince(*t, later).evicted.size(), 1u);

  for (uint32_t bad : {0u, later + 1, later + 100}) {
    page = t->ChangesSince(bad, {}, 100);
    EXPECT_EQ(page.status().code(), absl::StatusCode::kInvalidArgument)
        << "mark " << bad << ": " << page.status();
  }
  EXPECT_EQ(t->ChangesSince(later, {5, 0}, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->ChangesSince(later, {0, 99}, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->ChangesSince(later, {}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Rows expired by their TTL.

TEST(SparseTableTtlTest, RowsNotTouchedForTheTtlExpire) {
  FakeClock clock;
  SparseTableOptions o = Options("sgd", 2);
  o.num_stripes = 1;
  o.ttl = absl::Seconds(10);
  o.clock = clock.Get();
  auto t = Make(o);
  PullRows(*t, {1, 2, 3});
  const uint32_t mark = Mark(*t);
  clock.now += absl::Seconds(5);
  ASSERT_TRUE(t->Push({2}, {1.0f, 1.0f}).ok());
  const std::vector<float> pushed = PullRow(*t, 2);
  clock.now += absl::Seconds(10);  // 1 and 3: 15 s untouched; 2: 10 s
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{1, 2, 3}));  // not yet swept
  PullRow(*t, 4);
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{2, 4}));
  EXPECT_EQ(t->Stats().rows_expired, 2);
  EXPECT_EQ(t->Stats().rows_evicted, 0);
  EXPECT_EQ(PullRow(*t, 2), pushed);
  const Changes changes = ChangesSince(*t, mark);
  EXPECT_EQ(changes.evicted, (std::multiset<uint64_t>{1, 3}));
  EXPECT_EQ(Ids(changes), (std::set<uint64_t>{2, 4}));
  // An expired row comes back from its initial value.
  EXPECT_EQ(PullRow(*t, 1), Initial(*t, 1));
}

TEST(SparseTableTtlTest, ExpiredSlotsAreReusedSoMemoryStaysFlat) {
  FakeClock clock;
  SparseTableOptions o = Options("adagrad", 8);
  o.num_stripes = 4;
  o.ttl = absl::Seconds(1);
  o.clock = clock.Get();
  auto t = Make(o);
  int64_t memory_after_first_round = 0, memory_after_round_10 = 0;
  for (uint64_t round = 0; round < 20; ++round) {
    std::vector<uint64_t> ids(1000);
    for (uint64_t k = 0; k < ids.size(); ++k) ids[k] = round * 1000 + k;
    PullRows(*t, ids);
    clock.now += absl::Seconds(5);
    if (round == 0) memory_after_first_round = t->Stats().memory_bytes;
    if (round == 10) memory_after_round_10 = t->Stats().memory_bytes;
  }
  const SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 1000);
  EXPECT_EQ(st.rows_expired, 19000);
  // The hash indexes settle at a larger capacity under churn (tombstones);
  // the rows' storage does not grow at all.
  EXPECT_EQ(st.memory_bytes, memory_after_round_10);
  EXPECT_LE(st.memory_bytes, memory_after_first_round * 2);
}

// ttl_steps counts the table's completed steps (AdvanceStep) from the first
// it completes, not from step 0: rows a restore at step 1000 loaded are as
// young as that step, and time alone expires nothing.
TEST(SparseTableTtlTest, RowsNotTouchedForTheTtlInStepsExpire) {
  FakeClock clock;
  SparseTableOptions o = Options("sgd", 2);
  o.num_stripes = 1;
  o.ttl_steps = 10;
  o.clock = clock.Get();
  auto t = Make(o);
  EXPECT_GT(SparseTable::RowBytes(o),
            SparseTable::BytesPerRow(o.dim, o.optimizer.name));
  ASSERT_TRUE(t->LoadRow(7, {1.0f, 2.0f}, {}, 1).ok());  // a restore's
  t->AdvanceStep(1000);
  PullRows(*t, {1, 2, 3});
  t->AdvanceStep(1005);
  ASSERT_TRUE(t->Push({2}, {1.0f, 1.0f}).ok());
  clock.now += absl::Hours(10);
  t->AdvanceStep(1003);  // an older step moves nothing back
  t->AdvanceStep(1010);
  PullRow(*t, 4);
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{1, 2, 3, 4, 7}));
  t->AdvanceStep(1011);  // 7, 1 and 3: untouched since step 1000
  PullRow(*t, 4);
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{2, 4}));
  EXPECT_EQ(t->Stats().rows_expired, 3);
  t->AdvanceStep(1016);  // 2: pushed at step 1005
  PullRow(*t, 4);
  EXPECT_EQ(Resident(*t), (std::set<uint64_t>{4}));
  EXPECT_EQ(t->Stats().rows_expired, 4);
}

TEST(SparseTableTtlTest, ATtlInStepsIsRefusedNegativeOrBesideOneInTime) {
  SparseTableOptions o = Options("sgd", 2);
  o.ttl_steps = -1;
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o.ttl_steps = 5;
  o.ttl = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<SparseTable>> refused = SparseTable::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("not beside one in seconds"),
            std::string::npos)
      << refused.status();
}

TEST(SparseTableTtlTest, ATtlBelowASecondIsRefused) {
  SparseTableOptions o = Options("sgd", 2);
  for (absl::Duration ttl :
       {absl::ZeroDuration(), absl::Milliseconds(500), absl::Seconds(-3)}) {
    o.ttl = ttl;
    absl::StatusOr<std::unique_ptr<SparseTable>> refused =
        SparseTable::Create(o);
    ASSERT_FALSE(refused.ok()) << absl::FormatDuration(ttl);
    EXPECT_NE(refused.status().message().find("a row TTL must be at least 1s"),
              absl::string_view::npos)
        << refused.status();
  }
  o.ttl = absl::Seconds(1);
  EXPECT_TRUE(SparseTable::Create(o).ok());
  EXPECT_EQ(SparseTable::RowBytes(o), SparseTable::BytesPerRow(2, "sgd") + 8);
}

// ---------------------------------------------------------------------------
// Admission.

TEST(SparseTableAdmissionTest, RowIsCreatedOnTheNthSighting) {
  SparseTableOptions o = Options("sgd", 2);
  o.admit_after = 3;
  auto t = Make(o);
  const uint64_t x = 77;
  EXPECT_EQ(PullRow(*t, x), Initial(*t, x));
  EXPECT_EQ(PullRow(*t, x), Initial(*t, x));
  SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 0);
  EXPECT_EQ(st.pulls_unadmitted, 2);
  EXPECT_EQ(st.ids_pending_admission, 1);
  // Pushes before admission are dropped and counted.
  SparsePushResult result;
  ASSERT_TRUE(t->Push({x, 78}, {5, 5, 5, 5}, &result).ok());
  EXPECT_EQ(result.dropped_unadmitted, 2);
  EXPECT_EQ(result.rows_applied, 0);
  st = t->Stats();
  EXPECT_EQ(st.pushes_dropped_unadmitted, 2);
  EXPECT_EQ(st.rows, 0);
  // Third sighting: created, from the initial value (the push was dropped).
  EXPECT_EQ(PullRow(*t, x), Initial(*t, x));
  st = t->Stats();
  EXPECT_EQ(st.rows, 1);
  EXPECT_EQ(st.rows_created, 1);
  EXPECT_EQ(st.ids_pending_admission, 0);
  EXPECT_EQ(st.pulls_unadmitted, 2);
  ASSERT_TRUE(t->Push({x}, {2, -2}, &result).ok());
  EXPECT_EQ(result.dropped_unadmitted, 0);
  EXPECT_EQ(result.rows_applied, 1);
  EXPECT_EQ(result.rows_created, 0);
  const std::vector<float> init = Initial(*t, x);
  EXPECT_EQ(PullRow(*t, x),
            (std::vector<float>{init[0] - 0.05f * 2, init[1] + 0.05f * 2}));
  EXPECT_EQ(t->Stats().pushes_dropped_unadmitted, 2);

  // Each occurrence in one pull counts: the third copy creates the row.
  EXPECT_EQ(PullRows(*t, {5, 5, 5}),
            (std::vector<float>{Initial(*t, 5)[0], Initial(*t, 5)[1],
                                Initial(*t, 5)[0], Initial(*t, 5)[1],
                                Initial(*t, 5)[0], Initial(*t, 5)[1]}));
  EXPECT_EQ(t->Stats().rows, 2);
  EXPECT_EQ(t->Stats().pulls_unadmitted, 4);
}

TEST(SparseTableAdmissionTest, SightingsRoundTripAndBadOnesAreRefused) {
  SparseTableOptions o = Options("sgd", 2);
  o.admit_after = 3;
  auto a = Make(o);
  PullRows(*a, {7, 7, 9});
  PullRows(*a, {11, 11, 11});  // admitted: a row, no count
  std::vector<std::pair<uint64_t, uint32_t>> seen;
  a->ForEachSighting(
      [&](uint64_t id, uint32_t count) { seen.emplace_back(id, count); });
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<std::pair<uint64_t, uint32_t>>{{7, 2}, {9, 1}}));
  auto b = Make(o);
  for (const auto& [id, count] : seen)
    ASSERT_TRUE(b->LoadSighting(id, count).ok());
  EXPECT_EQ(b->Stats().ids_pending_admission, 2);
  PullRow(*b, 7);  // the third sighting, on the copy too
  EXPECT_EQ(b->Stats().rows, 1);

  EXPECT_FALSE(b->LoadSighting(5, 0).ok());
  EXPECT_FALSE(b->LoadSighting(5, 4).ok());  // above admit_after
  EXPECT_FALSE(b->LoadSighting(7, 1).ok());  // resident
  EXPECT_FALSE(Make(Options("sgd", 2))->LoadSighting(5, 1).ok());
  EXPECT_EQ(b->Stats().ids_pending_admission, 1);  // nothing changed
}

TEST(SparseTableAdmissionTest, AdmittedThenEvictedRowIsRecreatedByPush) {
  SparseTableOptions o = Options("sgd", 1);
  o.admit_after = 2;
  o.max_rows = 1;
  auto t = Make(o);
  PullRows(*t, {1, 1});  // admitted
  PullRows(*t, {2, 2});  // admitted, evicts 1
  SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 1);
  EXPECT_EQ(st.rows_evicted, 1);
  EXPECT_EQ(st.evicted_ids_remembered, 1);
  EXPECT_EQ(st.ids_pending_admission, 0);
  // The push for 1 (computed from a pull before its eviction) is applied.
  SparsePushResult result;
  ASSERT_TRUE(t->Push({1}, {4}, &result).ok());
  EXPECT_EQ(result.rows_created, 1);
  EXPECT_EQ(result.rows_applied, 1);
  st = t->Stats();
  EXPECT_EQ(st.pushes_dropped_unadmitted, 0);
  EXPECT_EQ(st.rows_created, 3);
  EXPECT_EQ(st.evicted_ids_remembered, 1);  // now 2 is the evicted one
  EXPECT_EQ(PullRow(*t, 1)[0], Initial(*t, 1)[0] - 0.05f * 4);
  // A remembered id is also re-created by a single pull.
  PullRow(*t, 2);
  EXPECT_EQ(Resident(*t), std::set<uint64_t>{2});
  // Only the first sightings of 1 and 2 were answered without a row.
  EXPECT_EQ(t->Stats().pulls_unadmitted, 2);
}

TEST(SparseTableAdmissionTest, PendingIdsAreBoundedByAging) {
  SparseTableOptions o = Options("sgd", 1);
  o.admit_after = 3;
  o.max_pending_ids = 8;
  o.num_stripes = 1;
  auto t = Make(o);
  PullRows(*t, {1000, 1000});  // count 2
  for (uint64_t id = 0; id < 7; ++id) PullRow(*t, id);
  EXPECT_EQ(t->Stats().ids_pending_admission, 8);
  // The table is full: the next new id halves every count (1000 -> 1, the
  // one-time ids -> 0, forgotten) before it is counted.
  PullRow(*t, 7);
  SparseTableStats st = t->Stats();
  EXPECT_EQ(st.ids_pending_admission, 2);
  EXPECT_EQ(st.pending_ids_forgotten, 7);
  PullRow(*t, 1000);  // count 2
  EXPECT_EQ(t->Stats().rows, 0);
  PullRow(*t, 1000);  // count 3: admitted
  EXPECT_EQ(Resident(*t), std::set<uint64_t>{1000});
  for (uint64_t id = 100; id < 1000; ++id) {
    PullRow(*t, id);
    ASSERT_LE(t->Stats().ids_pending_admission, 8);
  }
}

// ---------------------------------------------------------------------------
// Checkpoint support.

TEST(SparseTableCheckpointTest, RowsRoundTripIntoAnyStripeCount) {
  for (const char* opt : {"sgd", "adagrad", "adam", "ftrl"}) {
    SparseTableOptions o = Options(opt, 3);
    auto a = Make(o);
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<float> g(-1, 1);
    for (int step = 0; step < 50; ++step) {
      std::set<uint64_t> ids;
      while (ids.size() < 6) ids.insert(rng() % 40);
      std::vector<uint64_t> v(ids.begin(), ids.end());
      std::vector<float> grads(v.size() * 3);
      for (float& x : grads) x = g(rng);
      PullRows(*a, v);
      ASSERT_TRUE(a->Push(v, grads).ok());
    }
    SparseTableOptions ob = o;
    ob.num_stripes = 5;
    auto b = Make(ob);
    a->ForEachRow([&](uint64_t id, absl::Span<const float> value,
                      absl::Span<const float> state, int64_t count) {
      ASSERT_TRUE(b->LoadRow(id, value, state, count).ok());
    });
    EXPECT_EQ(Dump(*a), Dump(*b)) << opt;
    EXPECT_EQ(b->Stats().rows_loaded, a->Stats().rows);
    // Both continue identically.
    std::vector<uint64_t> ids = {0, 1, 2, 39, 41};
    std::vector<float> grads(15, 0.5f);
    ASSERT_TRUE(a->Push(ids, grads).ok());
    ASSERT_TRUE(b->Push(ids, grads).ok());
    EXPECT_EQ(PullRows(*a, ids), PullRows(*b, ids)) << opt;
  }
}

TEST(SparseTableCheckpointTest, LoadRowRejectsImpossibleRows) {
  auto adagrad = Make(Options("adagrad", 2));
  EXPECT_FALSE(adagrad->LoadRow(1, {1, 1}, {0.1f}, 0).ok());         // size
  EXPECT_FALSE(adagrad->LoadRow(1, {1, 1}, {0.1f, -1.0f}, 0).ok());  // acc < 0
  EXPECT_FALSE(adagrad->LoadRow(1, {1, NAN}, {0.1f, 0.1f}, 0).ok());
  EXPECT_FALSE(adagrad->LoadRow(1, {1, 1}, {0.1f, 0.1f}, -1).ok());
  auto ftrl = Make(Options("ftrl", 1));
  EXPECT_FALSE(ftrl->LoadRow(1, {0}, {1, -1}, 1).ok());  // n < 0
  EXPECT_EQ(adagrad->Stats().rows + ftrl->Stats().rows, 0);
  // ftrl derives the value from (z, n).
  ASSERT_TRUE(ftrl->LoadRow(1, {123}, {2, 4}, 1).ok());
  EXPECT_NEAR(PullRow(*ftrl, 1)[0], -2.0 / ((1.0 + 2.0) / 0.05), 1e-7);
}

// ---------------------------------------------------------------------------
// Validation.

TEST(SparseTableConfigTest, BadOptimizerConfigsNameTheFlag) {
  auto message = [](SparseOptimizerConfig c) {
    absl::Status s = ValidateSparseOptimizer(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  SparseOptimizerConfig c;
  EXPECT_TRUE(ValidateSparseOptimizer(c).ok());
  c.name = "adadelta";
  EXPECT_NE(message(c).find("--sparse_optimizer"), std::string::npos);
  c = {};
  c.learning_rate = 0;
  EXPECT_NE(message(c).find("--sparse_learning_rate"), std::string::npos);
  c = {};
  c.name = "adagrad";
  c.initial_accumulator = -1;
  EXPECT_NE(message(c).find("--sparse_adagrad_initial_accumulator"),
            std::string::npos);
  // torch's start (0) is fine with an epsilon, and 0/0 without one is not.
  c.initial_accumulator = 0;
  c.epsilon = 1e-10f;
  EXPECT_TRUE(ValidateSparseOptimizer(c).ok());
  c.epsilon = 0;
  EXPECT_NE(message(c).find("needs an epsilon > 0"), std::string::npos);
  c = {};
  c.name = "adam";
  c.beta2 = 1;
  EXPECT_NE(message(c).find("--sparse_adam_beta2"), std::string::npos);
  c = {};
  c.name = "ftrl";
  c.ftrl_alpha = -1;
  EXPECT_NE(message(c).find("--ftrl_alpha"), std::string::npos);
  c = {};
  c.name = "ftrl";
  c.ftrl_l1 = NAN;
  EXPECT_NE(message(c).find("--ftrl_l1"), std::string::npos);
  c = {};
  c.name = "ftrl";
  c.learning_rate = 0;  // unused by ftrl
  EXPECT_TRUE(ValidateSparseOptimizer(c).ok());

  SparseTableOptions o = Options("sgd", 0);
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o = Options("sgd", 4);
  o.name = "";
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o = Options("sgd", 4);
  o.max_rows = -1;
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o = Options("sgd", 4);
  o.admit_after = 2;
  o.max_pending_ids = 0;
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o = Options("sgd", 4);
  o.num_stripes = -1;
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o = Options("sgd", 4);
  o.num_stripes = 4097;
  EXPECT_FALSE(SparseTable::Create(o).ok());
  o = Options("nope", 4);
  absl::StatusOr<std::unique_ptr<SparseTable>> bad = SparseTable::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("emb"), absl::string_view::npos);
}

// ---------------------------------------------------------------------------
// Concurrency.

// Integer gradient in [-3, 3] for (thread, iteration, id, element).
float IntGrad(int thread, int iter, uint64_t id, int j) {
  return static_cast<float>((thread * 7 + iter * 13 + id * 5 + j * 3) % 7) - 3;
}

TEST(SparseTableConcurrencyTest, NoLostUpdatesUnderConcurrentPushes) {
  for (int stripes : {1, 64}) {
    constexpr int kThreads = 4, kIters = 400, kDim = 4;
    SparseTableOptions o = Options("sgd", kDim);
    o.init = Spec(InitSpec::ZEROS, 0);
    o.optimizer.learning_rate = 1.0f;
    o.num_stripes = stripes;
    auto t = Make(o);
    // Per thread: expected sum of its gradients per (id, element).
    std::vector<std::map<uint64_t, std::vector<double>>> sums(kThreads);
    std::atomic<bool> done{false};
    std::vector<std::thread> threads;
    for (int th = 0; th < kThreads; ++th) {
      threads.emplace_back([&, th] {
        std::mt19937_64 rng(th);
        for (int it = 0; it < kIters; ++it) {
          std::set<uint64_t> set;
          for (int k = 0; k < 8; ++k) set.insert(rng() % 50);  // shared
          for (int k = 0; k < 8; ++k) {
            set.insert(1000 * (th + 1) + rng() % 50);  // this thread's own
          }
          std::vector<uint64_t> ids(set.begin(), set.end());
          std::shuffle(ids.begin(), ids.end(), rng);
          std::vector<float> grads(ids.size() * kDim);
          for (size_t i = 0; i < ids.size(); ++i) {
            auto& s = sums[th][ids[i]];
            s.resize(kDim);
            for (int j = 0; j < kDim; ++j) {
              grads[i * kDim + j] = IntGrad(th, it, ids[i], j);
              s[j] += grads[i * kDim + j];
            }
          }
          ASSERT_TRUE(t->Push(ids, grads).ok());
        }
      });
    }
    std::thread reader([&] {
      std::vector<uint64_t> ids = {0, 1, 2, 1001, 2002, 3003, 4004, 49};
      std::vector<float> out(ids.size() * kDim);
      while (!done.load()) {
        ASSERT_TRUE(t->Pull(ids, absl::MakeSpan(out)).ok());
        for (float x : out) ASSERT_EQ(x, std::round(x));
        t->Stats();
      }
    });
    for (auto& th : threads) th.join();
    done = true;
    reader.join();

    std::map<uint64_t, std::vector<double>> total;
    for (const auto& per_thread : sums) {
      for (const auto& [id, s] : per_thread) {
        auto& acc = total[id];
        acc.resize(kDim);
        for (int j = 0; j < kDim; ++j) acc[j] += s[j];
      }
    }
    const std::map<uint64_t, Row> rows = Dump(*t);
    for (const auto& [id, s] : total) {
      ASSERT_EQ(rows.count(id), 1u) << id;
      for (int j = 0; j < kDim; ++j) {
        EXPECT_EQ(rows.at(id).value[j], -s[j]) << "id " << id << " elem " << j;
      }
    }
    EXPECT_EQ(t->Stats().rows, static_cast<int64_t>(total.size()));
  }
}

// A skewed stream: id = floor(V^u) - 1 for u ~ U[0, 1) is log-uniform, i.e.
// Zipf with exponent ~1 over [0, V).
uint64_t ZipfIsh(std::mt19937_64& rng, double vocab) {
  std::uniform_real_distribution<double> u(0, 1);
  return static_cast<uint64_t>(std::floor(std::pow(vocab, u(rng)))) - 1;
}

TEST(SparseTableConcurrencyTest, EvictionAndAdmissionStayConsistent) {
  SparseTableOptions o = Options("adam", 4);
  o.max_rows = 100;
  o.admit_after = 2;
  o.max_pending_ids = 256;
  auto t = Make(o);
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937_64 rng(100 + th);
      for (int it = 0; it < 500; ++it) {
        std::set<uint64_t> set;
        for (int k = 0; k < 16; ++k) set.insert(ZipfIsh(rng, 5000));
        std::vector<uint64_t> ids(set.begin(), set.end());
        std::vector<float> out(ids.size() * 4);
        ASSERT_TRUE(t->Pull(ids, absl::MakeSpan(out)).ok());
        std::vector<float> grads(ids.size() * 4, 0.1f);
        ASSERT_TRUE(t->Push(ids, grads).ok());
        ASSERT_LE(t->Stats().rows, 100);
      }
    });
  }
  for (auto& th : threads) th.join();
  const SparseTableStats st = t->Stats();
  EXPECT_EQ(st.rows, 100);
  EXPECT_EQ(st.rows, st.rows_created - st.rows_evicted);
  EXPECT_LE(st.ids_pending_admission + st.evicted_ids_remembered, 256 + 64);
  EXPECT_EQ(static_cast<int64_t>(Dump(*t).size()), st.rows);
}

// ---------------------------------------------------------------------------
// Memory.

TEST(SparseTableMemoryTest, SkewedStreamWithARowCapStaysBounded) {
  constexpr int64_t kDim = 16, kMaxRows = 1000, kMaxPending = 2048;
  SparseTableOptions o = Options("adam", kDim);
  o.max_rows = kMaxRows;
  o.admit_after = 2;
  o.max_pending_ids = kMaxPending;
  auto capped = Make(o);
  SparseTableOptions uo = o;
  uo.max_rows = 0;
  uo.admit_after = 0;
  auto unbounded = Make(uo);

  // Per row: value + 2 state slots, bookkeeping, and index slack (a hash
  // table runs between 7/16 and 7/8 full: <= 3 slots of 17 bytes per entry).
  // Per pending id: 3 slots. Per stripe: a fixed struct and small vectors.
  const int64_t bound = kMaxRows * (kDim * 3 * 4 + 2 * 32 + 3 * 17) +
                        kMaxPending * 3 * 17 + 64 * 1024;
  std::mt19937_64 rng(11);
  int64_t memory_mid = 0;
  for (int batch = 0; batch < 800; ++batch) {
    std::set<uint64_t> set;
    for (int k = 0; k < 256; ++k) set.insert(ZipfIsh(rng, 1e6));
    std::vector<uint64_t> ids(set.begin(), set.end());
    std::vector<float> grads(ids.size() * kDim, 0.01f);
    for (SparseTable* t : {capped.get(), unbounded.get()}) {
      PullRows(*t, ids);
      ASSERT_TRUE(t->Push(ids, grads).ok());
    }
    if (batch == 399) memory_mid = capped->Stats().memory_bytes;
  }
  const SparseTableStats st = capped->Stats();
  EXPECT_LE(st.rows, kMaxRows);
  EXPECT_GT(st.rows_evicted, 0);
  EXPECT_GT(st.pulls_unadmitted, 0);
  EXPECT_LE(st.ids_pending_admission + st.evicted_ids_remembered,
            kMaxPending + 64);
  std::cout << "capped: rows " << st.rows << ", memory " << st.memory_bytes
            << " bytes (bound " << bound << ", at half-stream " << memory_mid
            << "); unbounded: rows " << unbounded->Stats().rows << ", memory "
            << unbounded->Stats().memory_bytes << " bytes\n";
  EXPECT_LE(st.memory_bytes, bound);
  EXPECT_LE(st.memory_bytes, memory_mid * 11 / 10);  // no growth once warm
  // The unbounded table fed the same stream is far larger.
  EXPECT_GT(unbounded->Stats().memory_bytes, 10 * bound);
  // The hottest ids survive eviction.
  const std::set<uint64_t> resident = Resident(*capped);
  for (uint64_t id = 0; id < 4; ++id) EXPECT_EQ(resident.count(id), 1u) << id;
}

}  // namespace
}  // namespace pstrain
