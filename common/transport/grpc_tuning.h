// gRPC transport settings that ps_server, worker and ps_bench share as
// flags, so a cluster's operator can tune HTTP/2 and socket reads the same
// way on both ends of a connection.
//
//   --grpc_max_frame_bytes       HTTP/2 frame size a peer may send us
//   --grpc_stream_window_bytes   initial HTTP/2 stream flow-control window
//   --grpc_write_buffer_bytes    bytes gRPC buffers per stream before it
//                                stops accepting writes
//   --grpc_tcp_read_chunk_bytes  how much gRPC asks the socket for per read
//
// Every default is 0: gRPC's own value. On loopback with 2 vCPUs none of the
// larger settings moved 4 MiB push+pull goodput beyond the noise (see
// bench/results/transport_*.txt), so none is imposed; on a fast real
// network a larger window is the usual first thing to try.
#ifndef PSTRAIN_COMMON_TRANSPORT_GRPC_TUNING_H_
#define PSTRAIN_COMMON_TRANSPORT_GRPC_TUNING_H_

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pstrain {

struct GrpcTuning {
  int max_frame_bytes = 0;
  int stream_window_bytes = 0;
  int write_buffer_bytes = 0;
  int tcp_read_chunk_bytes = 0;
};

// The flags' values, or InvalidArgument naming the first flag out of range
// (ValidateGrpcTuning).
absl::StatusOr<GrpcTuning> GrpcTuningFromFlags();

// The flags' values, unchecked: for a configuration validated later.
GrpcTuning GrpcTuningFlagValues();

// InvalidArgument naming the first setting out of range, by its flag (HTTP/2
// allows frames of 16 KiB .. 16 MiB; the others must be >= 0 and at most
// 1 GiB).
absl::Status ValidateGrpcTuning(const GrpcTuning& tuning);

// The flags that reproduce `tuning` in another process (only those != 0).
std::vector<std::string> GrpcTuningArgs(const GrpcTuning& tuning);

void ApplyGrpcTuning(const GrpcTuning& tuning, grpc::ChannelArguments* args);
void ApplyGrpcTuning(const GrpcTuning& tuning, grpc::ServerBuilder* builder);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_GRPC_TUNING_H_
