// Force-included (-include) by run_fuzz.sh when clang cannot parse
// ps_server/shard.h: clang evaluates the arguments of thread-safety
// attributes, and shard.h annotates CompleteIfReadyLocked with
// ABSL_EXCLUSIVE_LOCKS_REQUIRED(block.mu) while Shard::Block is still an
// incomplete type ("member access into incomplete type"); gcc ignores the
// attribute. Turning the annotation off changes no generated code.
#ifndef PSTRAIN_PS_SERVER_FUZZ_THREAD_ANNOTATIONS_OFF_H_
#define PSTRAIN_PS_SERVER_FUZZ_THREAD_ANNOTATIONS_OFF_H_

#include "absl/base/thread_annotations.h"

#undef ABSL_EXCLUSIVE_LOCKS_REQUIRED
#define ABSL_EXCLUSIVE_LOCKS_REQUIRED(...)

#endif  // PSTRAIN_PS_SERVER_FUZZ_THREAD_ANNOTATIONS_OFF_H_
