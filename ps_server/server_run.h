// One ps_server's life, from a ServerConfig without problems
// (ServerConfigProblems): everything ps_server does between reading its
// flags and exiting.
#ifndef PSTRAIN_PS_SERVER_SERVER_RUN_H_
#define PSTRAIN_PS_SERVER_SERVER_RUN_H_

#include "ps_server/server_config.h"

namespace pstrain {

// Starts the shard (restored from the newest checkpoint under
// --checkpoint_dir), its service, data plane, metrics, gRPC and health
// ports; serves until SIGTERM or SIGINT (CatchTerminationSignals must have
// run); shuts down in order, writing a last checkpoint. Returns the exit
// status: 0, or 1 when a part could not start (said in the log). A config
// the shard refuses exits 2 with one line per problem.
int RunServer(const ServerConfig& config);

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SERVER_RUN_H_
