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

// Reads `path` and returns, for each of `params` in order, its values.
// The file must hold exactly these tensors, each F32 of the spec's shape:
// a missing, extra, mistyped or misshapen tensor is InvalidArgument with
// one line naming the file and the tensor (and both shapes).
absl::StatusOr<std::vector<std::vector<float>>> LoadModelFile(
    const std::string& path, const std::vector<DenseTensorSpec>& params);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_MODEL_FILE_H_
