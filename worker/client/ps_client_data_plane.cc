// PsClient on the data plane (common/transport/data_link.h): which shards offer
// it, its connections, and running a step's calls over them.

#include <algorithm>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/protocol.h"
#include "common/transport/socket.h"
#include "glog/logging.h"
#include "worker/client/ps_client_internal.h"

namespace pstrain {
namespace {

// How long a data port that could not be reached is left alone (a server
// with a fixed --data_port may come back on it).
constexpr absl::Duration kDataPortRetry = absl::Seconds(30);
// The longest a call waits to learn the shards' data ports again: a
// registration answers in milliseconds where the server is up, and one that
// is not must leave the call most of its retry window.
constexpr absl::Duration kDataPortRefreshTimeout = absl::Seconds(3);

}  // namespace

bool PsClient::DataPlaneAllowed() const {
  return options_.data_plane && (options_.credentials == nullptr ||
                                 options_.data_plane_tls != nullptr);
}

bool PsClient::DataPushPullOffered(int shard) {
  absl::MutexLock lock(&data_ports_mu_);
  return data_push_pull_[shard];
}

int PsClient::DataPortToUse(int shard) {
  absl::MutexLock lock(&data_ports_mu_);
  const int port = data_ports_[shard];
  // Tensors never leave in plaintext from a TLS client, and a plaintext
  // client cannot speak to a TLS port: either way, gRPC.
  const bool tls_client = options_.credentials != nullptr;
  if (port == 0 || data_port_tls_[shard] != tls_client ||
      (port == data_failed_ports_[shard] &&
       absl::Now() < data_failed_at_[shard] + kDataPortRetry)) {
    return 0;
  }
  return port;
}

absl::StatusOr<std::unique_ptr<DataLink>> PsClient::OpenDataLink(
    const std::string& grpc_address, int port, absl::Time deadline) const {
  std::string host;
  int grpc_port;
  if (absl::Status s = SplitHostPort(grpc_address, &host, &grpc_port);
      !s.ok()) {
    return s;
  }
  return DataLink::Open(
      host, port, options_.auth_token, options_.max_message_bytes,
      std::min(deadline, absl::Now() + absl::Seconds(5)),
      options_.credentials != nullptr ? options_.data_plane_tls : nullptr);
}

bool PsClient::SomeShardOnAnotherHost() const {
  for (int s = 0; s < num_shards(); ++s) {
    if (primary_on_this_host_[s].load() == 0) return true;
  }
  return false;
}

int PsClient::DataConnectionOf(int shard, int connection) const {
  if (options_.connections_per_shard > 0 || connection == 0) return connection;
  // Not known yet: the first link opened tells.
  return primary_on_this_host_[shard].load() == 1 ? connection : 0;
}

DataLink* PsClient::LinkFor(int shard, DataSlot& slot, absl::Time deadline) {
  const int port = DataPortToUse(shard);
  if (port == 0) return nullptr;
  if (slot.link != nullptr && slot.port == port && slot.link->usable()) {
    return slot.link.get();
  }
  slot.link.reset();
  absl::StatusOr<std::unique_ptr<DataLink>> link =
      OpenDataLink(HostOf(shard), port, deadline);
  if (!link.ok()) {
    LOG(WARNING) << "data plane of shard " << shard << " (port " << port
                 << " of " << HostOf(shard)
                 << ") cannot be reached: " << link.status()
                 << "; its pushes and pulls go over gRPC until it announces "
                    "another port or 30 s have passed";
    absl::MutexLock lock(&data_ports_mu_);
    data_failed_ports_[shard] = port;
    data_failed_at_[shard] = absl::Now();
    refresh_data_ports_ = true;
    return nullptr;
  }
  {
    const int on_this_host = (*link)->same_host() ? 1 : 0;
    if (primary_on_this_host_[shard].exchange(on_this_host) != on_this_host &&
        options_.connections_per_shard == 0) {
      LOG(INFO)
          << "shard " << shard << "'s data plane (" << (*link)->peer()
          << ") is on " << (on_this_host ? "this host: " : "another host: ")
          << (on_this_host ? connections_ : 1) << " connection"
          << (on_this_host && connections_ > 1 ? "s" : "")
          << (on_this_host
                  ? ""
                  : absl::StrCat(
                        ", round trip ",
                        absl::FormatDuration((*link)->hello_round_trip()), ", ",
                        WindowBytesForRoundTrip((*link)->hello_round_trip()) /
                            1024,
                        " KiB in flight past the oldest request"));
    }
  }
  slot.link = std::move(*link);
  slot.port = port;
  return slot.link.get();
}

bool PsClient::MayReadFromBackups() const {
  if (options_.pulls_from_backups == PsClientOptions::BackupReads::kNever ||
      replicas_ != 2 || mode_ != ConsistencyMode::kSync ||
      !DataPlaneAllowed() || clip_max_norm_ > 0) {
    return false;
  }
  // Each worker reads the shards of the other parity from their backups.
  return num_shards() > 1 || worker_id_ % 2 == 1;
}

int PsClient::BackupToReadFrom(int shard) {
  if (!MayReadFromBackups() || (worker_id_ + shard) % 2 == 0 ||
      DataPortToUse(shard) == 0 || !DataPushPullOffered(shard)) {
    return -1;  // the read's push goes to the primary's data plane
  }
  const int backup = 1 - current_replica_[shard].load();
  absl::MutexLock lock(&data_ports_mu_);
  const absl::Time now = absl::Now();
  if (now < backup_reads_off_until_[shard] ||
      data_port_tls_[shard] != (options_.credentials != nullptr)) {
    return -1;
  }
  if (options_.pulls_from_backups == PsClientOptions::BackupReads::kByHost &&
      primary_on_this_host_[shard].load() != 0) {
    return -1;
  }
  const std::vector<int>& ports = replica_data_ports_[shard];
  if (static_cast<int>(ports.size()) != replicas_ || ports[backup] == 0) {
    // No backup when this worker last registered (one catching up after a
    // failover, say): it asks again now and then.
    backup_reads_off_until_[shard] = now + kDataPortRetry;
    refresh_data_ports_ = true;
    return -1;
  }
  return backup;
}

DataLink* PsClient::BackupLinkFor(int shard, int replica, DataSlot& slot,
                                  absl::Time deadline) {
  int port = 0;
  {
    absl::MutexLock lock(&data_ports_mu_);
    const std::vector<int>& ports = replica_data_ports_[shard];
    if (replica < static_cast<int>(ports.size())) port = ports[replica];
  }
  if (port == 0) {  // a registration since forgot it
    StopBackupReads(shard, absl::UnavailableError("no data port known"));
    return nullptr;
  }
  if (slot.link != nullptr && slot.port == port && slot.link->usable()) {
    return slot.link.get();
  }
  slot.link.reset();
  absl::StatusOr<std::unique_ptr<DataLink>> link =
      OpenDataLink(replica_hosts_[shard][replica], port, deadline);
  if (!link.ok()) {
    StopBackupReads(shard, link.status());
    return nullptr;
  }
  slot.link = std::move(*link);
  slot.port = port;
  return slot.link.get();
}

void PsClient::StopBackupReads(int shard, const absl::Status& why) {
  absl::MutexLock lock(&data_ports_mu_);
  const int failures = std::min(backup_read_failures_[shard]++, 5);
  const absl::Duration pause = kDataPortRetry * (1 << failures);
  LOG(WARNING) << "shard " << shard << ": reading from its backup failed ("
               << why << "); its values come from the primary for "
               << absl::FormatDuration(pause);
  backup_reads_off_until_[shard] = absl::Now() + pause;
  // A backup started again listens on another data port.
  refresh_data_ports_ = true;
}

void PsClient::OpenMissingLinks(const std::vector<Call>& calls,
                                const std::vector<size_t>& which,
                                absl::Time deadline) {
  std::map<int, std::vector<DataSlot*>> missing;  // by shard
  for (size_t i : which) {
    const int shard = calls[i].shard;
    DataSlot* slot =
        data_slots_[SlotOf(shard, DataConnectionOf(shard, calls[i].connection))]
            .get();
    if (!slot->mu.TryLock()) continue;  // in use: not missing
    const bool usable = slot->link != nullptr && slot->link->usable();
    slot->mu.Unlock();
    if (usable || DataPortToUse(calls[i].shard) == 0) continue;
    std::vector<DataSlot*>& slots = missing[calls[i].shard];
    if (std::find(slots.begin(), slots.end(), slot) == slots.end()) {
      slots.push_back(slot);
    }
  }
  OpenLinks(missing, deadline);
}

void PsClient::OpenLinks(const std::map<int, std::vector<DataSlot*>>& by_shard,
                         absl::Time deadline) {
  auto open_shard = [this, deadline](int shard,
                                     const std::vector<DataSlot*>& slots) {
    for (DataSlot* slot : slots) {
      if (!slot->mu.TryLock()) continue;  // in use: it has its link
      LinkFor(shard, *slot, deadline);
      slot->mu.Unlock();
    }
  };
  if (by_shard.size() == 1) {
    open_shard(by_shard.begin()->first, by_shard.begin()->second);
    return;
  }
  std::vector<std::thread> openers;
  for (const auto& [shard, slots] : by_shard) {
    openers.emplace_back(open_shard, shard, std::cref(slots));
  }
  for (std::thread& opener : openers) opener.join();
}

void PsClient::MaybeRefreshDataPorts(absl::Time deadline) {
  {
    absl::MutexLock lock(&data_ports_mu_);
    if (!refresh_data_ports_) return;
    refresh_data_ports_ = false;
  }
  // A server restarted from its checkpoint keeps its model, so nothing else
  // would make this worker register again and hear its new port. Bounded
  // well inside the call's deadline: a server that is gone (its calls then
  // fail and RunAll retries them within --retry_window_s) must not hold
  // the step for the connect timeout. The next data port that cannot be
  // reached asks again.
  const absl::Time give_up =
      std::min(deadline, absl::Now() + kDataPortRefreshTimeout);
  if (absl::Status s = RegisterOnShards(give_up); !s.ok()) {
    LOG(WARNING) << "registering again to learn data ports failed: " << s;
  }
}

std::vector<size_t> PsClient::RunOnDataPlane(const std::string& short_name,
                                             std::vector<Call>& calls,
                                             const std::vector<size_t>& which,
                                             absl::Duration timeout) {
  if (!DataPlaneAllowed()) return which;
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
  const absl::Time deadline = absl::Now() + timeout;
  MaybeRefreshDataPorts(deadline);
  OpenMissingLinks(calls, which, deadline);
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
    const bool backup_read = call.read_replica >= 0;
    // A backup read follows the PushPull carrying its push: without that
    // push on its way, the read would wait for a step that cannot come.
    if (backup_read && !over_grpc.empty() && over_grpc.back() + 1 == i) {
      over_grpc.push_back(i);
      continue;
    }
    const data_plane::Method call_method =
        backup_read ? data_plane::Method::kPull : method;
    if (call_method == data_plane::Method::kPushPull &&
        !DataPushPullOffered(call.shard)) {
      over_grpc.push_back(i);  // the two calls, on the data plane or not
      continue;
    }
    const int connection = DataConnectionOf(call.shard, call.connection);
    DataSlot& slot =
        *data_slots_[backup_read ? SlotOfReplica(call.shard, call.read_replica,
                                                 connection)
                                 : SlotOf(call.shard, connection)];
    auto it = std::find_if(held.begin(), held.end(),
                           [&slot](const auto& h) { return h.first == &slot; });
    if (it == held.end()) {
      // Busy on another thread (a push thread beside a pull): gRPC.
      if (!slot.mu.TryLock()) {
        over_grpc.push_back(i);
        continue;
      }
      held.emplace_back(
          &slot, backup_read ? BackupLinkFor(call.shard, call.read_replica,
                                             slot, deadline)
                             : LinkFor(call.shard, slot, deadline));
      it = held.end() - 1;
    }
    DataLink* link = it->second;
    if (link == nullptr) {
      over_grpc.push_back(i);
      continue;
    }
    DataExchange& exchange = exchanges.emplace_back();
    exchange.link = link;
    exchange.method = call_method;
    exchange.on_response = [&call](absl::string_view body) {
      return call.on_response ? call.on_response(absl::MakeConstSpan(&body, 1))
                              : absl::OkStatus();
    };
    exchange.place_payloads = call.place_payloads;
    if (call.place_payloads && call.group != nullptr) {
      // At most: values pulled in 16 bits bring half.
      exchange.answer_bytes = call.group->elements * sizeof(float);
    }
    exchange.can_send = call.can_send;
    exchange.send_wake_fd = call.send_wake_fd;
    exchange.on_ok = call.on_ok;
    if (call_method == data_plane::Method::kPushPull) {
      PreparePushPull(call, exchange);
    } else if (call.message.num_pieces() > 0) {
      exchange.body = call.message.Pieces();
    } else {
      exchange.body = {call.flat};
    }
    call_of_exchange.push_back(i);
  }
  for (size_t k = 0; k < exchanges.size(); ++k) {
    const Call& call = calls[call_of_exchange[k]];
    if (call.after >= 0) {
      auto followed = std::find(call_of_exchange.begin(),
                                call_of_exchange.end(), call.after);
      if (followed != call_of_exchange.end()) {
        exchanges[k].after =
            static_cast<int>(followed - call_of_exchange.begin());
        exchanges[k].grace = call.grace;
      }
    }
    Track(exchanges[k].link, call.epoch);
  }
  RunExchanges(absl::MakeSpan(exchanges), deadline,
               options_.data_requests_in_flight);
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

}  // namespace pstrain
