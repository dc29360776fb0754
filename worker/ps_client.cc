#include "worker/ps_client.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/distributions.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_bytes.h"
#include "common/grpc_status.h"
#include "common/protocol.h"
#include "common/socket.h"
#include "common/status_text.h"
#include "common/tensor_codec.h"
#include "glog/logging.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/sync_stream.h"

namespace pstrain {
namespace {

constexpr char kServicePath[] = "/pstrain.ParameterServer/";

// A pulled group of at least this many bytes asks the data plane for its
// payloads apart, to read them straight into the tensors.
constexpr size_t kPayloadsApartFromBytes = 64 << 10;

// How long a data port that could not be reached is left alone (a server
// with a fixed --data_port may come back on it).
constexpr absl::Duration kDataPortRetry = absl::Seconds(30);

template <typename Message>
absl::Status Deserialize(absl::Span<const absl::string_view> bytes,
                         Message* message) {
  bool parsed;
  if (bytes.size() == 1) {
    parsed = message->ParseFromArray(bytes[0].data(),
                                     static_cast<int>(bytes[0].size()));
  } else {
    std::string flat;
    for (absl::string_view piece : bytes) {
      flat.append(piece.data(), piece.size());
    }
    parsed = message->ParseFromString(flat);
  }
  if (parsed) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat("unreadable ", Message::descriptor()->name()));
}

}  // namespace

// One RPC: what it sends and how to take its answer; the per-attempt gRPC
// state is rebuilt for every retry.
struct PsClient::Call {
  int shard = 0;
  int connection = 0;
  // The client's Interrupt count when the call's RunAll began.
  uint64_t epoch = 0;
  const Group* group = nullptr;
  std::string flat;     // the request, when small (control messages, pulls)
  WireMessage message;  // a push's request, referencing gradient memory
  bool wait_for_ready = false;
  // Runs with the answer's bytes when the call succeeded (on a gRPC thread,
  // or on the caller's for the data plane); may turn it into an error.
  std::function<absl::Status(absl::Span<const absl::string_view>)> on_response;
  // A pull of large blocks on the data plane: where the payloads go
  // (DataExchange::place_payloads), instead of on_response.
  std::function<absl::StatusOr<std::vector<absl::Span<char>>>(
      absl::string_view meta)>
      place_payloads;
  // A PushPull: `message` is the push, `flat` the pull, and this takes the
  // PushResponse (on_response and place_payloads take the pull's answer).
  std::function<absl::Status(absl::Span<const absl::string_view>)>
      on_push_response;
  char push_length[data_plane::kLengthPrefixBytes] = {};  // sent before it

  std::unique_ptr<grpc::ClientContext> context;
  grpc::ByteBuffer request, response;
  absl::Status status;

  grpc::ByteBuffer MakeRequest() const {
    if (message.num_pieces() == 0) {
      grpc::Slice slice(flat.data(), flat.size());
      return grpc::ByteBuffer(&slice, 1);
    }
    // No keep-alive: the message and what it references outlive the call.
    return PiecesToByteBuffer(message.Pieces());
  }
};

// A stream's state is only touched under `mu`, which the caller of
// CallOnStream holds for one request and its answer.
struct PsClient::CallStream {
  absl::Mutex mu;
  std::unique_ptr<grpc::ClientContext> context ABSL_GUARDED_BY(mu);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream ABSL_GUARDED_BY(mu);
  // The stream's deadline: a stream is replaced before a call whose own
  // deadline would pass it.
  absl::Time expires ABSL_GUARDED_BY(mu);
  // gRPC keeps a pointer to the method name for the stream's life.
  std::string method ABSL_GUARDED_BY(mu);

  // Ends the stream (if any) and returns its status. `cancel` for a stream
  // that may still be open; a stream whose read or write failed is over
  // already, and its status is the server's.
  grpc::Status CloseLocked(bool cancel) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (stream == nullptr) return grpc::Status::OK;
    if (cancel) context->TryCancel();
    grpc::Status status = stream->Finish();
    stream.reset();
    context.reset();
    return status;
  }
  ~CallStream() {
    absl::MutexLock lock(&mu);
    CloseLocked(/*cancel=*/true);
  }
};

// One data-plane connection; its user holds `mu` for a whole exchange.
struct PsClient::DataSlot {
  absl::Mutex mu;
  std::unique_ptr<DataLink> link ABSL_GUARDED_BY(mu);
  int port ABSL_GUARDED_BY(mu) = 0;  // the port `link` is connected to
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
  if (options.gradient_wire_type != TOPK_FLOAT32 &&
      WireElementBytes(options.gradient_wire_type) == 0) {
    return absl::InvalidArgumentError("unsupported gradient wire type");
  }
  if (!(options.gradient_topk_fraction > 0 &&
        options.gradient_topk_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gradient_topk_fraction must be in (0, 1], got ",
                     options.gradient_topk_fraction));
  }
  return std::unique_ptr<PsClient>(new PsClient(options));
}

PsClient::PsClient(const PsClientOptions& options)
    : options_(options),
      incarnation_(absl::Uniform<uint64_t>(
          absl::BitGen(), 1, std::numeric_limits<uint64_t>::max())) {
  for (const std::string& host : options.hosts) {
    for (int c = 0; c < options.connections_per_shard; ++c) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(options.max_message_bytes);
      args.SetMaxSendMessageSize(options.max_message_bytes);
      // A private subchannel pool and a distinct argument make each channel
      // its own TCP connection instead of sharing one.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      ApplyGrpcTuning(options.grpc_tuning, &args);
      args.SetInt("pstrain.connection_index", c);
      channels_.push_back(grpc::CreateCustomChannel(
          host,
          options.credentials != nullptr ? options.credentials
                                         : grpc::InsecureChannelCredentials(),
          args));
      stubs_.push_back(std::make_unique<grpc::GenericStub>(channels_.back()));
      push_streams_.push_back(std::make_unique<CallStream>());
      pull_streams_.push_back(std::make_unique<CallStream>());
      data_slots_.push_back(std::make_unique<DataSlot>());
    }
  }
  absl::MutexLock lock(&data_ports_mu_);
  data_ports_.assign(options.hosts.size(), 0);
  data_push_pull_.assign(options.hosts.size(), false);
  data_failed_ports_.assign(options.hosts.size(), 0);
  data_failed_at_.assign(options.hosts.size(), absl::InfinitePast());
}

