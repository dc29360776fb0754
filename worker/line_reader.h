// Reads a text data file line by line for the CSV, LIBSVM and Criteo TSV
// readers, with errors that name the file and line.
#ifndef PSTRAIN_WORKER_LINE_READER_H_
#define PSTRAIN_WORKER_LINE_READER_H_

#include <cstdint>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pstrain {

// Hands out each line without its end (LF or CRLF), without a UTF-8 byte
// order mark on the first line, and, when `comment` is not '\0', without
// anything from `comment` on. Nothing else is removed: for TSV a trailing
// tab is data, so callers strip whitespace where their format allows it.
class LineReader {
 public:
  LineReader(const std::string& path, char comment);

  // NotFound naming the file and errno when it could not be opened.
  absl::Status OpenStatus() const;
  // False at the end of the file (or a read error: see ReadStatus). The
  // line stays valid until the next call.
  bool Next(absl::string_view* line);
  // DataLoss when reading stopped on an I/O error.
  absl::Status ReadStatus() const;
  // InvalidArgument "<path>:<line>: <what>" about the last line read.
  absl::Status Error(absl::string_view what) const;

 private:
  std::string path_;
  char comment_;
  std::ifstream in_;
  std::string buffer_;
  int64_t line_number_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LINE_READER_H_
