// The consistency contract a job runs under (README "Consistency"): sync
// (every worker's gradient of a step, summed, then one update), async (each
// push applied on arrival) or ssp (async within a staleness bound). One name
// on the wire, in flags and in reports; one enum in code, on both ends.
#ifndef PSTRAIN_COMMON_CONSISTENCY_MODE_H_
#define PSTRAIN_COMMON_CONSISTENCY_MODE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain {

enum class ConsistencyMode { kSync, kAsync, kSsp };

// "sync" | "async" | "ssp"; anything else is InvalidArgument naming --mode.
absl::StatusOr<ConsistencyMode> ParseConsistencyMode(absl::string_view name);

// The name ParseConsistencyMode reads back.
std::string ConsistencyModeName(ConsistencyMode mode);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CONSISTENCY_MODE_H_
