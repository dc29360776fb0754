#include <algorithm>

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
      if (absl::Status s = CheckPulled(params[0]); !s.ok()) return s;
    }
    if (absl::Status s = backend_->Fill(params_[0].shape(0), 1.0f, grads[0]);
        !s.ok()) {
      return s;
    }
    return BatchResult{0.0, 0, batch.rows};
  }

  // The step a block at a time, as the layer models' first layer: each
  // block's values are read as they arrive and its gradient leaves as soon
  // as it is written, so the fault trials exercise the pipelined step with
  // the probe's exactly-once check (on a device too, whose hooks copy each
  // range in and out). The values are checked once the step
  // goes on to its gradient (before_backward): a read found mixed is read
  // again and this forward starts over, so only the values a gradient is
  // made from must be of one step.
  absl::StatusOr<BatchResult> ComputeGradientsStreamed(
      const std::vector<const float*>& params, const DeviceBatch& batch,
      const std::vector<float*>& grads,
      const ParameterStream& stream) override {
    if (params.size() != 1 || grads.size() != 1) {
      return absl::InvalidArgumentError("the probe model has one tensor");
    }
    const int64_t n = params_[0].shape(0);
    const int64_t chunk = std::max<int64_t>(1, stream.chunk_elements);
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t end = std::min(n, begin + chunk);
      if (absl::Status s = stream.wait_pulled(0, end); !s.ok()) return s;
    }
    absl::StatusOr<bool> go_on = stream.before_backward();
    if (!go_on.ok()) return go_on.status();
    if (*go_on && check_pulls_) {
      if (absl::Status s = CheckPulled(params[0]); !s.ok()) return s;
    }
    if (*go_on) {
      for (int64_t begin = 0; begin < n; begin += chunk) {
        const int64_t end = std::min(n, begin + chunk);
        if (absl::Status s =
                backend_->Fill(end - begin, 1.0f, grads[0] + begin);
            !s.ok()) {
          return s;
        }
        stream.gradient_ready(0, end);
      }
    }
    return BatchResult{0.0, 0, batch.rows};
  }

  absl::StatusOr<BatchResult> Evaluate(const std::vector<const float*>&,
                                       const DeviceBatch& batch) override {
    return BatchResult{0.0, 0, batch.rows};
  }

 private:
  // The pulled values, in backend memory, all equal element 0.
  absl::Status CheckPulled(const float* pulled) {
    const int64_t n = params_[0].shape(0);
    const float* w = pulled;
    if (!backend_->MemoryIsHost()) {
      host_copy_.resize(n);
      if (absl::Status s = backend_->CopyToHost(pulled, host_copy_.data(),
                                                n * sizeof(float));
          !s.ok()) {
        return s;
      }
      w = host_copy_.data();
    }
    for (int64_t i = 1; i < n; ++i) {
      if (w[i] != w[0]) {
        return absl::DataLossError(
            absl::StrCat("probe: the values pulled differ: element ", i, " is ",
                         w[i], ", element 0 is ", w[0],
                         " (a block read at another step than the others)"));
      }
    }
    return absl::OkStatus();
  }

  kernels::Backend* backend_;
  const bool check_pulls_;
  std::vector<DenseTensorSpec> params_;
  std::vector<float> host_copy_;  // CheckPulled's, on a device
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreateProbeModel(
    kernels::Backend* backend, int64_t num_elements, bool check_pulls) {
  if (num_elements < 1 || num_elements > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "probe model size must be in [1, 2^30], got ", num_elements));
  }
  return std::unique_ptr<Model>(
      new ProbeModel(backend, num_elements, check_pulls));
}

}  // namespace pstrain
