#include "worker/model_file.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <numeric>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
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

std::string SchemaJson(const ModelSchema& schema) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(schema, &json, options)
           .ok()) {
    return "";
  }
  return json;
}

// A tensor of `file` (named `where` in errors) of this dtype and shape.
absl::StatusOr<const SafetensorsTensor*> Expect(
    const SafetensorsFile& file, absl::string_view where,
    const std::string& name, SafetensorsDtype dtype,
    const std::vector<int64_t>& shape) {
  const SafetensorsTensor* tensor = file.Find(name);
  if (tensor == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": tensor '", name, "' is missing"));
  }
  if (tensor->dtype != dtype || tensor->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": tensor '", name, "' is ", SafetensorsDtypeName(tensor->dtype),
        " ", ShapeText(tensor->shape), ", expected ",
        SafetensorsDtypeName(dtype), " ", ShapeText(shape)));
  }
  return tensor;
}

// The schema and step in `file`'s metadata, whose format must be `format`.
absl::Status ReadHeader(const SafetensorsFile& file, absl::string_view where,
                        absl::string_view format, ModelSchema* schema,
                        int64_t* step) {
  auto text = [&](const std::string& key) -> std::string {
    auto it = file.metadata.find(key);
    return it == file.metadata.end() ? "" : it->second;
  };
  if (text("format") != format) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a ", format,
                                                   " file (its format is '",
                                                   text("format"), "')"));
  }
  if (!google::protobuf::util::JsonStringToMessage(text("schema"), schema)
           .ok() ||
      !absl::SimpleAtoi(text("step"), step)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": its schema or step metadata is unreadable"));
  }
  return absl::OkStatus();
}

// `table`'s ids (U64 [n]) and rows (F32 [n, dim]) named prefix + "/ids" and
// prefix + "/rows" in `file`; none when `optional` and both are absent.
absl::StatusOr<SparseTableRows> ReadRows(const SafetensorsFile& file,
                                         absl::string_view where,
                                         const SparseTableSpec& spec,
                                         bool optional) {
  const std::string ids_name = absl::StrCat(spec.name(), "/ids");
  const std::string rows_name = absl::StrCat(spec.name(), "/rows");
  SparseTableRows out;
  const SafetensorsTensor* ids = file.Find(ids_name);
  if (ids == nullptr && optional && file.Find(rows_name) == nullptr) {
    return out;
  }
  const int64_t n = ids != nullptr && !ids->shape.empty() ? ids->shape[0] : 0;
  absl::StatusOr<const SafetensorsTensor*> checked_ids =
      Expect(file, where, ids_name, SafetensorsDtype::kU64, {n});
  if (!checked_ids.ok()) return checked_ids.status();
  absl::StatusOr<const SafetensorsTensor*> rows =
      Expect(file, where, rows_name, SafetensorsDtype::kF32, {n, spec.dim()});
  if (!rows.ok()) return rows.status();
  out.ids = (*checked_ids)->AsU64();
  out.rows = (*rows)->AsF32();
  for (int64_t i = 1; i < n; ++i) {
    if (out.ids[i] <= out.ids[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": '", ids_name, "' is not strictly ascending at ", i));
    }
  }
  return out;
}