PsClient::~PsClient() { StopHeartbeats(); }

void PsClient::Interrupt() {
  absl::MutexLock lock(&interrupt_mu_);
  ++interrupts_;
  for (grpc::ClientContext* context : active_contexts_) context->TryCancel();
  for (const DataLink* link : active_links_) link->Abort();
}

uint64_t PsClient::interrupts() const {
  absl::MutexLock lock(&interrupt_mu_);
  return interrupts_;
}

void PsClient::Track(grpc::ClientContext* context, uint64_t epoch) {
  absl::MutexLock lock(&interrupt_mu_);
  // gRPC cancels a call whose context was cancelled before it started.
  if (interrupts_ != epoch) context->TryCancel();
  active_contexts_.insert(context);
}

void PsClient::Untrack(grpc::ClientContext* context) {
  absl::MutexLock lock(&interrupt_mu_);
  active_contexts_.erase(context);
}

void PsClient::Track(const DataLink* link, uint64_t epoch) {
  absl::MutexLock lock(&interrupt_mu_);
  if (interrupts_ != epoch) link->Abort();
  active_links_.insert(link);
}

void PsClient::Untrack(const DataLink* link) {
  absl::MutexLock lock(&interrupt_mu_);
  active_links_.erase(link);
}

bool PsClient::SleepUnlessInterrupted(absl::Duration duration,
                                      uint64_t epoch) const {
  const absl::Time until = absl::Now() + duration;
  absl::MutexLock lock(&interrupt_mu_);
  auto interrupted = [this, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                         interrupt_mu_) { return interrupts_ != epoch; };
  return !interrupt_mu_.AwaitWithDeadline(absl::Condition(&interrupted), until);
}

void PsClient::PrepareCall(std::chrono::system_clock::time_point deadline,
                           Call& call) const {
  call.context = std::make_unique<grpc::ClientContext>();
  call.context->set_deadline(deadline);
  call.context->set_wait_for_ready(call.wait_for_ready);
  if (!options_.auth_token.empty()) {
    call.context->AddMetadata("authorization",
                              absl::StrCat("Bearer ", options_.auth_token));
  }
  call.request = call.MakeRequest();
  call.response.Clear();
}

bool PsClient::CallOnStream(const std::string& method, absl::Duration timeout,
                            const std::string& short_name, Call& call) {
  const bool push = short_name == "Push";
  if (!push && short_name != "Pull") return false;
  const size_t index =
      call.shard * options_.connections_per_shard + call.connection;
  CallStream& s = *(push ? push_streams_ : pull_streams_)[index];
  if (!s.mu.TryLock()) return false;
  absl::Cleanup unlock = [&s]() ABSL_UNLOCK_FUNCTION(s.mu) { s.mu.Unlock(); };
  const absl::Time now = absl::Now();
  if (s.stream != nullptr && now + timeout > s.expires) {
    s.CloseLocked(/*cancel=*/true);
  }
  if (s.stream == nullptr) {
    // Twice the call timeout, so that every call on it gets its own whole
    // timeout, and no stream outlives 2x: a wait on it always ends.
    s.expires = now + 2 * timeout;
    s.method = absl::StrCat(method, "Stream");
    s.context = std::make_unique<grpc::ClientContext>();
    s.context->set_deadline(absl::ToChronoTime(s.expires));
    if (!options_.auth_token.empty()) {
      s.context->AddMetadata("authorization",
                             absl::StrCat("Bearer ", options_.auth_token));
    }
    s.stream.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer,
                                                             grpc::ByteBuffer>::
                       Create(channels_[index].get(),
                              grpc::internal::RpcMethod(
                                  s.method.c_str(),
                                  grpc::internal::RpcMethod::BIDI_STREAMING),
                              s.context.get()));
  }
  call.request = call.MakeRequest();
  call.response.Clear();
  Track(s.context.get(), call.epoch);
  const bool answered =
      s.stream->Write(call.request) && s.stream->Read(&call.response);
  Untrack(s.context.get());
  if (answered) {
    FinishCall(grpc::Status::OK, short_name, call);
    return true;
  }
  // The server ended the stream: its status is this call's, as it would
  // have been the unary call's. A stream cut without one is a lost
  // connection.
  grpc::Status status = s.CloseLocked(/*cancel=*/false);
  if (status.error_code() == grpc::StatusCode::CANCELLED) {
    status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the server closed the call stream (shutting down)");
  }
  if (status.ok()) {
    status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the call stream closed without an answer");
  }
  FinishCall(status, short_name, call);
  return true;
}

void PsClient::FinishCall(const grpc::Status& status,
                          const std::string& short_name, Call& call) {
  call.status = FromGrpcStatus(status, short_name);
  if (call.status.ok() && call.on_response) {
    ReceivedBytes bytes;
    absl::Status handled =
        bytes.Load(call.response)
            ? call.on_response(bytes.views())
            : absl::DataLossError("unreadable response buffer");
    if (!handled.ok()) {
      call.status = absl::Status(
          handled.code(), absl::StrCat(short_name, ": ", handled.message()));
    }
  }
}

bool PsClient::DataPushPullOffered(int shard) {
  absl::MutexLock lock(&data_ports_mu_);
  return data_push_pull_[shard];
}

