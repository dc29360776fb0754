#include "worker/line_reader.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

LineReader::LineReader(const std::string& path, char comment)
    : path_(path), comment_(comment), in_(path, std::ios::binary) {}

absl::Status LineReader::OpenStatus() const {
  if (in_.is_open()) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat(path_, ": cannot open: ", std::strerror(errno)));
}

bool LineReader::Next(absl::string_view* line) {
  if (!std::getline(in_, buffer_)) return false;
  ++line_number_;
  absl::string_view view = buffer_;
  if (absl::EndsWith(view, "\r")) view.remove_suffix(1);
  // Spreadsheet exports often start with a UTF-8 byte order mark.
  if (line_number_ == 1 && absl::StartsWith(view, "\xEF\xBB\xBF")) {
    view.remove_prefix(3);
  }
  if (comment_ != '\0') {
    const size_t pos = view.find(comment_);
    if (pos != absl::string_view::npos) view = view.substr(0, pos);
  }
  *line = view;
  return true;
}

absl::Status LineReader::ReadStatus() const {
  if (in_.bad()) {
    return absl::DataLossError(absl::StrCat(path_, ": read error"));
  }
  return absl::OkStatus();
}

absl::Status LineReader::Error(absl::string_view what) const {
  return absl::InvalidArgumentError(
      absl::StrCat(path_, ":", line_number_, ": ", what));
}

}  // namespace pstrain
