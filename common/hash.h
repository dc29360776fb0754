// Counter-based hashing for everything that must be a pure function of its
// inputs: initial values, synthetic data, row placement. Hashing where a
// number is used (seed, stream, index) instead of drawing from a sequential
// generator is what lets any process compute any value alone.
#ifndef PSTRAIN_COMMON_HASH_H_
#define PSTRAIN_COMMON_HASH_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace pstrain {

// splitmix64: a bijection on 64 bits with full avalanche.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// FNV-1a of a string: stable across builds, platforms and runs. FNV-1a
// goes byte by byte, so the hash of a + b is Fnv1a64(b, Fnv1a64(a)): a name
// built from parts is hashed without building it.
inline constexpr uint64_t kFnv1a64Basis = 0xcbf29ce484222325ULL;
inline uint64_t Fnv1a64(absl::string_view s, uint64_t h = kFnv1a64Basis) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_HASH_H_
