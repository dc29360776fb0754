#include "common/transport/grpc_bytes.h"

#include <utility>

namespace pstrain {
namespace {

void ReleaseKeepAlive(void* holder) {
  delete static_cast<std::shared_ptr<const void>*>(holder);
}

}  // namespace

grpc::ByteBuffer PiecesToByteBuffer(absl::Span<const absl::string_view> pieces,
                                    std::shared_ptr<const void> keep_alive) {
  std::vector<grpc::Slice> slices;
  slices.reserve(pieces.size());
  for (absl::string_view piece : pieces) {
    if (piece.empty()) continue;
    void* data = const_cast<char*>(piece.data());
    if (keep_alive == nullptr) {
      slices.emplace_back(data, piece.size(), grpc::Slice::STATIC_SLICE);
    } else {
      slices.emplace_back(data, piece.size(), &ReleaseKeepAlive,
                          new std::shared_ptr<const void>(keep_alive));
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

bool ReceivedBytes::Load(const grpc::ByteBuffer& buffer) {
  slices_.clear();
  views_.clear();
  size_ = 0;
  if (!buffer.Valid()) return true;  // an empty message
  if (!buffer.Dump(&slices_).ok()) return false;
  views_.reserve(slices_.size());
  for (const grpc::Slice& slice : slices_) {
    views_.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                        slice.size());
    size_ += slice.size();
  }
  return true;
}

}  // namespace pstrain
