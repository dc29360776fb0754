#include "common/partition.h"

#include <cmath>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/consistency_mode.h"
#include "common/hash.h"
#include "common/status_text.h"

namespace pstrain {
namespace {

constexpr int64_t kMaxTensorElements = int64_t{1} << 40;

std::string ShapeString(const DenseTensorSpec& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "]");
}

uint64_t Mix64(uint64_t x) {  // splitmix64's finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

int SparseShardOf(absl::string_view table, uint64_t id, int num_shards) {
  return SparseShards(table, num_shards).Of(id);
}

SparseShards::SparseShards(absl::string_view table, int num_shards)
    : table_hash_(Fnv1a64(table)),
      num_shards_(static_cast<uint64_t>(num_shards)) {}

int SparseShards::Of(uint64_t id) const {
  return static_cast<int>(Mix64(table_hash_ ^ Mix64(id)) % num_shards_);
}

int64_t NumElements(const DenseTensorSpec& tensor) {
  int64_t n = 1;
  for (int64_t d : tensor.shape()) n *= d;
  return n;
}

absl::Status ValidateSchema(const ModelSchema& schema) {
  if (schema.dense_size() == 0) {
    return absl::InvalidArgumentError("schema has no tensors");
  }
  if (schema.block_elements() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schema block_elements must be >= 1, got ", schema.block_elements()));
  }
  absl::flat_hash_set<std::string> names;
  for (int i = 0; i < schema.dense_size(); ++i) {
    const DenseTensorSpec& tensor = schema.dense(i);
    const std::string where =
        absl::StrCat("tensor ", i, " (", QuoteForStatus(tensor.name()), ")");
    if (tensor.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty name"));
    }
    if (!names.insert(tensor.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate name"));
    }
    if (tensor.shape_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty shape"));
    }
    int64_t elements = 1;
    for (int64_t d : tensor.shape()) {
      if (d < 1 || d > kMaxTensorElements ||
          elements > kMaxTensorElements / d) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": shape ", ShapeString(tensor),
            " must have dimensions >= 1 and at most 2^40 elements"));
      }
      elements *= d;
    }
    const InitSpec& init = tensor.init();
    if (!InitSpec::Kind_IsValid(init.kind())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown init kind ", init.kind()));
    }
    if (!DenseTensorSpec::Role_IsValid(tensor.role())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown role ", tensor.role()));
    }
    if (!std::isfinite(init.value()) || !std::isfinite(init.scale()) ||
        init.scale() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": init value and scale must be finite, scale >= 0"));
    }
  }
  for (int i = 0; i < schema.sparse_size(); ++i) {
    const SparseTableSpec& table = schema.sparse(i);
    const std::string where = absl::StrCat("sparse table ", i, " (",
                                           QuoteForStatus(table.name()), ")");
    if (table.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty name"));
    }
    if (!names.insert(table.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate name"));
    }
    if (table.dim() < 1 || table.dim() > 65536) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": dim must be in [1, 65536], got ", table.dim()));
    }
    if (!InitSpec::Kind_IsValid(table.init().kind()) ||
        table.init().kind() == InitSpec::PROVIDED ||
        !std::isfinite(table.init().scale()) || table.init().scale() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": bad init"));
    }
    if (table.max_bytes() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": max_bytes must be >= 0 (0: no budget), got ",
                       table.max_bytes()));
    }
    if (!table.mode().empty() && !ParseConsistencyMode(table.mode()).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       ": mode must be empty (the servers' --mode), "
                       "sync, async or ssp, got ",
                       QuoteForStatus(table.mode(), 16)));
    }
  }
  return absl::OkStatus();
}

int64_t ResolvedBlockElements(const ModelSchema& schema) {
  constexpr int64_t kSmallest = int64_t{1} << 13;
  constexpr int64_t kLargest = int64_t{1} << 17;
  if (schema.block_elements() != kBlockElementsByModel) {
    return schema.block_elements();
  }
  constexpr int64_t kBlocksWanted = 16;
  int64_t elements = 0;
  for (const DenseTensorSpec& tensor : schema.dense()) {
    elements += NumElements(tensor);
  }
  int64_t block = kSmallest;
  while (block < kLargest && block * 2 * kBlocksWanted <= elements) block *= 2;
  return block;
}

