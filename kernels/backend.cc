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

// 13000 -> "13.0", 12080 -> "12.8" (CUDA's version encoding).
std::string CudaVersionText(int version) {
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

}  // namespace

absl::Status ClassifyCudaProbe(const CudaProbe& probe) {
  if (!probe.compiled) {
    return absl::NotFoundError(
        "no GPU: this build has no CUDA backend (no CUDA toolkit was found "
        "when it was built)");
  }
  if (probe.error == 0 && probe.device_count > 0) return absl::OkStatus();
  if ((probe.error == 0 && probe.device_count <= 0) ||
      probe.error == kCudaErrorNoDevice) {
    return absl::NotFoundError(
        "no GPU: the NVIDIA driver is installed but shows no CUDA device "
        "(is CUDA_VISIBLE_DEVICES empty or wrong?)");
  }
  // The runtime reports a missing driver and an old driver with the same
  // error; only the driver version tells them apart (0: none installed).
  if (probe.error == kCudaErrorInsufficientDriver &&
      probe.driver_version == 0) {
    return absl::NotFoundError(
        "no GPU: no NVIDIA driver is installed on this machine");
  }
  if (probe.error == kCudaErrorInsufficientDriver) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the NVIDIA driver here supports CUDA up to ",
        CudaVersionText(probe.driver_version),
        ", but this build uses the CUDA ",
        CudaVersionText(probe.runtime_version),
        " runtime: install a newer driver (CUDA 13 needs R580 or later) or "
        "run with --device=cpu"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the CUDA runtime cannot use the GPU: cudaGetDeviceCount failed with ",
      probe.error_name, " (", probe.error_string, ")"));
}

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
  if (device == "cpu" || device == "cpu_reference" || device == "cpu_staged") {
    if (precision == Precision::kBf16) {
      return bf16_needs_gpu(absl::StrCat("--device=", device));
    }
    if (device == "cpu_reference") {
      return std::make_unique<CpuBackend>(CpuGemm::kReference);
    }
    if (device == "cpu_staged") {
      return std::make_unique<CpuBackend>(CpuGemm::kBlas, /*staged=*/true);
    }
    LOG_FIRST_N(INFO, 1) << "CPU GEMMs through OpenBLAS on " << cpu_threads
                         << " thread(s)";
    return std::make_unique<CpuBackend>();
  }
  if (device == "auto") {
    // Only "this machine has no GPU" falls back to the CPU. A GPU that is
    // there but unusable (old driver, no kernel image for it) is an error:
    // training on the CPU instead would be silent and ten times slower.
    const absl::Status gpu = ClassifyCudaProbe(ProbeCuda());
    if (gpu.ok()) {
      // One worker per GPU: CUDA_VISIBLE_DEVICES picks the GPU, and the
      // first visible one is the worker's.
      absl::StatusOr<std::unique_ptr<Backend>> backend =
          CreateCudaBackend(0, precision);
      if (!backend.ok()) {
        return absl::Status(
            backend.status().code(),
            absl::StrCat("--device=auto: ", backend.status().message(),
                         " (--device=cpu runs on the CPU)"));
      }
      LOG_FIRST_N(INFO, 1) << "--device=auto: using " << DescribeCudaDevice(0)
                           << (precision == Precision::kBf16 ? " (bf16 GEMMs)"
                                                             : "");
      return backend;
    }
    if (!absl::IsNotFound(gpu)) {
      return absl::Status(gpu.code(),
                          absl::StrCat("--device=auto: ", gpu.message()));
    }
    if (precision == Precision::kBf16) {
      return bf16_needs_gpu(
          absl::StrCat("--device=auto found ", gpu.message()));
    }
    LOG_FIRST_N(INFO, 1) << "--device=auto: " << gpu.message()
                         << "; training on the CPU";
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
                   "the exact CPU kernels, or cpu_staged, the GPU worker's "
                   "staging on the CPU), got '",
                   device, "'"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const std::string& device) {
  BackendOptions options;
  options.device = device;
  return CreateBackend(options);
}

}  // namespace pstrain::kernels
