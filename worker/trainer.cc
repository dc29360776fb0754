#include "worker/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "glog/logging.h"
#include "worker/last_tenth.h"
#include "worker/step_overlap.h"

namespace pstrain {
namespace {

// The model's parameters and gradients, in host memory (for the wire) and
// in backend memory (for compute). The host side is the backend's host
// memory (page-locked on CUDA): each copy between the two is then one DMA
// straight into or out of what the client sends and receives. A tensor
// whose wire type is 16-bit (--gradient_wire_type / --parameter_wire_type
// bf16 or fp16) is cast on the device and staged in 16 bits, so the host
// moves half the bytes and converts nothing; top-k is converted by the
// client on the host, from float32 staging, as are the gradients
// --overlap_push sends (OverlappedPush stages float32).
struct ParameterBuffers {
  // host_params: empty for a tensor pulled in 16 bits or unstaged.
  // host_grads: also what --overlap_push stages into, staged or not.
  std::vector<kernels::HostArray<float>> host_params, host_grads;
  std::vector<kernels::DeviceArray<float>> device_params, device_grads;
  // Per tensor, empty unless it travels as 16 bits (staged only): the host
  // copies and the device casts of that type, which push_from and
  // pull_into name (BFLOAT16 or FLOAT16).
  std::vector<kernels::HostArray<uint16_t>> host_params16, host_grads16;
  std::vector<kernels::DeviceArray<uint16_t>> device_params16, device_grads16;
  // What the client pulls into and pushes from: the backend's arrays when
  // the backend computes in host memory (no staging copies), else the host
  // arrays above, 16-bit where a tensor travels so.
  bool staged = true;
  std::vector<PsClient::TensorRef> pull_into;
  std::vector<PsClient::ConstTensorRef> push_from;

  absl::Status Allocate(const Model& model, const PsClient& client,
                        kernels::Backend& backend) {
    staged = !backend.MemoryIsHost();
    const std::vector<DenseTensorSpec>& specs = model.Params();
    for (size_t t = 0; t < specs.size(); ++t) {
      const int64_t n = NumElements(specs[t]);
      const DataType push_type = client.PushWireType(t);
      const DataType pull_type = client.PullWireType(t);
      const bool push16 =
          staged && (push_type == BFLOAT16 || push_type == FLOAT16);
      const bool pull16 =
          staged && (pull_type == BFLOAT16 || pull_type == FLOAT16);
      absl::Status s = Add(backend, n, host_grads, device_params, device_grads);
      if (s.ok()) s = Add(backend, staged && !pull16 ? n : 0, host_params);
      if (s.ok())
        s = Add(backend, pull16 ? n : 0, host_params16, device_params16);
      if (s.ok())
        s = Add(backend, push16 ? n : 0, host_grads16, device_grads16);
      if (!s.ok()) return s;
      if (!staged) {
        pull_into.push_back({FLOAT32, device_params[t].data()});
        push_from.push_back({FLOAT32, device_grads[t].data()});
        continue;
      }
      pull_into.push_back(
          pull16 ? PsClient::TensorRef{pull_type, host_params16[t].data()}
                 : PsClient::TensorRef{FLOAT32, host_params[t].data()});
      push_from.push_back(
          push16 ? PsClient::ConstTensorRef{push_type, host_grads16[t].data()}
                 : PsClient::ConstTensorRef{FLOAT32, host_grads[t].data()});
    }
    return absl::OkStatus();
  }

  // Whether any tensor is cast for the wire by the backend.
  bool CastsOnDevice() const {
    for (size_t i = 0; i < host_params16.size(); ++i) {
      if (host_params16[i].size() > 0 || host_grads16[i].size() > 0) {
        return true;
      }
    }
    return false;
  }

  template <typename T, typename Array>
  static std::vector<T*> Pointers(Array& arrays) {
    std::vector<T*> out;
    for (auto& a : arrays) out.push_back(a.data());
    return out;
  }

  // Returns the step the pulled model is at (see PsClient::Pull).
  absl::StatusOr<int64_t> PullToDevice(PsClient& client, int64_t step,
                                       kernels::Backend& backend) {
    // Unstaged, the pull writes arrays the backend may still be reading.
    if (!staged) {
      if (absl::Status s = backend.Synchronize(); !s.ok()) return s;
    }
    absl::StatusOr<int64_t> at = client.PullTensors(step, pull_into);
    if (!at.ok()) return at.status();
    if (absl::Status s = ParamsToDevice(backend); !s.ok()) return s;
    return at;
  }

  // Pushes push_from as `step` and pulls step + 1 (PsClient::PushPull).
  // Call after GradsToHost, which also waits for the backend.
  absl::StatusOr<PsClient::PushPullResult> PushPullToDevice(
      PsClient& client, int64_t step, kernels::Backend& backend) {
    absl::StatusOr<PsClient::PushPullResult> done =
        client.PushPullTensors(step, push_from, step + 1, pull_into);
    if (!done.ok()) return done.status();
    if (absl::Status s = ParamsToDevice(backend); !s.ok()) return s;
    return done;
  }

