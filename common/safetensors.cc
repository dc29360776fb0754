#include "common/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cli.h"
#include "nlohmann/json.hpp"

// The data buffer is the in-memory representation of the elements; a
// big-endian host would need byte swaps on the way in and out.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; this host is not");

namespace pstrain {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr absl::string_view kMetadataKey = "__metadata__";
// The format's own cap on the header (the reference reader refuses more), so
// a corrupt length cannot make a reader allocate the whole file for JSON.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

int64_t ElementBytes(SafetensorsDtype dtype) {
  return dtype == SafetensorsDtype::kF32 ? 4 : 8;
}

template <typename T>
std::string RawBytes(absl::Span<const T> values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(T));
}

template <typename T>
std::vector<T> FromRawBytes(const std::string& data) {
  std::vector<T> out(data.size() / sizeof(T));
  std::memcpy(out.data(), data.data(), out.size() * sizeof(T));
  return out;
}

// The product of `shape` times the element size, or -1 when a dimension is
// negative or the product overflows int64.
int64_t ByteCount(const std::vector<int64_t>& shape, SafetensorsDtype dtype) {
  int64_t bytes = ElementBytes(dtype);
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(bytes, dim, &bytes)) return -1;
  }
  return bytes;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Invalid(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": not a valid safetensors file: ", what));
}

// Parses the header JSON, refusing duplicate keys at any depth (nlohmann
// would silently keep the last one, so two entries for one tensor would
// pass).
absl::StatusOr<Json> ParseHeaderJson(absl::string_view text,
                                     absl::string_view source) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  auto callback = [&](int /*depth*/, Json::parse_event_t event,
                      Json& parsed) -> bool {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys_per_object.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!keys_per_object.empty()) keys_per_object.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys_per_object.empty() && parsed.is_string() &&
            !keys_per_object.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(text.begin(), text.end(), callback);
  } catch (const Json::exception& e) {
    return Invalid(source,
                   absl::StrCat("the header is not JSON (", e.what(), ")"));
  }
  if (!duplicate.empty()) {
    return Invalid(
        source, absl::StrCat("the header has the key '", duplicate, "' twice"));
  }
  if (!header.is_object()) {
    return Invalid(source, "the header is not a JSON object");
  }
  return header;
}

absl::StatusOr<SafetensorsDtype> ParseDtype(const Json& value,
                                            absl::string_view where) {
  if (!value.is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dtype must be a string"));
  }
  const std::string name = value.get<std::string>();
  if (name == "F32") return SafetensorsDtype::kF32;
  if (name == "I64") return SafetensorsDtype::kI64;
  if (name == "U64") return SafetensorsDtype::kU64;
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": dtype ", name,
                   " is not supported (pstrain reads F32, I64 and U64)"));
}

// One non-negative integer that fits int64 (JSON numbers such as 1.0, -1 or
// 2^64 are refused).
bool GetIndex(const Json& value, int64_t* out) {
  if (!value.is_number_unsigned()) return false;
  const uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(INT64_MAX)) return false;
  *out = static_cast<int64_t>(v);
  return true;
}

struct Entry {
  SafetensorsTensor tensor;
  int64_t begin = 0, end = 0;
};

