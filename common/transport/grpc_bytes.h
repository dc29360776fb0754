// Moving bytes in and out of gRPC without copying payloads: a message given
// as pieces becomes a ByteBuffer whose slices point at the pieces, and a
// received ByteBuffer becomes views of the slices gRPC already holds.
#ifndef PSTRAIN_COMMON_TRANSPORT_GRPC_BYTES_H_
#define PSTRAIN_COMMON_TRANSPORT_GRPC_BYTES_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pstrain {

// A ByteBuffer referencing `pieces` in order. gRPC may read the pieces until
// it destroys the last slice: with `keep_alive`, each slice holds a
// reference to it (put the owner of the pieces' memory there); without, the
// caller must keep the pieces alive and unchanged until the call completes.
grpc::ByteBuffer PiecesToByteBuffer(
    absl::Span<const absl::string_view> pieces,
    std::shared_ptr<const void> keep_alive = nullptr);

// The received bytes as views; valid while this object lives.
class ReceivedBytes {
 public:
  // False when gRPC could not expose the buffer (it is then empty). An
  // uninitialized buffer is an empty message.
  bool Load(const grpc::ByteBuffer& buffer);
  absl::Span<const absl::string_view> views() const { return views_; }
  size_t size() const { return size_; }

 private:
  std::vector<grpc::Slice> slices_;
  std::vector<absl::string_view> views_;
  size_t size_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_GRPC_BYTES_H_
