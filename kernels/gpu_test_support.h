// How a test that needs a GPU behaves on a machine without one.
//
// By default it skips, with the reason, so the suite passes on CPU-only
// machines. With PSTRAIN_REQUIRE_GPU=1 in the environment (deploy/gpu/check.sh
// sets it; pass it to Bazel as --test_env=PSTRAIN_REQUIRE_GPU=1) the same
// situation is a test failure: on a GPU host, a broken driver or a binary
// without kernels for the device must not read as "skipped".
#ifndef PSTRAIN_KERNELS_GPU_TEST_SUPPORT_H_
#define PSTRAIN_KERNELS_GPU_TEST_SUPPORT_H_

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda_backend.h"

namespace pstrain::kernels {

// Whether PSTRAIN_REQUIRE_GPU asks for GPU tests to fail instead of skip.
inline bool GpuRequired() {
  const char* value = std::getenv("PSTRAIN_REQUIRE_GPU");
  return value != nullptr && *value != '\0' && std::string(value) != "0";
}

// Empty when CUDA device 0 can be used; otherwise why it cannot.
inline std::string WhyNoGpu() {
  if (!CudaBackendCompiled()) {
    return "no CUDA device visible: this build has no CUDA backend (no CUDA "
           "toolkit at build time)";
  }
  // CudaDeviceCount says why in plain words ("no GPU: no NVIDIA driver is
  // installed on this machine", or a driver too old for this build).
  std::string why_none;
  if (CudaDeviceCount(&why_none) == 0) return why_none;
  return "";
}

}  // namespace pstrain::kernels

// In a test body or SetUp: skips (or, under PSTRAIN_REQUIRE_GPU, fails) when
// no GPU can be used. `why` is a std::string saying what is missing.
#define PSTRAIN_SKIP_OR_FAIL_WITHOUT_GPU(why)                       \
  do {                                                              \
    const std::string pstrain_why_ = (why);                         \
    if (::pstrain::kernels::GpuRequired()) {                        \
      FAIL() << "PSTRAIN_REQUIRE_GPU is set, but " << pstrain_why_; \
    }                                                               \
    GTEST_SKIP() << pstrain_why_;                                   \
  } while (false)

// Skips or fails (see above) unless a CUDA device is usable.
#define PSTRAIN_REQUIRE_GPU_OR_SKIP()                                   \
  do {                                                                  \
    const std::string pstrain_no_gpu_ = ::pstrain::kernels::WhyNoGpu(); \
    if (!pstrain_no_gpu_.empty()) {                                     \
      PSTRAIN_SKIP_OR_FAIL_WITHOUT_GPU(pstrain_no_gpu_);                \
    }                                                                   \
  } while (false)

#endif  // PSTRAIN_KERNELS_GPU_TEST_SUPPORT_H_
