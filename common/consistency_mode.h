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

// The mode a sparse table named `table` runs under servers running
// `servers`, from its schema field `table_mode` (SparseTableSpec.mode): ""
// is the servers' mode; a table may be async under any servers' mode, or
// name the servers' own. Anything else is InvalidArgument naming the table
// and what the servers support. One rule for the servers (which apply it)
// and the workers (which skip a sync table's empty pushes only when async).
absl::StatusOr<ConsistencyMode> TableConsistencyMode(
    ConsistencyMode servers, absl::string_view table,
    absl::string_view table_mode);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CONSISTENCY_MODE_H_
