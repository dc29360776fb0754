// kernel_bench: the CUDA backend's ops, one by one, against the device's own
// ceilings measured in the same run.
//
//   bazel run -c opt //bench:kernel_bench -- [--device=cuda:0] [--min_ms=50]
//
// For every op and size it prints the time per call (CUDA events around a
// batch of calls on the backend's stream, after warm-up) and either the
// achieved bandwidth (memory-bound ops: the bytes the op must move at the
// least, divided by the time) as a ratio to the device-to-device cudaMemcpy
// bandwidth, or the achieved TFLOP/s (GEMMs) as a ratio to cuBLAS's own
// SGEMM (fp32) or bf16 GemmEx rate on large square matrices. Absolute
// numbers drift on shared machines; the ratios are what to compare.
//
// Output: a table, then one JSON line per row ({"bench":"kernel",...}).
// Without a GPU (or without the CUDA backend in the build) it says so and
// exits 0.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

#ifdef PSTRAIN_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

ABSL_FLAG(std::string, device, "cuda:0", "The GPU to measure (cuda:N).");
ABSL_FLAG(double, min_ms, 50,
          "Each measurement runs the op for at least this long (after "
          "warm-up).");
ABSL_FLAG(int, warmup, 3, "Untimed calls before each measurement.");
ABSL_FLAG(bool, quick, false,
          "Only the smaller sizes (a smoke run, seconds instead of minutes).");

namespace pstrain {
namespace {

#ifdef PSTRAIN_HAVE_CUDA

using kernels::Backend;
using kernels::BackendOptions;
using kernels::DeviceArray;

// Benchmarks stop at the first error: a number measured after one would
// be meaningless.
void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) {
    std::fprintf(stderr, "kernel_bench: %s: %s\n", what.c_str(),
                 status.ToString().c_str());
    std::exit(1);
  }
}

void CheckCuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "kernel_bench: %s: %s (%s)\n", what,
                 cudaGetErrorName(error), cudaGetErrorString(error));
    std::exit(1);
  }
}

void CheckCublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "kernel_bench: %s: %s\n", what,
                 cublasGetStatusName(status));
    std::exit(1);
  }
}

DeviceArray<float> Array(Backend* backend, size_t n, float fill) {
  absl::StatusOr<DeviceArray<float>> array =
      DeviceArray<float>::Create(backend, n);
  Check(array.status(), absl::StrCat("allocating ", n, " floats"));
  Check(backend->Fill(n, fill, array->data()), "Fill");
  return *std::move(array);
}

template <typename T>
DeviceArray<T> Upload(Backend* backend, const std::vector<T>& host) {
  absl::StatusOr<DeviceArray<T>> array =
      DeviceArray<T>::Create(backend, host.size());
  Check(array.status(), "allocating");
  Check(backend->CopyToDevice(host.data(), array->data(), array->bytes()),
        "CopyToDevice");
  return *std::move(array);
}

// Seconds per call of `op`, which enqueues work on `stream`: warm-up, then
// one timed call to size the batch, then a batch lasting >= --min_ms, timed
// by events recorded on the stream around it.
double TimePerCall(cudaStream_t stream, const std::function<void()>& op) {
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) op();
  CheckCuda(cudaStreamSynchronize(stream), "warm-up");
  cudaEvent_t start, stop;
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  auto timed = [&](int64_t calls) {
    CheckCuda(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int64_t i = 0; i < calls; ++i) op();
    CheckCuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return static_cast<double>(ms);
  };
  const double one_ms = std::max(timed(1), 1e-3);
  const int64_t calls = std::clamp<int64_t>(
      static_cast<int64_t>(absl::GetFlag(FLAGS_min_ms) / one_ms) + 1, 5,
      100000);
  const double seconds = timed(calls) / 1e3 / calls;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return seconds;
}

