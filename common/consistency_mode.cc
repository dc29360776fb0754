#include "common/consistency_mode.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

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

}  // namespace pstrain
