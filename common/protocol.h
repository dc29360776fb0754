// Constants both sides of the wire agree on.
#ifndef PSTRAIN_COMMON_PROTOCOL_H_
#define PSTRAIN_COMMON_PROTOCOL_H_

#include <cstddef>
#include <cstdint>

namespace pstrain {

// Bumped when a message changes meaning (not when a field is added). A server
// refuses requests carrying another version with FAILED_PRECONDITION.
inline constexpr uint32_t kProtocolVersion = 1;

// gRPC's default receive cap is 4 MiB, far below one dense block batch.
inline constexpr int kDefaultMaxMessageBytes = 512 << 20;

// Tensor payloads smaller than this are copied into the message's header
// bytes rather than sent as their own slice: for a bias vector the copy is
// cheaper than the slice bookkeeping.
inline constexpr size_t kInlineBelowBytes = 4096;

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_PROTOCOL_H_
