#include "ps_server/rounded_blocks.h"

#include <utility>

#include "common/transport/tensor_codec.h"

namespace pstrain {

std::shared_ptr<const std::string> RoundedBlocks::Get(
    const std::string* tensor, int64_t block, int64_t version,
    const BlockValues::Ref& values, DataType dtype) {
  const Key key(tensor, block, dtype);
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end() && it->second.version == version &&
        it->second.buffer == values.get()) {
      reused_.fetch_add(1, std::memory_order_relaxed);
      return it->second.bytes;
    }
  }
  // Rounded outside the lock: other blocks' answers need not wait for it.
  auto bytes = std::make_shared<std::string>();
  EncodeFromFloat32(dtype, *values, bytes.get());
  rounded_.fetch_add(1, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  // The last one rounded is kept: versions only grow, except where a
  // block's state is replaced (restore, catch-up), which this follows.
  entries_[key] = Entry{version, values.get(), bytes};
  return bytes;
}

}  // namespace pstrain
