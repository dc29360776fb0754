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

// A schema's block_elements when its client leaves the choice to
// ResolvedBlockElements (PsClient::Register resolves it before anything
// else sees the schema): the worker's --block_elements default, and what
// bench/transport/ps_bench measures unless told otherwise.
inline constexpr int64_t kBlockElementsByModel = 0;

// The schema's block_elements, or, when it is kBlockElementsByModel, a
// power of two in [8192, 131072] (32 to 512 KiB of float32) that cuts the
// model's dense elements into about 16 blocks, so every worker of a job
// picks the same from the schema alone.
//
// Why about 16: a sync step answers each block group once every worker has
// pushed it, so on a link that binds, a step nears the link-bound ideal
// only when one group's answer can travel while the next groups are pushed.
// A 235k-float MLP in 512 KiB blocks has 7 groups and takes 1.9x the ideal
// on 1 Gbit/s links; in 8192-element blocks it has 30 and takes 1.2-1.4x
// (bench/results/block_size_tradeoff.txt). Why not smaller for every
// model: on one host each group costs a few microseconds of calls, which a
// large model in small blocks pays per block (a 22 MiB PushPull: -25% in
// 8192-element blocks), and a large model has enough 512 KiB blocks anyway.
// Replicated shards take the same rule: a backup gets each block group's
// step as one record once it completes (ps_server/replication.h), not a
// forward per push before its answer, so small groups cost it no more.
int64_t ResolvedBlockElements(const ModelSchema& schema);

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

// SparseShardOf for the many ids of one table: its name hashed once (per id,
// hashing the name cost as much as the rest of a row's pull in the client).
class SparseShards {
 public:
  SparseShards(absl::string_view table, int num_shards);
  int Of(uint64_t id) const;

 private:
  uint64_t table_hash_;
  uint64_t num_shards_;
};

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
