// What the PsClient sources share and its header keeps private: the state
// of one RPC, of a gRPC stream and of a data-plane connection. Only
// worker/client/ps_client*.cc include this.
#ifndef PSTRAIN_WORKER_CLIENT_PS_CLIENT_INTERNAL_H_
#define PSTRAIN_WORKER_CLIENT_PS_CLIENT_INTERNAL_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/protocol.h"
#include "common/transport/data_link.h"
#include "common/transport/grpc_bytes.h"
#include "common/transport/wire.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace ps_client_internal {

// Parses a message that may arrive in pieces (a gRPC byte buffer's slices).
template <typename Message>
absl::Status Deserialize(absl::Span<const absl::string_view> bytes,
                         Message* message) {
  bool parsed;
  if (bytes.size() == 1) {
    parsed = message->ParseFromArray(bytes[0].data(),
                                     static_cast<int>(bytes[0].size()));
  } else {
    std::string flat;
    for (absl::string_view piece : bytes) {
      flat.append(piece.data(), piece.size());
    }
    parsed = message->ParseFromString(flat);
  }
  if (parsed) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat("unreadable ", Message::descriptor()->name()));
}

}  // namespace ps_client_internal

// One RPC: what it sends and how to take its answer; the per-attempt gRPC
// state is rebuilt for every retry.
struct PsClient::Call {
  int shard = 0;
  int connection = 0;
  // The client's Interrupt count when the call's RunAll began.
  uint64_t epoch = 0;
  const Group* group = nullptr;
  std::string flat;     // the request, when small (control messages, pulls)
  WireMessage message;  // a push's request, referencing gradient memory
  bool wait_for_ready = false;
  // Runs with the answer's bytes when the call succeeded (on a gRPC thread,
  // or on the caller's for the data plane); may turn it into an error.
  std::function<absl::Status(absl::Span<const absl::string_view>)> on_response;
  // A pull of large blocks on the data plane: where the payloads go
  // (DataExchange::place_payloads), instead of on_response.
  std::function<absl::StatusOr<std::vector<absl::Span<char>>>(
      absl::string_view meta)>
      place_payloads;
  // A PushPull: `message` is the push, `flat` the pull, and this takes the
  // PushResponse (on_response and place_payloads take the pull's answer).
  std::function<absl::Status(absl::Span<const absl::string_view>)>
      on_push_response;
  char push_length[data_plane::kLengthPrefixBytes] = {};  // sent before it
  // A pull from this replica of the shard, a backup (pulls_from_backups);
  // -1: from the shard's current replica.
  int read_replica = -1;
  // The replica of the shard its last attempt went to (StartAndWait).
  int replica = -1;
  // On the data plane: the index (in the same RunOnDataPlane) of a call
  // whose end starts this one's shorter deadline, `grace` later
  // (DataExchange::after); -1: none.
  int after = -1;
  absl::Duration grace = absl::InfiniteDuration();
  // PushPullStreamed: DataExchange's can_send, send_wake_fd and on_ok. A
  // call with can_send goes on the data plane or fails (StartAndWait).
  std::function<bool()> can_send;
  int send_wake_fd = -1;
  std::function<void()> on_ok;

  std::unique_ptr<grpc::ClientContext> context;
  grpc::ByteBuffer request, response;
  absl::Status status;

  grpc::ByteBuffer MakeRequest() const {
    if (message.num_pieces() == 0) {
      grpc::Slice slice(flat.data(), flat.size());
      return grpc::ByteBuffer(&slice, 1);
    }
    // No keep-alive: the message and what it references outlive the call.
    return PiecesToByteBuffer(message.Pieces());
  }
};

// A stream's state is only touched under `mu`, which the caller of
// CallOnStream holds for one request and its answer.
struct PsClient::CallStream {
  absl::Mutex mu;
  std::unique_ptr<grpc::ClientContext> context ABSL_GUARDED_BY(mu);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream ABSL_GUARDED_BY(mu);
  // The stream's deadline: a stream is replaced before a call whose own
  // deadline would pass it.
  absl::Time expires ABSL_GUARDED_BY(mu);
  // gRPC keeps a pointer to the method name for the stream's life.
  std::string method ABSL_GUARDED_BY(mu);

  // Ends the stream (if any) and returns its status. `cancel` for a stream
  // that may still be open; a stream whose read or write failed is over
  // already, and its status is the server's.
  grpc::Status CloseLocked(bool cancel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (stream == nullptr) return grpc::Status::OK;
    if (cancel) context->TryCancel();
    grpc::Status status = stream->Finish();
    stream.reset();
    context.reset();
    return status;
  }
  ~CallStream() {
    absl::MutexLock lock(&mu);
    CloseLocked(/*cancel=*/true);
  }
};

// One data-plane connection; its user holds `mu` for a whole exchange.
struct PsClient::DataSlot {
  absl::Mutex mu;
  std::unique_ptr<DataLink> link ABSL_GUARDED_BY(mu);
  int port ABSL_GUARDED_BY(mu) = 0;  // the port `link` is connected to
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_PS_CLIENT_INTERNAL_H_
