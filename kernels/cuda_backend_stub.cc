// Stands in for cuda_backend.cc in builds without a CUDA toolkit (see
// bazel/cuda_configure.bzl): the same functions, reporting that this build
// has no CUDA backend, so that callers need no #ifdefs.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

namespace pstrain::kernels {
namespace {

constexpr char kNoCuda[] =
    "this build has no CUDA backend (no CUDA toolkit was found when it was "
    "built; see bazel/cuda_configure.bzl)";

}  // namespace

bool CudaBackendCompiled() { return false; }

CudaProbe ProbeCuda() { return CudaProbe(); }

int CudaDeviceCount(std::string* why_none) {
  if (why_none != nullptr) *why_none = kNoCuda;
  return 0;
}

std::string DescribeCudaDevice(int ordinal) {
  return absl::StrCat("cuda:", ordinal, ": ", kNoCuda);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int ordinal, Precision /*precision*/) {
  return absl::UnavailableError(absl::StrCat("cuda:", ordinal, ": ", kNoCuda));
}

void* CudaStreamOf(Backend* /*backend*/) { return nullptr; }

}  // namespace pstrain::kernels
