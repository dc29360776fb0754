// Decisions of the CUDA backend that need no GPU to make, kept apart from
// cuda_backend.cc (which needs one to run) so that tests check them on any
// machine.
#ifndef PSTRAIN_KERNELS_CUDA_POLICY_H_
#define PSTRAIN_KERNELS_CUDA_POLICY_H_

#include <algorithm>
#include <cstddef>

namespace pstrain::kernels::internal {

// The new size of a pinned staging buffer of `capacity` bytes that must
// hold `bytes`: at least double the old size (every reallocation
// synchronizes the device, so a run of growing copies must reallocate only
// O(log n) times), at least `min_size`, at most `max_size` (larger copies
// are chunked).
inline size_t NextStagingCapacity(size_t capacity, size_t bytes,
                                  size_t min_size, size_t max_size) {
  return std::min(max_size, std::max({bytes, min_size, 2 * capacity}));
}

}  // namespace pstrain::kernels::internal

#endif  // PSTRAIN_KERNELS_CUDA_POLICY_H_
