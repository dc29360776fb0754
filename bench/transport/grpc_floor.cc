#include "bench/transport/grpc_floor.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/grpc_bytes.h"

namespace pstrain {
namespace {

constexpr char kPushMethod[] = "/pstrain.bench.GrpcFloor/Push";
constexpr char kPullMethod[] = "/pstrain.bench.GrpcFloor/Pull";
constexpr int kMaxMessageBytes = 1 << 30;

// Copies the received bytes to `out`, which holds exactly bytes.size().
void CopyReceived(const ReceivedBytes& bytes, char* out) {
  for (absl::string_view view : bytes.views()) {
    std::memcpy(out, view.data(), view.size());
    out += view.size();
  }
}

}  // namespace

// One stream: answers each message, one at a time, in order.
class GrpcFloorService::Stream final : public grpc::ServerGenericBidiReactor {
 public:
  Stream(GrpcFloorService* service, bool pull)
      : service_(service), pull_(pull) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client closed its side
      Finish(grpc::Status::OK);
      return;
    }
    if (pull_) {
      uint64_t bytes = 0;
      ReceivedBytes asked;
      const bool readable = asked.Load(request_) && asked.size() == 8;
      if (readable) CopyReceived(asked, reinterpret_cast<char*>(&bytes));
      if (!readable || bytes > kMaxMessageBytes) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "a pull names its size (at most 1 GiB) in 8 "
                            "bytes"));
        return;
      }
      const std::vector<char>& source = service_->PullSource(bytes);
      grpc::Slice slice(const_cast<char*>(source.data()), bytes,
                        grpc::Slice::STATIC_SLICE);
      response_ = grpc::ByteBuffer(&slice, 1);
    } else {
      grpc::Slice ack(std::string(1, 'a'));
      response_ = grpc::ByteBuffer(&ack, 1);
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    request_.Clear();
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  GrpcFloorService* const service_;
  const bool pull_;
  grpc::ByteBuffer request_, response_;
};

const std::vector<char>& GrpcFloorService::PullSource(size_t bytes) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<const std::vector<char>>& source = pull_sources_[bytes];
  if (source == nullptr)
    source = std::make_unique<std::vector<char>>(bytes, 'x');
  return *source;
}

grpc::ServerGenericBidiReactor* GrpcFloorService::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new Stream(this, absl::EndsWith(context->method(), "/Pull"));
}

// One long-lived stream of a connection: one exchange (a message each way)
// at a time.
class GrpcFloorClient::Stream final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Stream(grpc::GenericStub& stub, const char* method, absl::Time deadline) {
    context_.set_deadline(absl::ToChronoTime(deadline));
    stub.PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    AddHold();  // exchanges are started from outside the reactions
    StartCall();
  }

  // Sends `request`, reads into `response`; `done(ok)` runs once both are
  // over (a write may be reported after the answer's read).
  void Exchange(grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                std::function<void(bool)> done) {
    done_ = std::move(done);
    ok_.store(true);
    pending_.store(2);
    StartWrite(request);
    StartRead(response);
  }

  void OnWriteDone(bool ok) override { Settle(ok); }
  void OnReadDone(bool ok) override { Settle(ok); }
  void OnDone(const grpc::Status&) override {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }

  // Ends the stream and waits (bounded) until gRPC is done with it; a
  // stream that will not end is cancelled.
  void Close(absl::Duration timeout) {
    StartWritesDone();
    RemoveHold();
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&finished_), timeout)) return;
    context_.TryCancel();
    mu_.AwaitWithTimeout(absl::Condition(&finished_), timeout);
  }

 private:
  void Settle(bool ok) {
    if (!ok) ok_.store(false);
    if (pending_.fetch_sub(1) == 1) done_(ok_.load());
  }

  grpc::ClientContext context_;
  std::function<void(bool)> done_;
  std::atomic<bool> ok_{true};
  std::atomic<int> pending_{0};
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

GrpcFloorClient::GrpcFloorClient(absl::Duration timeout) : timeout_(timeout) {}