// Makes work issued on `consumer` from now on wait for all work issued on
// `producer` so far (without blocking the host). Needed whenever memory
// from one backend's pool is used on another backend's stream: each
// backend orders only its own stream.
void StreamWaitsFor(cudaStream_t consumer, cudaStream_t producer) {
  cudaEvent_t ready;
  CheckCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming),
            "cudaEventCreateWithFlags");
  CheckCuda(cudaEventRecord(ready, producer), "cudaEventRecord");
  CheckCuda(cudaStreamWaitEvent(consumer, ready, 0), "cudaStreamWaitEvent");
  // Destroying a recorded event is fine: the wait keeps what it needs.
  CheckCuda(cudaEventDestroy(ready), "cudaEventDestroy");
}

struct Row {
  Row(std::string op_name, std::string shape_text)
      : op(std::move(op_name)), shape(std::move(shape_text)) {}

  std::string op;
  std::string shape;
  double seconds = 0;
  double bytes = 0;     // for memory-bound ops
  double flops = 0;     // for GEMMs
  double baseline = 0;  // GB/s or TFLOP/s this row is compared with
  std::string baseline_name;
};

class Bench {
 public:
  explicit Bench(std::string device_name)
      : device_name_(std::move(device_name)) {}

  void Add(Row row) {
    PrintRow(row);
    rows_.push_back(std::move(row));
  }

  void PrintHeader() const {
    std::printf("%-30s %-26s %12s %14s %9s  %s\n", "op", "shape", "time/call",
                "achieved", "ratio", "(to)");
  }

  void PrintRow(const Row& row) const {
    const bool gemm = row.flops > 0;
    const double rate =
        gemm ? row.flops / row.seconds / 1e12 : row.bytes / row.seconds / 1e9;
    std::printf("%-30s %-26s %9.2f us %9.2f %s %9.3f  (%s)\n", row.op.c_str(),
                row.shape.c_str(), row.seconds * 1e6, rate,
                gemm ? "TF/s" : "GB/s",
                row.baseline > 0 ? rate / row.baseline : 1.0,
                row.baseline_name.c_str());
    std::fflush(stdout);
  }

  void PrintJson() const {
    for (const Row& row : rows_) {
      const bool gemm = row.flops > 0;
      const double rate =
          gemm ? row.flops / row.seconds / 1e12 : row.bytes / row.seconds / 1e9;
      std::printf(
          "{\"bench\":\"kernel\",\"device\":\"%s\",\"op\":\"%s\","
          "\"shape\":\"%s\",\"time_us\":%.3f,\"%s\":%.4f,\"ratio_to_%s\":%.4f,"
          "\"baseline_%s\":%.4f}\n",
          device_name_.c_str(), row.op.c_str(), row.shape.c_str(),
          row.seconds * 1e6, gemm ? "tflops" : "gbps", rate,
          row.baseline_name.c_str(),
          row.baseline > 0 ? rate / row.baseline : 1.0,
          gemm ? "tflops" : "gbps", row.baseline);
    }
  }

 private:
  std::string device_name_;
  std::vector<Row> rows_;
};

// The fp32 backend under test and a bf16 one on the same device, with their
// streams: the events that time an op must be recorded on the stream the
// op's backend enqueues on.
struct Backends {
  std::unique_ptr<Backend> fp32;
  std::unique_ptr<Backend> bf16;
  cudaStream_t stream = nullptr;    // fp32's
  cudaStream_t stream16 = nullptr;  // bf16's
};