DataLink* PsClient::LinkFor(int shard, DataSlot& slot, absl::Time deadline) {
  int port;
  {
    absl::MutexLock lock(&data_ports_mu_);
    port = data_ports_[shard];
    if (port == 0 || (port == data_failed_ports_[shard] &&
                      absl::Now() < data_failed_at_[shard] + kDataPortRetry)) {
      return nullptr;
    }
  }
  if (slot.link != nullptr && slot.port == port && slot.link->usable()) {
    return slot.link.get();
  }
  slot.link.reset();
  std::string host;
  int grpc_port;
  absl::Status split = SplitHostPort(options_.hosts[shard], &host, &grpc_port);
  absl::StatusOr<std::unique_ptr<DataLink>> link =
      split.ok()
          ? DataLink::Open(host, port, options_.auth_token,
                           options_.max_message_bytes,
                           std::min(deadline, absl::Now() + absl::Seconds(5)))
          : split;
  if (!link.ok()) {
    LOG(WARNING) << "data plane of shard " << shard << " (port " << port
                 << " of " << options_.hosts[shard]
                 << ") cannot be reached: " << link.status()
                 << "; its pushes and pulls go over gRPC until it announces "
                    "another port or 30 s have passed";
    absl::MutexLock lock(&data_ports_mu_);
    data_failed_ports_[shard] = port;
    data_failed_at_[shard] = absl::Now();
    refresh_data_ports_ = true;
    return nullptr;
  }
  slot.link = std::move(*link);
  slot.port = port;
  return slot.link.get();
}

void PsClient::MaybeRefreshDataPorts() {
  {
    absl::MutexLock lock(&data_ports_mu_);
    if (!refresh_data_ports_) return;
    refresh_data_ports_ = false;
  }
  // A server restarted from its checkpoint keeps its model, so nothing else
  // would make this worker register again and hear its new port.
  if (absl::Status s = RegisterOnShards(); !s.ok()) {
    LOG(WARNING) << "registering again to learn data ports failed: " << s;
  }
}

std::vector<size_t> PsClient::RunOnDataPlane(const std::string& short_name,
                                             std::vector<Call>& calls,
                                             const std::vector<size_t>& which,
                                             absl::Duration timeout) {
  if (!options_.data_plane || options_.credentials != nullptr) return which;
  data_plane::Method method;
  if (short_name == "Push") {
    method = data_plane::Method::kPush;
  } else if (short_name == "Pull") {
    method = data_plane::Method::kPull;
  } else if (short_name == "PushPull") {
    method = data_plane::Method::kPushPull;
  } else {
    return which;
  }
  MaybeRefreshDataPorts();
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<size_t> over_grpc;
  // Each slot this call holds, with its link resolved once: a second call
  // on the same connection must not reopen (and free) the link the first
  // one's exchange already points at.
  std::vector<std::pair<DataSlot*, DataLink*>> held;
  std::vector<DataExchange> exchanges;
  std::vector<size_t> call_of_exchange;
  exchanges.reserve(which.size());
  for (size_t i : which) {
    Call& call = calls[i];
    if (method == data_plane::Method::kPushPull &&
        !DataPushPullOffered(call.shard)) {
      over_grpc.push_back(i);  // the two calls, on the data plane or not
      continue;
    }
    DataSlot& slot = *data_slots_[call.shard * options_.connections_per_shard +
                                  call.connection];
    auto it = std::find_if(held.begin(), held.end(),
                           [&slot](const auto& h) { return h.first == &slot; });
    if (it == held.end()) {
      // Busy on another thread (a push thread beside a pull): gRPC.
      if (!slot.mu.TryLock()) {
        over_grpc.push_back(i);
        continue;
      }
      held.emplace_back(&slot, LinkFor(call.shard, slot, deadline));
      it = held.end() - 1;
    }
    DataLink* link = it->second;
    if (link == nullptr) {
      over_grpc.push_back(i);
      continue;
    }
    DataExchange& exchange = exchanges.emplace_back();
    exchange.link = link;
    exchange.method = method;
    exchange.on_response = [&call](absl::string_view body) {
      return call.on_response ? call.on_response(absl::MakeConstSpan(&body, 1))
                              : absl::OkStatus();
    };
    exchange.place_payloads = call.place_payloads;
    if (method == data_plane::Method::kPushPull) {
      PreparePushPull(call, exchange);
    } else if (call.message.num_pieces() > 0) {
      exchange.body = call.message.Pieces();
    } else {
      exchange.body = {call.flat};
    }
    call_of_exchange.push_back(i);
  }
  for (size_t k = 0; k < exchanges.size(); ++k) {
    Track(exchanges[k].link, calls[call_of_exchange[k]].epoch);
  }
  RunExchanges(absl::MakeSpan(exchanges), deadline);
  for (const DataExchange& exchange : exchanges) Untrack(exchange.link);
  for (size_t k = 0; k < exchanges.size(); ++k) {
    const absl::Status& status = exchanges[k].status;
    calls[call_of_exchange[k]].status =
        status.ok()
            ? status
            : absl::Status(status.code(),
                           absl::StrCat(short_name, ": ", status.message()));
  }
  for (auto& [slot, link] : held) {
    if (slot->link != nullptr && !slot->link->usable()) slot->link.reset();
    slot->mu.Unlock();
  }
  return over_grpc;
}

void PsClient::PreparePushPull(Call& call, DataExchange& exchange) {
  data_plane::EncodeLengthPrefix(static_cast<uint32_t>(call.message.ByteSize()),
                                 call.push_length);
  exchange.body = call.message.Pieces();
  exchange.body.insert(
      exchange.body.begin(),
      absl::string_view(call.push_length, sizeof(call.push_length)));
  exchange.body.push_back(call.flat);
  // The answer's PullResponse part (the body, or with payloads apart the
  // meta) comes after the PushResponse.
  auto take_push_response =
      [&call](absl::string_view bytes) -> absl::StatusOr<absl::string_view> {
    absl::StatusOr<data_plane::LengthPrefixed> parts =
        data_plane::SplitLengthPrefixed(bytes, "PushPull answer");
    if (!parts.ok()) return absl::DataLossError(parts.status().message());
    if (absl::Status s =
            call.on_push_response(absl::MakeConstSpan(&parts->head, 1));
        !s.ok()) {
      return s;
    }
    return parts->rest;
  };
  exchange.on_response = [&call, take_push_response](absl::string_view body) {
    absl::StatusOr<absl::string_view> pull = take_push_response(body);
    if (!pull.ok()) return pull.status();
    return call.on_response(absl::MakeConstSpan(&*pull, 1));
  };
  if (call.place_payloads) {
    exchange.place_payloads = [&call,
                               take_push_response](absl::string_view meta)
        -> absl::StatusOr<std::vector<absl::Span<char>>> {
      absl::StatusOr<absl::string_view> pull_meta = take_push_response(meta);
      if (!pull_meta.ok()) return pull_meta.status();
      return call.place_payloads(*pull_meta);
    };
  }
}

