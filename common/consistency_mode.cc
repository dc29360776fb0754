#include "common/consistency_mode.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_text.h"

namespace pstrain {

absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name) {
  if (name == "sync") return ConsistencyMode::kSync;
  if (name == "async") return ConsistencyMode::kAsync;
  if (name == "ssp") return ConsistencyMode::kSsp;
  return absl::InvalidArgumentError(
      absl::StrCat("--mode must be sync, async or ssp, got '", name, "'"));
}

std::string ConsistencyModeName(ConsistencyMode mode) {
  switch (mode) {
    case ConsistencyMode::kSync:
      return "sync";
    case ConsistencyMode::kAsync:
      return "async";
    case ConsistencyMode::kSsp:
      return "ssp";
  }
  return "?";
}

absl::StatusOr<ConsistencyMode> TableConsistencyMode(
    ConsistencyMode servers, absl::string_view table,
    absl::string_view table_mode) {
  if (table_mode.empty()) return servers;
  if (table_mode == "async") return ConsistencyMode::kAsync;
  if (table_mode == ConsistencyModeName(servers)) return servers;
  const bool known = table_mode == "sync" || table_mode == "ssp";
  return absl::InvalidArgumentError(absl::StrCat(
      "sparse table ", QuoteForStatus(table), " asks for mode ",
      QuoteForStatus(table_mode, 16),
      known ? absl::StrCat(" but the servers run --mode=",
                           ConsistencyModeName(servers))
            : " (not a mode)",
      ": a table's mode is empty (the servers'), 'async', or the servers' "
      "own ('",
      ConsistencyModeName(servers), "')"));
}

}  // namespace pstrain