// False (after saying so) when --device names a backend that is not CUDA:
// there is no stream to time it on.
bool CreateBackends(Backends* out) {
  BackendOptions options;
  options.device = absl::GetFlag(FLAGS_device);
  absl::StatusOr<std::unique_ptr<Backend>> created =
      kernels::CreateBackend(options);
  Check(created.status(), "creating the fp32 backend");
  out->fp32 = *std::move(created);
  options.precision = "bf16";
  created = kernels::CreateBackend(options);
  Check(created.status(), "creating the bf16 backend");
  out->bf16 = *std::move(created);
  out->stream =
      static_cast<cudaStream_t>(kernels::CudaStreamOf(out->fp32.get()));
  out->stream16 =
      static_cast<cudaStream_t>(kernels::CudaStreamOf(out->bf16.get()));
  if (out->stream == nullptr || out->stream16 == nullptr) {
    std::fprintf(stderr, "kernel_bench: %s is not a CUDA backend\n",
                 out->fp32->Name().c_str());
    return false;
  }
  return true;
}

// Device-to-device copy: every byte read once and written once. Measured
// before any op, in this run, so the memory-bound ratios do not depend on
// a datasheet or on another day's machine state.
Row MeasureCopyBaseline(Backend* gpu, cudaStream_t stream, bool quick) {
  const size_t copy_bytes = (quick ? size_t{64} : size_t{512}) << 20;
  DeviceArray<float> copy_src = Array(gpu, copy_bytes / 4, 1.0f);
  DeviceArray<float> copy_dst = Array(gpu, copy_bytes / 4, 0.0f);
  Row d2d{"cudaMemcpy D2D (baseline)", absl::StrCat(copy_bytes >> 20, " MiB")};
  d2d.seconds = TimePerCall(stream, [&] {
    CheckCuda(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), copy_bytes,
                              cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync");
  });
  d2d.bytes = 2.0 * copy_bytes;
  d2d.baseline = d2d.bytes / d2d.seconds / 1e9;
  d2d.baseline_name = "d2d";
  return d2d;
}

struct GemmBaselines {
  Row sgemm;
  Row bgemm;
};