absl::StatusOr<Entry> ParseEntry(const std::string& name, const Json& value,
                                 absl::string_view source) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  auto bad = [&](absl::string_view what) {
    return Invalid(source, absl::StrCat(where, ": ", what));
  };
  if (name.empty()) return Invalid(source, "a tensor has an empty name");
  if (!value.is_object()) return bad("its entry is not a JSON object");
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" &&
        it.key() != "data_offsets") {
      return bad(absl::StrCat("unknown field '", it.key(),
                              "' (expected dtype, shape, data_offsets)"));
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) return bad(absl::StrCat("no ", field));
  }
  Entry entry;
  entry.tensor.name = name;
  absl::StatusOr<SafetensorsDtype> dtype = ParseDtype(value["dtype"], where);
  if (!dtype.ok()) return Invalid(source, dtype.status().message());
  entry.tensor.dtype = *dtype;
  const Json& shape = value["shape"];
  if (!shape.is_array()) return bad("shape must be an array");
  for (const Json& dim : shape) {
    int64_t d = 0;
    if (!GetIndex(dim, &d)) {
      return bad(absl::StrCat("shape ", shape.dump(),
                              " must hold non-negative integers"));
    }
    entry.tensor.shape.push_back(d);
  }
  const Json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !GetIndex(offsets[0], &entry.begin) ||
      !GetIndex(offsets[1], &entry.end) || entry.begin > entry.end) {
    return bad(absl::StrCat("data_offsets ", offsets.dump(),
                            " must be [begin, end] with 0 <= begin <= end"));
  }
  const int64_t bytes = ByteCount(entry.tensor.shape, entry.tensor.dtype);
  if (bytes < 0) {
    return bad(absl::StrCat("shape ", ShapeText(entry.tensor.shape),
                            " has more elements than can be addressed"));
  }
  if (entry.end - entry.begin != bytes) {
    return bad(absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                            "] hold ", entry.end - entry.begin,
                            " bytes but dtype ",
                            SafetensorsDtypeName(entry.tensor.dtype), " shape ",
                            ShapeText(entry.tensor.shape), " needs ", bytes));
  }
  return entry;
}

}  // namespace

const char* SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kI64:
      return "I64";
    case SafetensorsDtype::kU64:
      return "U64";
  }
  return "?";
}

SafetensorsTensor SafetensorsTensor::F32(std::string name,
                                         std::vector<int64_t> shape,
                                         absl::Span<const float> values) {
  return {std::move(name), SafetensorsDtype::kF32, std::move(shape),
          RawBytes(values)};
}

SafetensorsTensor SafetensorsTensor::I64(std::string name,
                                         std::vector<int64_t> shape,
                                         absl::Span<const int64_t> values) {
  return {std::move(name), SafetensorsDtype::kI64, std::move(shape),
          RawBytes(values)};
}

SafetensorsTensor SafetensorsTensor::U64(std::string name,
                                         std::vector<int64_t> shape,
                                         absl::Span<const uint64_t> values) {
  return {std::move(name), SafetensorsDtype::kU64, std::move(shape),
          RawBytes(values)};
}

int64_t SafetensorsTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

std::vector<float> SafetensorsTensor::AsF32() const {
  return FromRawBytes<float>(data);
}
std::vector<int64_t> SafetensorsTensor::AsI64() const {
  return FromRawBytes<int64_t>(data);
}
std::vector<uint64_t> SafetensorsTensor::AsU64() const {
  return FromRawBytes<uint64_t>(data);
}

