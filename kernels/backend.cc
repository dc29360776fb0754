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
#include "kernels/cuda_backend.h"

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
    const BackendOptions& options) {
  const std::string& device = options.device;
  Precision precision;
  if (options.precision == "fp32") {
    precision = Precision::kFp32;
  } else if (options.precision == "bf16") {
    precision = Precision::kBf16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--precision must be fp32 or bf16, got '", options.precision, "'"));
  }
  // bf16 only changes how the CUDA backend runs GEMMs; the CPU reference
  // has no bf16 path, and silently running fp32 would mislead benchmarks.
  const auto bf16_needs_gpu = [](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--precision=bf16 needs a CUDA device: ", why));
  };

  if (options.cpu_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cpu_threads must be >= 0 (0: every core this process may use), "
        "got ",
        options.cpu_threads));
  }
  const int cpu_threads = SetCpuGemmThreads(options.cpu_threads);
  if (device == "cpu" || device == "cpu_reference") {
    if (precision == Precision::kBf16) {
      return bf16_needs_gpu(absl::StrCat("--device=", device));
    }
    if (device == "cpu_reference") {
      return std::make_unique<CpuBackend>(CpuGemm::kReference);
    }
    LOG_FIRST_N(INFO, 1) << "CPU GEMMs through OpenBLAS on " << cpu_threads
                         << " thread(s)";
    return std::make_unique<CpuBackend>();
  }
  if (device == "auto") {
    std::string why_none;
    if (CudaDeviceCount(&why_none) > 0) {
      // One worker per GPU: CUDA_VISIBLE_DEVICES picks the GPU, and the
      // first visible one is the worker's.
      absl::StatusOr<std::unique_ptr<Backend>> backend =
          CreateCudaBackend(0, precision);
      if (backend.ok()) {
        LOG_FIRST_N(INFO, 1)
            << "--device=auto: using " << DescribeCudaDevice(0)
            << (precision == Precision::kBf16 ? " (bf16 GEMMs)" : "");
      }
      return backend;
    }
    if (precision == Precision::kBf16) {
      return bf16_needs_gpu(
          absl::StrCat("--device=auto found no GPU (", why_none, ")"));
    }
    LOG_FIRST_N(INFO, 1) << "no GPU visible (" << why_none
                         << "); using the CPU backend";
    return std::make_unique<CpuBackend>();
  }
  constexpr absl::string_view kCudaPrefix = "cuda:";
  int ordinal = 0;
  if (absl::StartsWith(device, kCudaPrefix) &&
      ParseDeviceOrdinal(absl::string_view(device).substr(kCudaPrefix.size()),
                         &ordinal)) {
    absl::StatusOr<std::unique_ptr<Backend>> backend =
        CreateCudaBackend(ordinal, precision);
    if (!backend.ok()) {
      // The message already starts with "cuda:N"; make it name the flag.
      const absl::string_view message = backend.status().message();
      return absl::Status(
          backend.status().code(),
          absl::StartsWith(message, device)
              ? absl::StrCat("--device=", message)
              : absl::StrCat("--device=", device, ": ", message));
    }
    LOG(INFO) << "--device=" << device << ": using "
              << DescribeCudaDevice(ordinal)
              << (precision == Precision::kBf16 ? " (bf16 GEMMs)" : "");
    return backend;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be auto, cpu or cuda:N (or cpu_reference, "
                   "the exact CPU kernels), got '",
                   device, "'"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const std::string& device) {
  BackendOptions options;
  options.device = device;
  return CreateBackend(options);
}

}  // namespace pstrain::kernels