// cuBLAS on large square matrices, straight (no conversion, no backend):
// the rate the backend's GEMMs could reach at best on this device.
GemmBaselines MeasureGemmBaselines(Backend* gpu, cudaStream_t stream,
                                   bool quick) {
  const int64_t square = quick ? 2048 : 8192;
  cublasHandle_t cublas;
  CheckCublas(cublasCreate(&cublas), "cublasCreate");
  CheckCublas(cublasSetStream(cublas, stream), "cublasSetStream");
  DeviceArray<float> sa = Array(gpu, square * square, 0.5f);
  DeviceArray<float> sb = Array(gpu, square * square, 0.25f);
  DeviceArray<float> sc = Array(gpu, square * square, 0.0f);
  const float one = 1.0f, zero = 0.0f;
  const int sq = static_cast<int>(square);
  Row sgemm{"cublasSgemm (baseline)", absl::StrCat(square, "^3")};
  sgemm.flops = 2.0 * square * square * square;
  sgemm.seconds = TimePerCall(stream, [&] {
    CheckCublas(cublasSgemm(cublas, CUBLAS_OP_N, CUBLAS_OP_N, sq, sq, sq, &one,
                            sa.data(), sq, sb.data(), sq, &zero, sc.data(), sq),
                "cublasSgemm");
  });
  sgemm.baseline = sgemm.flops / sgemm.seconds / 1e12;
  sgemm.baseline_name = "sgemm";
  // bf16 inputs (bit patterns of 0.5/0.25 are irrelevant to speed; the
  // fp32 arrays are reused as storage), fp32 accumulation and output.
  Row bgemm{"cublasGemmEx bf16 (baseline)", absl::StrCat(square, "^3")};
  bgemm.flops = sgemm.flops;
  bgemm.seconds = TimePerCall(stream, [&] {
    CheckCublas(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, sq, sq, sq, &one,
                             sa.data(), CUDA_R_16BF, sq, sb.data(), CUDA_R_16BF,
                             sq, &zero, sc.data(), CUDA_R_32F, sq,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx");
  });
  bgemm.baseline = bgemm.flops / bgemm.seconds / 1e12;
  bgemm.baseline_name = "bf16_gemm";
  CheckCublas(cublasDestroy(cublas), "cublasDestroy");
  return {std::move(sgemm), std::move(bgemm)};
}

// Adds the rows of memory-bound ops, which are all compared with the one
// copy bandwidth measured in this run.
class MemoryRows {
 public:
  MemoryRows(Bench* bench, double d2d_gbps)
      : bench_(bench), d2d_gbps_(d2d_gbps) {}

  void Add(const std::string& op, const std::string& shape, double bytes,
           cudaStream_t stream, const std::function<void()>& run) const {
    Row row{op, shape};
    row.seconds = TimePerCall(stream, run);
    row.bytes = bytes;
    row.baseline = d2d_gbps_;
    row.baseline_name = "d2d";
    bench_->Add(row);
  }

 private:
  Bench* bench_;
  double d2d_gbps_;
};

// Elementwise: bytes are the reads and writes each element needs.
void MeasureElementwise(Backend* gpu, cudaStream_t stream, bool quick,
                        const MemoryRows& memory) {
  std::vector<int64_t> sizes = {1 << 16, 1 << 20, 1 << 24};
  if (!quick) sizes.push_back(1 << 26);
  for (int64_t n : sizes) {
    const std::string shape = absl::StrCat("n=", n);
    DeviceArray<float> x = Array(gpu, n, 0.5f);
    DeviceArray<float> y = Array(gpu, n, -0.25f);
    DeviceArray<float> z = Array(gpu, n, 0.0f);
    const double f = sizeof(float);
    memory.Add("Fill", shape, f * n, stream,
               [&] { Check(gpu->Fill(n, 1.0f, z.data()), "Fill"); });
    memory.Add("Scale", shape, 2 * f * n, stream,
               [&] { Check(gpu->Scale(n, 1.0f, z.data()), "Scale"); });
    memory.Add("Axpy", shape, 3 * f * n, stream,
               [&] { Check(gpu->Axpy(n, 1e-6f, x.data(), y.data()), "Axpy"); });
    memory.Add("Relu", shape, 2 * f * n, stream,
               [&] { Check(gpu->Relu(n, y.data(), z.data()), "Relu"); });
    memory.Add("ReluGrad", shape, 3 * f * n, stream, [&] {
      Check(gpu->ReluGrad(n, y.data(), x.data(), z.data()), "ReluGrad");
    });
  }
}

// Row-wise ops on [rows, cols] activations.
void MeasureRowwise(Backend* gpu, cudaStream_t stream, bool quick,
                    const MemoryRows& memory) {
  std::vector<std::pair<int64_t, int64_t>> shapes = {
      {256, 1024}, {4096, 1024}, {65536, 16}};
  if (!quick) shapes.push_back({65536, 1024});
  for (const auto& [rows, cols] : shapes) {
    const std::string shape = absl::StrCat(rows, "x", cols);
    const double f = sizeof(float);
    DeviceArray<float> y = Array(gpu, rows * cols, 0.5f);
    DeviceArray<float> bias = Array(gpu, cols, 0.0f);
    memory.Add("AddBias", shape, f * (2.0 * rows * cols + cols), stream, [&] {
      Check(gpu->AddBias(rows, cols, bias.data(), y.data()), "AddBias");
    });
    memory.Add("BiasGrad", shape, f * (1.0 * rows * cols + cols), stream, [&] {
      Check(gpu->BiasGrad(rows, cols, y.data(), bias.data()), "BiasGrad");
    });
  }
}

// Softmax cross-entropy: includes its one device->host sync, which is part
// of what a training step pays for it.
void MeasureSoftmaxCrossEntropy(Backend* gpu, cudaStream_t stream, bool quick,
                                const MemoryRows& memory) {
  std::vector<std::pair<int64_t, int64_t>> ce_shapes = {
      {256, 10}, {4096, 1000}, {65536, 16}};
  if (!quick) ce_shapes.push_back({512, 32000});
  for (const auto& [rows, cols] : ce_shapes) {
    const std::string shape = absl::StrCat(rows, "x", cols);
    DeviceArray<float> logits = Array(gpu, rows * cols, 0.0f);
    DeviceArray<float> grad = Array(gpu, rows * cols, 0.0f);
    std::vector<int32_t> host_labels(rows);
    for (int64_t r = 0; r < rows; ++r) host_labels[r] = r % cols;
    DeviceArray<int32_t> labels = Upload(gpu, host_labels);
    double loss;
    int64_t correct;
    // Logits read, gradient written.
    memory.Add("SoftmaxCrossEntropy fwd+bwd", shape,
               2.0 * sizeof(float) * rows * cols, stream, [&] {
                 Check(gpu->SoftmaxCrossEntropy(rows, cols, logits.data(),
                                                labels.data(), 1.0f,
                                                grad.data(), &loss, &correct),
                       "SoftmaxCrossEntropy");
               });
    memory.Add("SoftmaxCrossEntropy fwd", shape,
               1.0 * sizeof(float) * rows * cols, stream, [&] {
                 Check(gpu->SoftmaxCrossEntropy(rows, cols, logits.data(),
                                                labels.data(), 1.0f, nullptr,
                                                &loss, &correct),
                       "SoftmaxCrossEntropy");
               });
  }
}

// Embeddings: rows read/written plus the indices.
void MeasureEmbeddings(Backend* gpu, cudaStream_t stream, bool quick,
                       const MemoryRows& memory) {
  const int64_t table_rows = quick ? 100000 : 1000000, dim = 128;
  const int64_t n = 65536;
  DeviceArray<float> table = Array(gpu, table_rows * dim, 0.0f);
  DeviceArray<float> rows = Array(gpu, n * dim, 1.0f);
  std::vector<int64_t> host_indices(n);
  for (int64_t i = 0; i < n; ++i) {
    host_indices[i] = (i * 7919) % table_rows;  // spread, no repeats
  }
  DeviceArray<int64_t> indices = Upload(gpu, host_indices);
  const std::string shape = absl::StrCat(n, " of ", table_rows, "x", dim);
  const double row_bytes = sizeof(float) * static_cast<double>(n) * dim;
  memory.Add("Gather", shape, 2 * row_bytes + 8.0 * n, stream, [&] {
    Check(gpu->Gather(n, dim, table_rows, table.data(), indices.data(),
                      rows.data()),
          "Gather");
  });
  memory.Add("ScatterAdd", shape, 3 * row_bytes + 8.0 * n, stream, [&] {
    Check(gpu->ScatterAdd(n, dim, table_rows, rows.data(), indices.data(),
                          table.data()),
          "ScatterAdd");
  });
  Check(gpu->Synchronize(), "Synchronize");
}

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k;
};

