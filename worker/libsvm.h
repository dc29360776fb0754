// The one LIBSVM / SVMlight line parser both readers use: the dense reader
// (worker/data.h ReadLibsvm: class labels, real values, 1-based indices) and
// the CTR reader (worker/ctr_data.h ReadLibsvmCtr: click labels, binary
// values, indices as ids). It checks a line's form; what a label or a value
// may be, and which indices are in range, is each reader's own rule.
#ifndef PSTRAIN_WORKER_LIBSVM_H_
#define PSTRAIN_WORKER_LIBSVM_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pstrain {

struct LibsvmFeature {
  uint64_t index = 0;
  absl::string_view value;  // its text, unparsed
};

// One example: "label index:value index:value ..." (spaces or tabs apart).
// The views point into the parsed line.
struct LibsvmLine {
  absl::string_view label;  // its text, unparsed
  std::vector<LibsvmFeature> features;
};

// Splits `line` (comments already stripped, not blank) into `out`, reusing
// its storage. InvalidArgument, worded for "<file>:<line>: " in front, when
// a feature is not index:value with a non-negative integer index or the
// indices do not strictly increase.
absl::Status ParseLibsvmLine(absl::string_view line, LibsvmLine* out);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LIBSVM_H_
