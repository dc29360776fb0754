// How PsClient runs its calls: one RPC per shard connection over gRPC (a
// unary call or a bidirectional stream), in parallel, with retries and
// deadlines (RunAll); the data plane is tried first where it serves.

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/grpc_status.h"
#include "glog/logging.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "worker/client/ps_client_internal.h"

namespace pstrain {
namespace {

constexpr char kServicePath[] = "/pstrain.ParameterServer/";

}  // namespace

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
  const size_t index = SlotOf(call.shard, call.connection);
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
  for (size_t i : all) calls[i].replica = current_replica_[calls[i].shard];
  const std::string short_name = method.substr(method.rfind('/') + 1);
  std::vector<size_t> which = RunOnDataPlane(short_name, calls, all, timeout);
  // A call whose request may not be made yet (can_send: the pipelined
  // step's) goes on the data plane, which waits for it, or fails here.
  which.erase(std::remove_if(which.begin(), which.end(),
                             [&calls](size_t i) {
                               if (!calls[i].can_send) return false;
                               calls[i].status = absl::FailedPreconditionError(
                                   "a pipelined step's call found no "
                                   "data-plane connection");
                               return true;
                             }),
              which.end());
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
            channels_[SlotOf(call.shard, call.connection)].get(),
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

void PsClient::NextReplica(int shard, int from) {
  int expected = from;
  if (!current_replica_[shard].compare_exchange_strong(
          expected, (from + 1) % replicas_)) {
    return;  // moved on already
  }
  // Its data port is the new replica's to announce (registration).
  absl::MutexLock lock(&data_ports_mu_);
  data_ports_[shard] = 0;
}

void PsClient::RetainPushes(const std::vector<Call>& calls, int64_t step,
                            bool answered) {
  if (replicas_ < 2 || mode_ != ConsistencyMode::kSync) return;
  std::vector<RetainedPush> kept;
  {
    absl::MutexLock lock(&retained_mu_);
    if (answered) {
      kept.swap(retained_spare_);
    } else {
      // A step that failed (or was interrupted) after some shards took it:
      // kept beside the answered step before it, in the place of an
      // earlier attempt of its own.
      kept = std::move(retained_pushes_);
      kept.erase(std::remove_if(kept.begin(), kept.end(),
                                [step](const RetainedPush& push) {
                                  return push.step == step;
                                }),
                 kept.end());
    }
  }
  size_t n = answered ? 0 : kept.size();
  for (const Call& call : calls) {
    if (call.message.num_pieces() == 0) continue;  // a read, no push
    if (n == kept.size()) kept.emplace_back();
    RetainedPush& push = kept[n++];
    push.shard = call.shard;
    push.connection = call.connection;
    push.step = step;
    // The replica it went to: the heartbeat thread may have moved the
    // shard's calls on since (and then this worker has not sent it there).
    push.replica =
        call.replica >= 0 ? call.replica : current_replica_[call.shard].load();
    push.request.clear();
    push.request.reserve(call.message.ByteSize());
    for (absl::string_view piece : call.message.Pieces()) {
      push.request.append(piece.data(), piece.size());
    }
  }
  kept.resize(n);
  absl::MutexLock lock(&retained_mu_);
  retained_pushes_.swap(kept);
  if (answered) retained_spare_ = std::move(kept);
}

void PsClient::ResendIfReplicaMoved(absl::Time give_up) {
  std::vector<int> moved;
  {
    absl::MutexLock lock(&retained_mu_);
    for (const RetainedPush& push : retained_pushes_) {
      if (push.replica != current_replica_[push.shard] &&
          std::find(moved.begin(), moved.end(), push.shard) == moved.end()) {
        moved.push_back(push.shard);
      }
    }
  }
  if (!moved.empty()) ResendRetainedPushes(moved, give_up);
}

void PsClient::ResendRetainedPushes(const std::vector<int>& shards,
                                    absl::Time give_up) {
  std::vector<Call> calls;
  // Each call's kept push's step: one that a replica took (or refused for
  // good) is not sent again until its shard's calls move on.
  std::vector<int64_t> steps;
  {
    absl::MutexLock lock(&retained_mu_);
    for (const RetainedPush& push : retained_pushes_) {
      if (std::find(shards.begin(), shards.end(), push.shard) == shards.end()) {
        continue;
      }
      Call& call = calls.emplace_back();
      call.shard = push.shard;
      call.connection = push.connection;
      call.flat = push.request;
      steps.push_back(push.step);
    }
  }
  auto held_by = [this, &steps, &calls](size_t i, int replica) {
    absl::MutexLock lock(&retained_mu_);
    for (RetainedPush& push : retained_pushes_) {
      if (push.shard == calls[i].shard &&
          push.connection == calls[i].connection && push.step == steps[i]) {
        push.replica = replica;
      }
    }
  };
  if (calls.empty()) return;
  const std::string method = absl::StrCat(kServicePath, "Push");
  const absl::Time until = std::min(give_up, absl::Now() + kResendWindow);
  const uint64_t epoch = interrupts();
  std::vector<size_t> which(calls.size());
  for (size_t i = 0; i < which.size(); ++i) which[i] = i;
  while (true) {
    for (size_t i : which) calls[i].epoch = epoch;
    StartAndWait(method, calls, which,
                 std::max(absl::Milliseconds(100),
                          std::min(options_.rpc_timeout, until - absl::Now())));
    std::vector<size_t> again;
    for (size_t i : which) {
      const absl::Status& status = calls[i].status;
      if (status.ok()) {
        held_by(i, calls[i].replica);
        continue;
      }
      switch (status.code()) {
        case absl::StatusCode::kUnavailable:
        case absl::StatusCode::kDeadlineExceeded:
        case absl::StatusCode::kCancelled:
          NextReplica(calls[i].shard, calls[i].replica);
          again.push_back(i);
          break;
        default: {
          LOG(WARNING) << "shard " << calls[i].shard
                       << " refused this worker's last step's push, sent "
                          "again after it moved to another replica: "
                       << status;
          held_by(i, calls[i].replica);
        }
      }
    }
    if (again.empty()) return;
    if (interrupts() != epoch || absl::Now() + absl::Milliseconds(50) > until ||
        !SleepUnlessInterrupted(absl::Milliseconds(50), epoch)) {
      LOG(WARNING) << "shard " << calls[again.front()].shard
                   << " did not take this worker's last step's push again: "
                   << calls[again.front()].status;
      return;
    }
    which = std::move(again);
  }
}

absl::Status PsClient::RunAll(const char* method, std::vector<Call>& calls,
                              absl::Duration timeout, bool retry) {
  const std::string full_method = absl::StrCat(kServicePath, method);
  std::vector<size_t> all(calls.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  std::vector<size_t> which = all;
  const absl::Time give_up = absl::Now() + options_.retry_window;
  absl::Duration backoff = absl::Milliseconds(50);
  const uint64_t epoch = interrupts();
  for (Call& call : calls) call.epoch = epoch;
  // Per step, so kept off the heap for up to 16 shards.
  absl::InlinedVector<uint64_t, 16> lives(num_shards());
  absl::InlinedVector<int, 16> replica_tried(num_shards());
  int moving_rounds_left = replicas_ - 1;
  for (int s = 0; s < num_shards(); ++s) lives[s] = server_lives_[s].load();
  // What the call was waiting for when it was cut: the shards still
  // unanswered, or the error it was retrying after.
  std::string waiting_for;
  auto interrupted = [&] {
    return absl::CancelledError(
        absl::StrCat(method, " interrupted while ", waiting_for,
                     " (Interrupt: a signal, or Ctrl-C in Python)"));
  };
  // The calls of a step and of the job's end; not the heartbeat thread's,
  // which must keep the leases while a resend waits.
  const bool resends = absl::string_view(method) == "PushPull" ||
                       absl::string_view(method) == "Push" ||
                       absl::string_view(method) == "Pull" ||
                       absl::string_view(method) == "Checkpoint" ||
                       absl::string_view(method) == "Leave";
  while (true) {
    if (resends) ResendIfReplicaMoved(give_up);
    for (int s = 0; s < num_shards(); ++s) {
      replica_tried[s] = current_replica_[s].load();
    }
    StartAndWait(full_method, calls, which, timeout);
    if (interrupts() != epoch) {
      std::vector<std::string> pending;
      for (size_t i : which) {
        if (calls[i].status.ok()) continue;
        std::string shard = absl::StrCat("shard ", calls[i].shard, " (",
                                         HostOf(calls[i].shard), ")");
        // A shard's several calls (block groups) are one thing waited for.
        if (std::find(pending.begin(), pending.end(), shard) == pending.end()) {
          pending.push_back(std::move(shard));
        }
      }
      waiting_for = absl::StrCat(
          "waiting for ", pending.empty() ? std::string("the servers")
                                          : absl::StrJoin(pending, ", "));
      return interrupted();
    }
    std::vector<size_t> failed;
    bool retryable = retry;
    bool reregister = false;
    bool moved_replica = false;
    bool all_transient = true;
    for (size_t i : which) {
      if (calls[i].status.ok()) continue;
      failed.push_back(i);
      switch (calls[i].status.code()) {
        case absl::StatusCode::kUnavailable:       // down or restarting
        case absl::StatusCode::kDeadlineExceeded:  // peers slow or dead
        case absl::StatusCode::kCancelled:  // by a server shutting down (an
                                            // Interrupt returned above)
          // A replicated shard: gone, or not the primary (a backup says
          // so as UNAVAILABLE): the next replica may be.
          if (replicas_ > 1) {
            NextReplica(calls[i].shard, replica_tried[calls[i].shard]);
            reregister = true;
            moved_replica = true;
          }
          break;
        case absl::StatusCode::kNotFound:  // restarted with no model
          reregister = true;
          break;
        default:
          retryable = false;
          all_transient = false;
      }
    }
    // A server that restarted during the call lost what its previous life
    // applied: a sync step it completed there for this worker's other
    // pushes now waits for them again, and the other workers' calls with
    // it. Sent again (once per restart), each is applied once: a step the
    // restart kept takes the push as a duplicate.
    absl::InlinedVector<bool, 16> restarted(num_shards(), false);
    for (int s = 0; s < num_shards(); ++s) {
      const uint64_t life = server_lives_[s].load();
      restarted[s] = lives[s] != 0 && life != lives[s];
      if (life != 0) lives[s] = life;
    }
    auto again = [&] {
      std::vector<size_t> calls_again;
      for (size_t i : all) {
        if (!calls[i].status.ok() || restarted[calls[i].shard]) {
          calls_again.push_back(i);
        }
      }
      return calls_again;
    };
    if (failed.empty()) {
      // Bounded like a retry: a server claiming a new life on every answer
      // cannot keep the call going.
      if (std::find(restarted.begin(), restarted.end(), true) ==
              restarted.end() ||
          absl::Now() >= give_up) {
        return absl::OkStatus();
      }
      which = again();
      LOG(WARNING) << method << ": a shard restarted during the call; its "
                   << which.size() << " call(s) go again";
      continue;
    }
    const Call& first = calls[failed.front()];
    // The replica the call went to (HostOf may have moved on to the next).
    const absl::Status error(
        first.status.code(),
        absl::StrCat("shard ", first.shard, " (",
                     replica_hosts_[first.shard][replica_tried[first.shard]],
                     "): ", first.status.message()));
    if (!retryable || absl::Now() + backoff > give_up) {
      // A replicated shard's next replica is tried even without retries:
      // one that is gone is no reason to fail while another serves.
      if (!moved_replica || moving_rounds_left == 0 || !all_transient) {
        return error;
      }
      --moving_rounds_left;
      which = again();
      continue;
    }
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
    // Moving through a shard's replicas while one takes over: a takeover
    // takes a fraction of a second, so the tries stay close together.
    backoff = moved_replica ? absl::Milliseconds(50)
                            : std::min(backoff * 2, absl::Seconds(5));
    if (reregister) {
      // Within the retry window: a server that is not back yet must not
      // hold the worker for the whole connect timeout.
      if (absl::Status s = RegisterOnShards(give_up); !s.ok()) {
        LOG(WARNING) << "registering again failed: " << s;
      }
    }
    which = again();
  }
}

}  // namespace pstrain