// GEMMs through the backend, fp32 and bf16 on the same operands: forward
// (NN) and the two backward shapes (TN for weights, NT for inputs) of MLP
// layers, and squares.
void MeasureGemms(const Backends& gpus, bool quick,
                  const GemmBaselines& baselines, Bench* bench) {
  std::vector<GemmCase> gemms = {
      {false, false, 256, 1024, 1024},
      {true, false, 1024, 1024, 256},
      {false, true, 256, 1024, 1024},
      {false, false, 4096, 4096, 4096},
  };
  if (!quick) gemms.push_back({false, false, 8192, 8192, 8192});
  Backend* const gpu = gpus.fp32.get();
  Backend* const gpu16 = gpus.bf16.get();
  for (const GemmCase& g : gemms) {
    const std::string shape = absl::StrCat(g.ta ? "T" : "N", g.tb ? "T" : "N",
                                           " ", g.m, "x", g.n, "x", g.k);
    DeviceArray<float> a = Array(gpu, g.m * g.k, 0.5f);
    DeviceArray<float> b = Array(gpu, g.k * g.n, 0.25f);
    DeviceArray<float> c = Array(gpu, g.m * g.n, 0.0f);
    for (Backend* backend : {gpu, gpu16}) {
      const bool bf16 = backend == gpu16;
      // a, b and c come from the fp32 backend's pool and were filled on its
      // stream; the bf16 backend's stream must not start on them earlier.
      if (bf16) StreamWaitsFor(gpus.stream16, gpus.stream);
      Row row{bf16 ? "Gemm bf16 (incl. conversion)" : "Gemm fp32", shape};
      row.flops = 2.0 * g.m * g.n * g.k;
      row.seconds = TimePerCall(bf16 ? gpus.stream16 : gpus.stream, [&] {
        Check(backend->Gemm(g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.data(), b.data(),
                            0.0f, c.data()),
              "Gemm");
      });
      row.baseline = bf16 ? baselines.bgemm.baseline : baselines.sgemm.baseline;
      row.baseline_name = bf16 ? "bf16_gemm" : "sgemm";
      bench->Add(row);
    }
    // The arrays go back to the fp32 pool at the end of this iteration,
    // where the next shape's Fill on the fp32 stream may reuse them: that
    // stream must first wait for the bf16 GEMMs still reading them.
    StreamWaitsFor(gpus.stream, gpus.stream16);
  }
}

