// The gRPC floor: the best push+pull plain gRPC reaches on a machine, i.e.
// what a parameter server built on gRPC could do if it did no work of its
// own. It is ps_bench's gRPC baseline, next to raw TCP.
//
// Built from what measured best (../shared/DESIGN.md, Transport): raw bytes
// (no protobuf copy), `connections` TCP connections with one long-lived
// bidirectional stream each, a tensor cut into one chunk per stream, all
// chunks in flight at once.
//   push: each chunk is sent from the caller's memory (no copy); the server
//         answers 1 byte without reading it.
//   pull: each stream asks for its chunk; the server answers from a
//         prefilled buffer (no copy); the client copies each answer into
//         the destination, as any receiver of gRPC messages must.
#ifndef PSTRAIN_BENCH_TRANSPORT_GRPC_FLOOR_H_
#define PSTRAIN_BENCH_TRANSPORT_GRPC_FLOOR_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace pstrain {

// Serves the floor's streams. A pull of n bytes is answered from a buffer
// of n bytes made and filled at the first pull of that size (so the kernel
// copies real pages), then kept.
class GrpcFloorService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  class Stream;
  const std::vector<char>& PullSource(size_t bytes);

  absl::Mutex mu_;
  std::map<size_t, std::unique_ptr<const std::vector<char>>> pull_sources_
      ABSL_GUARDED_BY(mu_);
};

class GrpcFloorClient {
 public:
  // Opens `connections` connections to `target` (host:port), one stream
  // each. Every exchange must finish within `timeout`.
  static absl::StatusOr<std::unique_ptr<GrpcFloorClient>> Connect(
      const std::string& target, int connections, absl::Duration timeout);
  ~GrpcFloorClient();  // closes the streams (bounded by the timeout)

  // Sends `data` as one chunk per stream and waits for every answer.
  absl::Status Push(absl::Span<const char> data);
  // Fills `out`, one chunk per stream.
  absl::Status Pull(absl::Span<char> out);

 private:
  class Stream;
  explicit GrpcFloorClient(absl::Duration timeout);
  // Runs requests[i] on connection i's push or pull stream, all at once,
  // and waits for the answers; `answered(i, response)` (if given) runs on a
  // gRPC thread.
  absl::Status ExchangeAll(
      bool pull, std::vector<grpc::ByteBuffer>& requests,
      const std::function<absl::Status(int, const grpc::ByteBuffer&)>&
          answered);

  const absl::Duration timeout_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::vector<std::unique_ptr<Stream>> streams_;
};

}  // namespace pstrain

#endif  // PSTRAIN_BENCH_TRANSPORT_GRPC_FLOOR_H_