void PsClient::PushPullOverGrpc(std::vector<Call>& calls,
                                const std::vector<size_t>& which,
                                absl::Duration timeout) {
  std::vector<Call> pushes(which.size()), pulls(which.size());
  std::vector<size_t> all(which.size()), pushed;
  for (size_t k = 0; k < which.size(); ++k) {
    const Call& call = calls[which[k]];
    all[k] = k;
    pushes[k].shard = pulls[k].shard = call.shard;
    pushes[k].connection = pulls[k].connection = call.connection;
    pushes[k].epoch = pulls[k].epoch = call.epoch;
    pushes[k].message = call.message;
    pushes[k].on_response = call.on_push_response;
    pulls[k].group = call.group;
    pulls[k].flat = call.flat;
    pulls[k].on_response = call.on_response;
    pulls[k].place_payloads = call.place_payloads;
  }
  StartAndWait(absl::StrCat(kServicePath, "Push"), pushes, all, timeout);
  for (size_t k = 0; k < which.size(); ++k) {
    if (pushes[k].status.ok()) {
      pushed.push_back(k);
    } else {
      calls[which[k]].status = pushes[k].status;
    }
  }
  StartAndWait(absl::StrCat(kServicePath, "Pull"), pulls, pushed, timeout);
  for (size_t k : pushed) calls[which[k]].status = pulls[k].status;
}

void PsClient::StartAndWait(const std::string& method, std::vector<Call>& calls,
                            const std::vector<size_t>& all,
                            absl::Duration timeout) {
  if (all.empty()) return;
  const std::string short_name = method.substr(method.rfind('/') + 1);
  const std::vector<size_t> which =
      RunOnDataPlane(short_name, calls, all, timeout);
  if (which.empty()) return;
  if (short_name == "PushPull") return PushPullOverGrpc(calls, which, timeout);
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout);
  if (which.size() == 1) {
    Call& call = calls[which.front()];
    if (options_.call_streams &&
        CallOnStream(method, timeout, short_name, call)) {
      return;
    }
    // One RPC: wait for it on this thread, as a generated blocking stub
    // does, instead of having gRPC's callback thread wake this one (a
    // thread hop measured at ~8% of a 4 KiB push's latency).
    PrepareCall(deadline, call);
    Track(call.context.get(), call.epoch);
    const grpc::Status status =
        grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
            channels_[call.shard * options_.connections_per_shard +
                      call.connection]
                .get(),
            grpc::internal::RpcMethod(method.c_str(),
                                      grpc::internal::RpcMethod::NORMAL_RPC),
            call.context.get(), call.request, &call.response);
    Untrack(call.context.get());
    FinishCall(status, short_name, call);
    return;
  }
  // Not a Mutex-guarded count: the last callback may still be inside
  // Unlock when the waiter wakes and returns, destroying the mutex under it.
  // BlockingCounter::Wait guarantees no decrementer touches it afterwards.
  absl::BlockingCounter pending(static_cast<int>(which.size()));
  for (size_t i : which) {
    Call& call = calls[i];
    PrepareCall(deadline, call);
    Track(call.context.get(), call.epoch);
    Connection(call.shard, call.connection)
        .UnaryCall(call.context.get(), method, grpc::StubOptions(),
                   &call.request, &call.response,
                   [&pending, &call, &short_name](grpc::Status status) {
                     FinishCall(status, short_name, call);
                     pending.DecrementCount();
                   });
  }
  // Terminates: gRPC runs every callback by the deadline set above.
  pending.Wait();
  for (size_t i : which) Untrack(calls[i].context.get());
}

