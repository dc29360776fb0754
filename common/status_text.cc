#include "common/status_text.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

std::string QuoteForStatus(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) {
    return absl::StrCat("'", absl::CHexEscape(text), "'");
  }
  return absl::StrCat("'", absl::CHexEscape(text.substr(0, max_bytes)),
                      "...' (", text.size(), " bytes)");
}

std::string FormatIdList(absl::Span<const int> sorted_ids) {
  std::string out;
  for (size_t i = 0; i < sorted_ids.size();) {
    size_t end = i;
    while (end + 1 < sorted_ids.size() &&
           sorted_ids[end + 1] == sorted_ids[end] + 1) {
      ++end;
    }
    if (!out.empty()) out += ", ";
    if (end >= i + 2) {
      absl::StrAppend(&out, sorted_ids[i], "-", sorted_ids[end]);
    } else {
      absl::StrAppend(&out, sorted_ids[i]);
      if (end == i + 1) absl::StrAppend(&out, ", ", sorted_ids[end]);
    }
    i = end + 1;
  }
  return out;
}

}  // namespace pstrain
