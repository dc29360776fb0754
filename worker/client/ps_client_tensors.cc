// PsClient's tensor calls: dense Pull, Push, Assign and PushPull by blocks,
// and the sparse tables' rows.

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/consistency_mode.h"
#include "common/protocol.h"
#include "common/transport/tensor_codec.h"
#include "glog/logging.h"
#include "worker/client/ps_client_internal.h"

namespace pstrain {

using ps_client_internal::Deserialize;
namespace {

// A pulled group of at least this many float32 bytes (half as many when it
// travels in 16 bits) asks the data plane for its payloads apart, to read
// them straight into the tensors.
constexpr size_t kPayloadsApartFromBytes = 64 << 10;

// A read from a backup, once its primary answered (PushPullReadingBackups):
// this long, plus its values' transfer at this rate (100 Mbit/s), queued
// behind the earlier reads on its link.
constexpr absl::Duration kBackupReadGrace = absl::Seconds(5);
constexpr double kBackupReadSlowestBytesPerSecond = 12.5e6;

// The float32 form of tensor pointers (the calls' own form is by dtype).
template <typename Ref, typename Pointer>
std::vector<Ref> Float32Refs(const std::vector<Pointer>& pointers) {
  std::vector<Ref> refs;
  refs.reserve(pointers.size());
  for (Pointer p : pointers) refs.push_back(Ref{FLOAT32, p});
  return refs;
}

// Copies a payload of exactly out.size() bytes into out.
absl::Status CopySegments(const ByteSegments& data, absl::Span<char> out) {
  size_t total = 0;
  for (absl::string_view piece : data) total += piece.size();
  if (total != out.size()) {
    return absl::DataLossError(absl::StrCat(
        "payload of ", total, " bytes where ", out.size(), " were expected"));
  }
  char* at = out.data();
  for (absl::string_view piece : data) {
    if (piece.empty()) continue;
    std::memcpy(at, piece.data(), piece.size());
    at += piece.size();
  }
  return absl::OkStatus();
}

}  // namespace

DataType PsClient::PushWireType(int tensor) const {
  CHECK(tensor >= 0 && tensor < schema_.dense_size())
      << "PushWireType(" << tensor << "): the model has "
      << schema_.dense_size() << " dense tensors (registered?)";
  return schema_.dense(tensor).role() == DenseTensorSpec::STATE
             ? FLOAT32
             : options_.gradient_wire_type;
}

DataType PsClient::PullWireType(int tensor) const {
  CHECK(tensor >= 0 && tensor < schema_.dense_size())
      << "PullWireType(" << tensor << "): the model has "
      << schema_.dense_size() << " dense tensors (registered?)";
  return schema_.dense(tensor).role() == DenseTensorSpec::STATE
             ? FLOAT32
             : pull_wire_type_;
}

absl::Status PsClient::CheckReturnedBlock(const WireBlock& wire, int g) const {
  const BlockLocation& loc = partition_->blocks()[g];
  if (wire.block != loc.block ||
      wire.tensor != schema_.dense(loc.tensor).name()) {
    return absl::DataLossError(
        absl::StrCat("returned block ", wire.block, " of '", wire.tensor,
                     "' where block ", loc.block, " of '",
                     schema_.dense(loc.tensor).name(), "' was asked for"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::Span<char>>> PsClient::PlacePayloads(
    const Group& group, absl::string_view meta,
    const std::vector<TensorRef>& tensors) {
  absl::StatusOr<WirePullResponse> response =
      ParsePullResponse(absl::MakeConstSpan(&meta, 1));
  if (!response.ok()) return response.status();
  if (response->blocks.size() != group.blocks.size()) {
    return absl::DataLossError(
        absl::StrCat("returned ", response->blocks.size(), " blocks, expected ",
                     group.blocks.size()));
  }
  std::vector<absl::Span<char>> places;
  places.reserve(group.blocks.size());
  for (size_t i = 0; i < group.blocks.size(); ++i) {
    const WireBlock& wire = response->blocks[i];
    const int g = group.blocks[i];
    if (absl::Status s = CheckReturnedBlock(wire, g); !s.ok()) return s;
    const BlockLocation& loc = partition_->blocks()[g];
    const TensorRef& into = tensors[loc.tensor];
    if (wire.dtype != into.dtype || wire.data_size != 0) {
      return absl::DataLossError(absl::StrCat(
          "block ", wire.block, " of '", wire.tensor,
          "' came with its payload inline or as dtype ", wire.dtype,
          " where it was asked apart as ", DataType_Name(into.dtype)));
    }
    const int64_t element_bytes = WireElementBytes(into.dtype);
    places.emplace_back(
        static_cast<char*>(into.data) + loc.offset * element_bytes,
        loc.length * element_bytes);
    block_versions_[g] = wire.version;
  }
  return places;
}

absl::Status PsClient::StoreBlocks(const Group& group,
                                   const WirePullResponse& response,
                                   const std::vector<TensorRef>& tensors) {
  if (response.blocks.size() != group.blocks.size()) {
    return absl::DataLossError(absl::StrCat("returned ", response.blocks.size(),
                                            " blocks, expected ",
                                            group.blocks.size()));
  }
  for (size_t i = 0; i < group.blocks.size(); ++i) {
    const WireBlock& wire = response.blocks[i];
    const int g = group.blocks[i];
    const BlockLocation& loc = partition_->blocks()[g];
    if (absl::Status s = CheckReturnedBlock(wire, g); !s.ok()) return s;
    const TensorRef& into = tensors[loc.tensor];
    absl::Status stored;
    if (wire.dtype != FLOAT32 && wire.dtype != PullWireType(loc.tensor)) {
      stored = absl::DataLossError(
          absl::StrCat("block ", wire.block, " of '", wire.tensor,
                       "' came as dtype ", wire.dtype, ", not FLOAT32 or ",
                       DataType_Name(PullWireType(loc.tensor))));
    } else if (into.dtype == FLOAT32) {
      stored = DecodeSegments(
          wire.dtype, wire.data,
          absl::MakeSpan(static_cast<float*>(into.data) + loc.offset,
                         loc.length),
          /*accumulate=*/false);
    } else if (wire.dtype != into.dtype) {
      stored = absl::DataLossError(absl::StrCat(
          "block ", wire.block, " of '", wire.tensor, "' came as dtype ",
          wire.dtype, ", not ", DataType_Name(into.dtype)));
    } else {
      const int64_t element_bytes = WireElementBytes(into.dtype);
      stored =
          CopySegments(wire.data, absl::MakeSpan(static_cast<char*>(into.data) +
                                                     loc.offset * element_bytes,
                                                 loc.length * element_bytes));
    }
    if (!stored.ok()) return stored;
    block_versions_[g] = wire.version;
  }
  return absl::OkStatus();
}

absl::Status PsClient::CheckPullArguments(
    const std::vector<TensorRef>& tensors) const {
  if (partition_ == nullptr) {
    return absl::FailedPreconditionError("Pull before Register");
  }
  if (static_cast<int>(tensors.size()) != partition_->NumTensors()) {
    return absl::InvalidArgumentError(absl::StrCat("Pull got ", tensors.size(),
                                                   " tensors, the model has ",
                                                   partition_->NumTensors()));
  }
  for (int t = 0; t < partition_->NumTensors(); ++t) {
    if (tensors[t].dtype != FLOAT32 && tensors[t].dtype != PullWireType(t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Pull into '", schema_.dense(t).name(), "' as ",
                       DataType_Name(tensors[t].dtype), ": it comes as ",
                       DataType_Name(PullWireType(t)), " (FLOAT32 takes any)"));
    }
  }
  return absl::OkStatus();
}

std::vector<PsClient::Call> PsClient::PullCalls(
    int64_t step, const std::vector<TensorRef>& tensors) {
  // The block list of each group is serialized once; the step and worker
  // are appended per call, as protobuf allows.
  PullRequest header;
  header.set_worker_id(worker_id_);
  header.set_step(step);
  header.set_dtype(pull_wire_type_);
  const std::string per_call = header.SerializeAsString();
  std::vector<Call> calls(groups_.size());
  for (size_t i = 0; i < groups_.size(); ++i) {
    Call& call = calls[i];
    call.group = &groups_[i];
    call.shard = groups_[i].shard;
    call.connection = groups_[i].connection;
    call.flat = groups_[i].pull_request + per_call;
    // Decoded on gRPC's thread as each response lands, while other RPCs are
    // still in flight; groups write disjoint memory.
    call.on_response = [this, &tensors, group = call.group](
                           absl::Span<const absl::string_view> bytes) {
      absl::StatusOr<WirePullResponse> response = ParsePullResponse(bytes);
      if (!response.ok()) return response.status();
      return StoreBlocks(*group, *response, tensors);
    };
    // Large blocks on the data plane land straight in the tensors; small
    // ones are cheaper to copy out of one read than to read apart, and
    // ones that need converting must be decoded.
    bool as_they_come = true;
    for (int g : groups_[i].blocks) {
      const int t = partition_->blocks()[g].tensor;
      as_they_come = as_they_come && tensors[t].dtype == PullWireType(t);
    }
    if (as_they_come &&
        groups_[i].elements * sizeof(float) >= kPayloadsApartFromBytes) {
      call.place_payloads = [this, &tensors,
                             group = call.group](absl::string_view meta) {
        return PlacePayloads(*group, meta, tensors);
      };
    }
  }
  return calls;
}

int64_t PsClient::RecordPulledStep(int64_t step) {
  int64_t pulled = step;
  if (mode_ == ConsistencyMode::kSync && !block_versions_.empty()) {
    // Blocks past `step` mean the job moved on without this worker:
    // continue from the step every block is at.
    int64_t at = std::numeric_limits<int64_t>::max();
    for (int64_t version : block_versions_) at = std::min(at, version);
    pulled = std::max(at, step);
  }
  NoteFurthestPulled(pulled);
  return pulled;
}

bool PsClient::PulledBlocksDisagree() const {
  if (mode_ != ConsistencyMode::kSync || block_versions_.empty()) return false;
  const auto [lowest, highest] =
      std::minmax_element(block_versions_.begin(), block_versions_.end());
  return *lowest != *highest;
}

absl::StatusOr<int64_t> PsClient::FinishObserverRead(
    int64_t step, const std::vector<TensorRef>& tensors) {
  // An observer (pstrain_export, an evaluation) reading a running sync job
  // finds its shards a step apart about as often as not, and is no member
  // to skip with: it reads again at the step after the furthest, which
  // each shard answers as that step completes there, before any of its
  // blocks can move on (the next step's pushes need this step's values).
  constexpr int kReadsAtMost = 3;
  for (int reads = 0; reads < kReadsAtMost && PulledBlocksDisagree(); ++reads) {
    const auto [lowest, highest] =
        std::minmax_element(block_versions_.begin(), block_versions_.end());
    const int64_t from = *lowest, next = *highest + 1;
    std::vector<Call> pulls = PullCalls(next, tensors);
    if (absl::Status s =
            RunAll("Pull", pulls, options_.rpc_timeout, /*retry=*/true);
        !s.ok()) {
      if (!absl::IsDeadlineExceeded(s)) return s;
      return absl::FailedPreconditionError(absl::StrCat(
          "the shards hold steps ", from, " to ", next - 1,
          " and none reached step ", next, " within ",
          absl::FormatDuration(options_.rpc_timeout),
          ": a sync job stopped between two steps (read its checkpoint "
          "instead); ",
          s.message()));
    }
    step = next;
  }
  if (PulledBlocksDisagree()) {
    return absl::AbortedError(absl::StrCat(
        "the shards were at different steps in each of ", kReadsAtMost,
        " reads (a worker's lease ran out meanwhile?); read again"));
  }
  return RecordPulledStep(step);
}

absl::StatusOr<int64_t> PsClient::FinishPlainRead(
    int64_t step, const std::vector<TensorRef>& tensors) {
  if (worker_id_ < 0) return FinishObserverRead(step, tensors);
  // A skip completes the step on the shards behind, so one more read finds
  // every block at one step unless another lease ran out meanwhile.
  constexpr int kSkipsAtMost = 3;
  for (int skips = 0; skips < kSkipsAtMost && PulledBlocksDisagree(); ++skips) {
    const auto [lowest, highest] =
        std::minmax_element(block_versions_.begin(), block_versions_.end());
    const int64_t skip_to = *highest;
    // One request, the same to every shard: those already at skip_to
    // have nothing of this worker to mark.
    LOG(WARNING) << "the read of step " << step << " found blocks at steps "
                 << *lowest << " and " << skip_to
                 << ": a shard went on without this worker (its lease ran out "
                    "there); it skips to step "
                 << skip_to << " on every shard";
    HeartbeatRequest skip;
    skip.set_worker_id(worker_id_);
    skip.set_incarnation(incarnation_);
    skip.set_step(skip_to);
    skip.set_skip_to_step(skip_to);
    const std::string flat = skip.SerializeAsString();
    std::vector<Call> heartbeats(num_shards());
    for (int s = 0; s < num_shards(); ++s) {
      heartbeats[s].shard = s;
      heartbeats[s].flat = flat;
    }
    if (absl::Status s = RunAll("Heartbeat", heartbeats, options_.rpc_timeout);
        !s.ok()) {
      return s;
    }
    NoteFurthestPulled(skip_to);
    std::vector<Call> pulls = PullCalls(skip_to, tensors);
    if (absl::Status s =
            RunAll("Pull", pulls, options_.rpc_timeout, /*retry=*/true);
        !s.ok()) {
      return s;
    }
    step = skip_to;
  }
  return RecordPulledStep(step);
}

void PsClient::NoteFurthestPulled(int64_t step) {
  int64_t furthest = furthest_pulled_step_.load();
  while (step > furthest &&
         !furthest_pulled_step_.compare_exchange_weak(furthest, step)) {
  }
}

absl::StatusOr<int64_t> PsClient::Pull(int64_t step,
                                       const std::vector<float*>& tensors) {
  return PullTensors(step, Float32Refs<TensorRef>(tensors));
}

absl::StatusOr<int64_t> PsClient::PullTensors(
    int64_t step, const std::vector<TensorRef>& tensors) {
  if (absl::Status s = CheckPullArguments(tensors); !s.ok()) return s;
  std::vector<Call> calls = PullCalls(step, tensors);
  if (absl::Status s =
          RunAll("Pull", calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    return s;
  }
  return FinishPlainRead(step, tensors);
}

absl::StatusOr<std::vector<PsClient::Call>> PsClient::PushCalls(
    int64_t step, const std::vector<ConstTensorRef>& gradients,
    absl::Span<const int> only, std::vector<PushResponse>& responses,
    bool exact_values, size_t inline_below_bytes) {
  if (partition_ == nullptr) {
    return absl::FailedPreconditionError("Push before Register");
  }
  if (static_cast<int>(gradients.size()) != partition_->NumTensors()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Push got ", gradients.size(), " tensors, the model has ",
                     partition_->NumTensors()));
  }
  std::vector<bool> selected(gradients.size(), only.empty());
  for (int tensor : only) {
    if (tensor < 0 || tensor >= partition_->NumTensors()) {
      return absl::InvalidArgumentError(absl::StrCat("Push of tensor ", tensor,
                                                     "; the model has ",
                                                     partition_->NumTensors()));
    }
    selected[tensor] = true;
  }
  // Values (Assign, STATE tensors) are never compressed: only a
  // gradient's rounding is harmless.
  auto wire_type_of = [&](int tensor) {
    return exact_values ? FLOAT32 : PushWireType(tensor);
  };
  for (int t = 0; t < partition_->NumTensors(); ++t) {
    const DataType given = gradients[t].dtype;
    if (selected[t] && given != FLOAT32 &&
        (given != wire_type_of(t) || WireElementBytes(given) == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("Push of '", schema_.dense(t).name(), "' given as ",
                       DataType_Name(given), ": it goes as ",
                       DataType_Name(wire_type_of(t)), " (FLOAT32 takes any)"));
    }
  }
  std::vector<Call> calls;
  calls.reserve(groups_.size());
  responses.assign(groups_.size(), PushResponse());
  std::vector<OutgoingBlock> blocks;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& group = groups_[i];
    blocks.clear();
    for (int g : group.blocks) {
      const BlockLocation& loc = partition_->blocks()[g];
      if (!selected[loc.tensor]) continue;
      const ConstTensorRef& from = gradients[loc.tensor];
      const DataType wire_type = wire_type_of(loc.tensor);
      const int64_t element_bytes = WireElementBytes(from.dtype);
      absl::string_view data(
          static_cast<const char*>(from.data) + loc.offset * element_bytes,
          loc.length * element_bytes);
      // Sent as given when it is in its wire type already (float32 on a
      // float32 wire, or 16-bit elements a device cast); float32 is
      // converted here.
      if (from.dtype == FLOAT32 && wire_type != FLOAT32) {
        const float* values = static_cast<const float*>(from.data) + loc.offset;
        if (wire_type == TOPK_FLOAT32) {
          // Error feedback: what earlier pushes left out rides along.
          std::vector<float>& residual = topk_residual_[g];
          residual.resize(loc.length);
          for (int64_t k = 0; k < loc.length; ++k) residual[k] += values[k];
          EncodeTopK(absl::MakeSpan(residual),
                     static_cast<int64_t>(std::ceil(
                         options_.gradient_topk_fraction * loc.length)),
                     &encoded_[g]);
        } else {
          EncodeFromFloat32(wire_type, absl::MakeConstSpan(values, loc.length),
                            &encoded_[g]);
        }
        data = encoded_[g];
      }
      blocks.push_back(OutgoingBlock{{schema_.dense(loc.tensor).name(),
                                      loc.block, wire_type, block_versions_[g]},
                                     data});
    }
    if (blocks.empty()) continue;
    Call& call = calls.emplace_back();
    call.group = &group;
    call.shard = group.shard;
    call.connection = group.connection;
    call.message = EncodePushRequest(
        kProtocolVersion, worker_id_, step, blocks, inline_below_bytes,
        PushExtras{group_rates_, group_momentums_, clip_max_norm_});
    call.on_response = [&responses, i, &life = server_lives_[group.shard]](
                           absl::Span<const absl::string_view> bytes) {
      absl::Status parsed = Deserialize(bytes, &responses[i]);
      if (parsed.ok() && responses[i].server_life() != 0) {
        life.store(responses[i].server_life());
      }
      return parsed;
    };
  }
  return calls;
}

PsClient::PushResult PsClient::SumPushResponses(
    const std::vector<PushResponse>& responses) {
  PushResult result;
  for (const PushResponse& response : responses) {
    result.blocks_duplicate += response.blocks_duplicate();
    result.blocks_late += response.blocks_late();
  }
  return result;
}

absl::Status PsClient::InjectDuplicatePushes(const std::vector<Call>& pushed) {
  if (options_.inject_duplicate_push_probability <= 0) return absl::OkStatus();
  std::vector<Call> again;
  for (const Call& call : pushed) {
    if (!absl::Bernoulli(random_, options_.inject_duplicate_push_probability)) {
      continue;
    }
    Call& copy = again.emplace_back();
    copy.shard = call.shard;
    copy.connection = call.connection;
    copy.message = call.message;
  }
  injected_duplicates_ += static_cast<int64_t>(again.size());
  return RunAll("Push", again, options_.rpc_timeout, /*retry=*/true);
}

void PsClient::InjectPushJitter() {
  if (options_.inject_push_jitter <= absl::ZeroDuration()) return;
  // PushSparse may run on another thread than the dense calls (CTR).
  thread_local absl::BitGen random;
  SleepUnlessInterrupted(
      options_.inject_push_jitter * absl::Uniform(random, 0.0, 1.0),
      interrupts());
}

absl::StatusOr<PsClient::PushResult> PsClient::Push(
    int64_t step, const std::vector<const float*>& gradients,
    absl::Span<const int> only) {
  return PushTensors(step, Float32Refs<ConstTensorRef>(gradients), only);
}

absl::StatusOr<PsClient::PushResult> PsClient::PushTensors(
    int64_t step, const std::vector<ConstTensorRef>& gradients,
    absl::Span<const int> only) {
  InjectPushJitter();
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> calls =
      PushCalls(step, gradients, only, responses);
  if (!calls.ok()) return calls.status();
  if (absl::Status s =
          RunAll("Push", *calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    return s;
  }
  const PushResult result = SumPushResponses(responses);
  if (absl::Status s = InjectDuplicatePushes(*calls); !s.ok()) return s;
  if (clip_max_norm_ > 0 && only.empty()) {
    if (absl::Status s = FinishClippedStep(step); !s.ok()) return s;
  }
  return result;
}

absl::Status PsClient::FinishClippedStep(int64_t step) {
  ClipNormRequest request;
  request.set_protocol_version(kProtocolVersion);
  request.set_worker_id(worker_id_);
  request.set_step(step);
  std::vector<Call> calls(num_shards());
  std::vector<ClipNormResponse> shares(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].flat = request.SerializeAsString();
    calls[s].on_response = [&shares,
                            s](absl::Span<const absl::string_view> bytes) {
      return Deserialize(bytes, &shares[s]);
    };
  }
  if (absl::Status st =
          RunAll("ClipNorm", calls, options_.rpc_timeout, /*retry=*/true);
      !st.ok()) {
    return st;
  }
  // Summed in shard order, so every worker computes the same coefficient.
  // Applied already: another worker did it, and the shards that applied it
  // say the norm (a replica that took over since has it from the step's
  // record; a block past a later clipped step says 0).
  bool applied = false;
  double applied_norm = 0;
  for (const ClipNormResponse& share : shares) {
    applied = applied || share.applied();
    applied_norm = std::max(applied_norm, share.applied_norm());
  }
  if (applied) {
    last_clip_norm_ = applied_norm;
    return absl::OkStatus();
  }
  double sum_of_squares = 0, max_norm = 0;
  for (const ClipNormResponse& share : shares) {
    sum_of_squares += share.sum_of_squares();
    max_norm = std::max(max_norm, share.max_norm());
  }
  last_clip_norm_ = std::sqrt(sum_of_squares);
  // torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), at most 1.
  const double coefficient = std::min(1.0, max_norm / (last_clip_norm_ + 1e-6));
  ApplyClipRequest apply;
  apply.set_protocol_version(kProtocolVersion);
  apply.set_worker_id(worker_id_);
  apply.set_step(step);
  apply.set_coefficient(coefficient);
  apply.set_norm(last_clip_norm_);
  std::vector<Call> applies(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    applies[s].shard = s;
    applies[s].flat = apply.SerializeAsString();
  }
  return RunAll("ApplyClip", applies, options_.rpc_timeout, /*retry=*/true);
}

absl::StatusOr<PsClient::PushResult> PsClient::Assign(
    const std::vector<const float*>& values, absl::Span<const int> only) {
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> calls =
      PushCalls(/*step=*/0, Float32Refs<ConstTensorRef>(values), only,
                responses, /*exact_values=*/true);
  if (!calls.ok()) return calls.status();
  if (absl::Status s =
          RunAll("Assign", *calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    return s;
  }
  return SumPushResponses(responses);
}

absl::StatusOr<PsClient::PushPullResult> PsClient::PushPull(
    int64_t push_step, const std::vector<const float*>& gradients,
    int64_t pull_step, const std::vector<float*>& tensors) {
  return PushPullTensors(push_step, Float32Refs<ConstTensorRef>(gradients),
                         pull_step, Float32Refs<TensorRef>(tensors));
}

absl::StatusOr<PsClient::PushPullResult> PsClient::PushPullTensors(
    int64_t push_step, const std::vector<ConstTensorRef>& gradients,
    int64_t pull_step, const std::vector<TensorRef>& tensors) {
  if (absl::Status s = CheckPullArguments(tensors); !s.ok()) return s;
  if (clip_max_norm_ > 0) {
    // The pull of a clipped step waits for its coefficient, which needs
    // the norm of every shard's share first: a push, then the clip, then
    // the pull, instead of one round trip.
    absl::StatusOr<PushResult> pushed = PushTensors(push_step, gradients);
    if (!pushed.ok()) return pushed.status();
    absl::StatusOr<int64_t> pulled = PullTensors(pull_step, tensors);
    if (!pulled.ok()) return pulled.status();
    return PushPullResult{*pushed, *pulled};
  }
  InjectPushJitter();
  // Backup reads go outside RunAll, which would send the kept pushes first.
  ResendIfReplicaMoved(absl::Now() + options_.retry_window);
  std::vector<int> read_from(num_shards(), -1);
  bool backup_reads = false;
  for (int s = 0; s < num_shards() && options_.pulls_from_backups !=
                                          PsClientOptions::BackupReads::kNever;
       ++s) {
    // The attempt runs on the data plane alone: a shard whose PushPull
    // would go over gRPC makes it the plain PushPull for this step.
    if (DataPortToUse(s) == 0 || !DataPushPullOffered(s)) {
      backup_reads = false;
      break;
    }
    read_from[s] = BackupToReadFrom(s);
    backup_reads |= read_from[s] >= 0;
  }
  if (backup_reads) {
    const uint64_t epoch = interrupts();
    absl::StatusOr<PushPullResult> read = PushPullReadingBackups(
        push_step, gradients, pull_step, tensors, read_from);
    if (read.ok()) return read;
    if (interrupts() != epoch) {
      return absl::CancelledError(
          "PushPull interrupted (Interrupt: a signal, or Ctrl-C in Python)");
    }
    // Sent again as a plain PushPull: whatever push arrived is a duplicate.
    LOG(WARNING) << "step " << push_step
                 << " goes again without backup reads: " << read.status();
  }
  // One PushPull per group, all sent at once. A sync server answers a
  // connection's requests in order, each once its group's step completes;
  // every worker sends the groups in the same order, so the steps complete
  // in that order and no answer waits on a request behind it. On a link
  // that binds, the answer of one group then travels while the pushes of
  // the next ones still arrive: with small groups (--block_elements) on
  // one connection per shard, a step approaches the link-bound ideal
  // instead of twice it (bench/results/netns_link_speed.txt). Pushing
  // everything first and then pulling cannot overlap the two.
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> calls =
      PushPullCalls(push_step, gradients, pull_step, tensors, responses);
  if (!calls.ok()) return calls.status();
  if (absl::Status s =
          RunAll("PushPull", *calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    // Some shards may have taken the step and answered its pull.
    RetainPushes(*calls, push_step, /*answered=*/false);
    return s;
  }
  RetainPushes(*calls, push_step, /*answered=*/true);
  PushPullResult result;
  result.pushed = SumPushResponses(responses);
  if (absl::Status s = InjectDuplicatePushes(*calls); !s.ok()) return s;
  absl::StatusOr<int64_t> pulled = FinishPlainRead(pull_step, tensors);
  if (!pulled.ok()) return pulled.status();
  result.pulled_step = *pulled;
  return result;
}

absl::StatusOr<std::vector<PsClient::Call>> PsClient::PushPullCalls(
    int64_t push_step, const std::vector<ConstTensorRef>& gradients,
    int64_t pull_step, const std::vector<TensorRef>& tensors,
    std::vector<PushResponse>& responses, size_t inline_below_bytes) {
  absl::StatusOr<std::vector<Call>> pushes =
      PushCalls(push_step, gradients, /*only=*/{}, responses,
                /*exact_values=*/false, inline_below_bytes);
  if (!pushes.ok()) return pushes.status();
  std::vector<Call> calls = PullCalls(pull_step, tensors);
  // Every group has blocks of some tensor, so with all tensors pushed the
  // push calls are the groups in order, as the pull calls are.
  CHECK_EQ(pushes->size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    calls[i].message = std::move((*pushes)[i].message);
    calls[i].on_push_response = std::move((*pushes)[i].on_response);
  }
  return calls;
}

absl::StatusOr<PsClient::PushPullResult> PsClient::PushPullReadingBackups(
    int64_t push_step, const std::vector<ConstTensorRef>& gradients,
    int64_t pull_step, const std::vector<TensorRef>& tensors,
    const std::vector<int>& read_from) {
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> push_pulls =
      PushPullCalls(push_step, gradients, pull_step, tensors, responses);
  if (!push_pulls.ok()) return push_pulls.status();
  // Protobuf merges fields appended to a message: the flags go after the
  // pull as it was built.
  static const std::string* const values_elsewhere = [] {
    PullRequest flag;
    flag.set_values_elsewhere(true);
    return new std::string(flag.SerializeAsString());
  }();
  static const std::string* const replica_read = [] {
    PullRequest flag;
    flag.set_replica_read(true);
    return new std::string(flag.SerializeAsString());
  }();
  std::vector<Call> calls;
  calls.reserve(2 * push_pulls->size());  // `sent` below stays put
  // Per shard and connection: the values read from the backup so far, in
  // bytes; each read queues behind the earlier ones on its link.
  std::map<std::pair<int, int>, int64_t> bytes_read;
  for (Call& push_pull : *push_pulls) {
    const int backup = read_from[push_pull.shard];
    Call& sent = calls.emplace_back(std::move(push_pull));
    if (backup < 0) continue;
    const int sent_index = static_cast<int>(calls.size()) - 1;
    // The primary answers once the step is in, without the values; the
    // backup, once it applied the step's record, with them.
    Call& read = calls.emplace_back();
    read.shard = sent.shard;
    read.connection = sent.connection;
    read.group = sent.group;
    // The primary answers once the step is in, and the record is on its
    // way to the backup then, so from then on the backup's answer is the
    // record's apply and its transfer: a backup that went
    // silent, or that the worker cannot reach, then costs the step
    // kBackupReadGrace and the values' time at kBackupReadSlowestRate, not
    // the call's deadline, before it goes again without backup reads.
    int64_t& queued =
        bytes_read[{read.shard, DataConnectionOf(read.shard, read.connection)}];
    queued += sent.group->elements * int64_t{sizeof(float)};  // at most
    read.after = sent_index;
    read.grace =
        kBackupReadGrace + absl::Seconds(static_cast<double>(queued) /
                                         kBackupReadSlowestBytesPerSecond);
    read.flat = sent.flat + *replica_read;
    read.on_response = std::move(sent.on_response);
    read.place_payloads = std::move(sent.place_payloads);
    read.read_replica = backup;
    sent.flat += *values_elsewhere;
    sent.on_response = [](absl::Span<const absl::string_view>) {
      return absl::OkStatus();
    };
    sent.place_payloads = nullptr;
  }
  std::vector<size_t> all(calls.size());
  const uint64_t epoch = interrupts();
  for (size_t i = 0; i < calls.size(); ++i) {
    all[i] = i;
    calls[i].epoch = epoch;
    calls[i].replica = current_replica_[calls[i].shard];  // RetainPushes
  }
  const std::vector<size_t> not_sent =
      RunOnDataPlane("PushPull", calls, all, options_.rpc_timeout);
  for (size_t i : not_sent) {
    if (calls[i].read_replica >= 0) {
      StopBackupReads(calls[i].shard,
                      absl::UnavailableError("its push was not sent"));
    }
  }
  if (!not_sent.empty()) {
    return absl::UnavailableError("a shard's data plane is not open");
  }
  for (const Call& call : calls) {
    if (call.status.ok()) continue;
    if (call.read_replica >= 0 && interrupts() == epoch) {
      StopBackupReads(call.shard, call.status);
    }
    return call.status;
  }
  {
    absl::MutexLock lock(&data_ports_mu_);
    for (int s = 0; s < num_shards(); ++s) {
      if (read_from[s] >= 0) backup_read_failures_[s] = 0;
    }
  }
  RetainPushes(calls, push_step, /*answered=*/true);
  PushPullResult result;
  result.pushed = SumPushResponses(responses);
  absl::StatusOr<int64_t> pulled = FinishPlainRead(pull_step, tensors);
  if (!pulled.ok()) return pulled.status();
  result.pulled_step = *pulled;
  return result;
}

bool PsClient::IsSyncTable(const SparseTableSpec& spec) const {
  // The servers accepted the table's mode at registration.
  return TableConsistencyMode(mode_, spec.name(), spec.mode())
             .value_or(mode_) == ConsistencyMode::kSync;
}

absl::Status PsClient::PullSparse(int table, int64_t step,
                                  absl::Span<const uint64_t> ids, float* out) {
  return PullSparse(step, {SparsePullPart{table, ids, out}});
}

absl::Status PsClient::PullSparse(int64_t step,
                                  absl::Span<const SparsePullPart> parts) {
  for (const SparsePullPart& part : parts) {
    if (part.table < 0 || part.table >= schema_.sparse_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("no sparse table ", part.table, " in the model"));
    }
  }
  // positions[p][s]: where shard s's rows of part p go in its `out`;
  // missing[p]: the rows of part p the cache did not have (all without one).
  std::vector<std::vector<std::vector<size_t>>> positions(parts.size());
  std::vector<std::vector<size_t>> missing(parts.size());
  // ids[p][s]: the ids of part p that shard s is asked for (swapped into
  // its request).
  std::vector<std::vector<google::protobuf::RepeatedField<uint64_t>>> ids(
      parts.size());
  // asked[s]: the parts shard s gets, in order.
  std::vector<std::vector<size_t>> asked(num_shards());
  for (size_t p = 0; p < parts.size(); ++p) {
    const SparseTableSpec& spec = schema_.sparse(parts[p].table);
    const int64_t dim = spec.dim();
    if (row_cache_ != nullptr) {
      missing[p] = row_cache_->Lookup(parts[p].table, dim, step, parts[p].ids,
                                      parts[p].out);
    } else {
      missing[p].resize(parts[p].ids.size());
      std::iota(missing[p].begin(), missing[p].end(), size_t{0});
    }
    positions[p].resize(num_shards());
    ids[p].resize(num_shards());
    const SparseShards shards(spec.name(), num_shards());
    for (size_t i : missing[p]) {
      const int s = shards.Of(parts[p].ids[i]);
      positions[p][s].push_back(i);
      ids[p][s].Add(parts[p].ids[i]);
    }
    // A sync table's pull is also its step's barrier (it returns once the
    // table has every member's rows of the step before): every shard gets
    // one, with no ids where the batch (or the row cache) needs none, or
    // this worker's next push could reach a shard still a step behind.
    const bool sync_table = IsSyncTable(spec);
    for (int s = 0; s < num_shards(); ++s) {
      if (!positions[p][s].empty() || sync_table) asked[s].push_back(p);
    }
  }
  // Rows of part p from shard s, in the order they were asked for.
  auto store = [&](size_t p, int s, const SparsePullResponse& response) {
    const int64_t dim = schema_.sparse(parts[p].table).dim();
    const std::vector<size_t>& where = positions[p][s];
    if (response.values().size() != where.size() * dim * sizeof(float)) {
      return absl::DataLossError(absl::StrCat(
          "sparse pull of '", schema_.sparse(parts[p].table).name(),
          "' returned ", response.values().size(), " bytes for ", where.size(),
          " rows of dim ", dim));
    }
    const char* values = response.values().data();
    for (size_t r = 0; r < where.size(); ++r) {
      std::memcpy(parts[p].out + where[r] * dim,
                  values + r * dim * sizeof(float), dim * sizeof(float));
    }
    return absl::OkStatus();
  };
  // One call per shard carrying every table it is asked for, where every
  // shard takes that; else one per table and shard.
  std::vector<Call> calls;
  for (int s = 0; s < num_shards(); ++s) {
    for (size_t first = 0; first < asked[s].size();) {
      const size_t last = sparse_pull_tables_ ? asked[s].size() : first + 1;
      SparsePullRequest request;
      request.set_protocol_version(kProtocolVersion);
      request.set_worker_id(worker_id_);
      request.set_step(step);
      for (size_t k = first; k < last; ++k) {
        const size_t p = asked[s][k];
        const std::string& table = schema_.sparse(parts[p].table).name();
        if (k == first) {
          request.set_table(table);
          request.mutable_ids()->Swap(&ids[p][s]);
        } else {
          SparseTableIds* more = request.add_more();
          more->set_table(table);
          more->mutable_ids()->Swap(&ids[p][s]);
        }
      }
      Call& call = calls.emplace_back();
      call.shard = s;
      call.connection = static_cast<int>(calls.size() - 1) % connections_;
      call.flat = request.SerializeAsString();
      call.on_response = [&store, &asked, s, first,
                          last](absl::Span<const absl::string_view> bytes) {
        SparsePullResponse response;
        if (absl::Status st = Deserialize(bytes, &response); !st.ok()) {
          return st;
        }
        if (response.more_size() != static_cast<int>(last - first - 1)) {
          return absl::DataLossError(
              absl::StrCat("sparse pull of ", last - first, " tables answered ",
                           response.more_size() + 1));
        }
        for (size_t k = first; k < last; ++k) {
          const SparsePullResponse& part =
              k == first ? response : response.more(k - first - 1);
          if (absl::Status st = store(asked[s][k], s, part); !st.ok()) {
            return st;
          }
        }
        return absl::OkStatus();
      };
      first = last;
    }
  }
  if (absl::Status s =
          RunAll("SparsePull", calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    return s;
  }
  if (row_cache_ != nullptr) {
    for (size_t p = 0; p < parts.size(); ++p) {
      row_cache_->Insert(parts[p].table, schema_.sparse(parts[p].table).dim(),
                         step, parts[p].ids, missing[p], parts[p].out);
    }
  }
  // Not RecordPulledStep: it reads the dense pulls' block versions, which
  // a dense Pull on another thread may be writing.
  NoteFurthestPulled(step);
  return absl::OkStatus();
}

absl::StatusOr<PsClient::PushResult> PsClient::PushSparse(
    int table, int64_t step, absl::Span<const uint64_t> ids,
    const float* grads) {
  return PushSparse(step, {SparsePushPart{table, ids, grads}});
}

absl::StatusOr<PsClient::PushResult> PsClient::PushSparse(
    int64_t step, absl::Span<const SparsePushPart> parts) {
  for (const SparsePushPart& part : parts) {
    if (part.table < 0 || part.table >= schema_.sparse_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("no sparse table ", part.table, " in the model"));
    }
  }
  InjectPushJitter();
  // Rows are already the few that changed: top-k has nothing to drop.
  const DataType wire_type = options_.gradient_wire_type == TOPK_FLOAT32
                                 ? FLOAT32
                                 : options_.gradient_wire_type;
  // Each table's rows for each shard; where every shard takes several
  // tables in one call, a shard's go in one SparsePush (the first table in
  // the request itself, the others in `more`), else one call each.
  std::vector<std::vector<SparsePushRequest>> by_shard(num_shards());
  for (const SparsePushPart& part : parts) {
    const SparseTableSpec& spec = schema_.sparse(part.table);
    const int64_t dim = spec.dim();
    std::vector<SparsePushRequest> requests(num_shards());
    std::vector<std::vector<float>> rows(num_shards());
    const SparseShards shards(spec.name(), num_shards());
    for (size_t i = 0; i < part.ids.size(); ++i) {
      const int s = shards.Of(part.ids[i]);
      requests[s].add_ids(part.ids[i]);
      rows[s].insert(rows[s].end(), part.grads + i * dim,
                     part.grads + (i + 1) * dim);
    }
    const bool sync_table = IsSyncTable(spec);
    for (int s = 0; s < num_shards(); ++s) {
      // Sync steps complete only when every member has pushed, even nothing.
      if (requests[s].ids_size() == 0 && !sync_table) continue;
      requests[s].set_table(spec.name());
      requests[s].set_dtype(wire_type);
      EncodeFromFloat32(wire_type, rows[s], requests[s].mutable_gradients());
      by_shard[s].push_back(std::move(requests[s]));
    }
  }
  std::vector<Call> calls;
  for (int s = 0; s < num_shards(); ++s) {
    std::vector<SparsePushRequest>& tables = by_shard[s];
    for (size_t first = 0; first < tables.size();) {
      const size_t end = sparse_push_tables_ ? tables.size() : first + 1;
      SparsePushRequest& request = tables[first];
      for (size_t t = first + 1; t < end; ++t) {
        *request.add_more() = std::move(tables[t]);
      }
      request.set_protocol_version(kProtocolVersion);
      request.set_worker_id(worker_id_);
      request.set_step(step);
      Call& call = calls.emplace_back();
      call.shard = s;
      call.connection = static_cast<int>(calls.size() - 1) % connections_;
      call.flat = request.SerializeAsString();
      first = end;
    }
  }
  std::vector<SparsePushResponse> responses(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    calls[c].on_response = [&responses,
                            c](absl::Span<const absl::string_view> bytes) {
      return Deserialize(bytes, &responses[c]);
    };
  }
  if (absl::Status st =
          RunAll("SparsePush", calls, options_.rpc_timeout, /*retry=*/true);
      !st.ok()) {
    return st;
  }
  PushResult result;
  auto count = [&result](const SparsePushResponse& answer) {
    result.blocks_duplicate += answer.duplicate();
    result.blocks_late += answer.late();
  };
  for (const SparsePushResponse& response : responses) {
    count(response);
    for (const SparsePushResponse& more : response.more()) count(more);
  }
  return result;
}

// The pipelined step's stream (--pipeline_step).
PsClient::StepStream::StepStream(const Partition& partition, int num_tensors)
    : partition_(partition),
      blocks_of_tensor_(num_tensors),
      ready_end_(new std::atomic<int64_t>[num_tensors]),
      num_tensors_(num_tensors) {
  const std::vector<BlockLocation>& blocks = partition.blocks();
  for (size_t g = 0; g < blocks.size(); ++g) {
    blocks_of_tensor_[blocks[g].tensor].push_back(static_cast<int>(g));
  }
  for (int t = 0; t < num_tensors; ++t) ready_end_[t].store(0);
  pulled_.assign(blocks.size(), 1);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

int64_t PsClient::StepStream::FirstBlockElements(int tensor) const {
  const std::vector<int>& blocks = blocks_of_tensor_[tensor];
  return blocks.empty() ? 1 : partition_.blocks()[blocks.front()].length;
}

PsClient::StepStream::~StepStream() {
  if (wake_fd_ >= 0) close(wake_fd_);
}

void PsClient::StepStream::BeginStep() {
  for (int t = 0; t < num_tensors_; ++t) ready_end_[t].store(0);
  absl::MutexLock lock(&mu_);
  std::fill(pulled_.begin(), pulled_.end(), 0);
  failed_ = absl::OkStatus();
  refetch_ = false;
  refetched_ = false;
  not_reading_ = false;
  cancelled_ = false;
}

bool PsClient::StepStream::TakeRefetched() {
  absl::MutexLock lock(&mu_);
  const bool refetched = refetched_;
  refetched_ = false;
  return refetched;
}

bool PsClient::StepStream::AllReady() const {
  for (int t = 0; t < num_tensors_; ++t) {
    const std::vector<int>& blocks = blocks_of_tensor_[t];
    if (blocks.empty()) continue;
    const BlockLocation& last = partition_.blocks()[blocks.back()];
    if (ready_end_[t].load(std::memory_order_acquire) <
        last.offset + last.length) {
      return false;
    }
  }
  return true;
}

bool PsClient::StepStream::failed() {
  absl::MutexLock lock(&mu_);
  return !failed_.ok();
}

void PsClient::StepStream::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
}

void PsClient::StepStream::StopReading() {
  absl::MutexLock lock(&mu_);
  not_reading_ = true;
}

bool PsClient::StepStream::AwaitRefetch(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  refetch_ = true;
  refetched_ = true;
  std::fill(pulled_.begin(), pulled_.end(), 0);
  // The gradients are made on the compute thread, which takes no lock: it
  // is looked at again every millisecond.
  while (!(not_reading_ && AllReady())) {
    if (absl::Now() >= deadline || cancelled_) return false;
    mu_.AwaitWithTimeout(absl::Condition(&not_reading_), absl::Milliseconds(1));
  }
  return true;
}

void PsClient::StepStream::SetReady(int tensor, int64_t end) {
  ready_end_[tensor].store(end, std::memory_order_release);
  Trace('r', tensor, end);
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

bool PsClient::StepStream::BlocksReady(const std::vector<int>& blocks) const {
  for (int g : blocks) {
    const BlockLocation& b = partition_.blocks()[g];
    if (ready_end_[b.tensor].load(std::memory_order_acquire) <
        b.offset + b.length) {
      return false;
    }
  }
  return true;
}

void PsClient::StepStream::MarkPulled(const std::vector<int>& blocks) {
  TraceGroup('p', blocks);
  absl::MutexLock lock(&mu_);
  for (int g : blocks) pulled_[g] = 1;
  ++landings_;
}

int64_t PsClient::StepStream::PulledEnd(int tensor) {
  absl::MutexLock lock(&mu_);
  int64_t end = 0;
  for (int g : blocks_of_tensor_[tensor]) {
    if (!pulled_[g]) break;
    const BlockLocation& b = partition_.blocks()[g];
    end = b.offset + b.length;
  }
  return end;
}

int64_t PsClient::StepStream::landings() {
  absl::MutexLock lock(&mu_);
  return landings_;
}

bool PsClient::StepStream::AwaitLanding(int64_t seen, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto changed = [&]() {
    mu_.AssertHeld();
    return landings_ != seen || !failed_.ok() || refetch_;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&changed), deadline) &&
         failed_.ok() && !refetch_;
}

void PsClient::StepStream::Trace(char what, int tensor, int64_t end) {
  if (!tracing_.load(std::memory_order_relaxed)) return;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&trace_mu_);
  trace_.push_back({now, what, tensor, end});
}

void PsClient::StepStream::TraceGroup(char what,
                                      const std::vector<int>& blocks) {
  if (blocks.empty() || !tracing_.load(std::memory_order_relaxed)) return;
  const BlockLocation& last = partition_.blocks()[blocks.back()];
  Trace(what, last.tensor, last.offset + last.length);
}

std::vector<PsClient::StepStream::TraceEvent>
PsClient::StepStream::TakeTrace() {
  absl::MutexLock lock(&trace_mu_);
  return std::exchange(trace_, {});
}

void PsClient::StepStream::MarkAllPulled(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  std::fill(pulled_.begin(), pulled_.end(), 1);
  refetch_ = false;
  if (!status.ok()) failed_ = status;
}

absl::Status PsClient::StepStream::WaitPulled(int tensor, int64_t end,
                                              absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (refetch_) {
    not_reading_ = true;
    return absl::AbortedError("pipelined step: the values are pulled again");
  }
  auto in = [&]() {
    mu_.AssertHeld();
    if (!failed_.ok() || refetch_) return true;
    for (int g : blocks_of_tensor_[tensor]) {
      if (partition_.blocks()[g].offset >= end) break;
      if (!pulled_[g]) return false;
    }
    return true;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&in), deadline)) {
    return absl::DeadlineExceededError("pipelined step: values not pulled");
  }
  if (refetch_ && failed_.ok()) {
    not_reading_ = true;
    return absl::AbortedError("pipelined step: the values are pulled again");
  }
  return failed_;
}

