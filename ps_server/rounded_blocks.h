// Pulled blocks rounded to 16 bits (PullRequest.dtype), made once per block
// version: in sync mode every worker pulls the same version of every block,
// and the thread that completes a step answers all their pulls, so without
// this a shard would round each block once per worker, one after another.
#ifndef PSTRAIN_PS_SERVER_ROUNDED_BLOCKS_H_
#define PSTRAIN_PS_SERVER_ROUNDED_BLOCKS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "proto/ps.pb.h"
#include "ps_server/block_values.h"

namespace pstrain {

class RoundedBlocks {
 public:
  // `values` (block `block` of `tensor` at `version`) as `dtype` (BFLOAT16
  // or FLOAT16), the bytes EncodeFromFloat32 makes. The same bytes object
  // while the block stays at that version and in that buffer; a new
  // version or buffer is rounded again and replaces it. One rounded copy
  // per block and dtype is kept (half the shard's values at most). Thread-
  // safe; two threads asking at once for a version not rounded yet may
  // both round it. `values` must not change while its version stays (the
  // shard bumps a block's version with every write).
  std::shared_ptr<const std::string> Get(const std::string* tensor,
                                         int64_t block, int64_t version,
                                         const BlockValues::Ref& values,
                                         DataType dtype);

  // Blocks rounded so far, and answers served from a copy made before.
  int64_t rounded() const { return rounded_.load(); }
  int64_t reused() const { return reused_.load(); }

 private:
  // The block's identity (its tensor's name lives as long as the model)
  // and the dtype.
  using Key = std::tuple<const std::string*, int64_t, DataType>;
  struct Entry {
    int64_t version = -1;
    // Which buffer was rounded: a block written in place bumps its version,
    // one whose buffer was replaced (restore, catch-up) changes this.
    const void* buffer = nullptr;
    std::shared_ptr<const std::string> bytes;
  };

  absl::Mutex mu_;
  absl::flat_hash_map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> rounded_{0}, reused_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_ROUNDED_BLOCKS_H_
