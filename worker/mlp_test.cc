#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "proto/ps.pb.h"
#include "worker/model.h"
#include "worker/model_testing.h"

namespace pstrain {
namespace {

using kernels::Backend;
using kernels::DeviceArray;
using model_testing::CpuBackend;
using model_testing::Download;
using model_testing::ExpectGradientsMatchFiniteDifferences;
using model_testing::HostBatch;
using model_testing::RandomBatch;
using model_testing::Tensors;
using model_testing::Upload;
using ::testing::HasSubstr;

struct GradCheckConfig {
  std::string name;
  int64_t input_dim;
  std::vector<int64_t> hidden;
  int64_t classes;
  int64_t rows;
};

// Names the case in failure messages instead of dumping its bytes.
void PrintTo(const GradCheckConfig& config, std::ostream* os) {
  *os << config.name;
}

class GradientCheckTest : public ::testing::TestWithParam<GradCheckConfig> {};

TEST_P(GradientCheckTest, MatchesFiniteDifferences) {
  const GradCheckConfig& config = GetParam();
  std::unique_ptr<Backend> backend = CpuBackend();
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreateMlp(backend.get(), config.input_dim, config.hidden, config.classes,
                /*max_batch=*/8);
  ASSERT_TRUE(model.ok()) << model.status();
  std::mt19937 rng(16);
  ExpectGradientsMatchFiniteDifferences(
      backend.get(), **model,
      RandomBatch(config.rows, config.input_dim, config.classes, &rng));
}

INSTANTIATE_TEST_SUITE_P(
    Models, GradientCheckTest,
    ::testing::Values(GradCheckConfig{"SoftmaxRegression", 5, {}, 3, 4},
                      GradCheckConfig{"Mlp", 5, {4, 3}, 3, 4},
                      GradCheckConfig{"MlpPartialBatch", 3, {6}, 4, 7}),
    [](const ::testing::TestParamInfo<GradCheckConfig>& info) {
      return info.param.name;
    });

TEST(MlpTest, ParamsNamesShapesAndInit) {
  std::unique_ptr<Backend> backend = CpuBackend();
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreateMlp(backend.get(), 5, {4, 3}, 2, 16);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<DenseTensorSpec>& params = (*model)->Params();
  ASSERT_EQ(params.size(), 6u);
  const std::vector<std::vector<int64_t>> dims = {{5, 4}, {4, 3}, {3, 2}};
  for (int l = 0; l < 3; ++l) {
    const DenseTensorSpec& weight = params[2 * l];
    const DenseTensorSpec& bias = params[2 * l + 1];
    const int64_t in = dims[l][0], out = dims[l][1];
    EXPECT_EQ(weight.name(), "fc" + std::to_string(l) + "/weight");
    EXPECT_THAT(weight.shape(), ::testing::ElementsAre(in, out));
    EXPECT_EQ(weight.init().kind(), InitSpec::UNIFORM);
    EXPECT_FLOAT_EQ(weight.init().scale(), std::sqrt(6.0f / (in + out)));
    EXPECT_EQ(bias.name(), "fc" + std::to_string(l) + "/bias");
    EXPECT_THAT(bias.shape(), ::testing::ElementsAre(out));
    EXPECT_EQ(bias.init().kind(), InitSpec::ZEROS);
  }
}

TEST(MlpTest, SoftmaxRegressionHasOneLayer) {
  std::unique_ptr<Backend> backend = CpuBackend();
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreateMlp(backend.get(), 7, {}, 10, 4);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->Params().size(), 2u);
  EXPECT_EQ((*model)->Params()[0].name(), "fc0/weight");
  EXPECT_THAT((*model)->Params()[0].shape(), ::testing::ElementsAre(7, 10));
  EXPECT_EQ((*model)->Params()[1].name(), "fc0/bias");
}

TEST(MlpTest, CreateRejectsBadArguments) {
  std::unique_ptr<Backend> backend = CpuBackend();
  EXPECT_EQ(CreateMlp(nullptr, 5, {}, 3, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateMlp(backend.get(), 0, {}, 3, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateMlp(backend.get(), 5, {4, 0}, 3, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateMlp(backend.get(), 5, {}, 0, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateMlp(backend.get(), 5, {}, 3, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

class MlpBatchTest : public ::testing::Test {
 protected:
  static constexpr int64_t kMaxBatch = 6;
  void SetUp() override {
    backend_ = CpuBackend();
    absl::StatusOr<std::unique_ptr<Model>> model =
        CreateMlp(backend_.get(), 5, {4, 3}, 3, kMaxBatch);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    tensors_ = std::make_unique<Tensors>(backend_.get(), *model_);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (size_t i = 0; i < tensors_->size(); ++i) {
      for (float& x : tensors_->host(i)) x = uniform(rng);
    }
    tensors_->SyncAll();
    host_batch_ = RandomBatch(kMaxBatch + 1, 5, 3, &rng);
    features_ = Upload(backend_.get(), host_batch_.features);
    labels_ = Upload(backend_.get(), host_batch_.labels);
  }
  DeviceBatch Batch(int64_t rows) const {
    return {rows, features_.data(), labels_.data()};
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tensors> tensors_;
  HostBatch host_batch_;
  DeviceArray<float> features_;
  DeviceArray<int32_t> labels_;
};

TEST_F(MlpBatchTest, EvaluateMatchesComputeGradients) {
  for (int64_t rows : {int64_t{1}, int64_t{3}, kMaxBatch}) {
    absl::StatusOr<BatchResult> train = model_->ComputeGradients(
        tensors_->params(), Batch(rows), tensors_->grads());
    ASSERT_TRUE(train.ok()) << train.status();
    absl::StatusOr<BatchResult> eval =
        model_->Evaluate(tensors_->params(), Batch(rows));
    ASSERT_TRUE(eval.ok()) << eval.status();
    EXPECT_EQ(train->rows, rows);
    EXPECT_EQ(eval->rows, rows);
    EXPECT_GT(eval->loss_sum, 0);
    EXPECT_DOUBLE_EQ(eval->loss_sum, train->loss_sum) << rows;
    EXPECT_EQ(eval->num_correct, train->num_correct) << rows;
  }
}

// The logits against a plain host forward pass of the 5-4-3-3 MLP.
TEST_F(MlpBatchTest, LogitsMatchAHostForwardPass) {
  const int64_t rows = 4;
  absl::StatusOr<std::vector<float>> logits =
      model_->Logits(tensors_->params(), {rows, features_.data(), nullptr});
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(logits->size(), rows * 3);
  const std::vector<int64_t> dims = {5, 4, 3, 3};
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> x(host_batch_.features.begin() + r * 5,
                          host_batch_.features.begin() + (r + 1) * 5);
    for (size_t l = 0; l + 1 < dims.size(); ++l) {
      const std::vector<float>& w = tensors_->host(2 * l);
      const std::vector<float>& b = tensors_->host(2 * l + 1);
      std::vector<double> y(dims[l + 1]);
      for (int64_t j = 0; j < dims[l + 1]; ++j) {
        y[j] = b[j];
        for (int64_t i = 0; i < dims[l]; ++i)
          y[j] += x[i] * w[i * dims[l + 1] + j];
        if (l + 2 < dims.size()) y[j] = std::max(y[j], 0.0);
      }
      x = std::move(y);
    }
    for (int64_t c = 0; c < 3; ++c) {
      EXPECT_NEAR((*logits)[r * 3 + c], x[c], 1e-5) << "row " << r;
    }
  }
}

TEST_F(MlpBatchTest, GradientsAreOverwrittenAndRepeatable) {
  absl::StatusOr<BatchResult> first = model_->ComputeGradients(
      tensors_->params(), Batch(kMaxBatch), tensors_->grads());
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<std::vector<float>> before;
  for (size_t i = 0; i < tensors_->size(); ++i) {
    before.push_back(tensors_->grad(i));
  }
  // Poison the gradients: a second call must overwrite, not accumulate.
  for (size_t i = 0; i < tensors_->size(); ++i) {
    const DeviceArray<float>& g = tensors_->device_grad(i);
    ASSERT_TRUE(backend_->Fill(g.size(), 1e6f, g.data()).ok());
  }
  absl::StatusOr<BatchResult> second = model_->ComputeGradients(
      tensors_->params(), Batch(kMaxBatch), tensors_->grads());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->loss_sum, first->loss_sum);
  for (size_t i = 0; i < tensors_->size(); ++i) {
    EXPECT_EQ(tensors_->grad(i), before[i]) << i;
  }
}

TEST_F(MlpBatchTest, RejectsBadBatches) {
  for (int64_t rows : {int64_t{0}, int64_t{-1}, kMaxBatch + 1}) {
    absl::StatusOr<BatchResult> r = model_->ComputeGradients(
        tensors_->params(), Batch(rows), tensors_->grads());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << rows;
    EXPECT_EQ(model_->Evaluate(tensors_->params(), Batch(rows)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << rows;
  }
  DeviceBatch no_features = Batch(2);
  no_features.features = nullptr;
  EXPECT_EQ(model_->Evaluate(tensors_->params(), no_features).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(MlpBatchTest, RejectsWrongTensorCounts) {
  std::vector<const float*> params = tensors_->params();
  std::vector<float*> grads = tensors_->grads();
  params.pop_back();
  EXPECT_EQ(model_->ComputeGradients(params, Batch(2), grads).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model_->Evaluate(params, Batch(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  grads.pop_back();
  absl::StatusOr<BatchResult> r =
      model_->ComputeGradients(tensors_->params(), Batch(2), grads);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("gradient"));
  grads = tensors_->grads();
  grads[1] = nullptr;
  EXPECT_EQ(model_->ComputeGradients(tensors_->params(), Batch(2), grads)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(MlpBatchTest, BadLabelIsAnError) {
  DeviceArray<int32_t> bad = Upload(backend_.get(), std::vector<int32_t>{0, 3});
  const DeviceBatch batch{2, features_.data(), bad.data()};
  EXPECT_EQ(model_->Evaluate(tensors_->params(), batch).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Forwards to a CPU backend, counting allocations.
class CountingBackend : public Backend {
 public:
  CountingBackend() : inner_(CpuBackend()) {}
  int allocations() const { return allocations_; }

  std::string Name() const override { return inner_->Name(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    ++allocations_;
    return inner_->Allocate(bytes);
  }
  void Free(void* ptr) override { inner_->Free(ptr); }
  absl::Status CopyToDevice(const void* host, void* device,
                            size_t bytes) override {
    return inner_->CopyToDevice(host, device, bytes);
  }
  absl::Status CopyToHost(const void* device, void* host,
                          size_t bytes) override {
    return inner_->CopyToHost(device, host, bytes);
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  absl::Status FloatToBf16(int64_t n, const float* x, uint16_t* y) override {
    return inner_->FloatToBf16(n, x, y);
  }
  absl::Status Bf16ToFloat(int64_t n, const uint16_t* x, float* y) override {
    return inner_->Bf16ToFloat(n, x, y);
  }
  absl::Status FloatToFp16(int64_t n, const float* x, uint16_t* y) override {
    return inner_->FloatToFp16(n, x, y);
  }
  absl::Status Fp16ToFloat(int64_t n, const uint16_t* x, float* y) override {
    return inner_->Fp16ToFloat(n, x, y);
  }
  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    float alpha, const float* a, const float* b, float beta,
                    float* c) override {
    return inner_->Gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c);
  }
  absl::Status AddBias(int64_t rows, int64_t cols, const float* bias,
                       float* y) override {
    return inner_->AddBias(rows, cols, bias, y);
  }
  absl::Status BiasGrad(int64_t rows, int64_t cols, const float* dy,
                        float* bias_grad) override {
    return inner_->BiasGrad(rows, cols, dy, bias_grad);
  }
  absl::Status Relu(int64_t n, const float* x, float* y) override {
    return inner_->Relu(n, x, y);
  }
  absl::Status ReluGrad(int64_t n, const float* y, const float* dy,
                        float* dx) override {
    return inner_->ReluGrad(n, y, dy, dx);
  }
  absl::Status SoftmaxCrossEntropy(int64_t rows, int64_t cols,
                                   const float* logits, const int32_t* labels,
                                   float grad_scale, float* dlogits,
                                   double* loss_sum,
                                   int64_t* num_correct) override {
    return inner_->SoftmaxCrossEntropy(rows, cols, logits, labels, grad_scale,
                                       dlogits, loss_sum, num_correct);
  }
  absl::Status Axpy(int64_t n, float alpha, const float* x, float* y) override {
    return inner_->Axpy(n, alpha, x, y);
  }
  absl::Status Scale(int64_t n, float alpha, float* x) override {
    return inner_->Scale(n, alpha, x);
  }
  absl::Status Fill(int64_t n, float value, float* x) override {
    return inner_->Fill(n, value, x);
  }
  absl::Status Gather(int64_t num_indices, int64_t dim, int64_t table_rows,
                      const float* table, const int64_t* indices,
                      float* out) override {
    return inner_->Gather(num_indices, dim, table_rows, table, indices, out);
  }
  absl::Status ScatterAdd(int64_t num_indices, int64_t dim, int64_t table_rows,
                          const float* grads, const int64_t* indices,
                          float* table) override {
    return inner_->ScatterAdd(num_indices, dim, table_rows, grads, indices,
                              table);
  }
  absl::Status Im2Col(const kernels::Window2D& w, const float* x,
                      float* col) override {
    return inner_->Im2Col(w, x, col);
  }
  absl::Status Col2Im(const kernels::Window2D& w, const float* col,
                      float* x) override {
    return inner_->Col2Im(w, col, x);
  }
  absl::Status MaxPool2D(const kernels::Window2D& w, const float* x, float* y,
                         int64_t* argmax) override {
    return inner_->MaxPool2D(w, x, y, argmax);
  }
  absl::Status MaxPool2DGrad(const kernels::Window2D& w, const float* dy,
                             const int64_t* argmax, float* dx) override {
    return inner_->MaxPool2DGrad(w, dy, argmax, dx);
  }

 private:
  std::unique_ptr<Backend> inner_;
  int allocations_ = 0;
};

TEST(MlpTest, NoAllocationPerCall) {
  CountingBackend backend;
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreateMlp(&backend, 5, {4, 3}, 3, 8);
  ASSERT_TRUE(model.ok()) << model.status();
  Tensors tensors(&backend, **model);
  std::mt19937 rng(3);
  const HostBatch host_batch = RandomBatch(8, 5, 3, &rng);
  DeviceArray<float> features = Upload(&backend, host_batch.features);
  DeviceArray<int32_t> labels = Upload(&backend, host_batch.labels);

  const int before = backend.allocations();
  for (int64_t rows : {int64_t{8}, int64_t{1}, int64_t{5}}) {
    const DeviceBatch batch{rows, features.data(), labels.data()};
    ASSERT_TRUE((*model)
                    ->ComputeGradients(tensors.params(), batch, tensors.grads())
                    .ok());
    ASSERT_TRUE((*model)->Evaluate(tensors.params(), batch).ok());
  }
  EXPECT_EQ(backend.allocations(), before);
}

// Three well-separated Gaussian blobs in 2-D; plain SGD must fit them.
void TrainOnBlobs(const std::vector<int64_t>& hidden) {
  constexpr int64_t kClasses = 3, kInput = 2, kRows = 90, kBatch = 30;
  constexpr float kLearningRate = 0.3f;
  constexpr int kEpochs = 30;
  const float centers[kClasses][kInput] = {
      {1.5f, 0}, {-0.75f, 1.3f}, {-0.75f, -1.3f}};

  std::mt19937 rng(1);
  std::normal_distribution<float> noise(0.0f, 0.4f);
  HostBatch data;
  for (int64_t r = 0; r < kRows; ++r) {
    const int32_t label = static_cast<int32_t>(r % kClasses);
    data.labels.push_back(label);
    for (int d = 0; d < kInput; ++d) {
      data.features.push_back(centers[label][d] + noise(rng));
    }
  }

  std::unique_ptr<Backend> backend = CpuBackend();
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreateMlp(backend.get(), kInput, hidden, kClasses, kBatch);
  ASSERT_TRUE(model.ok()) << model.status();
  Tensors tensors(backend.get(), **model);
  tensors.InitializeLikeServers(**model, rng);
  DeviceArray<float> features = Upload(backend.get(), data.features);
  DeviceArray<int32_t> labels = Upload(backend.get(), data.labels);

  auto full_pass = [&]() {
    BatchResult total;
    for (int64_t start = 0; start < kRows; start += kBatch) {
      const DeviceBatch batch{kBatch, features.data() + start * kInput,
                              labels.data() + start};
      absl::StatusOr<BatchResult> r =
          (*model)->Evaluate(tensors.params(), batch);
      EXPECT_TRUE(r.ok()) << r.status();
      total.loss_sum += r->loss_sum;
      total.num_correct += r->num_correct;
      total.rows += r->rows;
    }
    return total;
  };

  const BatchResult initial = full_pass();
  const double initial_loss = initial.loss_sum / initial.rows;
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    for (int64_t start = 0; start < kRows; start += kBatch) {
      const DeviceBatch batch{kBatch, features.data() + start * kInput,
                              labels.data() + start};
      ASSERT_TRUE(
          (*model)
              ->ComputeGradients(tensors.params(), batch, tensors.grads())
              .ok());
      for (size_t i = 0; i < tensors.size(); ++i) {
        const DeviceArray<float>& p = tensors.device_param(i);
        ASSERT_TRUE(backend
                        ->Axpy(p.size(), -kLearningRate,
                               tensors.device_grad(i).data(), p.data())
                        .ok());
      }
    }
  }
  const BatchResult final_result = full_pass();
  const double final_loss = final_result.loss_sum / final_result.rows;
  // With this seed the initial losses are about 1.2 and 0.9 and the final
  // ones about 0.05 and 0.01.
  EXPECT_GT(initial_loss, 0.8);
  EXPECT_LT(final_loss, 0.1);
  EXPECT_LT(final_loss, 0.1 * initial_loss);
  EXPECT_GE(final_result.num_correct, kRows - 2);
}

TEST(MlpTrainingTest, SoftmaxRegressionLearnsBlobs) { TrainOnBlobs({}); }

TEST(MlpTrainingTest, MlpLearnsBlobs) { TrainOnBlobs({8}); }

}  // namespace
}  // namespace pstrain