int Run() {
  Backends gpus;
  if (!CreateBackends(&gpus)) return 1;
  int ordinal = 0;
  CheckCuda(cudaGetDevice(&ordinal), "cudaGetDevice");
  const std::string device_name = gpus.fp32->Name();
  std::printf("kernel_bench on %s\n",
              kernels::DescribeCudaDevice(ordinal).c_str());
  const bool quick = absl::GetFlag(FLAGS_quick);
  Bench bench(device_name);

  // The baselines are all measured before the table starts, since every
  // row after them is printed as a ratio to one of them.
  const Row d2d = MeasureCopyBaseline(gpus.fp32.get(), gpus.stream, quick);
  const GemmBaselines gemm =
      MeasureGemmBaselines(gpus.fp32.get(), gpus.stream, quick);
  bench.PrintHeader();
  bench.Add(d2d);
  bench.Add(gemm.sgemm);
  bench.Add(gemm.bgemm);

  const MemoryRows memory(&bench, d2d.baseline);
  MeasureElementwise(gpus.fp32.get(), gpus.stream, quick, memory);
  MeasureRowwise(gpus.fp32.get(), gpus.stream, quick, memory);
  MeasureSoftmaxCrossEntropy(gpus.fp32.get(), gpus.stream, quick, memory);
  MeasureEmbeddings(gpus.fp32.get(), gpus.stream, quick, memory);
  MeasureGemms(gpus, quick, gemm, &bench);

  std::printf("\n");
  bench.PrintJson();
  return 0;
}

#endif  // PSTRAIN_HAVE_CUDA

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times every CUDA backend op against the device's measured copy "
      "bandwidth and cuBLAS GEMM rate.");
  absl::ParseCommandLine(argc, argv);
  // No GPU here: nothing to measure, and not an error. A GPU that cannot be
  // used (a driver too old) is one.
  const absl::Status gpu =
      pstrain::kernels::ClassifyCudaProbe(pstrain::kernels::ProbeCuda());
  if (absl::IsNotFound(gpu)) {
    std::printf("kernel_bench: %s; nothing to measure.\n",
                std::string(gpu.message()).c_str());
    return 0;
  }
  if (!gpu.ok()) {
    std::fprintf(stderr, "kernel_bench: %s\n",
                 std::string(gpu.message()).c_str());
    return 1;
  }
#ifdef PSTRAIN_HAVE_CUDA
  return pstrain::Run();
#else
  std::printf(
      "kernel_bench: built without CUDA headers; nothing to measure.\n");
  return 0;
#endif
}