absl::Status PsClient::RunAll(const char* method, std::vector<Call>& calls,
                              absl::Duration timeout, bool retry) {
  const std::string full_method = absl::StrCat(kServicePath, method);
  std::vector<size_t> which(calls.size());
  for (size_t i = 0; i < which.size(); ++i) which[i] = i;
  const absl::Time give_up = absl::Now() + options_.retry_window;
  absl::Duration backoff = absl::Milliseconds(50);
  const uint64_t epoch = interrupts();
  for (Call& call : calls) call.epoch = epoch;
  // What the call was waiting for when it was cut: the shards still
  // unanswered, or the error it was retrying after.
  std::string waiting_for;
  auto interrupted = [&] {
    return absl::CancelledError(
        absl::StrCat(method, " interrupted while ", waiting_for,
                     " (Interrupt: a signal, or Ctrl-C in Python)"));
  };
  while (true) {
    StartAndWait(full_method, calls, which, timeout);
    if (interrupts() != epoch) {
      std::vector<std::string> pending;
      for (size_t i : which) {
        if (calls[i].status.ok()) continue;
        pending.push_back(absl::StrCat("shard ", calls[i].shard, " (",
                                       options_.hosts[calls[i].shard], ")"));
      }
      waiting_for = absl::StrCat(
          "waiting for ", pending.empty() ? std::string("the servers")
                                          : absl::StrJoin(pending, ", "));
      return interrupted();
    }
    std::vector<size_t> failed;
    bool retryable = retry;
    bool reregister = false;
    for (size_t i : which) {
      if (calls[i].status.ok()) continue;
      failed.push_back(i);
      switch (calls[i].status.code()) {
        case absl::StatusCode::kUnavailable:       // down or restarting
        case absl::StatusCode::kDeadlineExceeded:  // peers slow or dead
        case absl::StatusCode::kCancelled:  // by a server shutting down: this
                                            // client never cancels a call
          break;
        case absl::StatusCode::kNotFound:  // restarted with no model
          reregister = true;
          break;
        default:
          retryable = false;
      }
    }
    if (failed.empty()) return absl::OkStatus();
    const Call& first = calls[failed.front()];
    const absl::Status error(
        first.status.code(),
        absl::StrCat("shard ", first.shard, " (", options_.hosts[first.shard],
                     "): ", first.status.message()));
    if (!retryable || absl::Now() + backoff > give_up) return error;
    // The time left before the error: a bar cut to the terminal's width
    // keeps it.
    const std::string line =
        absl::StrCat("retrying ", failed.size(), " call(s) in ",
                     absl::FormatDuration(backoff), " (",
                     absl::ToInt64Seconds(give_up - absl::Now()),
                     " s left of the retry window) after ", error.ToString());
    LOG(WARNING) << line;
    if (options_.on_retry) options_.on_retry(line);
    waiting_for = absl::StrCat("retrying after ", error.ToString());
    if (!SleepUnlessInterrupted(backoff, epoch)) return interrupted();
    backoff = std::min(backoff * 2, absl::Seconds(5));
    if (reregister) {
      if (absl::Status s = RegisterOnShards(); !s.ok()) {
        LOG(WARNING) << "registering again failed: " << s;
      }
    }
    which = std::move(failed);
  }
}

absl::StatusOr<std::vector<RegisterModelResponse>> PsClient::RegisterCalls() {
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = schema_;
  request.set_num_shards(num_shards());
  request.set_num_workers(num_workers_);
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  const std::string bytes = request.SerializeAsString();
  std::vector<Call> calls(num_shards());
  std::vector<RegisterModelResponse> responses(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].flat = bytes;
    calls[s].wait_for_ready = true;  // servers may still be starting
    calls[s].on_response = [&responses,
                            s](absl::Span<const absl::string_view> bytes) {
      return Deserialize(bytes, &responses[s]);
    };
  }
  if (absl::Status s = RunAll("RegisterModel", calls, options_.connect_timeout);
      !s.ok()) {
    return s;
  }
  absl::MutexLock lock(&data_ports_mu_);
  for (int s = 0; s < num_shards(); ++s) {
    data_ports_[s] = responses[s].data_port();
    data_push_pull_[s] = responses[s].data_push_pull();
  }
  return responses;
}

absl::Status PsClient::RegisterOnShards() { return RegisterCalls().status(); }

absl::StatusOr<Registration> PsClient::Register(const ModelSchema& schema,
                                                int num_workers,
                                                int worker_id) {
  absl::StatusOr<Partition> partition = Partition::Create(schema, num_shards());
  if (!partition.ok()) return partition.status();
  StopHeartbeats();
  schema_ = schema;
  num_workers_ = num_workers;
  worker_id_ = worker_id;
  absl::StatusOr<std::vector<RegisterModelResponse>> responses =
      RegisterCalls();
  if (!responses.ok()) return responses.status();
  Registration registration;
  registration.mode = (*responses)[0].mode();
  for (int s = 0; s < num_shards(); ++s) {
    const RegisterModelResponse& response = (*responses)[s];
    if (response.mode() != registration.mode) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shards disagree on the mode: shard 0 runs ", registration.mode,
          ", shard ", s, " runs ", response.mode()));
    }
    registration.start_step =
        std::max(registration.start_step, response.step());
  }
  registration.optimizer = (*responses)[0].optimizer();
  registration.learning_rate = (*responses)[0].learning_rate();
  mode_ = registration.mode;

  // Group each shard's blocks into RPCs of at most one block's bytes (small
  // tensors share an RPC), dealt round-robin over the shard's connections.
  partition_ = std::make_unique<Partition>(std::move(*partition));
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
      open->elements += length;
      open_elements += length;
    }
  }
  one_group_per_connection_ = true;
  for (int s = 0; s < num_shards(); ++s) {
    const auto groups =
        std::count_if(groups_.begin(), groups_.end(),
                      [s](const Group& group) { return group.shard == s; });
    if (groups > options_.connections_per_shard) {
      one_group_per_connection_ = false;
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
  topk_residual_.assign(partition_->blocks().size(), std::vector<float>());
  if (worker_id_ >= 0 && options_.heartbeat_interval > absl::ZeroDuration()) {
    heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  }
  return registration;
}

absl::Status PsClient::AwaitJobStart(const StartWaitReport& on_waiting,
                                     const std::atomic<bool>* stop) {
  if (worker_id_ < 0 || mode_ == "async") return absl::OkStatus();
  // Each call is held by the servers for up to this long: short enough to
  // notice an Interrupt and report progress about once a second.
  constexpr absl::Duration kPoll = absl::Seconds(1);
  constexpr absl::Duration kLogEvery = absl::Seconds(5);
  AwaitJobStartRequest request;
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  request.set_wait_ms(absl::ToInt64Milliseconds(kPoll));
  const std::string bytes = request.SerializeAsString();
  // Known once the servers say how long they wait; until then the connect
  // timeout bounds reaching them at all.
  absl::Time give_up = absl::Now() + options_.connect_timeout;
  absl::Time last_log = absl::Now();
  bool warmed_up = false;
  const uint64_t epoch = interrupts();
  while (true) {
    if (interrupts() != epoch || (stop != nullptr && stop->load())) {
      return absl::CancelledError(
          "interrupted while waiting for the job's workers to register");
    }
    std::vector<Call> calls(num_shards());
    std::vector<JobStart> answers(num_shards());
    for (int s = 0; s < num_shards(); ++s) {
      calls[s].shard = s;
      calls[s].flat = bytes;
      calls[s].on_response = [&answers,
                              s](absl::Span<const absl::string_view> bytes) {
        return Deserialize(bytes, &answers[s]);
      };
    }
    absl::Status status = RunAll("AwaitJobStart", calls,
                                 kPoll + absl::Seconds(5), /*retry=*/true);
    if (absl::IsCancelled(status) && interrupts() != epoch) {
      return absl::CancelledError(
          "interrupted while waiting for the job's workers to register");
    }
    // A server from before the start rule has nothing to wait for.
    if (absl::IsUnimplemented(status)) return absl::OkStatus();
    if (!status.ok()) return status;
    JobStart waiting;
    bool started = true;
    std::set<int> missing;
    for (const JobStart& answer : answers) {
      started &= answer.started();
      if (answer.started()) continue;
      missing.insert(answer.missing_workers().begin(),
                     answer.missing_workers().end());
      waiting.set_waited_s(std::max(waiting.waited_s(), answer.waited_s()));
      waiting.set_startup_timeout_s(answer.startup_timeout_s());
      waiting.set_num_workers(answer.num_workers());
      waiting.set_min_workers(answer.min_workers());
    }
    if (started) return absl::OkStatus();
    if (!warmed_up) {
      // The wait is free time: the first step then finds its data-plane
      // connections open (with many workers, opening them all at the start
      // took most of the first step).
      OpenDataLinks();
      warmed_up = true;
    }
    for (int w : missing) waiting.add_missing_workers(w);
    // The servers end the wait at their timeout and say so; this bound
    // only matters if they never do.
    give_up = absl::Now() +
              absl::Seconds(waiting.startup_timeout_s() - waiting.waited_s()) +
              absl::Seconds(30);
    if (absl::Now() - last_log >= kLogEvery) {
      last_log = absl::Now();
      LOG(INFO) << "waiting for workers "
                << FormatIdList(waiting.missing_workers()) << " ("
                << waiting.missing_workers_size() << " of "
                << waiting.num_workers() << " missing), "
                << static_cast<int64_t>(waiting.waited_s()) << " s of "
                << waiting.startup_timeout_s() << " s";
    }
    if (on_waiting) on_waiting(waiting);
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the job has not started after ", waiting.waited_s(), " s: workers ",
          FormatIdList(waiting.missing_workers()), " have not registered"));
    }
  }
}

