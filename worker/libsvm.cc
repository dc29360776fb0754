#include "worker/libsvm.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pstrain {

absl::Status ParseLibsvmLine(absl::string_view line, LibsvmLine* out) {
  out->label = {};
  out->features.clear();
  bool first = true;
  for (absl::string_view token :
       absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
    if (first) {
      out->label = token;
      first = false;
      continue;
    }
    const size_t colon = token.find(':');
    uint64_t index;
    if (colon == absl::string_view::npos ||
        !absl::SimpleAtoi(token.substr(0, colon), &index)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", token, "' is not index:value with a non-negative index"));
    }
    if (!out->features.empty() && index <= out->features.back().index) {
      return absl::InvalidArgumentError(
          absl::StrCat("index ", index, " does not increase (previous ",
                       out->features.back().index, ")"));
    }
    out->features.push_back({index, token.substr(colon + 1)});
  }
  if (first) return absl::InvalidArgumentError("no label");
  return absl::OkStatus();
}

}  // namespace pstrain
