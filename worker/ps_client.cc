#include "worker/ps_client.h"

#include <chrono>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_bytes.h"
#include "common/grpc_status.h"
#include "common/protocol.h"
#include "common/tensor_codec.h"

namespace pstrain {
namespace {

constexpr char kServicePath[] = "/pstrain.ParameterServer/";

template <typename Message>
grpc::ByteBuffer Serialize(const Message& message) {
  grpc::ByteBuffer buffer;
  bool own_buffer = false;
  grpc::SerializationTraits<Message>::Serialize(message, &buffer, &own_buffer)
      .IgnoreError();  // cannot fail for a message we built
  return buffer;
}

template <typename Message>
absl::Status Deserialize(grpc::ByteBuffer& buffer, Message* message) {
  grpc::Status status =
      grpc::SerializationTraits<Message>::Deserialize(&buffer, message);
  if (status.ok()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("unreadable ",
                                          Message::descriptor()->name(), ": ",
                                          status.error_message()));
}

}  // namespace

// One RPC in flight: everything it references lives here until it is done.
struct PsClient::Call {
  int shard = 0;
  int connection = 0;
  const Group* group = nullptr;
  grpc::ClientContext context;
  grpc::ByteBuffer request, response;
  WireMessage message;  // a push's encoded request, referenced by `request`
  bool wait_for_ready = false;
  // Runs on a gRPC thread when the RPC succeeded; may turn it into an error.
  std::function<absl::Status(Call&)> on_response;
  absl::Status status;
};

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
  if (options.connections_per_shard < 1 || options.connections_per_shard > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--connections_per_shard must be in [1, 64], got ",
                     options.connections_per_shard));
  }
  if (WireElementBytes(options.gradient_wire_type) == 0) {
    return absl::InvalidArgumentError("unsupported gradient wire type");
  }
  return std::unique_ptr<PsClient>(new PsClient(options));
}

PsClient::PsClient(const PsClientOptions& options) : options_(options) {
  for (const std::string& host : options.hosts) {
    for (int c = 0; c < options.connections_per_shard; ++c) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(options.max_message_bytes);
      args.SetMaxSendMessageSize(options.max_message_bytes);
      // A private subchannel pool and a distinct argument make each channel
      // its own TCP connection instead of sharing one.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetInt("pstrain.connection_index", c);
      stubs_.push_back(
          std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
              host, grpc::InsecureChannelCredentials(), args)));
    }
  }
}

PsClient::~PsClient() = default;

absl::Status PsClient::RunAll(const char* method, std::vector<Call>& calls,
                              absl::Duration timeout) {
  absl::Mutex mu;
  size_t pending = calls.size();
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout);
  const std::string method_name = absl::StrCat(kServicePath, method);
  for (Call& call : calls) {
    call.context.set_deadline(deadline);
    call.context.set_wait_for_ready(call.wait_for_ready);
    Connection(call.shard, call.connection)
        .UnaryCall(&call.context, method_name, grpc::StubOptions(),
                   &call.request, &call.response,
                   [&mu, &pending, &call, method](grpc::Status status) {
                     call.status = FromGrpcStatus(status, method);
                     if (call.status.ok() && call.on_response) {
                       absl::Status handled = call.on_response(call);
                       if (!handled.ok()) {
                         call.status = absl::Status(
                             handled.code(),
                             absl::StrCat(method, ": ", handled.message()));
                       }
                     }
                     absl::MutexLock lock(&mu);
                     --pending;
                   });
  }
  {
    // Terminates: gRPC runs every callback by the deadline set above.
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](size_t* left) { return *left == 0; }, &pending));
  }
  for (const Call& call : calls) {
    if (!call.status.ok()) {
      return absl::Status(
          call.status.code(),
          absl::StrCat("shard ", call.shard, " (", options_.hosts[call.shard],
                       "): ", call.status.message()));
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
  std::vector<Call> calls(num_shards());
  std::vector<RegisterModelResponse> responses(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].request = Serialize(request);
    calls[s].wait_for_ready = true;  // servers may still be starting
    calls[s].on_response = [&responses, s](Call& call) {
      return Deserialize(call.response, &responses[s]);
    };
  }
  if (absl::Status s = RunAll("RegisterModel", calls, options_.connect_timeout);
      !s.ok()) {
    return s;
  }
  for (int s = 1; s < num_shards(); ++s) {
    if (responses[s].mode() != responses[0].mode()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shards disagree on the mode: shard 0 runs ", responses[0].mode(),
          ", shard ", s, " runs ", responses[s].mode()));
    }
  }

  // Group each shard's blocks into RPCs of at most one block's bytes (small
  // tensors share an RPC), dealt round-robin over the shard's connections.
  partition_ = std::make_unique<Partition>(std::move(*partition));
  schema_ = schema;
  groups_.clear();
  const int64_t group_elements = schema.block_elements();
  for (int s = 0; s < num_shards(); ++s) {
    int next_connection = 0;
    Group* open = nullptr;
    int64_t open_elements = 0;
    for (int g : partition_->BlocksOfShard(s)) {
      const int64_t length = partition_->blocks()[g].length;
      if (open == nullptr || open_elements + length > group_elements) {
        groups_.emplace_back();
        open = &groups_.back();
        open->shard = s;
        open->connection = next_connection++ % options_.connections_per_shard;
        open_elements = 0;
      }
      open->blocks.push_back(g);
      open_elements += length;
    }
  }
  for (Group& group : groups_) {
    PullRequest pull;
    pull.set_protocol_version(kProtocolVersion);
    for (int g : group.blocks) {
      const BlockLocation& loc = partition_->blocks()[g];
      BlockRef* ref = pull.add_blocks();
      ref->set_tensor(schema_.dense(loc.tensor).name());
      ref->set_block(loc.block);
    }
    group.pull_request = pull.SerializeAsString();
  }
  block_versions_.assign(partition_->blocks().size(), 0);
  encoded_.assign(partition_->blocks().size(), std::string());
  return responses[0].mode();
}