void PsClient::OpenDataLinks() {
  if (!options_.data_plane || options_.credentials != nullptr) return;
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  std::set<std::pair<int, int>> used;
  for (const Group& group : groups_) {
    used.insert({group.shard, group.connection});
  }
  for (const auto& [shard, connection] : used) {
    DataSlot& slot =
        *data_slots_[shard * options_.connections_per_shard + connection];
    absl::MutexLock lock(&slot.mu);
    LinkFor(shard, slot, deadline);
  }
}

void PsClient::HeartbeatLoop() {
  HeartbeatRequest request;
  request.set_worker_id(worker_id_);
  request.set_incarnation(incarnation_);
  const std::string bytes = request.SerializeAsString();
  absl::Time last_warning = absl::InfinitePast();
  while (!stop_heartbeats_.WaitForNotificationWithTimeout(
      options_.heartbeat_interval)) {
    std::vector<Call> calls(num_shards());
    for (int s = 0; s < num_shards(); ++s) {
      calls[s].shard = s;
      calls[s].flat = bytes;
    }
    absl::Status status =
        RunAll("Heartbeat", calls, options_.heartbeat_interval);
    // A server that is down is the pulls' and pushes' problem to retry;
    // here it is only worth a line now and then.
    if (!status.ok() && absl::Now() - last_warning > absl::Seconds(30)) {
      LOG(WARNING) << "heartbeat: " << status;
      last_warning = absl::Now();
    }
  }
}

void PsClient::StopHeartbeats() {
  if (!heartbeat_thread_.joinable()) return;
  stop_heartbeats_.Notify();
  heartbeat_thread_.join();
}

absl::Status PsClient::Leave() {
  StopHeartbeats();
  if (worker_id_ < 0) return absl::OkStatus();
  LeaveRequest request;
  request.set_worker_id(worker_id_);
  std::vector<Call> calls(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].flat = request.SerializeAsString();
  }
  return RunAll("Leave", calls, options_.rpc_timeout);
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
    const std::vector<float*>& tensors) {
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
    if (wire.dtype != FLOAT32 || wire.data_size != 0) {
      return absl::DataLossError(absl::StrCat(
          "block ", wire.block, " of '", wire.tensor,
          "' came with its payload inline where it was asked apart"));
    }
    const BlockLocation& loc = partition_->blocks()[g];
    places.emplace_back(
        reinterpret_cast<char*>(tensors[loc.tensor] + loc.offset),
        loc.length * sizeof(float));
    block_versions_[g] = wire.version;
  }
  return places;
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
    if (absl::Status s = CheckReturnedBlock(wire, g); !s.ok()) return s;
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

absl::Status PsClient::CheckPullArguments(
    const std::vector<float*>& tensors) const {
  if (partition_ == nullptr) {
    return absl::FailedPreconditionError("Pull before Register");
  }
  if (static_cast<int>(tensors.size()) != partition_->NumTensors()) {
    return absl::InvalidArgumentError(absl::StrCat("Pull got ", tensors.size(),
                                                   " tensors, the model has ",
                                                   partition_->NumTensors()));
  }
  return absl::OkStatus();
}

std::vector<PsClient::Call> PsClient::PullCalls(
    int64_t step, const std::vector<float*>& tensors) {
  // The block list of each group is serialized once; the step and worker
  // are appended per call, as protobuf allows.
  PullRequest header;
  header.set_worker_id(worker_id_);
  header.set_step(step);
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
    // ones are cheaper to copy out of one read than to read apart.
    if (groups_[i].elements * sizeof(float) >= kPayloadsApartFromBytes) {
      call.place_payloads = [this, &tensors,
                             group = call.group](absl::string_view meta) {
        return PlacePayloads(*group, meta, tensors);
      };
    }
  }
  return calls;
}

