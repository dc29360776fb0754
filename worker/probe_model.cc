#include "absl/strings/str_cat.h"
#include "worker/model.h"

namespace pstrain {
namespace {

class ProbeModel : public Model {
 public:
  ProbeModel(kernels::Backend* backend, int64_t num_elements, bool check_pulls)
      : backend_(backend), check_pulls_(check_pulls) {
    DenseTensorSpec spec;
    spec.set_name("probe/w");
    spec.add_shape(num_elements);
    spec.mutable_init()->set_kind(InitSpec::ZEROS);
    params_.push_back(spec);
  }

  const std::vector<DenseTensorSpec>& Params() const override {
    return params_;
  }

  absl::StatusOr<BatchResult> ComputeGradientsImpl(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads,
      const GradientReadyCallback& /*gradient_ready*/) override {
    if (params.size() != 1 || grads.size() != 1) {
      return absl::InvalidArgumentError("the probe model has one tensor");
    }
    if (check_pulls_) {
      const float* w = params[0];
      for (int64_t i = 1; i < params_[0].shape(0); ++i) {
        if (w[i] != w[0]) {
          return absl::DataLossError(
              absl::StrCat("probe: the values pulled differ: element ", i,
                           " is ", w[i], ", element 0 is ", w[0],
                           " (a block read at another step than the others)"));
        }
      }
    }
    if (absl::Status s = backend_->Fill(params_[0].shape(0), 1.0f, grads[0]);
        !s.ok()) {
      return s;
    }
    return BatchResult{0.0, 0, batch.rows};
  }

  absl::StatusOr<BatchResult> Evaluate(const std::vector<const float*>&,
                                       const DeviceBatch& batch) override {
    return BatchResult{0.0, 0, batch.rows};
  }

 private:
  kernels::Backend* backend_;
  const bool check_pulls_;
  std::vector<DenseTensorSpec> params_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreateProbeModel(
    kernels::Backend* backend, int64_t num_elements, bool check_pulls) {
  if (num_elements < 1 || num_elements > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "probe model size must be in [1, 2^30], got ", num_elements));
  }
  if (check_pulls && !backend->MemoryIsHost()) {
    return absl::InvalidArgumentError(
        "--probe_check_pulls reads the values on the host: use --device=cpu");
  }
  return std::unique_ptr<Model>(
      new ProbeModel(backend, num_elements, check_pulls));
}

}  // namespace pstrain
