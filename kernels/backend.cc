#include "kernels/backend.h"

#include <glog/logging.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu_backend.h"

namespace pstrain::kernels {
namespace {

// True when `text` is a plain non-negative decimal int: SimpleAtoi alone
// would also accept signs and surrounding whitespace.
bool ParseDeviceOrdinal(absl::string_view text, int* ordinal) {
  if (text.empty()) return false;
  for (char ch : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) return false;
  }
  return absl::SimpleAtoi(text, ordinal);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const std::string& device) {
  if (device == "cpu") return std::make_unique<CpuBackend>();
  if (device == "auto") {
    // Until the CUDA backend lands, "auto" can only mean the CPU.
    LOG_FIRST_N(INFO, 1) << "no CUDA backend in this build; using the CPU "
                            "backend";
    return std::make_unique<CpuBackend>();
  }
  constexpr absl::string_view kCudaPrefix = "cuda:";
  int ordinal = 0;
  if (absl::StartsWith(device, kCudaPrefix) &&
      ParseDeviceOrdinal(absl::string_view(device).substr(kCudaPrefix.size()),
                         &ordinal)) {
    return absl::UnavailableError(absl::StrCat(
        "--device=", device, ": this build has no CUDA backend yet"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be auto, cpu or cuda:N, got '", device, "'"));
}

}  // namespace pstrain::kernels