int64_t PsClient::PulledStep(int64_t step) const {
  if (mode_ != "sync") return step;
  // Blocks past `step` mean the job moved on without this worker: continue
  // from the step every block is at.
  int64_t at = std::numeric_limits<int64_t>::max();
  for (int64_t version : block_versions_) at = std::min(at, version);
  return block_versions_.empty() ? step : std::max(at, step);
}

absl::StatusOr<int64_t> PsClient::Pull(int64_t step,
                                       const std::vector<float*>& tensors) {
  if (absl::Status s = CheckPullArguments(tensors); !s.ok()) return s;
  std::vector<Call> calls = PullCalls(step, tensors);
  if (absl::Status s =
          RunAll("Pull", calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    return s;
  }
  return PulledStep(step);
}

absl::StatusOr<std::vector<PsClient::Call>> PsClient::PushCalls(
    int64_t step, const std::vector<const float*>& gradients,
    absl::Span<const int> only, std::vector<PushResponse>& responses,
    bool exact_values) {
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
    return exact_values ||
                   schema_.dense(tensor).role() == DenseTensorSpec::STATE
               ? FLOAT32
               : options_.gradient_wire_type;
  };
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
      const float* values = gradients[loc.tensor] + loc.offset;
      absl::string_view data(reinterpret_cast<const char*>(values),
                             loc.length * sizeof(float));
      const DataType wire_type = wire_type_of(loc.tensor);
      if (wire_type == TOPK_FLOAT32) {
        // Error feedback: what earlier pushes left out rides along.
        std::vector<float>& residual = topk_residual_[g];
        residual.resize(loc.length);
        for (int64_t k = 0; k < loc.length; ++k) residual[k] += values[k];
        EncodeTopK(absl::MakeSpan(residual),
                   static_cast<int64_t>(
                       std::ceil(options_.gradient_topk_fraction * loc.length)),
                   &encoded_[g]);
        data = encoded_[g];
      } else if (wire_type != FLOAT32) {
        EncodeFromFloat32(wire_type, absl::MakeConstSpan(values, loc.length),
                          &encoded_[g]);
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
    call.message = EncodePushRequest(kProtocolVersion, worker_id_, step, blocks,
                                     kInlineBelowBytes);
    call.on_response = [&responses,
                        i](absl::Span<const absl::string_view> bytes) {
      return Deserialize(bytes, &responses[i]);
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

absl::StatusOr<PsClient::PushResult> PsClient::Push(
    int64_t step, const std::vector<const float*>& gradients,
    absl::Span<const int> only) {
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
  return result;
}

absl::StatusOr<PsClient::PushResult> PsClient::Assign(
    const std::vector<const float*>& values, absl::Span<const int> only) {
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> calls =
      PushCalls(/*step=*/0, values, only, responses, /*exact_values=*/true);
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
  if (absl::Status s = CheckPullArguments(tensors); !s.ok()) return s;
  // A connection answers one request at a time. With several groups on
  // one, a sync or ssp server would answer each group's pull (a wait for
  // the step) before it reads the next group's push, so the waits would
  // follow one another; pushing everything first, as the two calls do,
  // waits once. Such a model moves enough bytes that the round trip
  // saved would not show (2x2 sync MLP 784-2048-2048-10: 7% slower fused).
  if (mode_ != "async" && !one_group_per_connection_) {
    absl::StatusOr<PushResult> pushed = Push(push_step, gradients);
    if (!pushed.ok()) return pushed.status();
    absl::StatusOr<int64_t> pulled = Pull(pull_step, tensors);
    if (!pulled.ok()) return pulled.status();
    return PushPullResult{*pushed, *pulled};
  }
  std::vector<PushResponse> responses;
  absl::StatusOr<std::vector<Call>> pushes =
      PushCalls(push_step, gradients, /*only=*/{}, responses);
  if (!pushes.ok()) return pushes.status();
  std::vector<Call> calls = PullCalls(pull_step, tensors);
  // Every group has blocks of some tensor, so with all tensors pushed the
  // push calls are the groups in order, as the pull calls are.
  CHECK_EQ(pushes->size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    calls[i].message = std::move((*pushes)[i].message);
    calls[i].on_push_response = std::move((*pushes)[i].on_response);
  }
  if (absl::Status s =
          RunAll("PushPull", calls, options_.rpc_timeout, /*retry=*/true);
      !s.ok()) {
    return s;
  }
  PushPullResult result;
  result.pushed = SumPushResponses(responses);
  if (absl::Status s = InjectDuplicatePushes(calls); !s.ok()) return s;
  result.pulled_step = PulledStep(pull_step);
  return result;
}

absl::Status PsClient::PullSparse(int table, int64_t step,
                                  absl::Span<const uint64_t> ids, float* out) {
  if (table < 0 || table >= schema_.sparse_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no sparse table ", table, " in the model"));
  }
  const SparseTableSpec& spec = schema_.sparse(table);
  const int64_t dim = spec.dim();
  // positions[s]: where shard s's rows go in `out`.
  std::vector<std::vector<size_t>> positions(num_shards());
  std::vector<SparsePullRequest> requests(num_shards());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int s = SparseShardOf(spec.name(), ids[i], num_shards());
    positions[s].push_back(i);
    requests[s].add_ids(ids[i]);
  }
  std::vector<Call> calls;
  calls.reserve(num_shards());
  std::vector<int> shard_of_call;
  for (int s = 0; s < num_shards(); ++s) {
    if (positions[s].empty()) continue;
    requests[s].set_protocol_version(kProtocolVersion);
    requests[s].set_worker_id(worker_id_);
    requests[s].set_step(step);
    requests[s].set_table(spec.name());
    shard_of_call.push_back(s);
  }
  calls.resize(shard_of_call.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    const int s = shard_of_call[c];
    calls[c].shard = s;
    calls[c].connection = c % options_.connections_per_shard;
    calls[c].flat = requests[s].SerializeAsString();
    calls[c].on_response = [&positions, s, dim,
                            out](absl::Span<const absl::string_view> bytes) {
      SparsePullResponse response;
      if (absl::Status st = Deserialize(bytes, &response); !st.ok()) {
        return st;
      }
      const std::vector<size_t>& where = positions[s];
      if (response.values().size() != where.size() * dim * sizeof(float)) {
        return absl::DataLossError(
            absl::StrCat("sparse pull returned ", response.values().size(),
                         " bytes for ", where.size(), " rows of dim ", dim));
      }
      const char* values = response.values().data();
      for (size_t r = 0; r < where.size(); ++r) {
        std::memcpy(out + where[r] * dim, values + r * dim * sizeof(float),
                    dim * sizeof(float));
      }
      return absl::OkStatus();
    };
  }
  return RunAll("SparsePull", calls, options_.rpc_timeout, /*retry=*/true);
}

absl::StatusOr<PsClient::PushResult> PsClient::PushSparse(
    int table, int64_t step, absl::Span<const uint64_t> ids,
    const float* grads) {
  if (table < 0 || table >= schema_.sparse_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no sparse table ", table, " in the model"));
  }
  const SparseTableSpec& spec = schema_.sparse(table);
  const int64_t dim = spec.dim();
  // Rows are already the few that changed: top-k has nothing to drop.
  const DataType wire_type = options_.gradient_wire_type == TOPK_FLOAT32
                                 ? FLOAT32
                                 : options_.gradient_wire_type;
  std::vector<SparsePushRequest> requests(num_shards());
  std::vector<std::vector<float>> rows(num_shards());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int s = SparseShardOf(spec.name(), ids[i], num_shards());
    requests[s].add_ids(ids[i]);
    rows[s].insert(rows[s].end(), grads + i * dim, grads + (i + 1) * dim);
  }
  std::vector<int> shard_of_call;
  for (int s = 0; s < num_shards(); ++s) {
    // Sync steps complete only when every member has pushed, even nothing.
    if (requests[s].ids_size() == 0 && mode_ != "sync") continue;
    requests[s].set_protocol_version(kProtocolVersion);
    requests[s].set_worker_id(worker_id_);
    requests[s].set_step(step);
    requests[s].set_table(spec.name());
    requests[s].set_dtype(wire_type);
    EncodeFromFloat32(wire_type, rows[s], requests[s].mutable_gradients());
    shard_of_call.push_back(s);
  }
  std::vector<Call> calls(shard_of_call.size());
  std::vector<SparsePushResponse> responses(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    const int s = shard_of_call[c];
    calls[c].shard = s;
    calls[c].connection = c % options_.connections_per_shard;
    calls[c].flat = requests[s].SerializeAsString();
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
  for (const SparsePushResponse& response : responses) {
    result.blocks_duplicate += response.duplicate();
    result.blocks_late += response.late();
  }
  return result;
}

// async/ssp: the servers' model is final once no worker is a member any
// more and every worker's updates are applied (each applied push of a
// dense block bumps its version by one, so the smallest version reaches
// num_workers * steps). A worker that stopped early or died never brings
// it there: then the model counts as final once no member is left and it
// has not changed for kQuiet. Returns how the wait ended.
std::string PsClient::AwaitFinalModel(int64_t expected_version,
                                      absl::Duration timeout) {
  constexpr absl::Duration kQuiet = absl::Seconds(10);
  const absl::Time start = absl::Now();
  const uint64_t epoch = interrupts();
  absl::Time last_change = start;
  int64_t last_version = -1;
  std::string last_seen = "no stats";
  while (true) {
    absl::StatusOr<std::vector<StatsResponse>> stats = Stats();
    const absl::Time now = absl::Now();
    if (stats.ok()) {
      int members = 0;
      int64_t version = std::numeric_limits<int64_t>::max();
      for (const StatsResponse& shard : *stats) {
        members += shard.members();
        if (shard.num_blocks() > 0)
          version = std::min(version, shard.version());
      }
      if (members == 0 && version >= expected_version) return "all_done";
      if (version != last_version) {
        last_version = version;
        last_change = now;
      } else if (members == 0 && now - last_change >= kQuiet) {
        LOG(WARNING) << "the servers applied " << version << " of the "
                     << expected_version
                     << " updates expected and no worker is training: a "
                        "worker stopped early; evaluating the model as it is";
        return "quiet";
      }
      last_seen = absl::StrCat(members, " member(s) training, version ",
                               version, " of ", expected_version);
    } else {
      last_seen = stats.status().ToString();
    }
    if (now - start >= timeout) {
      LOG(WARNING) << "other workers still training after "
                   << absl::FormatDuration(timeout) << " (" << last_seen
                   << "); evaluating the model as it is now";
      return "timeout";
    }
    if (!SleepUnlessInterrupted(absl::Milliseconds(50), epoch)) {
      return "interrupted";
    }
  }
}

absl::StatusOr<int64_t> PsClient::StepsShort() {
  absl::StatusOr<std::vector<StatsResponse>> stats = Stats();
  if (!stats.ok()) return stats.status();
  int64_t most = 0;
  for (const StatsResponse& shard : *stats) {
    most = std::max(most, shard.steps_short());
  }
  return most;
}

absl::StatusOr<std::vector<StatsResponse>> PsClient::Stats() {
  std::vector<Call> calls(num_shards());
  std::vector<StatsResponse> responses(num_shards());
  for (int s = 0; s < num_shards(); ++s) {
    calls[s].shard = s;
    calls[s].on_response = [&responses,
                            s](absl::Span<const absl::string_view> bytes) {
      return Deserialize(bytes, &responses[s]);
    };
  }
  if (absl::Status s = RunAll("Stats", calls, options_.rpc_timeout); !s.ok()) {
    return s;
  }
  return responses;
}

}  // namespace pstrain
