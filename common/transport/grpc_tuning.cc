#include "common/transport/grpc_tuning.h"

#include <cstdint>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, grpc_max_frame_bytes, 0,
          "Largest HTTP/2 frame this process accepts, in [16384, 16777215]; "
          "0 keeps gRPC's default (16 KiB).");
ABSL_FLAG(int, grpc_stream_window_bytes, 0,
          "Initial HTTP/2 per-stream flow-control window; 0 keeps gRPC's "
          "default (it then grows the window by bandwidth-delay probing).");
ABSL_FLAG(int, grpc_write_buffer_bytes, 0,
          "Bytes gRPC buffers per stream before a write waits; 0 keeps "
          "gRPC's default.");
ABSL_FLAG(int, grpc_tcp_read_chunk_bytes, 0,
          "Bytes gRPC reads from a socket per read call; 0 keeps gRPC's "
          "adaptive default.");

namespace pstrain {
namespace {

constexpr int kMaxBytes = 1 << 30;

// (flag name, gRPC channel argument, value) for every setting != 0.
std::vector<std::pair<const char*, std::pair<const char*, int>>> Settings(
    const GrpcTuning& t) {
  std::vector<std::pair<const char*, std::pair<const char*, int>>> out;
  auto add = [&](const char* flag, const char* arg, int value) {
    if (value != 0) out.push_back({flag, {arg, value}});
  };
  add("grpc_max_frame_bytes", GRPC_ARG_HTTP2_MAX_FRAME_SIZE, t.max_frame_bytes);
  add("grpc_stream_window_bytes", GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
      t.stream_window_bytes);
  add("grpc_write_buffer_bytes", GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE,
      t.write_buffer_bytes);
  add("grpc_tcp_read_chunk_bytes", GRPC_ARG_TCP_READ_CHUNK_SIZE,
      t.tcp_read_chunk_bytes);
  return out;
}

}  // namespace

GrpcTuning GrpcTuningFlagValues() {
  GrpcTuning t;
  t.max_frame_bytes = absl::GetFlag(FLAGS_grpc_max_frame_bytes);
  t.stream_window_bytes = absl::GetFlag(FLAGS_grpc_stream_window_bytes);
  t.write_buffer_bytes = absl::GetFlag(FLAGS_grpc_write_buffer_bytes);
  t.tcp_read_chunk_bytes = absl::GetFlag(FLAGS_grpc_tcp_read_chunk_bytes);
  return t;
}

absl::Status ValidateGrpcTuning(const GrpcTuning& t) {
  if (t.max_frame_bytes != 0 &&
      (t.max_frame_bytes < 16384 || t.max_frame_bytes > 16777215)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--grpc_max_frame_bytes must be 0 or in [16384, 16777215] (HTTP/2's "
        "range), got ",
        t.max_frame_bytes));
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, int>{"grpc_stream_window_bytes",
                                    t.stream_window_bytes},
        {"grpc_write_buffer_bytes", t.write_buffer_bytes},
        {"grpc_tcp_read_chunk_bytes", t.tcp_read_chunk_bytes}}) {
    if (value < 0 || value > kMaxBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, " must be in [0, ", kMaxBytes, "], got ", value));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GrpcTuning> GrpcTuningFromFlags() {
  const GrpcTuning t = GrpcTuningFlagValues();
  if (absl::Status valid = ValidateGrpcTuning(t); !valid.ok()) return valid;
  return t;
}

std::vector<std::string> GrpcTuningArgs(const GrpcTuning& tuning) {
  std::vector<std::string> args;
  for (const auto& [flag, setting] : Settings(tuning)) {
    args.push_back(absl::StrCat("--", flag, "=", setting.second));
  }
  return args;
}

void ApplyGrpcTuning(const GrpcTuning& tuning, grpc::ChannelArguments* args) {
  for (const auto& [flag, setting] : Settings(tuning)) {
    args->SetInt(setting.first, setting.second);
  }
}

void ApplyGrpcTuning(const GrpcTuning& tuning, grpc::ServerBuilder* builder) {
  for (const auto& [flag, setting] : Settings(tuning)) {
    builder->AddChannelArgument(setting.first, setting.second);
  }
}

}  // namespace pstrain
