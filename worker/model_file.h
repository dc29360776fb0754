// Model files: a trained model as a safetensors file (common/safetensors.h),
// the format numpy, PyTorch and most ML tools read.
//
// Tensors:
//   <dense tensor name>   F32, the schema's shape (e.g. "fc0/weight" [in, out],
//                         "fc0/bias" [out]), in schema order
//   <table>/ids           U64 [rows]: the ids of every row the servers hold,
//                         ascending (rows never touched are not stored: they
//                         would be created from the init spec in the schema)
//   <table>/rows          F32 [rows, dim]: row i belongs to ids[i]
// Metadata ("__metadata__", all strings):
//   format  "pstrain"
//   step    the model's step (the smallest block version: updates applied)
//   schema  the ModelSchema as JSON (shapes, init specs, seed, optimizers)
// The file is a pure function of the model, so exporting the same model
// twice (from running servers, or from their checkpoint) gives the same
// bytes.
//
// Delta files (pstrain_export --since): what changed from a base model file
// (a whole model, or the delta before) to the current model, for a serving
// copy that holds the base.
//   <dense tensor name>   F32, the tensors whose values changed (every one
//                         in a delta from the servers' change marks)
//   <table>/ids, /rows    the rows added or changed since the base
//                         (ascending ids), as in a model file; one from the
//                         servers' change marks may hold a few rows that
//                         were written but kept their values
//   <table>/deleted_ids   U64, ascending: rows the base may hold and the
//                         model no longer does (evicted)
// Metadata: format "pstrain-delta", step, base_step, schema. Applying a
// base's deltas in order (ApplyModelDelta) gives exactly the model file of
// the last one's step.
#ifndef PSTRAIN_WORKER_MODEL_FILE_H_
#define PSTRAIN_WORKER_MODEL_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "proto/ps.pb.h"

namespace pstrain {

struct SparseTableRows {
  std::vector<uint64_t> ids;  // any order; unique
  std::vector<float> rows;    // [ids.size(), dim]
};

struct ModelSnapshot {
  ModelSchema schema;
  int64_t step = 0;
  std::vector<std::vector<float>> dense;  // per schema.dense(i), row-major
  std::vector<SparseTableRows> sparse;    // per schema.sparse(i)
};

// The safetensors file of a snapshot; InvalidArgument when the snapshot's
// sizes do not match its schema (a bug in whoever assembled it).
absl::StatusOr<SafetensorsFile> ModelFileFromSnapshot(
    const ModelSnapshot& snapshot);

// A model file read back: its schema, step, dense tensors and rows (ids
// ascending). InvalidArgument naming the file for one that is not a whole
// pstrain model file.
absl::StatusOr<ModelSnapshot> ReadModelSnapshot(const std::string& path);

// What changed from a base at `base_step` to the model at `step`.
struct ModelChanges {
  ModelSchema schema;
  int64_t step = 0;
  int64_t base_step = 0;
  std::vector<std::vector<float>> dense;  // per schema.dense(i); empty: same
  std::vector<SparseTableRows> sparse;    // rows changed or added
  // Per table, in any order and perhaps repeated; ids also in `sparse` are
  // not written as deleted (their row is the change).
  std::vector<std::vector<uint64_t>> deleted;
};

// The delta file of `changes`; InvalidArgument when its sizes do not match
// its schema.
absl::StatusOr<SafetensorsFile> ModelDeltaFile(const ModelChanges& changes);

// The delta file from `base` to `current`, which must be snapshots of the
// same model (schema); InvalidArgument otherwise, or when `current` is older.
absl::StatusOr<SafetensorsFile> ModelDelta(const ModelSnapshot& base,
                                           const ModelSnapshot& current);

// `base` with `delta` (named `delta_name` in errors) applied: the model the
// delta was taken of. A delta of another model, or taken from another base
// step, is refused (InvalidArgument naming both) and nothing is applied.
absl::StatusOr<ModelSnapshot> ApplyModelDelta(const ModelSnapshot& base,
                                              const SafetensorsFile& delta,
                                              absl::string_view delta_name);

// Reads `path` and returns, for each of `params` in order, its values.
// The file must hold exactly these tensors, each F32 of the spec's shape:
// a missing, extra, mistyped or misshapen tensor is InvalidArgument with
// one line naming the file and the tensor (and both shapes).
absl::StatusOr<std::vector<std::vector<float>>> LoadModelFile(
    const std::string& path, const std::vector<DenseTensorSpec>& params);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_MODEL_FILE_H_
