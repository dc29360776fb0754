// Text taken from a request (a tensor or table name, an id) and put into a
// status message. A status travels back in the call's trailers, which gRPC
// bounds: a message quoting a client's 70,000-character name unbounded was
// never sent, and the client (and the next call on its channel) got no
// answer at all until its deadline. Every status that quotes what a client
// sent goes through QuoteForStatus.
#ifndef PSTRAIN_COMMON_STATUS_TEXT_H_
#define PSTRAIN_COMMON_STATUS_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pstrain {

// `text` in single quotes, C-escaped (control bytes and invalid UTF-8 cannot
// garble a log line or a terminal), and cut after `max_bytes` of it with
// the length it had: 'abc...' (70000 bytes). The result is at most
// 4 * max_bytes + 32 characters.
std::string QuoteForStatus(absl::string_view text, size_t max_bytes = 128);

// Sorted ids as a person reads them, runs of three or more as ranges:
// "3, 5, 9-31". Bounded by the number of runs, not of ids.
std::string FormatIdList(absl::Span<const int> sorted_ids);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_STATUS_TEXT_H_
