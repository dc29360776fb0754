// The CUDA backend: every Backend op on one GPU, with cuBLAS for GEMMs and
// the kernels of cuda_kernels.cu for the rest.
//
// This header names no CUDA type, so code that only creates backends (and
// the stub built when the toolkit is absent, cuda_backend_stub.cc) needs no
// CUDA headers. Construction goes through CreateBackend (backend.h), or
// CreateCudaBackend below for callers that already know they want a GPU.
//
// Behaviour, beyond backend.h's conventions:
//  - All work is issued on one non-blocking cudaStream per backend, in order.
//    Host-visible results (CopyToHost, SoftmaxCrossEntropy's loss and count,
//    Synchronize) are the only points that wait for the GPU; a training step
//    of the MLP has exactly one, the loss.
//  - Allocate is a caching allocator: sizes are rounded up to a size class
//    (multiples of 512 bytes up to 64 KiB, then four classes per power of
//    two, so at most 25% waste), Free returns a block to its class's free
//    list, and Allocate reuses one from there before calling cudaMalloc. A
//    training loop that allocates the same sizes every step reaches a steady
//    state with no cudaMalloc/cudaFree. Reuse is safe without events because
//    every op runs on the one stream: work issued before a Free completes
//    before work issued after the next Allocate. On out-of-memory the cached
//    blocks are released and the cudaMalloc retried once. Memory is returned
//    to the driver when the backend is destroyed.
//  - CopyToDevice copies the host data into a pinned staging buffer (grown
//    on demand, up to 2 x 32 MiB; larger copies are pipelined through it in
//    chunks) and issues cudaMemcpyAsync on the stream: it returns before the
//    transfer finishes, and the caller may reuse its host buffer at once.
//    CopyToHost waits for all earlier work and the transfer.
//  - Every CUDA and cuBLAS call is checked; an error names the op, the call
//    and the CUDA/cuBLAS error name and string. Asynchronous errors from
//    kernels surface at the next call that synchronizes.
//  - Precision "bf16": Gemm rounds A and B to bfloat16 (round to nearest
//    even, into cached scratch buffers) and calls cublasGemmEx with fp32
//    accumulation and an fp32 C. Everything else is fp32 either way.
//  - Thread-safe: every public method takes the backend's mutex (its
//    scratch buffers, staging buffers and cuBLAS handle are shared), and
//    makes the backend's device current on the calling thread.
#ifndef PSTRAIN_KERNELS_CUDA_BACKEND_H_
#define PSTRAIN_KERNELS_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace pstrain::kernels {

enum class Precision { kFp32, kBf16 };

// False when this build left the CUDA backend out (no toolkit at build
// time); every other function here then reports that.
bool CudaBackendCompiled();

// What asking the CUDA runtime for devices found, in plain values so that
// the classification below needs no CUDA headers and can be tested anywhere.
struct CudaProbe {
  bool compiled = false;  // this build has the CUDA backend
  int device_count = 0;
  int error = 0;  // cudaGetDeviceCount's cudaError_t (0: success)
  std::string error_name;
  std::string error_string;
  int driver_version = 0;   // cudaDriverGetVersion: 0 when no driver is there
  int runtime_version = 0;  // cudaRuntimeGetVersion, e.g. 13000
};

// The cudaError_t values ClassifyCudaProbe tells apart (stable ABI values).
inline constexpr int kCudaErrorInsufficientDriver = 35;
inline constexpr int kCudaErrorNoDevice = 100;

CudaProbe ProbeCuda();

// OK when at least one GPU is visible. NotFound when this machine simply has
// none: no NVIDIA driver installed, no device (or CUDA_VISIBLE_DEVICES hides
// them all), or a build without the CUDA backend; only this may make
// --device=auto fall back to the CPU. FailedPrecondition for anything else,
// above all a driver too old for this build's CUDA runtime: a GPU host that
// silently trained on the CPU would be a far worse surprise than an error.
// The message says what was found and what to do, in plain words.
absl::Status ClassifyCudaProbe(const CudaProbe& probe);

// The number of CUDA devices this process can see (CUDA_VISIBLE_DEVICES
// applies). When it is 0, *why_none (if not null) says why, in plain words
// (ClassifyCudaProbe's message): no GPU or driver on this machine, a driver
// too old, or no CUDA backend in this build.
int CudaDeviceCount(std::string* why_none = nullptr);

// One line for logs about device `ordinal`: name, memory, compute capability.
std::string DescribeCudaDevice(int ordinal);

// A backend on device `ordinal` (Unavailable when there is no such device or
// the kernels in this binary were not compiled for it).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal,
                                                           Precision precision);

// The cudaStream_t (as a void*, to keep CUDA types out of this header) that
// `backend` issues its work on, or nullptr when it is not a CUDA backend.
// For benchmarks timing ops with CUDA events, and for interop.
void* CudaStreamOf(Backend* backend);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CUDA_BACKEND_H_
