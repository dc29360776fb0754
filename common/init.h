// Deterministic initial values. Element i of tensor `name` is a pure function
// of (seed, name, i), so the initial model is the same whichever shard
// computes a block, and the same on 1 shard or 5.
#ifndef PSTRAIN_COMMON_INIT_H_
#define PSTRAIN_COMMON_INIT_H_

#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/ps.pb.h"

namespace pstrain {

// Writes elements [offset, offset + out.size()) of the tensor's initial value.
void FillInitialValues(const InitSpec& init, uint64_t seed,
                       absl::string_view tensor_name, int64_t offset,
                       absl::Span<float> out);
// The same, for the tensor whose name hashes to `name_hash` (Fnv1a64): for
// names made per call (a sparse row's), hashed without being built.
void FillInitialValuesOfHashedName(const InitSpec& init, uint64_t seed,
                                   uint64_t name_hash, int64_t offset,
                                   absl::Span<float> out);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_INIT_H_
