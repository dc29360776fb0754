// How a model's dense tensors are spread over the parameter-server shards.
//
// Each tensor (flattened, row-major) is cut into blocks of
// schema.block_elements() elements (the last block of a tensor may be
// shorter). Blocks are numbered globally in schema order and block g lives on
// shard g % num_shards: round-robin keeps shards within one block of each
// other in element count for any mix of tensor sizes, and both binaries
// compute the same layout from the schema alone.
#ifndef PSTRAIN_COMMON_PARTITION_H_
#define PSTRAIN_COMMON_PARTITION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/ps.pb.h"

namespace pstrain {

// The worker's --block_elements default (512 KiB of float32): what a model
// registered without choosing gets, and what bench/transport/ps_bench
// measures unless told otherwise.
constexpr int64_t kDefaultBlockElements = int64_t{1} << 17;

struct BlockLocation {
  int tensor = 0;      // index into schema.dense()
  int64_t block = 0;   // index of the block within its tensor
  int64_t offset = 0;  // first element of the block within its tensor
  int64_t length = 0;  // elements in the block
  int shard = 0;
};

// Refuses a schema no server should hold: no tensors, empty or duplicate
// names, non-positive dimensions, block_elements < 1, bad init specs,
// tensors over 2^40 elements.
absl::Status ValidateSchema(const ModelSchema& schema);

// "" when the schemas are the same; otherwise a sentence naming the first
// difference, e.g. "tensor 1 ('fc0/bias'): shape [10] vs [12]".
std::string FirstSchemaDifference(const ModelSchema& expected,
                                  const ModelSchema& actual);

int64_t NumElements(const DenseTensorSpec& tensor);

// The shard holding row `id` of sparse table `table`: a hash of both, so
// tables spread independently and any shard count works.
int SparseShardOf(absl::string_view table, uint64_t id, int num_shards);

// The placement rule, shared by every layer that needs it (the client and
// the shards through Partition, checkpoints through these two): global
// block g lives on shard g % num_shards.
inline int ShardOfBlock(int64_t global_block, int num_shards) {
  return static_cast<int>(global_block % num_shards);
}
// How many of blocks [0, num_blocks) shard `shard` of `num_shards` holds.
inline int64_t BlocksOnShard(int64_t num_blocks, int shard, int num_shards) {
  return num_blocks > shard ? (num_blocks - shard - 1) / num_shards + 1 : 0;
}

class Partition {
 public:
  // The schema must pass ValidateSchema; num_shards >= 1.
  static absl::StatusOr<Partition> Create(const ModelSchema& schema,
                                          int num_shards);

  int num_shards() const { return num_shards_; }
  // Every block of the model, in global order.
  const std::vector<BlockLocation>& blocks() const { return blocks_; }
  // Indices into blocks() of the blocks held by `shard`, in global order.
  const std::vector<int>& BlocksOfShard(int shard) const {
    return shard_blocks_[shard];
  }
  int64_t TensorElements(int tensor) const { return tensor_elements_[tensor]; }
  int NumTensors() const { return static_cast<int>(tensor_elements_.size()); }

  // The index into blocks() of block `block` of the named tensor, or
  // InvalidArgument naming what is unknown.
  absl::StatusOr<int> FindBlock(absl::string_view tensor, int64_t block) const;
  // The index of the named tensor, or -1.
  int FindTensor(absl::string_view tensor) const;

 private:
  int num_shards_ = 1;
  std::vector<BlockLocation> blocks_;
  std::vector<std::vector<int>> shard_blocks_;
  std::vector<int64_t> tensor_elements_;
  std::vector<int> tensor_first_block_;
  absl::flat_hash_map<std::string, int> tensor_index_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_PARTITION_H_