std::string FirstSchemaDifference(const ModelSchema& expected,
                                  const ModelSchema& actual) {
  if (expected.seed() != actual.seed()) {
    return absl::StrCat("seed ", expected.seed(), " vs ", actual.seed());
  }
  if (expected.block_elements() != actual.block_elements()) {
    return absl::StrCat("block_elements ", expected.block_elements(), " vs ",
                        actual.block_elements());
  }
  const int common = std::min(expected.dense_size(), actual.dense_size());
  for (int i = 0; i < common; ++i) {
    const DenseTensorSpec& a = expected.dense(i);
    const DenseTensorSpec& b = actual.dense(i);
    const std::string where =
        absl::StrCat("tensor ", i, " (", QuoteForStatus(a.name()), ")");
    if (a.name() != b.name()) {
      return absl::StrCat(where, ": name ", QuoteForStatus(a.name()), " vs ",
                          QuoteForStatus(b.name()));
    }
    if (ShapeString(a) != ShapeString(b)) {
      return absl::StrCat(where, ": shape ", ShapeString(a), " vs ",
                          ShapeString(b));
    }
    if (a.init().SerializeAsString() != b.init().SerializeAsString()) {
      return absl::StrCat(where, ": init {", a.init().ShortDebugString(),
                          "} vs {", b.init().ShortDebugString(), "}");
    }
    if (a.role() != b.role()) {
      return absl::StrCat(where, ": role ",
                          DenseTensorSpec::Role_Name(a.role()), " vs ",
                          DenseTensorSpec::Role_Name(b.role()));
    }
    // Workers handing the servers different optimizers (or one none).
    if (a.optimizer().SerializeAsString() !=
        b.optimizer().SerializeAsString()) {
      return absl::StrCat(
          where, ": optimizer {",
          QuoteForStatus(a.optimizer().ShortDebugString(), 512), "} vs {",
          QuoteForStatus(b.optimizer().ShortDebugString(), 512), "}");
    }
  }
  if (expected.dense_size() != actual.dense_size()) {
    return absl::StrCat("tensor count ", expected.dense_size(), " vs ",
                        actual.dense_size());
  }
  const int common_sparse =
      std::min(expected.sparse_size(), actual.sparse_size());
  for (int i = 0; i < common_sparse; ++i) {
    if (expected.sparse(i).SerializeAsString() !=
        actual.sparse(i).SerializeAsString()) {
      // The specs carry the client's strings: each side is bounded.
      return absl::StrCat(
          "sparse table ", i, " (", QuoteForStatus(expected.sparse(i).name()),
          "): ", QuoteForStatus(expected.sparse(i).ShortDebugString(), 512),
          " vs ", QuoteForStatus(actual.sparse(i).ShortDebugString(), 512));
    }
  }
  if (expected.sparse_size() != actual.sparse_size()) {
    return absl::StrCat("sparse table count ", expected.sparse_size(), " vs ",
                        actual.sparse_size());
  }
  return "";
}

absl::StatusOr<Partition> Partition::Create(const ModelSchema& schema,
                                            int num_shards) {
  if (absl::Status s = ValidateSchema(schema); !s.ok()) return s;
  if (num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards must be >= 1, got ", num_shards));
  }
  Partition p;
  p.num_shards_ = num_shards;
  p.shard_blocks_.resize(num_shards);
  const int64_t block_elements = schema.block_elements();
  for (int t = 0; t < schema.dense_size(); ++t) {
    const int64_t elements = NumElements(schema.dense(t));
    p.tensor_elements_.push_back(elements);
    p.tensor_first_block_.push_back(static_cast<int>(p.blocks_.size()));
    p.tensor_index_[schema.dense(t).name()] = t;
    for (int64_t offset = 0, b = 0; offset < elements;
         offset += block_elements, ++b) {
      BlockLocation loc;
      loc.tensor = t;
      loc.block = b;
      loc.offset = offset;
      loc.length = std::min(block_elements, elements - offset);
      loc.shard =
          ShardOfBlock(static_cast<int64_t>(p.blocks_.size()), num_shards);
      p.shard_blocks_[loc.shard].push_back(static_cast<int>(p.blocks_.size()));
      p.blocks_.push_back(loc);
    }
  }
  return p;
}

int Partition::FindTensor(absl::string_view tensor) const {
  auto it = tensor_index_.find(tensor);
  return it == tensor_index_.end() ? -1 : it->second;
}

absl::StatusOr<int> Partition::FindBlock(absl::string_view tensor,
                                         int64_t block) const {
  const int t = FindTensor(tensor);
  if (t < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown tensor ", QuoteForStatus(tensor)));
  }
  const int first = tensor_first_block_[t];
  const int end = t + 1 < NumTensors() ? tensor_first_block_[t + 1]
                                       : static_cast<int>(blocks_.size());
  if (block < 0 || block >= end - first) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", QuoteForStatus(tensor), " has blocks [0, ",
                     end - first, "), got block ", block));
  }
  return first + static_cast<int>(block);
}

}  // namespace pstrain
