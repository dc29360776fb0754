// ps_server's flags (defined in server_flags.cc), read into a ServerConfig.
#ifndef PSTRAIN_PS_SERVER_SERVER_FLAGS_H_
#define PSTRAIN_PS_SERVER_SERVER_FLAGS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ps_server/server_config.h"

namespace pstrain {

// --cluster_spec: the job's description, applied before the flags are read
// (common/cluster_spec.h).
std::string ClusterSpecFlag();

// The config the flags describe. A flag that cannot even be read into it
// (the --grpc_* tuning's) adds its problem to `problems`; everything else
// is ServerConfigProblems' to check.
ServerConfig ServerConfigFromFlags(std::vector<absl::Status>* problems);

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SERVER_FLAGS_H_
