#include "worker/ps_client.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/protocol.h"
#include "common/tensor_codec.h"

namespace pstrain {

absl::StatusOr<std::unique_ptr<PsClient>> PsClient::Create(
    const PsClientOptions& options) {
  if (options.hosts.empty()) {
    return absl::InvalidArgumentError("--ps_hosts lists no servers");
  }
  for (const std::string& host : options.hosts) {
    if (host.empty() || host.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ps_hosts entries must be host:port, got '", host, "'"));
    }
  }
  return std::unique_ptr<PsClient>(new PsClient(options));
}

PsClient::PsClient(const PsClientOptions& options) : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  for (const std::string& host : options.hosts) {
    stubs_.push_back(ParameterServer::NewStub(grpc::CreateCustomChannel(
        host, grpc::InsecureChannelCredentials(), args)));
  }
  pulled_versions_.assign(stubs_.size(), 0);
}

template <typename Start>
absl::Status PsClient::FanOut(absl::Duration timeout, bool wait_for_ready,
                              absl::string_view what, Start start) {
  const int n = num_shards();
  std::vector<grpc::ClientContext> contexts(n);
  std::vector<grpc::Status> results(n);
  absl::Mutex mu;
  int pending = n;
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout);
  for (int s = 0; s < n; ++s) {
    contexts[s].set_deadline(deadline);
    contexts[s].set_wait_for_ready(wait_for_ready);
    start(s, &contexts[s], [&, s](grpc::Status status) {
      results[s] = std::move(status);
      absl::MutexLock lock(&mu);
      --pending;
    });
  }
  {
    // Terminates: gRPC runs every callback by the deadline set above.
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* left) { return *left == 0; }, &pending));
  }
  for (int s = 0; s < n; ++s) {
    if (!results[s].ok()) {
      return FromGrpcStatus(
          results[s],
          absl::StrCat(what, " on shard ", s, " (", options_.hosts[s], ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PsClient::Register(const ModelSchema& schema,
                                               int num_workers) {
  absl::StatusOr<Partition> partition = Partition::Create(schema, num_shards());
  if (!partition.ok()) return partition.status();
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = schema;
  request.set_num_shards(num_shards());
  request.set_num_workers(num_workers);
  std::vector<RegisterModelResponse> responses(num_shards());
  absl::Status status =
      FanOut(options_.connect_timeout, /*wait_for_ready=*/true, "RegisterModel",
             [&](int s, grpc::ClientContext* context, auto done) {
               stubs_[s]->async()->RegisterModel(
                   context, &request, &responses[s], std::move(done));
             });
  if (!status.ok()) return status;
  for (int s = 1; s < num_shards(); ++s) {
    if (responses[s].mode() != responses[0].mode()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shards disagree on the mode: shard 0 runs ", responses[0].mode(),
          ", shard ", s, " runs ", responses[s].mode()));
    }
  }
  partition_ = std::make_unique<Partition>(std::move(*partition));
  schema_ = schema;
  push_requests_.assign(num_shards(), PushRequest());
  pull_responses_.assign(num_shards(), PullResponse());
  return responses[0].mode();
}

absl::Status PsClient::Pull(int worker_id, int64_t step,
                            const std::vector<float*>& tensors) {
  if (partition_ == nullptr) {
    return absl::FailedPreconditionError("Pull before Register");
  }
  if (static_cast<int>(tensors.size()) != partition_->NumTensors()) {
    return absl::InvalidArgumentError(absl::StrCat("Pull got ", tensors.size(),
                                                   " tensors, the model has ",
                                                   partition_->NumTensors()));
  }
  PullRequest request;
  request.set_protocol_version(kProtocolVersion);
  request.set_worker_id(worker_id);
  request.set_step(step);
  absl::Status status =
      FanOut(options_.rpc_timeout, /*wait_for_ready=*/false, "Pull",
             [&](int s, grpc::ClientContext* context, auto done) {
               pull_responses_[s].Clear();
               stubs_[s]->async()->Pull(context, &request, &pull_responses_[s],
                                        std::move(done));
             });
  if (!status.ok()) return status;
  for (int s = 0; s < num_shards(); ++s) {
    const PullResponse& response = pull_responses_[s];
    const size_t expected = partition_->BlocksOfShard(s).size();
    if (static_cast<size_t>(response.blocks_size()) != expected) {
      return absl::DataLossError(absl::StrCat("shard ", s, " returned ",
                                              response.blocks_size(),
                                              " blocks, expected ", expected));
    }
    for (const TensorBlock& block : response.blocks()) {
      absl::StatusOr<int> global =
          partition_->FindBlock(block.tensor(), block.block());
      if (!global.ok()) return global.status();
      const BlockLocation& loc = partition_->blocks()[*global];
      if (loc.shard != s) {
        return absl::DataLossError(absl::StrCat(
            "shard ", s, " returned block ", block.block(), " of '",
            block.tensor(), "', held by shard ", loc.shard));
      }
      absl::Status decoded = DecodeToFloat32(
          block.dtype(), block.data(),
          absl::MakeSpan(tensors[loc.tensor] + loc.offset, loc.length));
      if (!decoded.ok()) return decoded;
    }
    pulled_versions_[s] = response.version();
  }
  return absl::OkStatus();
}

absl::StatusOr<int> PsClient::Push(int worker_id, int64_t step,
                                   const std::vector<const float*>& gradients) {
  if (partition_ == nullptr) {
    return absl::FailedPreconditionError("Push before Register");
  }
  if (static_cast<int>(gradients.size()) != partition_->NumTensors()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Push got ", gradients.size(), " tensors, the model has ",
                     partition_->NumTensors()));
  }
  for (int s = 0; s < num_shards(); ++s) {
    PushRequest& request = push_requests_[s];
    request.set_protocol_version(kProtocolVersion);
    request.set_worker_id(worker_id);
    request.set_step(step);
    request.set_pulled_version(pulled_versions_[s]);
    const std::vector<int>& blocks = partition_->BlocksOfShard(s);
    // Same block list every step: overwrite in place to reuse the buffers.
    while (request.blocks_size() < static_cast<int>(blocks.size())) {
      request.add_blocks();
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      const BlockLocation& loc = partition_->blocks()[blocks[i]];
      TensorBlock* out = request.mutable_blocks(i);
      out->set_tensor(schema_.dense(loc.tensor).name());
      out->set_block(loc.block);
      out->set_dtype(FLOAT32);
      EncodeFloat32(
          absl::MakeConstSpan(gradients[loc.tensor] + loc.offset, loc.length),
          out->mutable_data());
    }
  }
  std::vector<PushResponse> responses(num_shards());
  absl::Status status =
      FanOut(options_.rpc_timeout, /*wait_for_ready=*/false, "Push",
             [&](int s, grpc::ClientContext* context, auto done) {
               stubs_[s]->async()->Push(context, &push_requests_[s],
                                        &responses[s], std::move(done));
             });
  if (!status.ok()) return status;
  int duplicates = 0;
  for (const PushResponse& response : responses) {
    duplicates += response.duplicate() ? 1 : 0;
  }
  return duplicates;
}

absl::StatusOr<std::vector<StatsResponse>> PsClient::Stats() {
  StatsRequest request;
  std::vector<StatsResponse> responses(num_shards());
  absl::Status status =
      FanOut(options_.rpc_timeout, /*wait_for_ready=*/false, "Stats",
             [&](int s, grpc::ClientContext* context, auto done) {
               stubs_[s]->async()->Stats(context, &request, &responses[s],
                                         std::move(done));
             });
  if (!status.ok()) return status;
  return responses;
}

}  // namespace pstrain