bool PsClient::StepsCanStream(
    const std::vector<ConstTensorRef>& gradients) const {
  if (clip_max_norm_ != 0 || options_.credentials != nullptr ||
      static_cast<int>(gradients.size()) != schema_.dense_size()) {
    return false;
  }
  for (size_t t = 0; t < gradients.size(); ++t) {
    if (gradients[t].dtype != PushWireType(static_cast<int>(t))) return false;
  }
  return true;
}

std::unique_ptr<PsClient::StepStream> PsClient::MakeStepStream() const {
  return std::make_unique<StepStream>(*partition_, schema_.dense_size());
}

absl::StatusOr<PsClient::PushPullResult> PsClient::PushPullStreamed(
    int64_t push_step, const std::vector<ConstTensorRef>& gradients,
    int64_t pull_step, const std::vector<TensorRef>& tensors,
    StepStream& stream) {
  const uint64_t epoch = interrupts();
  auto finish = [&stream](absl::Status status) {
    stream.MarkAllPulled(status);
    return status;
  };
  // The plain PushPull, once every gradient is final and the compute thread
  // reads no pulled value: for what cannot stream, and after a failure.
  auto plain = [&]() -> absl::StatusOr<PushPullResult> {
    if (!stream.AwaitRefetch(absl::Now() + options_.rpc_timeout)) {
      return finish(absl::DeadlineExceededError(
          "pipelined step: the gradients were not all made by the deadline"));
    }
    absl::StatusOr<PushPullResult> done =
        PushPullTensors(push_step, gradients, pull_step, tensors);
    finish(done.status());
    return done;
  };
  // Streaming sends float32 gradients from where they lie, on every
  // shard's plaintext data plane (gRPC would not wait for them, and TLS
  // gathers small pieces into one record when the exchange starts), in one
  // round trip (a clipped step pushes, clips, then pulls).
  // Pulled values of any type are decoded as each answer lands.
  bool streams = StepsCanStream(gradients) && stream.wake_fd() >= 0;
  for (int s = 0; s < num_shards() && streams; ++s) {
    streams = DataPortToUse(s) != 0 && DataPushPullOffered(s);
  }
  if (!streams) return plain();
  InjectPushJitter();
  // Outside RunAll, which would send the kept pushes first.
  ResendIfReplicaMoved(absl::Now() + options_.retry_window);
  // Every block referenced where it lies, none copied into the request
  // now: the gradients are made after the calls are.
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> calls =
      PushPullCalls(push_step, gradients, pull_step, tensors, responses,
                    /*inline_below_bytes=*/0);
  if (!calls.ok()) return finish(calls.status());
  // The calls come in backward's order (the groups', RegisterResolved): the
  // later layers' groups leave while the first layer's gradient is made, and
  // its values come back last, in order, as forward reads them.
  for (Call& call : *calls) {
    const Group* group = call.group;
    call.can_send = [&stream, group] {
      if (!stream.BlocksReady(group->blocks)) return false;
      stream.TraceGroup('s', group->blocks);
      return true;
    };
    call.send_wake_fd = stream.wake_fd();
    call.on_ok = [&stream, group] { stream.MarkPulled(group->blocks); };
  }
  // One attempt as the groups become ready, not RunAll: its retries send
  // calls again (answered ones too, where a shard restarted), over gRPC
  // without waiting for their gradients, and rewrite values the next
  // forward may be reading. Any failure, or a shard that answered from a
  // new life, makes it the plain PushPull (with RunAll's retries) once
  // every gradient is final and the compute thread stopped reading pulled
  // values: the pushes that arrived are duplicates there, the values are
  // pulled again, and the next forward starts over on them.
  std::vector<uint64_t> lives(num_shards());
  for (int shard = 0; shard < num_shards(); ++shard) {
    lives[shard] = server_lives_[shard].load();
  }
  std::vector<size_t> all(calls->size());
  for (size_t i = 0; i < all.size(); ++i) {
    all[i] = i;
    (*calls)[i].epoch = epoch;
  }
  StartAndWait("/pstrain.ParameterServer/PushPull", *calls, all,
               options_.rpc_timeout);
  absl::Status s;
  for (const Call& call : *calls) {
    if (!call.status.ok()) {
      s = absl::Status(
          call.status.code(),
          absl::StrCat("shard ", call.shard, ": ", call.status.message()));
      break;
    }
  }
  for (int shard = 0; shard < num_shards() && s.ok(); ++shard) {
    if (lives[shard] != 0 && server_lives_[shard].load() != lives[shard]) {
      s = absl::UnavailableError(
          absl::StrCat("shard ", shard,
                       " answered from a new life (restarted or failed "
                       "over)"));
    }
  }
  if (s.ok() && interrupts() != epoch) {
    s = absl::CancelledError("PushPull interrupted");
  }
  if (s.ok() && PulledBlocksDisagree()) {
    // The plain PushPull reads again and skips to the later step
    // (FinishPlainRead); the next forward starts over on those values.
    s = absl::AbortedError(
        "its blocks were read at two steps (a shard went on without this "
        "worker)");
  }
  if (s.ok()) {
    if (absl::Status d = InjectDuplicatePushes(*calls); !d.ok()) {
      return finish(d);
    }
    // Before the compute thread may write the next step's gradients where
    // these pushes read them.
    RetainPushes(*calls, push_step, /*answered=*/true);
    finish(absl::OkStatus());
    PushPullResult result;
    result.pushed = SumPushResponses(responses);
    result.pulled_step = RecordPulledStep(pull_step);
    return result;
  }
  if (interrupts() != epoch) {
    // Some shards may have taken the step and answered its pull.
    RetainPushes(*calls, push_step, /*answered=*/false);
    return finish(s);
  }
  LOG(WARNING) << "pipelined step " << push_step
               << " goes again as a plain PushPull: " << s;
  return plain();
}

}  // namespace pstrain
