// The worker binary's flags, every one, and the WorkerConfig they make
// (worker/worker_config.h). Only the binary links this: a program that
// configures a worker some other way (the Python binding) fills the
// struct itself.
#ifndef PSTRAIN_WORKER_WORKER_FLAGS_H_
#define PSTRAIN_WORKER_WORKER_FLAGS_H_

#include "absl/status/statusor.h"
#include "worker/worker_config.h"

namespace pstrain {

// Applies the cluster spec (--cluster_spec or $PSTRAIN_CLUSTER: it sets the
// flags the command line leaves alone, and says which in the log), then
// reads every flag into a WorkerConfig, unchecked (ValidateWorkerConfig).
// An error is the cluster spec's. `argc`/`argv`: the command line, to tell
// a flag given from a default.
absl::StatusOr<WorkerConfig> WorkerConfigFromFlags(int argc, char** argv);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_WORKER_FLAGS_H_
