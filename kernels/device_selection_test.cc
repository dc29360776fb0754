// What the CUDA backend decides without a GPU, checked on any machine:
// which CUDA probe results let --device=auto fall back to the CPU (only
// "no GPU here"), what the messages say, and how pinned staging grows.
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_policy.h"

namespace pstrain::kernels {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

CudaProbe Probe(int device_count, int error, int driver_version) {
  CudaProbe probe;
  probe.compiled = true;
  probe.device_count = device_count;
  probe.error = error;
  probe.driver_version = driver_version;
  probe.runtime_version = 13000;
  if (error == kCudaErrorInsufficientDriver) {
    probe.error_name = "cudaErrorInsufficientDriver";
    probe.error_string =
        "CUDA driver version is insufficient for CUDA runtime version";
  }
  return probe;
}

TEST(ClassifyCudaProbeTest, AVisibleDeviceIsUsable) {
  EXPECT_TRUE(ClassifyCudaProbe(Probe(1, 0, 13000)).ok());
  EXPECT_TRUE(ClassifyCudaProbe(Probe(8, 0, 13020)).ok());
}

// The machine this suite mostly runs on: the CUDA runtime is linked in, but
// there is no libcuda. The runtime calls that "insufficient driver"; users
// must read "no driver installed", not "your driver is broken".
TEST(ClassifyCudaProbeTest, NoDriverInstalledIsNoGpuInPlainWords) {
  const absl::Status status =
      ClassifyCudaProbe(Probe(0, kCudaErrorInsufficientDriver, 0));
  EXPECT_TRUE(absl::IsNotFound(status)) << status;
  EXPECT_THAT(status.message(),
              HasSubstr("no GPU: no NVIDIA driver is installed"));
  EXPECT_THAT(status.message(), Not(HasSubstr("insufficient")));
}

TEST(ClassifyCudaProbeTest, NoDeviceIsNoGpu) {
  for (const CudaProbe& probe :
       {Probe(0, 0, 13000), Probe(0, kCudaErrorNoDevice, 13000)}) {
    const absl::Status status = ClassifyCudaProbe(probe);
    EXPECT_TRUE(absl::IsNotFound(status)) << status;
    EXPECT_THAT(status.message(), HasSubstr("no GPU"));
    EXPECT_THAT(status.message(), HasSubstr("CUDA_VISIBLE_DEVICES"));
  }
}

TEST(ClassifyCudaProbeTest, ABuildWithoutCudaIsNoGpu) {
  const absl::Status status = ClassifyCudaProbe(CudaProbe());
  EXPECT_TRUE(absl::IsNotFound(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("this build has no CUDA backend"));
}

// A GPU host whose driver predates the runtime: never a silent fallback.
TEST(ClassifyCudaProbeTest, ADriverTooOldIsAFailureThatSaysWhatToDo) {
  const absl::Status status =
      ClassifyCudaProbe(Probe(0, kCudaErrorInsufficientDriver, 12080));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("supports CUDA up to 12.8"));
  EXPECT_THAT(status.message(), HasSubstr("CUDA 13.0 runtime"));
  EXPECT_THAT(status.message(), HasSubstr("R580"));
  EXPECT_THAT(status.message(), HasSubstr("--device=cpu"));
}

TEST(ClassifyCudaProbeTest, AnyOtherCudaErrorIsAFailureNamingIt) {
  CudaProbe probe = Probe(0, 999, 13000);
  probe.error_name = "cudaErrorUnknown";
  probe.error_string = "unknown error";
  const absl::Status status = ClassifyCudaProbe(probe);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("cudaErrorUnknown (unknown error)"));
}

// On this machine, whatever it has: auto either gets the GPU, or falls back
// only because there is none, or fails with the reason.
TEST(ClassifyCudaProbeTest, AutoFollowsTheClassificationOfThisMachine) {
  const absl::Status gpu = ClassifyCudaProbe(ProbeCuda());
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("auto");
  if (absl::IsNotFound(gpu)) {
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->Name(), "cpu");
    std::string why;
    EXPECT_EQ(CudaDeviceCount(&why), 0);
    EXPECT_EQ(why, gpu.message());
  } else if (!gpu.ok()) {
    EXPECT_FALSE(backend.ok());
    EXPECT_THAT(backend.status().message(), HasSubstr("--device=auto"));
    EXPECT_THAT(backend.status().message(), HasSubstr(gpu.message()));
  } else if (backend.ok()) {
    EXPECT_THAT((*backend)->Name(), ::testing::StartsWith("cuda:0 ("));
  } else {
    // A GPU is there but no backend could be made on it (say, no kernel
    // image for it): an error, never the CPU.
    EXPECT_THAT(backend.status().message(), HasSubstr("--device=auto"));
  }
}

TEST(NextStagingCapacityTest, GrowsGeometricallyWithinBounds) {
  constexpr size_t kMin = 1 << 20;
  constexpr size_t kMax = 32 << 20;
  EXPECT_EQ(internal::NextStagingCapacity(0, 100, kMin, kMax), kMin);
  // One byte more than the buffer holds: double it, not just fit it.
  EXPECT_EQ(internal::NextStagingCapacity(kMin, kMin + 1, kMin, kMax),
            2 * kMin);
  EXPECT_EQ(internal::NextStagingCapacity(2 * kMin, 5 * kMin, kMin, kMax),
            5 * kMin);
  EXPECT_EQ(internal::NextStagingCapacity(16 << 20, (16 << 20) + 1, kMin, kMax),
            kMax);
  EXPECT_EQ(internal::NextStagingCapacity(kMax, 100 << 20, kMin, kMax), kMax);
  // A run of copies each one byte larger reallocates O(log n) times.
  size_t capacity = 0;
  int reallocations = 0;
  for (size_t bytes = 1; bytes <= kMax; bytes += 4096) {
    if (capacity < bytes) {
      capacity = internal::NextStagingCapacity(capacity, bytes, kMin, kMax);
      ++reallocations;
    }
  }
  EXPECT_LE(reallocations, 6);
}

}  // namespace
}  // namespace pstrain::kernels
