// The push/pull fuzz target as a plain test (no libFuzzer, any compiler):
// every seed-corpus file, then thousands of deterministic mutations of them
// (fixed seed), go through the same LLVMFuzzerTestOneInput, whose invariant
// checks abort on a violation.
//
//   push_pull_fuzz_smoke_test [--inputs=N] [--seed=S] PATH...
//
// Each PATH is an input file or a directory of them (the seed corpus, or a
// crash file written by libFuzzer: this reproduces it without clang).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "ps_server/fuzz/push_pull_fuzz.h"

namespace pstrain::fuzz {
namespace {

std::vector<std::string> g_paths;
uint64_t g_inputs = 20000;
uint64_t g_seed = 20240601;

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

std::vector<std::string> LoadInputs() {
  std::vector<std::filesystem::path> files;
  for (const std::string& path : g_paths) {
    if (std::filesystem::is_directory(path)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        files.push_back(entry.path());
      }
    } else {
      files.emplace_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> inputs;
  for (const auto& file : files) inputs.push_back(ReadFile(file));
  return inputs;
}

void RunInput(const std::string& input) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()),
                         input.size());
}

// A few libFuzzer-like mutations.
std::string Mutate(std::string input, std::mt19937_64& rng) {
  auto below = [&rng](size_t n) { return n == 0 ? 0 : rng() % n; };
  static const char* const kInteresting[] = {
      "\x00",
      "\xff",
      "\x80",
      "\x7f",
      "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  // -1 as a varint
      "\x80\x80\x80\x80\x80\x80\x80\x80\x10",      // 2^60
      "\xff\xff\xff\xff\x07",                      // 2^31 - 1
      "\x2a",                                      // field 5, bytes: a block
      "\x22",                                      // field 4, bytes: data
  };
  const int mutations = 1 + static_cast<int>(below(4));
  for (int m = 0; m < mutations; ++m) {
    const size_t size = input.size();
    if (size < kHeaderBytes) break;
    switch (below(8)) {
      case 0:  // flip a bit anywhere, header included
        if (size > 0) input[below(size)] ^= static_cast<char>(1 << below(8));
        break;
      case 1: {  // an interesting byte string over the body
        const char* value = kInteresting[below(std::size(kInteresting))];
        const size_t length = std::max<size_t>(1, std::strlen(value));
        const size_t at = kHeaderBytes + below(size + 1 - kHeaderBytes);
        input.replace(at, std::min(length, input.size() - at),
                      std::string(value, length));
        break;
      }
      case 2: {  // insert random bytes
        std::string bytes(1 + below(8), '\0');
        for (char& c : bytes) c = static_cast<char>(rng());
        input.insert(kHeaderBytes + below(size + 1 - kHeaderBytes), bytes);
        break;
      }
      case 3: {  // erase a range of the body
        if (size <= kHeaderBytes) break;
        const size_t at = kHeaderBytes + below(size - kHeaderBytes);
        input.erase(at, 1 + below(std::min<size_t>(16, size - at)));
        break;
      }
      case 4:  // truncate
        input.resize(kHeaderBytes + below(size + 1 - kHeaderBytes));
        break;
      case 5: {  // duplicate a chunk of the body
        if (size <= kHeaderBytes) break;
        const size_t at = kHeaderBytes + below(size - kHeaderBytes);
        const std::string chunk =
            input.substr(at, 1 + below(std::min<size_t>(32, size - at)));
        input.insert(kHeaderBytes + below(size + 1 - kHeaderBytes), chunk);
        break;
      }
      case 6:  // a new RPC kind / mode / options
        input[below(3)] = static_cast<char>(rng());
        break;
      case 7:  // new cut points
        for (size_t i = 3; i < kHeaderBytes; ++i) {
          input[i] = static_cast<char>(rng());
        }
        break;
    }
  }
  return input;
}

TEST(PushPullFuzzSmokeTest, SeedCorpus) {
  const std::vector<std::string> inputs = LoadInputs();
  ASSERT_FALSE(g_paths.empty()) << "no corpus path given";
  if (absl::StrContains(g_paths[0], "corpus")) {
    EXPECT_GE(inputs.size(), 40u) << "the seed corpus looks incomplete";
  }
  for (const std::string& input : inputs) RunInput(input);
}

TEST(PushPullFuzzSmokeTest, MutatedInputs) {
  const std::vector<std::string> seeds = LoadInputs();
  ASSERT_FALSE(seeds.empty());
  std::mt19937_64 rng(g_seed);
  const auto start = std::chrono::steady_clock::now();
  uint64_t pulls_waiting_for_deadline = 0;
  for (uint64_t i = 0; i < g_inputs; ++i) {
    std::string input;
    if (rng() % 10 == 0) {  // pure noise, header included
      input.resize(rng() % 200);
      for (char& c : input) c = static_cast<char>(rng());
    } else {
      input = Mutate(seeds[rng() % seeds.size()], rng);
    }
    // A pull answered by the reaper takes up to its 20 ms period: keep a
    // few of those, answer the rest by shutting the shard down.
    if (input.size() >= kHeaderBytes && (input[1] & 0x40) != 0) {
      if (rng() % 32 != 0) {
        input[1] = static_cast<char>(input[1] & ~0x40);
      } else {
        ++pulls_waiting_for_deadline;
      }
    }
    RunInput(input);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf(
      "[ smoke ] %llu mutated inputs (seed %llu, %llu pulls left to their "
      "deadline) in %.2f s, %.0f/s\n",
      static_cast<unsigned long long>(g_inputs),
      static_cast<unsigned long long>(g_seed),
      static_cast<unsigned long long>(pulls_waiting_for_deadline), seconds,
      g_inputs / seconds);
}

}  // namespace
}  // namespace pstrain::fuzz

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--inputs=")) {
      if (!absl::SimpleAtoi(arg.substr(9), &pstrain::fuzz::g_inputs)) {
        std::fprintf(stderr, "bad %s\n", arg.c_str());
        return 2;
      }
    } else if (absl::StartsWith(arg, "--seed=")) {
      if (!absl::SimpleAtoi(arg.substr(7), &pstrain::fuzz::g_seed)) {
        std::fprintf(stderr, "bad %s\n", arg.c_str());
        return 2;
      }
    } else {
      pstrain::fuzz::g_paths.push_back(arg);
    }
  }
  return RUN_ALL_TESTS();
}