absl::Status PsClient::StoreBlocks(const Group& group,
                                   const WirePullResponse& response,
                                   const std::vector<float*>& tensors) {
  if (response.blocks.size() != group.blocks.size()) {
    return absl::DataLossError(absl::StrCat("returned ", response.blocks.size(),
                                            " blocks, expected ",
                                            group.blocks.size()));
  }
  for (size_t i = 0; i < group.blocks.size(); ++i) {
    const WireBlock& wire = response.blocks[i];
    const int g = group.blocks[i];
    const BlockLocation& loc = partition_->blocks()[g];
    if (wire.block != loc.block ||
        wire.tensor != schema_.dense(loc.tensor).name()) {
      return absl::DataLossError(
          absl::StrCat("returned block ", wire.block, " of '", wire.tensor,
                       "' where block ", loc.block, " of '",
                       schema_.dense(loc.tensor).name(), "' was asked for"));
    }
    if (absl::Status s = DecodeSegments(
            wire.dtype, wire.data,
            absl::MakeSpan(tensors[loc.tensor] + loc.offset, loc.length),
            /*accumulate=*/false);
        !s.ok()) {
      return s;
    }
    block_versions_[g] = wire.version;
  }
  return absl::OkStatus();
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
  // The block list of each group is serialized once; the step and worker
  // are the two fields that change, appended as protobuf allows.
  PullRequest header;
  header.set_worker_id(worker_id);
  header.set_step(step);
  const std::string per_call = header.SerializeAsString();
  std::vector<Call> calls(groups_.size());
  for (size_t i = 0; i < groups_.size(); ++i) {
    Call& call = calls[i];
    call.group = &groups_[i];
    call.shard = groups_[i].shard;
    call.connection = groups_[i].connection;
    const std::string bytes = groups_[i].pull_request + per_call;
    grpc::Slice slice(bytes.data(), bytes.size());
    call.request = grpc::ByteBuffer(&slice, 1);
    // Decoded on gRPC's thread as each response lands, while other RPCs are
    // still in flight; groups write disjoint memory.
    call.on_response = [this, &tensors](Call& c) {
      ReceivedBytes bytes;
      if (!bytes.Load(c.response)) {
        return absl::DataLossError("unreadable pull response");
      }
      absl::StatusOr<WirePullResponse> response =
          ParsePullResponse(bytes.views());
      if (!response.ok()) return response.status();
      return StoreBlocks(*c.group, *response, tensors);
    };
  }
  return RunAll("Pull", calls, options_.rpc_timeout);
}

absl::StatusOr<int64_t> PsClient::Push(
    int worker_id, int64_t step, const std::vector<const float*>& gradients) {
  if (partition_ == nullptr) {
    return absl::FailedPreconditionError("Push before Register");
  }
  if (static_cast<int>(gradients.size()) != partition_->NumTensors()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Push got ", gradients.size(), " tensors, the model has ",
                     partition_->NumTensors()));
  }
  const DataType wire_type = options_.gradient_wire_type;
  std::vector<Call> calls(groups_.size());
  std::vector<PushResponse> responses(groups_.size());
  std::vector<OutgoingBlock> blocks;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Group& group = groups_[i];
    blocks.clear();
    for (int g : group.blocks) {
      const BlockLocation& loc = partition_->blocks()[g];
      const float* values = gradients[loc.tensor] + loc.offset;
      absl::string_view data(reinterpret_cast<const char*>(values),
                             loc.length * sizeof(float));
      if (wire_type != FLOAT32) {
        EncodeFromFloat32(wire_type, absl::MakeConstSpan(values, loc.length),
                          &encoded_[g]);
        data = encoded_[g];
      }
      blocks.push_back(OutgoingBlock{{schema_.dense(loc.tensor).name(),
                                      loc.block, wire_type, block_versions_[g]},
                                     data});
    }
    Call& call = calls[i];
    call.shard = group.shard;
    call.connection = group.connection;
    call.message = EncodePushRequest(kProtocolVersion, worker_id, step, blocks,
                                     kInlineBelowBytes);
    // No keep-alive: the gradients, encoded_ and call.message outlive RunAll.
    call.request = PiecesToByteBuffer(call.message.Pieces());
    call.on_response = [&responses, i](Call& c) {
      return Deserialize(c.response, &responses[i]);
    };
  }
  if (absl::Status s = RunAll("Push", calls, options_.rpc_timeout); !s.ok()) {
    return s;
  }
  int64_t duplicates = 0;
  for (const PushResponse& response : responses) {
    duplicates += response.blocks_duplicate();
  }
  return duplicates;
}

absl::StatusOr<std::vector<StatsResponse>> PsClient::Stats() {
  std::vector<Call> calls(num_shards());
  std::vector<StatsResponse> responses(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].request = Serialize(StatsRequest());
    calls[s].on_response = [&responses, s](Call& call) {
      return Deserialize(call.response, &responses[s]);
    };
  }
  if (absl::Status s = RunAll("Stats", calls, options_.rpc_timeout); !s.ok()) {
    return s;
  }
  return responses;
}

}  // namespace pstrain