const SafetensorsTensor* SafetensorsFile::Find(absl::string_view name) const {
  for (const SafetensorsTensor& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

absl::StatusOr<std::string> SerializeSafetensors(const SafetensorsFile& file) {
  OrderedJson header = OrderedJson::object();
  if (!file.metadata.empty()) {
    OrderedJson metadata = OrderedJson::object();
    for (const auto& [key, value] : file.metadata) metadata[key] = value;
    header[std::string(kMetadataKey)] = std::move(metadata);
  }
  absl::flat_hash_set<std::string> names;
  int64_t offset = 0;
  for (const SafetensorsTensor& tensor : file.tensors) {
    if (tensor.name.empty() || tensor.name == kMetadataKey ||
        !names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor name '", tensor.name,
                       "' is empty, reserved or used twice"));
    }
    const int64_t bytes = ByteCount(tensor.shape, tensor.dtype);
    if (bytes != static_cast<int64_t>(tensor.data.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors: tensor '", tensor.name, "' has ", tensor.data.size(),
          " bytes of data but dtype ", SafetensorsDtypeName(tensor.dtype),
          " shape ", ShapeText(tensor.shape), " needs ", bytes));
    }
    header[tensor.name] = {{"dtype", SafetensorsDtypeName(tensor.dtype)},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // Padding the header to 8 bytes keeps every tensor's data 8-byte aligned
  // in the file, so a reader may map it and use it in place.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);
  out += text;
  out.reserve(out.size() + offset);
  for (const SafetensorsTensor& tensor : file.tensors) out += tensor.data;
  return out;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(absl::string_view bytes,
                                                 absl::string_view source) {
  if (bytes.size() < 8) {
    return absl::DataLossError(absl::StrCat(
        source, ": not a valid safetensors file: ", bytes.size(),
        " bytes, too short for the 8-byte header length (truncated?)"));
  }
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  const uint64_t after_length = bytes.size() - 8;
  if (header_length > after_length) {
    return absl::DataLossError(absl::StrCat(
        source, ": not a valid safetensors file: the header length says ",
        header_length, " bytes but only ", after_length,
        " follow it (truncated, or not a safetensors file)"));
  }
  if (header_length > kMaxHeaderBytes) {
    return Invalid(source, absl::StrCat("the header length ", header_length,
                                        " is over the format's limit of ",
                                        kMaxHeaderBytes, " bytes"));
  }
  const absl::string_view header_text = bytes.substr(8, header_length);
  if (header_text.empty() || header_text[0] != '{') {
    return Invalid(source, "the header does not start with '{'");
  }
  absl::StatusOr<Json> header = ParseHeaderJson(header_text, source);
  if (!header.ok()) return header.status();
  const absl::string_view data = bytes.substr(8 + header_length);

  SafetensorsFile file;
  std::vector<Entry> entries;
  for (auto it = header->begin(); it != header->end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (!it.value().is_object()) {
        return Invalid(source, "__metadata__ is not a JSON object");
      }
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) {
          return Invalid(source, absl::StrCat("__metadata__ value of '",
                                              m.key(), "' is not a string"));
        }
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    absl::StatusOr<Entry> entry = ParseEntry(it.key(), it.value(), source);
    if (!entry.ok()) return entry.status();
    entries.push_back(std::move(*entry));
  }
  // The ranges must tile the data buffer: sorted by start, each begins where
  // the previous one ended, and the last ends at the end of the file.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::stable_sort(
      by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
        return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
      });
  int64_t expected = 0;
  const int64_t data_size = static_cast<int64_t>(data.size());
  for (const Entry* e : by_offset) {
    const std::string range =
        absl::StrCat("tensor '", e->tensor.name, "': data_offsets [", e->begin,
                     ", ", e->end, "]");
    if (e->end > data_size) {
      return absl::DataLossError(
          absl::StrCat(source, ": not a valid safetensors file: ", range,
                       " end past the data, which is ", data_size,
                       " bytes (truncated file?)"));
    }
    if (e->begin < expected) {
      return Invalid(source, absl::StrCat(range, " overlap another tensor"));
    }
    if (e->begin > expected) {
      return Invalid(source,
                     absl::StrCat(range, " leave bytes [", expected, ", ",
                                  e->begin, ") of the data unused"));
    }
    expected = e->end;
  }
  if (expected != data_size) {
    return Invalid(source, absl::StrCat("the data is ", data_size,
                                        " bytes but the tensors cover ",
                                        expected, " (trailing bytes)"));
  }
  // Tensors in file order, which is what the writer's order was.
  for (const Entry* e : by_offset) {
    SafetensorsTensor tensor = e->tensor;
    tensor.data = std::string(data.substr(e->begin, e->end - e->begin));
    file.tensors.push_back(std::move(tensor));
  }
  return file;
}

absl::Status WriteSafetensorsFile(const std::string& path,
                                  const SafetensorsFile& file) {
  absl::StatusOr<std::string> bytes = SerializeSafetensors(file);
  if (!bytes.ok()) return bytes.status();
  return WriteFileAtomically(path, *bytes);
}

absl::StatusOr<SafetensorsFile> ReadSafetensorsFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open (", std::strerror(errno), ")"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat(path, ": read error"));
  }
  return ParseSafetensors(contents.str(), path);
}

}  // namespace pstrain
