#include "worker/model_file.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/partition.h"
#include "google/protobuf/util/json_util.h"

namespace pstrain {
namespace {

std::string ShapeText(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<int64_t> ShapeOf(const DenseTensorSpec& spec) {
  return {spec.shape().begin(), spec.shape().end()};
}

}  // namespace

absl::StatusOr<SafetensorsFile> ModelFileFromSnapshot(
    const ModelSnapshot& snapshot) {
  const ModelSchema& schema = snapshot.schema;
  if (static_cast<int>(snapshot.dense.size()) != schema.dense_size() ||
      static_cast<int>(snapshot.sparse.size()) != schema.sparse_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model snapshot has ", snapshot.dense.size(), " dense tensors and ",
        snapshot.sparse.size(), " sparse tables; its schema has ",
        schema.dense_size(), " and ", schema.sparse_size()));
  }
  SafetensorsFile file;
  for (int i = 0; i < schema.dense_size(); ++i) {
    const DenseTensorSpec& spec = schema.dense(i);
    if (static_cast<int64_t>(snapshot.dense[i].size()) != NumElements(spec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model snapshot: tensor '", spec.name(), "' has ",
                       snapshot.dense[i].size(), " values, its shape ",
                       ShapeText(ShapeOf(spec)), " needs ", NumElements(spec)));
    }
    file.tensors.push_back(
        SafetensorsTensor::F32(spec.name(), ShapeOf(spec), snapshot.dense[i]));
  }
  for (int t = 0; t < schema.sparse_size(); ++t) {
    const SparseTableSpec& spec = schema.sparse(t);
    const SparseTableRows& table = snapshot.sparse[t];
    const int64_t dim = spec.dim();
    const int64_t n = static_cast<int64_t>(table.ids.size());
    if (static_cast<int64_t>(table.rows.size()) != n * dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model snapshot: table '", spec.name(), "' has ", n, " ids and ",
          table.rows.size(), " values, not ", n, " x dim ", dim));
    }
    // Ascending ids: the servers' order depends on their hash tables and
    // shard count, the file's must not.
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return table.ids[a] < table.ids[b];
    });
    std::vector<uint64_t> ids(n);
    std::vector<float> rows(n * dim);
    for (int64_t i = 0; i < n; ++i) {
      ids[i] = table.ids[order[i]];
      if (i > 0 && ids[i] == ids[i - 1]) {
        return absl::InvalidArgumentError(
            absl::StrCat("model snapshot: table '", spec.name(), "' holds id ",
                         ids[i], " twice"));
      }
      std::copy_n(table.rows.begin() + order[i] * dim, dim,
                  rows.begin() + i * dim);
    }
    file.tensors.push_back(
        SafetensorsTensor::U64(absl::StrCat(spec.name(), "/ids"), {n}, ids));
    file.tensors.push_back(SafetensorsTensor::F32(
        absl::StrCat(spec.name(), "/rows"), {n, dim}, rows));
  }
  std::string schema_json;
  google::protobuf::util::JsonPrintOptions json_options;
  json_options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(schema, &schema_json,
                                                   json_options)
           .ok()) {
    return absl::InternalError("cannot print the model schema as JSON");
  }
  file.metadata["format"] = "pstrain";
  file.metadata["step"] = absl::StrCat(snapshot.step);
  file.metadata["schema"] = schema_json;
  return file;
}

absl::StatusOr<std::vector<std::vector<float>>> LoadModelFile(
    const std::string& path, const std::vector<DenseTensorSpec>& params) {
  absl::StatusOr<SafetensorsFile> file = ReadSafetensorsFile(path);
  if (!file.ok()) return file.status();
  absl::flat_hash_set<std::string> expected;
  std::vector<std::string> wanted;
  for (const DenseTensorSpec& spec : params) {
    expected.insert(spec.name());
    wanted.push_back(absl::StrCat(spec.name(), " ", ShapeText(ShapeOf(spec))));
  }
  const std::string model_has = absl::StrCat(
      "this model (--model, --hidden, --num_features, "
      "--num_classes) has ",
      absl::StrJoin(wanted, ", "));
  for (const SafetensorsTensor& tensor : file->tensors) {
    if (!expected.contains(tensor.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", tensor.name,
                       "' is not a parameter of this model; ", model_has));
    }
  }
  std::vector<std::vector<float>> values;
  for (const DenseTensorSpec& spec : params) {
    const SafetensorsTensor* tensor = file->Find(spec.name());
    if (tensor == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", spec.name(), "' is missing; ", model_has));
    }
    if (tensor->dtype != SafetensorsDtype::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", spec.name(), "' is ",
                       SafetensorsDtypeName(tensor->dtype), ", expected F32"));
    }
    if (tensor->shape != ShapeOf(spec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", spec.name(), "' has shape ",
          ShapeText(tensor->shape), " but this model needs ",
          ShapeText(ShapeOf(spec)),
          " (check --model, --hidden, --num_features and --num_classes)"));
    }
    values.push_back(tensor->AsF32());
  }
  return values;
}

}  // namespace pstrain