absl::StatusOr<std::unique_ptr<GrpcFloorClient>> GrpcFloorClient::Connect(
    const std::string& target, int connections, absl::Duration timeout) {
  if (connections < 1) {
    return absl::InvalidArgumentError("the gRPC floor needs a connection");
  }
  std::unique_ptr<GrpcFloorClient> client(new GrpcFloorClient(timeout));
  const absl::Time deadline = absl::Now() + timeout;
  for (int c = 0; c < connections; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    // Its own TCP connection per channel.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("pstrain.connection_index", c);
    client->channels_.push_back(grpc::CreateCustomChannel(
        target, grpc::InsecureChannelCredentials(), args));
    if (!client->channels_.back()->WaitForConnected(
            absl::ToChronoTime(deadline))) {
      return absl::UnavailableError(
          absl::StrCat("gRPC floor: cannot connect to ", target));
    }
    client->stubs_.push_back(
        std::make_unique<grpc::GenericStub>(client->channels_.back()));
  }
  // Streams live as long as the client; each exchange has its own bound
  // through the stream deadline, which covers a whole measured phase.
  for (const char* method : {kPushMethod, kPullMethod}) {
    for (int c = 0; c < connections; ++c) {
      client->streams_.push_back(std::make_unique<Stream>(
          *client->stubs_[c], method, absl::Now() + timeout));
    }
  }
  return client;
}

GrpcFloorClient::~GrpcFloorClient() {
  for (std::unique_ptr<Stream>& stream : streams_) stream->Close(timeout_);
}

absl::Status GrpcFloorClient::ExchangeAll(
    bool pull, std::vector<grpc::ByteBuffer>& requests,
    const std::function<absl::Status(int, const grpc::ByteBuffer&)>& answered) {
  const int n = static_cast<int>(requests.size());
  // Push streams first, then pull streams, one per connection each.
  const int first = pull ? n : 0;
  std::vector<grpc::ByteBuffer> responses(n);
  std::vector<absl::Status> status(n);
  absl::BlockingCounter pending(n);
  for (int i = 0; i < n; ++i) {
    streams_[first + i]->Exchange(&requests[i], &responses[i], [&, i](bool ok) {
      if (!ok) {
        status[i] = absl::UnavailableError(
            absl::StrCat("gRPC floor stream ", i, " broke"));
      } else if (answered != nullptr) {
        status[i] = answered(i, responses[i]);
      }
      pending.DecrementCount();
    });
  }
  // Bounded: every stream ends by its deadline, failing what is in flight.
  pending.Wait();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

namespace {

// [begin, end) of chunk i of `size` bytes cut in n.
std::pair<size_t, size_t> Chunk(size_t size, int i, int n) {
  return {size * i / n, size * (i + 1) / n};
}

}  // namespace

absl::Status GrpcFloorClient::Push(absl::Span<const char> data) {
  const int n = static_cast<int>(channels_.size());
  std::vector<grpc::ByteBuffer> requests(n);
  for (int i = 0; i < n; ++i) {
    const auto [begin, end] = Chunk(data.size(), i, n);
    grpc::Slice slice(const_cast<char*>(data.data() + begin), end - begin,
                      grpc::Slice::STATIC_SLICE);
    requests[i] = grpc::ByteBuffer(&slice, 1);
  }
  return ExchangeAll(/*pull=*/false, requests, nullptr);
}

absl::Status GrpcFloorClient::Pull(absl::Span<char> out) {
  const int n = static_cast<int>(channels_.size());
  std::vector<grpc::ByteBuffer> requests(n);
  for (int i = 0; i < n; ++i) {
    const auto [begin, end] = Chunk(out.size(), i, n);
    const uint64_t bytes = end - begin;
    grpc::Slice slice(&bytes, sizeof(bytes));  // copied into the slice
    requests[i] = grpc::ByteBuffer(&slice, 1);
  }
  return ExchangeAll(
      /*pull=*/true, requests, [&](int i, const grpc::ByteBuffer& response) {
        const auto [begin, end] = Chunk(out.size(), i, n);
        ReceivedBytes answer;
        if (!answer.Load(response)) {
          return absl::DataLossError("unreadable gRPC floor answer");
        }
        if (answer.size() != end - begin) {
          return absl::DataLossError(absl::StrCat("gRPC floor answered ",
                                                  answer.size(), " bytes for ",
                                                  end - begin));
        }
        CopyReceived(answer, out.data() + begin);
        return absl::OkStatus();
      });
}

}  // namespace pstrain