bool SameBits(absl::Span<const float> a, absl::Span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

// `table`'s rows by ascending id.
SparseTableRows Sorted(const SparseTableRows& table, int64_t dim) {
  std::vector<int64_t> order(table.ids.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return table.ids[a] < table.ids[b]; });
  SparseTableRows out;
  out.ids.reserve(order.size());
  out.rows.reserve(order.size() * dim);
  for (int64_t i : order) {
    out.ids.push_back(table.ids[i]);
    out.rows.insert(out.rows.end(), table.rows.begin() + i * dim,
                    table.rows.begin() + (i + 1) * dim);
  }
  return out;
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
  const std::string schema_json = SchemaJson(schema);
  if (schema_json.empty()) {
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

absl::StatusOr<ModelSnapshot> ReadModelSnapshot(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = ReadSafetensorsFile(path);
  if (!file.ok()) return file.status();
  ModelSnapshot snapshot;
  if (absl::Status s =
          ReadHeader(*file, path, "pstrain", &snapshot.schema, &snapshot.step);
      !s.ok()) {
    return s;
  }
  for (const DenseTensorSpec& spec : snapshot.schema.dense()) {
    absl::StatusOr<const SafetensorsTensor*> tensor =
        Expect(*file, path, spec.name(), SafetensorsDtype::kF32, ShapeOf(spec));
    if (!tensor.ok()) return tensor.status();
    snapshot.dense.push_back((*tensor)->AsF32());
  }
  for (const SparseTableSpec& spec : snapshot.schema.sparse()) {
    absl::StatusOr<SparseTableRows> rows =
        ReadRows(*file, path, spec, /*optional=*/false);
    if (!rows.ok()) return rows.status();
    snapshot.sparse.push_back(*std::move(rows));
  }
  return snapshot;
}

absl::StatusOr<SafetensorsFile> ModelDelta(const ModelSnapshot& base,
                                           const ModelSnapshot& current) {
  if (const std::string difference =
          FirstSchemaDifference(base.schema, current.schema);
      !difference.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the base is a file of another model (", difference, ")"));
  }
  if (current.step < base.step) {
    return absl::InvalidArgumentError(
        absl::StrCat("the base is at step ", base.step,
                     ", after the model's step ", current.step));
  }
  ModelChanges changes;
  changes.schema = current.schema;
  changes.step = current.step;
  changes.base_step = base.step;
  const ModelSchema& schema = current.schema;
  for (int i = 0; i < schema.dense_size(); ++i) {
    changes.dense.push_back(SameBits(base.dense[i], current.dense[i])
                                ? std::vector<float>()
                                : current.dense[i]);
  }
  for (int t = 0; t < schema.sparse_size(); ++t) {
    const int64_t dim = schema.sparse(t).dim();
    const SparseTableRows old_rows = Sorted(base.sparse[t], dim);
    const SparseTableRows new_rows = Sorted(current.sparse[t], dim);
    SparseTableRows& changed = changes.sparse.emplace_back();
    std::vector<uint64_t>& deleted = changes.deleted.emplace_back();
    size_t a = 0, b = 0;
    auto row = [dim](const SparseTableRows& r, size_t i) {
      return absl::MakeConstSpan(r.rows).subspan(i * dim, dim);
    };
    while (a < old_rows.ids.size() || b < new_rows.ids.size()) {
      if (b == new_rows.ids.size() ||
          (a < old_rows.ids.size() && old_rows.ids[a] < new_rows.ids[b])) {
        deleted.push_back(old_rows.ids[a++]);
        continue;
      }
      const bool same_id =
          a < old_rows.ids.size() && old_rows.ids[a] == new_rows.ids[b];
      if (!same_id || !SameBits(row(old_rows, a), row(new_rows, b))) {
        changed.ids.push_back(new_rows.ids[b]);
        const absl::Span<const float> values = row(new_rows, b);
        changed.rows.insert(changed.rows.end(), values.begin(), values.end());
      }
      if (same_id) ++a;
      ++b;
    }
  }
  return ModelDeltaFile(changes);
}

absl::StatusOr<SafetensorsFile> ModelDeltaFile(const ModelChanges& changes) {
  const ModelSchema& schema = changes.schema;
  if (static_cast<int>(changes.dense.size()) != schema.dense_size() ||
      static_cast<int>(changes.sparse.size()) != schema.sparse_size() ||
      static_cast<int>(changes.deleted.size()) != schema.sparse_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model changes of ", changes.dense.size(), " dense tensors and ",
        changes.sparse.size(), " sparse tables; the schema has ",
        schema.dense_size(), " and ", schema.sparse_size()));
  }
  SafetensorsFile file;
  for (int i = 0; i < schema.dense_size(); ++i) {
    const std::vector<float>& values = changes.dense[i];
    if (values.empty()) continue;
    const DenseTensorSpec& spec = schema.dense(i);
    if (static_cast<int64_t>(values.size()) != NumElements(spec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model changes: tensor '", spec.name(), "' has ", values.size(),
          " values, its shape needs ", NumElements(spec)));
    }
    file.tensors.push_back(
        SafetensorsTensor::F32(spec.name(), ShapeOf(spec), values));
  }
  for (int t = 0; t < schema.sparse_size(); ++t) {
    const SparseTableSpec& spec = schema.sparse(t);
    const int64_t dim = spec.dim();
    const SparseTableRows& rows = changes.sparse[t];
    if (rows.rows.size() != rows.ids.size() * dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model changes: table '", spec.name(), "' has ", rows.ids.size(),
          " ids and ", rows.rows.size(), " values, not ids x dim ", dim));
    }
    const SparseTableRows changed = Sorted(rows, dim);
    for (size_t i = 1; i < changed.ids.size(); ++i) {
      if (changed.ids[i] == changed.ids[i - 1]) {
        return absl::InvalidArgumentError(
            absl::StrCat("model changes: table '", spec.name(), "' holds id ",
                         changed.ids[i], " twice"));
      }
    }
    std::vector<uint64_t> deleted = changes.deleted[t];
    std::sort(deleted.begin(), deleted.end());
    deleted.erase(std::unique(deleted.begin(), deleted.end()), deleted.end());
    std::vector<uint64_t> gone;
    std::set_difference(deleted.begin(), deleted.end(), changed.ids.begin(),
                        changed.ids.end(), std::back_inserter(gone));
    const int64_t n = static_cast<int64_t>(changed.ids.size());
    file.tensors.push_back(SafetensorsTensor::U64(
        absl::StrCat(spec.name(), "/ids"), {n}, changed.ids));
    file.tensors.push_back(SafetensorsTensor::F32(
        absl::StrCat(spec.name(), "/rows"), {n, dim}, changed.rows));
    file.tensors.push_back(
        SafetensorsTensor::U64(absl::StrCat(spec.name(), "/deleted_ids"),
                               {static_cast<int64_t>(gone.size())}, gone));
  }
  file.metadata["format"] = "pstrain-delta";
  file.metadata["step"] = absl::StrCat(changes.step);
  file.metadata["base_step"] = absl::StrCat(changes.base_step);
  file.metadata["schema"] = SchemaJson(schema);
  return file;
}