  // Makes push_from hold the gradients computed in device_grads.
  absl::Status GradsToHost(kernels::Backend& backend) {
    if (!staged) return backend.Synchronize();
    for (size_t i = 0; i < device_grads.size(); ++i) {
      if (absl::Status s = GradToHost(backend, i, 0, device_grads[i].size());
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  // Makes elements [begin, end) of tensor i's push_from hold its gradient
  // issued in device_grads (staged only). On return the host may send them.
  absl::Status GradToHost(kernels::Backend& backend, size_t i, int64_t begin,
                          int64_t end) {
    if (begin >= end) return absl::OkStatus();
    if (host_grads16[i].size() > 0) {
      const float* from = device_grads[i].data() + begin;
      uint16_t* to = device_grads16[i].data() + begin;
      absl::Status s = push_from[i].dtype == FLOAT16
                           ? backend.FloatToFp16(end - begin, from, to)
                           : backend.FloatToBf16(end - begin, from, to);
      if (!s.ok()) return s;
      return backend.CopyToHost(device_grads16[i].data() + begin,
                                host_grads16[i].data() + begin,
                                (end - begin) * sizeof(uint16_t));
    }
    return backend.CopyToHost(device_grads[i].data() + begin,
                              host_grads[i].data() + begin,
                              (end - begin) * sizeof(float));
  }

  absl::Status ParamsToDevice(kernels::Backend& backend) {
    if (!staged) return absl::OkStatus();
    for (size_t i = 0; i < device_params.size(); ++i) {
      if (absl::Status s =
              ParamToDevice(backend, i, 0, device_params[i].size());
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  // Makes elements [begin, end) of tensor i in device_params hold what was
  // pulled into pull_into (staged only), ahead of any work issued later.
  absl::Status ParamToDevice(kernels::Backend& backend, size_t i, int64_t begin,
                             int64_t end) {
    if (begin >= end) return absl::OkStatus();
    if (host_params16[i].size() > 0) {
      absl::Status s = backend.CopyToDevice(host_params16[i].data() + begin,
                                            device_params16[i].data() + begin,
                                            (end - begin) * sizeof(uint16_t));
      if (!s.ok()) return s;
      const uint16_t* from = device_params16[i].data() + begin;
      float* to = device_params[i].data() + begin;
      return pull_into[i].dtype == FLOAT16
                 ? backend.Fp16ToFloat(end - begin, from, to)
                 : backend.Bf16ToFloat(end - begin, from, to);
    }
    return backend.CopyToDevice(host_params[i].data() + begin,
                                device_params[i].data() + begin,
                                (end - begin) * sizeof(float));
  }

 private:
  // Appends an array of n elements (0: an empty one) to each of `arrays`,
  // host or device as its type says.
  template <typename... Arrays>
  static absl::Status Add(kernels::Backend& backend, int64_t n,
                          Arrays&... arrays) {
    absl::Status status;
    auto add = [&](auto& to) {
      if (!status.ok()) return;
      using Array = typename std::decay_t<decltype(to)>::value_type;
      if (n == 0) {
        to.emplace_back();
        return;
      }
      absl::StatusOr<Array> array = Array::Create(&backend, n);
      if (!array.ok()) {
        status = array.status();
        return;
      }
      to.push_back(std::move(*array));
    };
    (add(arrays), ...);
    return status;
  }
};

// A host batch and its copy in backend memory.
struct BatchBuffers {
  std::vector<float> host_features;
  std::vector<int32_t> host_labels;
  kernels::DeviceArray<float> features;
  kernels::DeviceArray<int32_t> labels;

  absl::Status Allocate(int64_t rows, int64_t num_features,
                        kernels::Backend& backend) {
    host_features.resize(rows * num_features);
    host_labels.resize(rows);
    absl::StatusOr<kernels::DeviceArray<float>> f =
        kernels::DeviceArray<float>::Create(&backend, rows * num_features);
    if (!f.ok()) return f.status();
    absl::StatusOr<kernels::DeviceArray<int32_t>> l =
        kernels::DeviceArray<int32_t>::Create(&backend, rows);
    if (!l.ok()) return l.status();
    features = std::move(*f);
    labels = std::move(*l);
    return absl::OkStatus();
  }

  absl::StatusOr<DeviceBatch> Upload(int64_t rows, int64_t num_features,
                                     kernels::Backend& backend) {
    absl::Status s = backend.CopyToDevice(host_features.data(), features.data(),
                                          rows * num_features * sizeof(float));
    if (s.ok()) {
      s = backend.CopyToDevice(host_labels.data(), labels.data(),
                               rows * sizeof(int32_t));
    }
    if (!s.ok()) return s;
    return DeviceBatch{rows, features.data(), labels.data()};
  }
};

absl::StatusOr<BatchResult> Evaluate(Model& model, kernels::Backend& backend,
                                     const std::vector<const float*>& params,
                                     const ExampleSource& test,
                                     int64_t max_batch, BatchBuffers& batch) {
  BatchResult total;
  std::vector<int64_t> indices;
  for (int64_t first = 0; first < test.size(); first += max_batch) {
    const int64_t rows = std::min(max_batch, test.size() - first);
    indices.resize(rows);
    std::iota(indices.begin(), indices.end(), first);
    if (absl::Status s = test.Gather(indices, batch.host_features.data(),
                                     batch.host_labels.data());
        !s.ok()) {
      return s;
    }
    absl::StatusOr<DeviceBatch> device =
        batch.Upload(rows, test.num_features(), backend);
    if (!device.ok()) return device.status();
    absl::StatusOr<BatchResult> result = model.Evaluate(params, *device);
    if (!result.ok()) return result.status();
    total.loss_sum += result->loss_sum;
    total.num_correct += result->num_correct;
    total.rows += result->rows;
  }
  return total;
}

// Fault injection: dies as kill -9 would, with nothing flushed or sent.
[[noreturn]] void CrashNow(const char* when, int64_t step) {
  LOG(WARNING) << "fault injection: SIGKILL at step " << step << ", " << when;
  google::FlushLogFiles(google::GLOG_INFO);
  kill(getpid(), SIGKILL);
  std::abort();  // not reached
}

}  // namespace

void InjectSigterm(const std::atomic<bool>* stop, int64_t step) {
  if (stop == nullptr) return;
  LOG(WARNING) << "fault injection: SIGTERM at step " << step;
  kill(getpid(), SIGTERM);
  // The signal reaches `stop` through the signal watch's thread: the next
  // step must not start before it has.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!stop->load() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
}

namespace {

// The first steps' warm-up (the first pulls, a device's first kernels):
// the steps --trace_steps and TrainResult::steady_steps leave out.
constexpr int64_t kWarmUpSteps = 10;

// --trace_steps: one step's timeline as a JSON line: [microseconds since the
// step began staging its batch, what, tensor, end] (PsClient::StepStream's
// events, and the trainer's: w forward asks for a parameter up to `end`,
// i it is in backend memory, B backward is next (the last exchange is
// waited for), b it ended, g a gradient is issued, e the step's compute
// is done).
void PrintStepTrace(
    int64_t step, absl::Time origin,
    const std::vector<PsClient::StepStream::TraceEvent>& events) {
  std::string line = absl::StrCat("{\"event\":\"step_trace\",\"step\":", step,
                                  ",\"events\":[");
  for (size_t i = 0; i < events.size(); ++i) {
    const PsClient::StepStream::TraceEvent& e = events[i];
    absl::StrAppend(
        &line, i == 0 ? "" : ",", "[", absl::ToInt64Microseconds(e.at - origin),
        ",\"", absl::string_view(&e.what, 1), "\",", e.tensor, ",", e.end, "]");
  }
  line += "]}\n";
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

// A staged gradient is copied out this many blocks at a time.
constexpr int64_t kCopyOutPieceBlocks = 4;

// What one step's forward, backward and push produced.
struct StepExchange {
  BatchResult batch;
  PsClient::PushResult pushed;
  absl::Duration compute_time;  // from staging the batch to the gradients
  absl::Duration push_time;     // the push's own time
  absl::Duration push_wait;     // how long the step waited for the push
  // A PushPull's: the step of the model it left in backend memory.
  std::optional<int64_t> pulled_ahead;
  // The pipelined step found the job past this step: nothing was pushed,
  // and the model in backend memory is at pulled_ahead.
  bool skipped = false;
  // The pipelined step: how long forward waited for values still on their
  // way (network wait, inside compute_time), and the gap from the last
  // value in to the first gradient ready, when no request can leave: the
  // rest of forward and the later layers' backward.
  absl::Duration values_wait;
  absl::Duration fill_gap;
};

// One step's forward, backward and push by one of the three push
// strategies, so that the training loop reads the same whichever runs:
//   overlap_push  each tensor is pushed as backward reports it ready;
//   push_pull     one PushPull after backward, which also brings the next
//                 step's model (where the caller allows it);
//   otherwise     one Push after backward.
class StepRunner {
 public:
  StepRunner(const TrainerOptions& options, ConsistencyMode mode,
             PsClient& client, Model& model, kernels::Backend& backend,
             ParameterBuffers& buffers)
      : options_(options),
        mode_(mode),
        client_(client),
        model_(model),
        backend_(backend),
        buffers_(buffers),
        params_(ParameterBuffers::Pointers<const float>(buffers.device_params)),
        grads_(ParameterBuffers::Pointers<float>(buffers.device_grads)) {
    for (const auto& params : buffers.device_params) {
      on_device_end_.push_back(params.size());
    }
    grads_on_host_end_.assign(on_device_end_.size(), 0);
    // Its push thread only where it is used.
    if (options.overlap_push) {
      overlapped_push_.emplace(client, backend, grads_, buffers.host_grads);
    }
  }

  const std::vector<const float*>& params() const { return params_; }
  // Whether its steps ran as a pipeline.
  bool pipelined() const { return pipelined_.value_or(false); }

  // `staged_at`: when the step began staging its batch (counted as
  // compute). `may_pull_ahead`: a PushPull may bring the next step's model
  // (not on the last step, nor before the job-start wait).
  absl::StatusOr<StepExchange> Run(int64_t step, const DeviceBatch& batch,
                                   absl::Time staged_at, bool may_pull_ahead) {
    injected_in_backward_ = false;
    if (!pipelined_.has_value()) {
      // Decided once: the first step's pull has opened the data plane's
      // links, which tell where the shards are. By host, only a sync step
      // that would otherwise end with one PushPull (not one whose user
      // chose --overlap_push or --push_pull=false) nor read from backups,
      // which on links that bind gains more (with two replicas on 1 Gbit/s
      // links, 2 x 2: 13.0-13.2 ms a step reading from backups, 14.1-14.4
      // ms pipelined; bench/results/replication_link_speed.txt); and only
      // where the exchange can stream and no schedule makes each step wait
      // for the last one's exchange (else the hand-offs gain nothing).
      // Then where a shard is on another host, or the worker stages
      // through a device's memory, whose copies and compute the exchange
      // hides even on one host (H200, bench/results/nvidia-h200: 1.07-1.09x
      // the plain step's samples/s in fp32, 1.14-1.25x with bf16 both
      // ways).
      using Pipeline = TrainerOptions::Pipeline;
      pipelined_ = options_.pipeline_step == Pipeline::kAlways ||
                   (options_.pipeline_step == Pipeline::kByHost &&
                    mode_ == ConsistencyMode::kSync && options_.push_pull &&
                    !options_.overlap_push && !client_.MayReadFromBackups() &&
                    client_.StepsCanStream(buffers_.push_from) &&
                    options_.learning_rate_at == nullptr &&
                    (buffers_.staged || client_.SomeShardOnAnotherHost()));
      announce_pipeline_ = *pipelined_;
    }
    if (*pipelined_) {
      bool model_refused = false;
      absl::StatusOr<StepExchange> out =
          RunPipelined(step, batch, staged_at, may_pull_ahead, model_refused);
      if (!model_refused) {
        if (announce_pipeline_) {
          // Said once the model has taken the first pipelined step.
          announce_pipeline_ = false;
          LOG(INFO) << (options_.pipeline_step ==
                                TrainerOptions::Pipeline::kAlways
                            ? "--pipeline_step=always: "
                        : buffers_.staged
                            ? "--pipeline_step=by_host: the worker stages "
                              "through a device, so "
                            : "--pipeline_step=by_host: a shard is on "
                              "another host, so ")
                    << "steps run as a pipeline";
        }
        return out;
      }
      const std::string why =
          absl::StrCat("--pipeline_step: ", out.status().message(),
                       "; this job's steps run one after another");
      // A warning only to whoever asked for the pipeline by name.
      if (options_.pipeline_step == TrainerOptions::Pipeline::kAlways) {
        LOG(WARNING) << why;
      } else {
        LOG(INFO) << why;
      }
      pipelined_ = false;
    }
    return overlapped_push_.has_value()
               ? RunOverlapped(step, batch, staged_at)
               : RunThenPush(step, batch, staged_at, may_pull_ahead);
  }

  // --pipeline_step: waits for the PushPull in flight, if any. The model
  // in backend memory is then at model_at_ (staged: what forward had not
  // copied in yet is copied now); its push's figures wait in TakeSettled.
  absl::Status Settle() {
    if (in_flight_) {
      stream_->StopReading();
      network_->Drain();
      in_flight_ = false;
      if (!in_flight_result_.ok()) return in_flight_result_.status();
      settled_ = in_flight_result_->pushed;
      model_at_ = in_flight_result_->pulled_step;
    }
    for (size_t i = 0; i < on_device_end_.size(); ++i) {
      const int64_t end = buffers_.device_params[i].size();
      if (absl::Status s = StageIn(i, end); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  PsClient::PushResult TakeSettled() {
    PsClient::PushResult pushed = settled_.value_or(PsClient::PushResult{});
    settled_.reset();
    return pushed;
  }

 private:
  // --pipeline_step (README, "The pipelined step"). Forward reads the first
  // layer's weight block by block as the last step's PushPull brings it
  // back; once forward is done that PushPull has ended, and this step's
  // starts on the network thread, each group leaving as backward finishes
  // its gradient (the last layers' first, then the first layer's block by
  // block). The step's figures report the last step's push.
  // `model_refused`: the model cannot stream its step (nothing ran; the
  // caller runs the plain step instead).
  absl::StatusOr<StepExchange> RunPipelined(int64_t step,
                                            const DeviceBatch& batch,
                                            absl::Time staged_at,
                                            bool may_pull_ahead,
                                            bool& model_refused) {
    if (stream_ == nullptr) {
      stream_ = client_.MakeStepStream();
      network_.emplace();
    }
    if (!in_flight_) stream_->MarkAllPulled(absl::OkStatus());
    std::fill(grads_on_host_end_.begin(), grads_on_host_end_.end(), 0);
    // A gradient's copy for the wire that failed (staged): the step fails
    // once compute is done.
    absl::Status staging_error;
    // Each wait ends with the PushPull it waits on, whose calls have their
    // deadlines; this only backs them up.
    const absl::Time deadline = absl::Now() + absl::Minutes(10);
    StepExchange out;
    bool fell_behind = false;
    bool hooks_ran = false;
    // The values this forward read were pulled again (the last step's
    // PushPull failed once): it starts over on them.
    bool start_over = false;
    ParameterStream hooks;
    hooks.chunk_elements = stream_->FirstBlockElements(0);
    absl::Time last_value_in = absl::InfinitePast();
    bool first_ready_seen = false;
    hooks.wait_pulled = [&](int param, int64_t end) {
      hooks_ran = true;
      const absl::Time asked = absl::Now();
      stream_->Trace('w', param, end);
      absl::Status s = StageWhileWaiting(param, end, deadline);
      if (s.ok()) s = stream_->WaitPulled(param, end, deadline);
      if (s.ok()) s = StageIn(param, end);
      stream_->Trace('i', param, end);
      last_value_in = absl::Now();
      out.values_wait += last_value_in - asked;
      if (absl::IsAborted(s) && !stream_->failed()) start_over = true;
      return s;
    };
    hooks.gradient_ready = [&](int param, int64_t end) {
      if (!first_ready_seen && last_value_in != absl::InfinitePast()) {
        first_ready_seen = true;
        out.fill_gap = absl::Now() - last_value_in;
      }
      stream_->Trace('g', param, end);
      // After this call's groups are free to leave: they are in flight
      // during the pause.
      absl::Cleanup injected = [&] { InjectInBackwardIfAsked(step); };
      if (!buffers_.staged) {
        stream_->SetReady(param, end);
        return;
      }
      // Copied out (and cast for the wire) before its groups may leave, a
      // few blocks at a time, so that the first ones leave while the rest
      // is copied.
      const int64_t piece =
          kCopyOutPieceBlocks * stream_->FirstBlockElements(param);
      while (staging_error.ok() && grads_on_host_end_[param] < end) {
        const int64_t from = grads_on_host_end_[param];
        const int64_t to = std::min(end, from + piece);
        staging_error = buffers_.GradToHost(backend_, param, from, to);
        if (!staging_error.ok()) return;
        grads_on_host_end_[param] = to;
        stream_->SetReady(param, to);
      }
    };
    hooks.before_backward = [&]() -> absl::StatusOr<bool> {
      hooks_ran = true;
      stream_->Trace('B', -1, 0);
      if (absl::Status s = Settle(); !s.ok()) return s;
      stream_->Trace('b', -1, 0);
      if (stream_->TakeRefetched()) {
        start_over = true;
        return absl::AbortedError("the values were pulled again");
      }
      out.pushed = TakeSettled();
      if (model_at_ > step) {
        // The job went on without this worker (sync: its last push came
        // late): no gradient of this step, and the trainer catches up from
        // the model it has.
        fell_behind = true;
        return false;
      }
      if (!may_pull_ahead) return true;
      stream_->BeginStep();
      in_flight_ = true;
      // The device keeps this step's values for backward; the next forward
      // copies in the new ones as they land.
      std::fill(on_device_end_.begin(), on_device_end_.end(), 0);
      network_->Schedule([this, step] {
        in_flight_result_ = client_.PushPullStreamed(
            step, buffers_.push_from, step + 1, buffers_.pull_into, *stream_);
      });
      return true;
    };
    absl::StatusOr<BatchResult> computed =
        model_.ComputeGradientsStreamed(params_, batch, grads_, hooks);
    if (!computed.ok() && !hooks_ran) {
      model_refused = true;
      return computed.status();
    }
    if (start_over) {
      // The last step's PushPull failed once and pulled every value again
      // (staged: all copied in again).
      std::fill(on_device_end_.begin(), on_device_end_.end(), 0);
      if (absl::Status s = Settle(); !s.ok()) return s;
      stream_->TakeRefetched();
      stream_->MarkAllPulled(absl::OkStatus());
      start_over = false;
      computed = model_.ComputeGradientsStreamed(params_, batch, grads_, hooks);
    }
    if (computed.ok() && !staging_error.ok()) computed = staging_error;
    if (!computed.ok()) {
      // The PushPull in flight waits for gradients that will not come.
      if (in_flight_) {
        stream_->Cancel();
        client_.Interrupt();
      }
      return computed.status();
    }
    stream_->Trace('e', -1, 0);
    if (Traced(step)) PrintStepTrace(step, staged_at, stream_->TakeTrace());
    // From the end of the step before the first traced one (its exchange's
    // groups leave in the gap) to the end of the last: no event is kept
    // for the rest of the job.
    stream_->SetTracing(Traced(step + 1));
    DelayIfAsked();
    const absl::Time push_start = absl::Now();
    out.compute_time = push_start - staged_at;
    out.batch = *computed;
    if (fell_behind) {
      out.pulled_ahead = model_at_;
      out.skipped = true;
    } else if (may_pull_ahead) {
      out.pulled_ahead = step + 1;
    } else {
      absl::StatusOr<PsClient::PushResult> pushed =
          client_.PushTensors(step, buffers_.push_from);
      if (!pushed.ok()) return pushed.status();
      out.pushed.blocks_duplicate += pushed->blocks_duplicate;
      out.pushed.blocks_late += pushed->blocks_late;
    }
    out.push_time = out.push_wait = absl::Now() - push_start;
    return out;
  }

  absl::StatusOr<StepExchange> RunOverlapped(int64_t step,
                                             const DeviceBatch& batch,
                                             absl::Time staged_at) {
    // The first error stops the reports (the step fails below).
    absl::Status ready_status;
    overlapped_push_->Start(step);
    absl::StatusOr<BatchResult> computed =
        model_.ComputeGradients(params_, batch, grads_, [&](int tensor) {
          if (ready_status.ok()) ready_status = overlapped_push_->Ready(tensor);
          InjectInBackwardIfAsked(step);
        });
    DelayIfAsked();
    StepExchange out;
    const absl::Time wait_start = absl::Now();
    absl::StatusOr<PsClient::PushResult> pushed = overlapped_push_->Finish();
    out.push_wait = absl::Now() - wait_start;
    out.compute_time = wait_start - staged_at;
    out.push_time = overlapped_push_->push_time();
    if (!computed.ok()) return computed.status();
    if (!ready_status.ok()) return ready_status;
    if (!pushed.ok()) return pushed.status();
    out.batch = *computed;
    out.pushed = *pushed;
    return out;
  }

  absl::StatusOr<StepExchange> RunThenPush(int64_t step,
                                           const DeviceBatch& batch,
                                           absl::Time staged_at,
                                           bool may_pull_ahead) {
    // Told of each gradient only for a fault injection (the model keeps a
    // report per parameter for a callback).
    const bool inject = options_.sigterm_in_backward_step == step ||
                        options_.backward_pause > absl::ZeroDuration();
    absl::StatusOr<BatchResult> computed = model_.ComputeGradients(
        params_, batch, grads_,
        inject
            ? GradientReadyCallback([&](int) { InjectInBackwardIfAsked(step); })
            : nullptr);
    if (!computed.ok()) return computed.status();
    if (absl::Status s = buffers_.GradsToHost(backend_); !s.ok()) return s;
    DelayIfAsked();
    StepExchange out;
    out.batch = *computed;
    const absl::Time push_start = absl::Now();
    out.compute_time = push_start - staged_at;
    if (options_.push_pull && may_pull_ahead) {
      absl::StatusOr<PsClient::PushPullResult> done =
          buffers_.PushPullToDevice(client_, step, backend_);
      if (!done.ok()) return done.status();
      out.pushed = done->pushed;
      out.pulled_ahead = done->pulled_step;
    } else {
      absl::StatusOr<PsClient::PushResult> pushed =
          client_.PushTensors(step, buffers_.push_from);
      if (!pushed.ok()) return pushed.status();
      out.pushed = *pushed;
    }
    out.push_time = out.push_wait = absl::Now() - push_start;
    return out;
  }

  // Staged: while forward waits for parameter `param` up to `end`, copies
  // in what has landed (the later layers' values come back first, and its
  // own in pieces), so that little is left to copy once it is in. A failed
  // PushPull is for WaitPulled to report.
  absl::Status StageWhileWaiting(int param, int64_t end, absl::Time deadline) {
    if (!buffers_.staged) return absl::OkStatus();
    for (;;) {
      const int64_t seen = stream_->landings();
      for (size_t p = 0; p < on_device_end_.size(); ++p) {
        if (absl::Status s = StageIn(p, stream_->PulledEnd(p)); !s.ok()) {
          return s;
        }
      }
      if (on_device_end_[param] >= end ||
          !stream_->AwaitLanding(seen, deadline)) {
        return absl::OkStatus();
      }
    }
  }

  // --trace_steps: whether `step` prints its timeline.
  bool Traced(int64_t step) const {
    return step >= kWarmUpSteps && step < kWarmUpSteps + options_.trace_steps;
  }

  // Staged (a device backend): makes elements [0, end) of parameter `param`
  // in backend memory hold the values pulled into the host arrays.
  absl::Status StageIn(size_t param, int64_t end) {
    if (!buffers_.staged || on_device_end_[param] >= end) {
      return absl::OkStatus();
    }
    absl::Status s =
        buffers_.ParamToDevice(backend_, param, on_device_end_[param], end);
    if (s.ok()) on_device_end_[param] = end;
    return s;
  }

  void DelayIfAsked() const {
    if (options_.step_delay > absl::ZeroDuration()) {
      absl::SleepFor(options_.step_delay);
    }
  }

  // --inject_sigterm_in_backward_step, --inject_backward_pause_ms: once a
  // step, when its first gradients are ready (told of every gradient).
  void InjectInBackwardIfAsked(int64_t step) {
    if (std::exchange(injected_in_backward_, true)) return;
    if (step == options_.sigterm_in_backward_step) {
      InjectSigterm(options_.stop, step);
    }
    if (options_.backward_pause > absl::ZeroDuration()) {
      absl::SleepFor(options_.backward_pause);
    }
  }

  const TrainerOptions& options_;
  const ConsistencyMode mode_;
  PsClient& client_;
  Model& model_;
  kernels::Backend& backend_;
  ParameterBuffers& buffers_;
  const std::vector<const float*> params_;
  const std::vector<float*> grads_;
  std::optional<OverlappedPush> overlapped_push_;
  // --pipeline_step: the stream its PushPulls share with the model, whether
  // one is in flight on network_, its result, and the step the model in
  // backend memory is at once it settled.
  std::unique_ptr<PsClient::StepStream> stream_;
  // Staged, per parameter: the elements [0, end) of backend memory that
  // hold the values the last PushPull pulled, and of the gradient that are
  // in the host arrays for the wire.
  std::vector<int64_t> on_device_end_, grads_on_host_end_;
  bool in_flight_ = false;
  // This step's InjectInBackwardIfAsked ran.
  bool injected_in_backward_ = false;
  absl::StatusOr<PsClient::PushPullResult> in_flight_result_;
  int64_t model_at_ = 0;
  std::optional<PsClient::PushResult> settled_;
  // Whether steps run as a pipeline (unset until the first step), and
  // whether to say so after the first one.
  std::optional<bool> pipelined_;
  bool announce_pipeline_ = false;
  std::optional<SerialWorker> network_;  // last: drained first
};

// Held-out evaluations of the parameters in backend memory: when one is
// due, and the first time the target accuracy is reached (in training
// time: evaluations left out). Only the evaluating worker times the target:
// the others see just the final model, whose time says nothing about when
// the target was met.
class Evaluator {
 public:
  Evaluator(const TrainerOptions& options, Model& model,
            kernels::Backend& backend, const std::vector<const float*>& params,
            const ExampleSource* test, BatchBuffers& batch,
            int64_t steps_per_epoch)
      : options_(options),
        model_(model),
        backend_(backend),
        params_(params),
        test_(test != nullptr && test->size() > 0 ? test : nullptr),
        batch_(batch),
        steps_per_epoch_(steps_per_epoch) {}

  bool has_test() const { return test_ != nullptr; }

  bool Due(int64_t step) const {
    if (!options_.periodic_evaluation || !has_test()) return false;
    return (options_.eval_every_steps > 0 &&
            step % options_.eval_every_steps == 0) ||
           (options_.eval_every_epochs > 0 &&
            step % (options_.eval_every_epochs * steps_per_epoch_) == 0);
  }

  // `start`: when training started (the job-start wait left out).
  absl::StatusOr<BatchResult> Run(int64_t at_step, absl::Time start,
                                  TrainResult& result) {
    const absl::Time eval_start = absl::Now();
    absl::StatusOr<BatchResult> evaluation = Evaluate(
        model_, backend_, params_, *test_, options_.batch_size, batch_);
    if (!evaluation.ok()) return evaluation.status();
    const double accuracy =
        static_cast<double>(evaluation->num_correct) / evaluation->rows;
    if (options_.periodic_evaluation && options_.target_accuracy > 0 &&
        result.step_to_target < 0 && accuracy >= options_.target_accuracy) {
      result.step_to_target = at_step;
      result.time_to_target_s =
          absl::ToDoubleSeconds(eval_start - start - time_);
    }
    time_ += absl::Now() - eval_start;
    return evaluation;
  }

  // After `step` steps: if an evaluation is due, evaluates the model of
  // that step (sync: after exactly `step` updates, waiting for the other
  // workers' gradients; async: the servers' current model), pulling it
  // unless `model_is_at_step` (a PushPull ending the step brought it), and
  // puts the figures in `report`.
  absl::Status AfterStep(int64_t step, bool model_is_at_step,
                         ParameterBuffers& buffers, PsClient& client,
                         absl::Time start, TrainResult& result,
                         StepReport& report) {
    if (!Due(step)) return absl::OkStatus();
    if (!model_is_at_step) {
      const absl::Time pull_start = absl::Now();
      absl::StatusOr<int64_t> pulled =
          buffers.PullToDevice(client, step, backend_);
      if (!pulled.ok()) return pulled.status();
      time_ += absl::Now() - pull_start;
    }
    absl::StatusOr<BatchResult> evaluation = Run(step, start, result);
    if (!evaluation.ok()) return evaluation.status();
    ++result.evaluations;
    last_evaluated_step_ = step;
    last_evaluation_ = *evaluation;
    report.evaluated = true;
    report.test_loss = evaluation->loss_sum / evaluation->rows;
    report.test_accuracy =
        static_cast<double>(evaluation->num_correct) / evaluation->rows;
    return absl::OkStatus();
  }

  // The job's final model, in backend memory, on the held-out set (none:
  // nothing to do). A sync job's model after its last step, if evaluated
  // then already, is not evaluated again.
  absl::Status Final(int64_t step, ConsistencyMode mode, absl::Time start,
                     TrainResult& result) {
    if (!has_test()) return absl::OkStatus();
    BatchResult evaluation;
    if (mode == ConsistencyMode::kSync &&
        last_evaluated_step_ == options_.steps && !result.stopped_early) {
      evaluation = last_evaluation_;
    } else {
      absl::StatusOr<BatchResult> final_evaluation = Run(step, start, result);
      if (!final_evaluation.ok()) return final_evaluation.status();
      evaluation = *final_evaluation;
    }
    result.test_examples = evaluation.rows;
    result.test_loss = evaluation.loss_sum / evaluation.rows;
    result.test_accuracy =
        static_cast<double>(evaluation.num_correct) / evaluation.rows;
    return absl::OkStatus();
  }

  // Time spent on evaluations, and on the pulls made only for them.
  absl::Duration time() const { return time_; }

 private:
  const TrainerOptions& options_;
  Model& model_;
  kernels::Backend& backend_;
  const std::vector<const float*>& params_;
  const ExampleSource* const test_;
  BatchBuffers& batch_;
  const int64_t steps_per_epoch_;
  absl::Duration time_ = absl::ZeroDuration();
  int64_t last_evaluated_step_ = -1;
  BatchResult last_evaluation_;
};

// Ends this worker's part in the job and leaves the job's final model in
// backend memory. sync: Pull(steps) waits for every member's last gradient
// (a worker that stopped early takes the step it reached), and the steps
// that ran short are counted. async/ssp: leave first, so that the others'
// wait counts this worker as done, then read the servers' model once every
// worker has finished, through the observer, which does not rejoin the job.
absl::Status PullFinalModel(const TrainerOptions& options, ConsistencyMode mode,
                            int64_t reached_step, PsClient& client,
                            ParameterBuffers& buffers,
                            kernels::Backend& backend, TrainResult& result) {
  if (mode == ConsistencyMode::kSync) {
    const int64_t final_step =
        result.stopped_early ? reached_step : options.steps;
    absl::StatusOr<int64_t> pulled =
        buffers.PullToDevice(client, final_step, backend);
    if (!pulled.ok()) return pulled.status();
    if (result.stopped_early && options.on_steps_done) options.on_steps_done();
    result.final_model = "sync_step";
    // First, as it waits out a shard restarting after the last step.
    if (final_step > 0) {
      absl::StatusOr<FinalState> state = client.SecureFinalState(final_step);
      if (!state.ok()) return state.status();
      result.final_state = *std::move(state);
    }
    // Every step this worker ran is complete now: count the short ones.
    absl::StatusOr<int64_t> steps_short = client.StepsShort();
    if (!steps_short.ok()) return steps_short.status();
    result.steps_short = *steps_short;
    return client.Leave(result.stopped_early, GraceOf(options.graceful_stop));
  }
  if (absl::Status s = client.Leave(result.stopped_early); !s.ok()) return s;
  PsClient& reader = options.observer != nullptr ? *options.observer : client;
  result.final_model = reader.AwaitFinalModel(
      options.num_workers * options.steps, options.final_model_timeout);
  if (absl::Status s =
          buffers.PullToDevice(reader, options.steps, backend).status();
      !s.ok()) {
    return s;
  }
  if (result.final_model != "all_done") return absl::OkStatus();
  absl::StatusOr<FinalState> state =
      reader.SecureFinalState(options.num_workers * options.steps);
  if (!state.ok()) return state.status();
  result.final_state = *std::move(state);
  return absl::OkStatus();
}

// What the step that brought the job to `step_done` adds to this worker's
// figures. The final loss and accuracy average the last tenth of the job's
// batches, gathered in `window`.
void Tally(const StepExchange& exchange, absl::Duration pull_time,
           int64_t step_done, LastTenth& window, TrainResult& result) {
  result.compute_seconds +=
      absl::ToDoubleSeconds(exchange.compute_time - exchange.values_wait);
  result.network_wait_seconds += absl::ToDoubleSeconds(
      pull_time + exchange.push_wait + exchange.values_wait);
  result.fill_gap_seconds += absl::ToDoubleSeconds(exchange.fill_gap);
  result.duplicate_blocks += exchange.pushed.blocks_duplicate;
  result.late_blocks += exchange.pushed.blocks_late;
  ++result.steps_run;
  window.Add(step_done, exchange.batch);
}

// This worker's figures once its steps are done: `steps_done` of them in
// `wall_time`, of which `evaluation_time` on evaluations; `window` the
// batches of the job's last tenth (of the steps run, if it stopped early).
void Summarize(const TrainerOptions& options, int64_t steps_done,
               int64_t steps_per_epoch, const LastTenth& window,
               absl::Duration wall_time, absl::Duration evaluation_time,
               TrainResult& result) {
  if (const BatchResult tail = window.Sums(result.steps_run); tail.rows > 0) {
    result.final_loss = tail.loss_sum / tail.rows;
    result.train_accuracy = static_cast<double>(tail.num_correct) / tail.rows;
  }
  result.steps = options.steps;
  result.epochs = static_cast<double>(steps_done) / steps_per_epoch;
  result.wall_time_s = absl::ToDoubleSeconds(wall_time);
  result.evaluation_seconds = absl::ToDoubleSeconds(evaluation_time);
  result.samples_per_sec =
      result.steps_run * options.batch_size /
      std::max(result.wall_time_s - result.evaluation_seconds, 1e-9);
}

// This worker's slice of every global batch, epoch after epoch.
EpochPlan::Options PlanOptions(const TrainerOptions& options,
                               const ExampleSource& train) {
  EpochPlan::Options plan_options;
  plan_options.num_examples = train.size();
  plan_options.worker_batch = options.batch_size;
  plan_options.num_workers = options.num_workers;
  plan_options.worker_index = options.worker_id;
  plan_options.shuffle = options.shuffle;
  plan_options.seed = options.seed;
  return plan_options;
}

// The progress line of the step just run (`step`: the steps done).
StepReport ReportOf(int64_t step, const TrainerOptions& options,
                    int64_t steps_per_epoch, const StepExchange& exchange,
                    absl::Duration pull_time, absl::Duration step_time) {
  StepReport report;
  report.step = step;
  report.steps = options.steps;
  const BatchResult& batch = exchange.batch;
  report.loss = batch.loss_sum / batch.rows;
  report.train_accuracy = static_cast<double>(batch.num_correct) / batch.rows;
  report.examples = batch.rows;
  report.step_seconds = absl::ToDoubleSeconds(step_time);
  report.pull_seconds = absl::ToDoubleSeconds(pull_time);
  report.push_seconds = absl::ToDoubleSeconds(exchange.push_time);
  // As Tally counts them: the pipelined forward's wait for its values is
  // the network's, not compute.
  report.compute_seconds =
      absl::ToDoubleSeconds(exchange.compute_time - exchange.values_wait);
  report.network_wait_seconds = absl::ToDoubleSeconds(
      pull_time + exchange.push_wait + exchange.values_wait);
  report.epoch = step / steps_per_epoch;
  return report;
}

}  // namespace

int64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string text;
  while (std::getline(status, text)) {
    absl::string_view line = text;
    int64_t kib = 0;
    if (absl::ConsumePrefix(&line, "VmHWM:") &&
        absl::SimpleAtoi(
            absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &kib)) {
      return kib * 1024;
    }
  }
  return 0;
}

absl::StatusOr<TrainResult> Train(const TrainerOptions& options,
                                  ConsistencyMode mode, PsClient& client,
                                  Model& model, kernels::Backend& backend,
                                  const ExampleSource& train,
                                  const ExampleSource* test) {
  absl::StatusOr<EpochPlan> plan =
      EpochPlan::Create(PlanOptions(options, train));
  if (!plan.ok()) return plan.status();
  const int64_t steps_per_epoch = plan->steps_per_epoch();
  ParameterBuffers buffers;
  if (absl::Status s = buffers.Allocate(model, client, backend); !s.ok()) {
    return s;
  }
  BatchBuffers batch;
  if (absl::Status s =
          batch.Allocate(options.batch_size, train.num_features(), backend);
      !s.ok()) {
    return s;
  }
  StepRunner runner(options, mode, client, model, backend, buffers);
  Evaluator evaluator(options, model, backend, runner.params(), test, batch,
                      steps_per_epoch);
  BatchPrefetcher prefetcher(*plan, train, options.batch_size);

  TrainResult result;
  result.mode = mode;
  result.start_step = options.start_step;
  result.steps_per_epoch = steps_per_epoch;
  LastTenth window(options.steps);  // the last tenth of the job's batches
  // Moved on by the start wait (TrainerOptions::await_job_start).
  absl::Time start = absl::Now();
  int64_t step = options.start_step;
  if (step < options.steps) prefetcher.Prefetch(step);
  // Where the last step's PushPull left the model in backend memory (the
  // step it is at): this step needs no pull of its own.
  std::optional<int64_t> pulled_ahead;
  while (step < options.steps) {
    absl::Time step_start = absl::Now();
    const bool await_start_after_push =
        options.await_job_start != nullptr && step == options.start_step;
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    const absl::Time pull_start = absl::Now();
    absl::StatusOr<int64_t> at =
        pulled_ahead.has_value() ? absl::StatusOr<int64_t>(*pulled_ahead)
                                 : buffers.PullToDevice(client, step, backend);
    pulled_ahead.reset();
    if (!at.ok()) return at.status();
    const absl::Duration pull_time = absl::Now() - pull_start;
    if (*at > step) {  // the job went on without this worker: catch up
      result.steps_skipped += *at - step;
      step = *at;
      if (step >= options.steps) break;
    }
    if (step == options.sigterm_before_push_step) {
      InjectSigterm(options.stop, step);
    }
    // Stopped while the pull waited: another worker may have stopped before
    // pushing this step, so this one does not push it either, and every
    // shard stops at the same step with none short (LeaveRequest.stopping).
    if (options.stop != nullptr && options.stop->load()) {
      result.stopped_early = true;
      break;
    }
    if (step == options.crash_before_push_step) {
      CrashNow("before its push", step);
    }
    if (options.graceful_stop != nullptr) {
      options.graceful_stop->StepWorkBegins();  // it will push
    }
    if (options.learning_rate_at) {
      // The client is not thread-safe: the pipelined step's PushPull in
      // flight must end first (the prototype loses its overlap here).
      if (absl::Status s = runner.Settle(); !s.ok()) return s;
      client.SetGroupRates({options.learning_rate_at(step)});
    }
    // The step fixes the examples, so a worker that joins late or catches
    // up takes exactly the slice a single process would have used.
    const absl::Time staged_at = absl::Now();
    if (absl::Status s =
            prefetcher.Take(step, batch.host_features, batch.host_labels);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<DeviceBatch> device_batch =
        batch.Upload(options.batch_size, train.num_features(), backend);
    if (!device_batch.ok()) return device_batch.status();
    if (step + 1 < options.steps) prefetcher.Prefetch(step + 1);
    absl::StatusOr<StepExchange> exchange = runner.Run(
        step, *device_batch, staged_at,
        /*may_pull_ahead=*/step + 1 < options.steps && !await_start_after_push);
    if (!exchange.ok()) return exchange.status();
    if (options.graceful_stop != nullptr) {
      // Pushed (before the first step's wait for the job to start): the
      // step's time with its push. A pipelined step's push is still in
      // flight; its forward's wait for the last step's values (inside
      // compute_time) is the part of that exchange that outlasted compute,
      // so a push on a slow link gets its time in the grace too. Both hold
      // waits for the step's peers: the servers hold a stopped worker's
      // step that much longer (LeaveRequest.stopping_grace_s).
      options.graceful_stop->StepWorkDone(exchange->compute_time +
                                          exchange->push_time);
    }
    pulled_ahead = exchange->pulled_ahead;
    if (exchange->skipped) {
      // Caught up at the top of the loop, as a plain step's pull would.
      result.duplicate_blocks += exchange->pushed.blocks_duplicate;
      result.late_blocks += exchange->pushed.blocks_late;
      continue;
    }
    if (await_start_after_push) {
      const absl::Time wait_start = absl::Now();
      if (absl::Status s = options.await_job_start(); !s.ok()) return s;
      const absl::Duration waited = absl::Now() - wait_start;
      start += waited;
      step_start += waited;
    }
    if (step == options.crash_after_step) {
      // The pipelined step's exchange ends first, as the plain one's has.
      if (absl::Status s = runner.Settle(); !s.ok()) return s;
      CrashNow("after its exchange", step);
    }
    if (step == options.sigterm_after_step) {
      InjectSigterm(options.stop, step);
    }
    ++step;
    Tally(*exchange, pull_time, step, window, result);
    const absl::Duration step_time = absl::Now() - step_start;
    if (step > kWarmUpSteps) {
      ++result.steady_steps;
      result.steady_step_seconds += absl::ToDoubleSeconds(step_time);
    }
    StepReport report = ReportOf(step, options, steps_per_epoch, *exchange,
                                 pull_time, step_time);
    if (evaluator.Due(step)) {
      if (absl::Status s = runner.Settle(); !s.ok()) return s;
    }
    if (absl::Status s =
            evaluator.AfterStep(step, pulled_ahead.has_value(), buffers, client,
                                start, result, report);
        !s.ok()) {
      return s;
    }
    if (options.on_step) options.on_step(report);
  }
  // The pipelined step's last PushPull, whose push no step has counted.
  if (absl::Status s = runner.Settle(); !s.ok()) return s;
  result.pipelined = runner.pipelined();
  const PsClient::PushResult settled = runner.TakeSettled();
  result.duplicate_blocks += settled.blocks_duplicate;
  result.late_blocks += settled.blocks_late;
  // A sync worker stopped by a signal waits next for the step it reached,
  // which a worker that stopped before pushing it never completes (its
  // Leave holds it: LeaveRequest.stopping): that wait is still cut short,
  // so that this worker leaves stopping too instead of counting as one that
  // trains (PullFinalModel goes quiet once it has the step).
  if (options.on_steps_done &&
      !(result.stopped_early && mode == ConsistencyMode::kSync)) {
    options.on_steps_done();
  }
  Summarize(options, step, steps_per_epoch, window, absl::Now() - start,
            evaluator.time(), result);
  result.injected_duplicate_pushes = client.injected_duplicate_pushes();

  if (absl::Status s =
          PullFinalModel(options, mode, step, client, buffers, backend, result);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = evaluator.Final(step, mode, start, result); !s.ok()) {
    return s;
  }
  result.peak_rss_bytes = PeakRssBytes();
  result.cast_on_device = buffers.CastsOnDevice();
  return result;
}

std::string FinalJson(const TrainResult& r, int worker_id, int num_workers,
                      const std::string& device) {
  // Not reached (or no target): null, which a JSON reader keeps apart from 0.
  const std::string time_to_target =
      r.step_to_target < 0 ? "null"
                           : absl::StrFormat("%.3f", r.time_to_target_s);
  const std::string step_to_target =
      r.step_to_target < 0 ? "null" : absl::StrCat(r.step_to_target);
  // A worker that trained no step here (it joined a job already at its
  // end: a rerun on a finished job's checkpoints) has no training figures.
  const std::string final_loss =
      r.steps_run > 0 ? absl::StrFormat("%.6f", r.final_loss) : "null";
  const std::string train_accuracy =
      r.steps_run > 0 ? absl::StrFormat("%.4f", r.train_accuracy) : "null";
  return absl::StrFormat(
      "{\"event\":\"final\",\"mode\":\"%s\",\"worker_id\":%d,"
      "\"num_workers\":%d,\"device\":\"%s\",\"steps\":%d,"
      "\"epochs\":%.3f,\"steps_per_epoch\":%d,"
      "\"final_loss\":%s,\"train_accuracy\":%s,\"test_loss\":%.6f,"
      "\"test_accuracy\":%.4f,\"test_examples\":%d,\"final_model\":\"%s\","
      "\"time_to_target_s\":%s,\"step_to_target\":%s,\"evaluations\":%d,"
      "\"evaluation_s\":%.3f,\"samples_per_sec\":%.1f,"
      "\"wall_time_s\":%.3f,\"compute_s\":%.3f,\"network_wait_s\":%.3f,"
      "\"network_wait_share\":%.3f,\"peak_rss_mb\":%.1f,"
      "\"cast_on_device\":%s,\"start_step\":%d,"
      "\"steps_run\":%d,"
      "\"steps_skipped\":%d,\"steps_short\":%d,"
      "\"duplicate_blocks\":%d,\"late_blocks\":%d,"
      "\"injected_duplicate_pushes\":%d,\"stopped_early\":%s,"
      "\"pipelined\":%s,\"fill_gap_ms\":%.3f,\"steady_step_ms\":%.3f,"
      "\"not_learning\":%s,"
      "\"final_state\":\"%s\",\"shards_behind\":[%s]}",
      ConsistencyModeName(r.mode), worker_id, num_workers, device, r.steps,
      r.epochs, r.steps_per_epoch, final_loss, train_accuracy, r.test_loss,
      r.test_accuracy, r.test_examples, r.final_model, time_to_target,
      step_to_target, r.evaluations, r.evaluation_seconds, r.samples_per_sec,
      r.wall_time_s, r.compute_seconds, r.network_wait_seconds,
      r.network_wait_seconds /
          std::max(r.wall_time_s - r.evaluation_seconds, 1e-9),
      r.peak_rss_bytes / 1048576.0, r.cast_on_device ? "true" : "false",
      r.start_step, r.steps_run, r.steps_skipped, r.steps_short,
      r.duplicate_blocks, r.late_blocks, r.injected_duplicate_pushes,
      r.stopped_early ? "true" : "false", r.pipelined ? "true" : "false",
      r.steps_run > 0 ? 1000 * r.fill_gap_seconds / r.steps_run : 0.0,
      r.steady_steps > 0 ? 1000 * r.steady_step_seconds / r.steady_steps : 0.0,
      r.not_learning ? "true" : "false", r.final_state.summary,
      absl::StrJoin(r.final_state.shards_behind, ","));
}

}  // namespace pstrain