absl::StatusOr<ModelSnapshot> ApplyModelDelta(const ModelSnapshot& base,
                                              const SafetensorsFile& delta,
                                              absl::string_view delta_name) {
  ModelSchema schema;
  int64_t step = 0;
  if (absl::Status s =
          ReadHeader(delta, delta_name, "pstrain-delta", &schema, &step);
      !s.ok()) {
    return s;
  }
  if (const std::string difference = FirstSchemaDifference(base.schema, schema);
      !difference.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        delta_name, " is a delta of another model (", difference, ")"));
  }
  const auto base_step = delta.metadata.find("base_step");
  int64_t delta_base = -1;
  if (base_step == delta.metadata.end() ||
      !absl::SimpleAtoi(base_step->second, &delta_base) ||
      delta_base != base.step) {
    return absl::InvalidArgumentError(absl::StrCat(
        delta_name, " was taken from a base at step ",
        base_step == delta.metadata.end() ? "?" : base_step->second,
        ", this model is at step ", base.step,
        ": apply the deltas in order, from the base they were taken from"));
  }
  absl::flat_hash_set<std::string> known;
  ModelSnapshot out = base;
  out.step = step;
  for (int i = 0; i < schema.dense_size(); ++i) {
    const DenseTensorSpec& spec = schema.dense(i);
    known.insert(spec.name());
    if (delta.Find(spec.name()) == nullptr) continue;
    absl::StatusOr<const SafetensorsTensor*> tensor = Expect(
        delta, delta_name, spec.name(), SafetensorsDtype::kF32, ShapeOf(spec));
    if (!tensor.ok()) return tensor.status();
    out.dense[i] = (*tensor)->AsF32();
  }
  for (int t = 0; t < schema.sparse_size(); ++t) {
    const SparseTableSpec& spec = schema.sparse(t);
    const int64_t dim = spec.dim();
    for (const char* suffix : {"/ids", "/rows", "/deleted_ids"}) {
      known.insert(absl::StrCat(spec.name(), suffix));
    }
    absl::StatusOr<SparseTableRows> changed =
        ReadRows(delta, delta_name, spec, /*optional=*/true);
    if (!changed.ok()) return changed.status();
    absl::flat_hash_set<uint64_t> dropped;
    if (const SafetensorsTensor* deleted =
            delta.Find(absl::StrCat(spec.name(), "/deleted_ids"));
        deleted != nullptr) {
      if (deleted->dtype != SafetensorsDtype::kU64 ||
          deleted->shape.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            delta_name, ": '", spec.name(), "/deleted_ids' must be U64 [n]"));
      }
      for (uint64_t id : deleted->AsU64()) dropped.insert(id);
    }
    for (uint64_t id : changed->ids) dropped.insert(id);
    const SparseTableRows old_rows = Sorted(base.sparse[t], dim);
    SparseTableRows merged;
    for (size_t i = 0; i < old_rows.ids.size(); ++i) {
      if (dropped.contains(old_rows.ids[i])) continue;
      merged.ids.push_back(old_rows.ids[i]);
      merged.rows.insert(merged.rows.end(), old_rows.rows.begin() + i * dim,
                         old_rows.rows.begin() + (i + 1) * dim);
    }
    merged.ids.insert(merged.ids.end(), changed->ids.begin(),
                      changed->ids.end());
    merged.rows.insert(merged.rows.end(), changed->rows.begin(),
                       changed->rows.end());
    out.sparse[t] = Sorted(merged, dim);
  }
  for (const SafetensorsTensor& tensor : delta.tensors) {
    if (!known.contains(tensor.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(delta_name, ": tensor '", tensor.name,
                       "' is not part of this model"));
    }
  }
  return out;
}

}  // namespace pstrain
