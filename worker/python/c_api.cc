// libpstrain's C ABI (c_api.h): argument conversion only; every call's
// logic is PsClient's or the data readers'.
#include "worker/python/c_api.h"

#include <errno.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/marshalling.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_spec.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "common/transport/connection_check.h"
#include "glog/logging.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/ps.pb.h"
#include "worker/client/client_config.h"
#include "worker/client/client_options.h"
#include "worker/client/graceful_stop.h"
#include "worker/client/ps_client.h"
#include "worker/connect_wait.h"
#include "worker/ctr_data.h"
#include "worker/data.h"
#include "worker/idx_data.h"
#include "worker/serial_worker.h"
#include "worker/unique_ids.h"

struct pstrain_step_stream;

struct pstrain_client {
  std::unique_ptr<pstrain::PsClient> client;
  // As made: the registration's wait and its diagnosis read the hosts.
  pstrain::PsClientOptions options;
  pstrain::ModelSchema schema;
  // The pipelined step's shared state, made by the first
  // pstrain_stream_start (it needs the registered partition); and the
  // stream running on it, if any (one at a time).
  std::unique_ptr<pstrain::PsClient::StepStream> step_stream;
  pstrain_step_stream* running = nullptr;
  // The exchanges' thread, made with step_stream; last: drained first.
  std::unique_ptr<pstrain::SerialWorker> exchange_thread;
};

// One pipelined step: PsClient::PushPullStreamed on the client's exchange
// thread.
struct pstrain_step_stream {
  pstrain_client* client = nullptr;
  std::vector<pstrain::PsClient::ConstTensorRef> gradients;
  std::vector<pstrain::PsClient::TensorRef> values;
  absl::StatusOr<pstrain::PsClient::PushPullResult> result;
  // StepStream::landings() when it started: the groups answered as they
  // were streamed are those since.
  int64_t landings_before = 0;
};

namespace pstrain {
namespace {

// The clients a signal interrupts, and the grace of a graceful stop
// (pstrain_stop_gracefully). Never destroyed: the watcher thread outlives
// main.
GracefulStop* const graceful_stop = new GracefulStop;

// pstrain_stop_gracefully's state: the signals (a bit per number) whose
// first arrival lets the step in hand finish, and the first such signal
// (0: none yet).
std::atomic<uint64_t> graceful_signals{0};
std::atomic<int> stop_signal{0};

// One SIGINT or SIGTERM read from the wakeup fd.
void OnTerminationSignal(int number) {
  if ((graceful_signals.load() >> number & 1) == 0) {
    graceful_stop->InterruptAll();
    return;
  }
  int none = 0;
  if (stop_signal.compare_exchange_strong(none, number)) {
    std::thread([] { graceful_stop->InterruptAfterGrace(); }).detach();
  } else if (number == SIGINT) {
    graceful_stop->InterruptAll();  // Ctrl-C again: stop now
  }
  // A second SIGTERM changes nothing: its sender escalates to SIGKILL.
}

}  // namespace
}  // namespace pstrain

struct pstrain_examples {
  std::unique_ptr<pstrain::ExampleSource> source;
};

struct pstrain_ctr_data {
  pstrain::CtrDataset data;
  std::vector<double> truth;
};

struct pstrain_epoch_plan {
  pstrain::EpochPlan plan;
};

namespace pstrain {
namespace {

char* CopyString(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

// The C convention: 0, or the status code with *error set.
int Fail(const absl::Status& status, char** error) {
  if (status.ok()) return 0;
  if (error != nullptr) *error = CopyString(std::string(status.message()));
  return static_cast<int>(status.code());
}

// Runs `body`, which returns a status; a C++ exception (a bug, or a JSON
// value of the wrong type) becomes INTERNAL / INVALID_ARGUMENT instead of
// crossing the C boundary.
int Guard(char** error, const std::function<absl::Status()>& body) {
  try {
    return Fail(body(), error);
  } catch (const nlohmann::json::exception& e) {
    return Fail(absl::InvalidArgumentError(e.what()), error);
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(e.what()), error);
  }
}

// Sets the ClientConfig option `name` (client_options.h) from `value`.
using OptionSetter = std::function<void(const nlohmann::json&, ClientConfig&)>;
const std::map<std::string, OptionSetter>& ClientOptionSetters() {
#define PSTRAIN_OPTION_SETTER(type, name, member, help)  \
  {#name, [](const nlohmann::json& v, ClientConfig& c) { \
     c.member = v.get<type>();                           \
   }},
  static const auto* setters = new std::map<std::string, OptionSetter>{
      {"hosts", [](auto& v, auto& c) { c.hosts = v; }},
      PSTRAIN_CLIENT_OPTIONS(PSTRAIN_OPTION_SETTER)};
#undef PSTRAIN_OPTION_SETTER
  return *setters;
}

// Reads a client option's value from its flag text (a cluster description's
// worker_flags) as the worker binary's flag of that name does.
using OptionParser =
    std::function<bool(const std::string&, nlohmann::json&, std::string*)>;
const std::map<std::string, OptionParser>& ClientOptionParsers() {
#define PSTRAIN_OPTION_PARSER(type, name, member, help)                        \
  {#name, [](const std::string& text, nlohmann::json& out, std::string* why) { \
     type parsed{};                                                            \
     if (!absl::ParseFlag(text, &parsed, why)) return false;                   \
     out = parsed;                                                             \
     return true;                                                              \
   }},
  static const auto* parsers = new std::map<std::string, OptionParser>{
      PSTRAIN_CLIENT_OPTIONS(PSTRAIN_OPTION_PARSER)};
#undef PSTRAIN_OPTION_PARSER
  return *parsers;
}

absl::StatusOr<ClientConfig> ParseClientOptions(const char* options_json) {
  const nlohmann::json options = nlohmann::json::parse(options_json);
  if (!options.is_object()) {
    return absl::InvalidArgumentError("client options must be a JSON object");
  }
  ClientConfig config;
  for (const auto& [name, value] : options.items()) {
    auto setter = ClientOptionSetters().find(name);
    if (setter == ClientOptionSetters().end()) {
      std::vector<std::string> known;
      for (const auto& [known_name, unused] : ClientOptionSetters()) {
        known.push_back(known_name);
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unknown client option '", name,
                       "' (known: ", absl::StrJoin(known, ", "), ")"));
    }
    try {
      setter->second(value, config);
    } catch (const nlohmann::json::exception&) {
      return absl::InvalidArgumentError(absl::StrCat(
          "client option '", name, "': ", value.dump(), " is not of its type"));
    }
  }
  if (config.hosts.empty()) {
    return absl::InvalidArgumentError(
        "hosts: the servers' host:port, every shard in order, is required");
  }
  return config;
}

// Exactly the schema's dense tensor count.
absl::Status CheckTensorCount(const pstrain_client& c, int num_tensors) {
  if (c.schema.dense_size() == 0) {
    return absl::FailedPreconditionError("register the model first");
  }
  if (num_tensors != c.schema.dense_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        num_tensors, " tensors, the model has ", c.schema.dense_size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> Only(const pstrain_client& c, const int* only,
                                      int num_only) {
  std::vector<int> out;
  for (int i = 0; i < num_only; ++i) {
    if (only[i] < 0 || only[i] >= c.schema.dense_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor index ", only[i], " out of range"));
    }
    out.push_back(only[i]);
  }
  return out;
}

absl::Status CheckTable(const pstrain_client& c, int table) {
  if (table < 0 || table >= c.schema.sparse_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse table ", table, " is not in the schema (it has ",
                     c.schema.sparse_size(), ")"));
  }
  return absl::OkStatus();
}

// The parts' tables and counts, checked; `make(i, ids)` builds part i.
template <typename Part, typename Make>
absl::StatusOr<std::vector<Part>> SparseParts(const pstrain_client& c,
                                              int num_parts, const int* tables,
                                              const uint64_t* const* ids,
                                              const int64_t* num_ids,
                                              Make make) {
  if (num_parts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_parts must be >= 0, got ", num_parts));
  }
  std::vector<Part> parts;
  parts.reserve(num_parts);
  for (int i = 0; i < num_parts; ++i) {
    if (absl::Status s = CheckTable(c, tables[i]); !s.ok()) return s;
    if (num_ids[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("part ", i, ": num_ids must be >= 0, got ", num_ids[i]));
    }
    parts.push_back(make(i, absl::MakeConstSpan(ids[i], num_ids[i])));
  }
  return parts;
}

}  // namespace
}  // namespace pstrain

using pstrain::Fail;
using pstrain::Guard;

extern "C" {

int pstrain_api_version(void) { return PSTRAIN_C_API_VERSION; }

void pstrain_free(void* p) { std::free(p); }

int pstrain_client_parse_options(const char* options_json, char** error) {
  return Guard(error, [&]() -> absl::Status {
    return pstrain::ParseClientOptions(options_json).status();
  });
}

int pstrain_client_create(const char* options_json, pstrain_client** out,
                          char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (!google::IsGoogleLoggingInitialized()) {
      google::InitGoogleLogging("pstrain");
      FLAGS_logtostderr = true;
    }
    absl::StatusOr<pstrain::ClientConfig> config =
        pstrain::ParseClientOptions(options_json);
    if (!config.ok()) return config.status();
    absl::StatusOr<pstrain::PsClientOptions> options =
        pstrain::MakePsClientOptions(*config);
    if (!options.ok()) return options.status();
    auto client = std::make_unique<pstrain_client>();
    client->options = *options;
    absl::StatusOr<std::unique_ptr<pstrain::PsClient>> made =
        pstrain::PsClient::Create(*options);
    if (!made.ok()) return made.status();
    client->client = std::move(*made);
    *out = client.release();
    pstrain::graceful_stop->Add((*out)->client.get());
    return absl::OkStatus();
  });
}

void pstrain_client_destroy(pstrain_client* client) {
  if (client->running != nullptr) pstrain_stream_cancel(client->running);
  pstrain::graceful_stop->Remove(client->client.get());
  delete client;
}

void pstrain_watch_signals(int fd) {
  static std::once_flag started;
  std::call_once(started, [fd] {
    // Detached: it lives as long as the process, blocked in read().
    std::thread([fd] {
      unsigned char signals[64];
      while (true) {
        const ssize_t n = read(fd, signals, sizeof(signals));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;  // the pipe closed
        for (ssize_t i = 0; i < n; ++i) {
          if (signals[i] == SIGINT || signals[i] == SIGTERM) {
            pstrain::OnTerminationSignal(signals[i]);
          }
        }
      }
    }).detach();
  });
}

void pstrain_client_interrupt(pstrain_client* client) {
  client->client->Interrupt();
}

void pstrain_stop_gracefully(uint64_t signals, int64_t step_work_ms) {
  if (signals != 0 && step_work_ms < 0) {
    // A new job: an earlier job's stop was handled by its caller (a
    // notebook's Ctrl-C, caught), and must not stop this one.
    pstrain::stop_signal.store(0);
    pstrain::graceful_stop->NewJob();
    pstrain::graceful_stop->StepWorkBegins();
    // Before the signals are watched: a stop that comes at once must find
    // the interrupts armed (the last job left them quiet).
    pstrain::graceful_stop->Arm();
  } else if (signals != 0) {
    pstrain::graceful_stop->StepWorkDone(absl::Milliseconds(step_work_ms));
  }
  pstrain::graceful_signals.store(signals);
  // Quiet while none is watched; a new watch before any signal came starts
  // loud (a process may train one job after another).
  if (signals == 0) {
    pstrain::graceful_stop->Quiet();
  } else if (pstrain::stop_signal.load() == 0) {
    pstrain::graceful_stop->Arm();
  }
}

int pstrain_stop_requested(void) { return pstrain::stop_signal.load(); }

void pstrain_stop_quiet(void) { pstrain::graceful_stop->Quiet(); }

int pstrain_client_num_shards(const pstrain_client* client) {
  return client->client->num_shards();
}

int pstrain_client_register(pstrain_client* c, const char* schema_json,
                            int num_workers, int worker_id, char** result_json,
                            char** error) {
  return Guard(error, [&]() -> absl::Status {
    pstrain::ModelSchema schema;
    google::protobuf::util::JsonParseOptions strict;
    if (auto s = google::protobuf::util::JsonStringToMessage(schema_json,
                                                             &schema, strict);
        !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("schema: ", std::string(s.message())));
    }
    // Register validates the schema (once its block size is resolved). A
    // wait for servers not up yet is said on stderr every few seconds (the
    // log), as the worker binary says it.
    absl::StatusOr<pstrain::Registration> registration =
        pstrain::RegisterShowingWait(*c->client, c->options, schema,
                                     num_workers, worker_id);
    if (absl::IsDeadlineExceeded(registration.status())) {
      // Waiting for servers, gRPC reports any cause as the deadline passing:
      // say what the likely one is, as the worker binary does.
      std::vector<std::string> causes;
      for (const std::string& host : c->options.hosts) {
        const std::string cause = pstrain::DiagnoseConnection(
            host, c->options.credentials != nullptr, absl::Seconds(2));
        if (!cause.empty()) causes.push_back(cause);
      }
      if (!causes.empty()) {
        return absl::Status(
            registration.status().code(),
            absl::StrCat(registration.status().message(),
                         "; likely cause: ", absl::StrJoin(causes, "; ")));
      }
    }
    if (!registration.ok()) return registration.status();
    c->schema = schema;
    nlohmann::json result = {
        {"mode", pstrain::ConsistencyModeName(registration->mode)},
        {"start_step", registration->start_step}};
    *result_json = pstrain::CopyString(result.dump());
    return absl::OkStatus();
  });
}

int pstrain_client_await_job_start(pstrain_client* c,
                                   pstrain_waiting_fn on_waiting, void* context,
                                   char** error) {
  return Guard(error, [&]() -> absl::Status {
    pstrain::PsClient::StartWaitReport report;
    if (on_waiting != nullptr) {
      report = [on_waiting, context](const pstrain::JobStart& waiting) {
        nlohmann::json info = {
            {"missing_workers",
             std::vector<int>(waiting.missing_workers().begin(),
                              waiting.missing_workers().end())},
            {"num_workers", waiting.num_workers()},
            {"waited_s", waiting.waited_s()},
            {"startup_timeout_s", waiting.startup_timeout_s()}};
        on_waiting(context, info.dump().c_str());
      };
    }
    return c->client->AwaitJobStart(report);
  });
}

int pstrain_client_pull(pstrain_client* c, int64_t step, float* const* tensors,
                        int num_tensors, int64_t* pulled_step, char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTensorCount(*c, num_tensors); !s.ok()) {
      return s;
    }
    absl::StatusOr<int64_t> pulled = c->client->Pull(
        step, std::vector<float*>(tensors, tensors + num_tensors));
    if (!pulled.ok()) return pulled.status();
    *pulled_step = *pulled;
    return absl::OkStatus();
  });
}

int pstrain_client_push(pstrain_client* c, int64_t step,
                        const float* const* gradients, int num_tensors,
                        const int* only, int num_only, int64_t result[2],
                        char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTensorCount(*c, num_tensors); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::vector<int>> selected =
        pstrain::Only(*c, only, num_only);
    if (!selected.ok()) return selected.status();
    absl::StatusOr<pstrain::PsClient::PushResult> pushed = c->client->Push(
        step, std::vector<const float*>(gradients, gradients + num_tensors),
        *selected);
    if (!pushed.ok()) return pushed.status();
    result[0] = pushed->blocks_duplicate;
    result[1] = pushed->blocks_late;
    return absl::OkStatus();
  });
}

int pstrain_client_push_pull(pstrain_client* c, int64_t push_step,
                             const float* const* gradients, int64_t pull_step,
                             float* const* tensors, int num_tensors,
                             int64_t result[3], char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTensorCount(*c, num_tensors); !s.ok()) {
      return s;
    }
    absl::StatusOr<pstrain::PsClient::PushPullResult> done =
        c->client->PushPull(
            push_step,
            std::vector<const float*>(gradients, gradients + num_tensors),
            pull_step, std::vector<float*>(tensors, tensors + num_tensors));
    if (!done.ok()) return done.status();
    result[0] = done->pushed.blocks_duplicate;
    result[1] = done->pushed.blocks_late;
    result[2] = done->pulled_step;
    return absl::OkStatus();
  });
}

int pstrain_client_some_shard_on_another_host(const pstrain_client* client) {
  return client->client->SomeShardOnAnotherHost() ? 1 : 0;
}

int pstrain_stream_start(pstrain_client* c, int64_t push_step,
                         const float* const* gradients, int64_t pull_step,
                         float* const* tensors, int num_tensors,
                         pstrain_step_stream** out, char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTensorCount(*c, num_tensors); !s.ok()) {
      return s;
    }
    if (c->running != nullptr) {
      return absl::FailedPreconditionError(
          "a pipelined step is still running on this client "
          "(pstrain_stream_finish or pstrain_stream_cancel it first)");
    }
    for (int t = 0; t < num_tensors; ++t) {
      if (gradients[t] == nullptr || tensors[t] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", t, ": no memory given"));
      }
    }
    if (c->step_stream == nullptr) {
      c->step_stream = c->client->MakeStepStream();
      c->exchange_thread = std::make_unique<pstrain::SerialWorker>();
    }
    auto stream = std::make_unique<pstrain_step_stream>();
    stream->client = c;
    for (int t = 0; t < num_tensors; ++t) {
      stream->gradients.push_back({pstrain::FLOAT32, gradients[t]});
      stream->values.push_back({pstrain::FLOAT32, tensors[t]});
    }
    c->step_stream->BeginStep();
    stream->landings_before = c->step_stream->landings();
    pstrain_step_stream* s = stream.get();
    c->exchange_thread->Schedule([s, push_step, pull_step] {
      s->result = s->client->client->PushPullStreamed(push_step, s->gradients,
                                                      pull_step, s->values,
                                                      *s->client->step_stream);
    });
    c->running = stream.release();
    *out = c->running;
    return absl::OkStatus();
  });
}

int pstrain_stream_ready(pstrain_step_stream* stream, int tensor, int64_t end) {
  const pstrain_client& c = *stream->client;
  if (tensor < 0 || tensor >= c.schema.dense_size()) {
    return static_cast<int>(absl::StatusCode::kInvalidArgument);
  }
  const int64_t size = pstrain::NumElements(c.schema.dense(tensor));
  if (end < 0 || end > size) {
    return static_cast<int>(absl::StatusCode::kInvalidArgument);
  }
  c.step_stream->SetReady(tensor, end);
  return 0;
}

int pstrain_stream_finish(pstrain_step_stream* stream, int64_t result[4],
                          char** error) {
  std::unique_ptr<pstrain_step_stream> owned(stream);
  stream->client->step_stream->StopReading();
  stream->client->exchange_thread->Drain();
  const int64_t streamed =
      stream->client->step_stream->landings() - stream->landings_before;
  stream->client->running = nullptr;
  return Guard(error, [&]() -> absl::Status {
    if (!owned->result.ok()) return owned->result.status();
    result[0] = owned->result->pushed.blocks_duplicate;
    result[1] = owned->result->pushed.blocks_late;
    result[2] = owned->result->pulled_step;
    result[3] = streamed;
    return absl::OkStatus();
  });
}

void pstrain_stream_cancel(pstrain_step_stream* stream) {
  std::unique_ptr<pstrain_step_stream> owned(stream);
  stream->client->step_stream->Cancel();
  stream->client->step_stream->StopReading();
  stream->client->client->Interrupt();
  stream->client->exchange_thread->Drain();
  stream->client->running = nullptr;
}

int pstrain_client_assign(pstrain_client* c, const float* const* values,
                          int num_tensors, const int* only, int num_only,
                          int64_t result[2], char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTensorCount(*c, num_tensors); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::vector<int>> selected =
        pstrain::Only(*c, only, num_only);
    if (!selected.ok()) return selected.status();
    absl::StatusOr<pstrain::PsClient::PushResult> assigned = c->client->Assign(
        std::vector<const float*>(values, values + num_tensors), *selected);
    if (!assigned.ok()) return assigned.status();
    result[0] = assigned->blocks_duplicate;
    result[1] = assigned->blocks_late;
    return absl::OkStatus();
  });
}

int pstrain_client_pull_sparse(pstrain_client* c, int table, int64_t step,
                               const uint64_t* ids, int64_t num_ids, float* out,
                               char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTable(*c, table); !s.ok()) return s;
    return c->client->PullSparse(table, step, absl::MakeConstSpan(ids, num_ids),
                                 out);
  });
}

int pstrain_client_push_sparse(pstrain_client* c, int table, int64_t step,
                               const uint64_t* ids, int64_t num_ids,
                               const float* gradients, int64_t result[2],
                               char** error) {
  return Guard(error, [&]() -> absl::Status {
    if (absl::Status s = pstrain::CheckTable(*c, table); !s.ok()) return s;
    absl::StatusOr<pstrain::PsClient::PushResult> pushed =
        c->client->PushSparse(table, step, absl::MakeConstSpan(ids, num_ids),
                              gradients);
    if (!pushed.ok()) return pushed.status();
    result[0] = pushed->blocks_duplicate;
    result[1] = pushed->blocks_late;
    return absl::OkStatus();
  });
}

int pstrain_client_pull_sparse_tables(pstrain_client* c, int64_t step,
                                      int num_parts, const int* tables,
                                      const uint64_t* const* ids,
                                      const int64_t* num_ids,
                                      float* const* outs, char** error) {
  return Guard(error, [&]() -> absl::Status {
    using Part = pstrain::PsClient::SparsePullPart;
    absl::StatusOr<std::vector<Part>> parts = pstrain::SparseParts<Part>(
        *c, num_parts, tables, ids, num_ids,
        [&](int i, absl::Span<const uint64_t> part_ids) {
          return Part{tables[i], part_ids, outs[i]};
        });
    if (!parts.ok()) return parts.status();
    return c->client->PullSparse(step, *parts);
  });
}

int pstrain_client_push_sparse_tables(pstrain_client* c, int64_t step,
                                      int num_parts, const int* tables,
                                      const uint64_t* const* ids,
                                      const int64_t* num_ids,
                                      const float* const* gradients,
                                      int64_t result[2], char** error) {
  return Guard(error, [&]() -> absl::Status {
    using Part = pstrain::PsClient::SparsePushPart;
    absl::StatusOr<std::vector<Part>> parts = pstrain::SparseParts<Part>(
        *c, num_parts, tables, ids, num_ids,
        [&](int i, absl::Span<const uint64_t> part_ids) {
          return Part{tables[i], part_ids, gradients[i]};
        });
    if (!parts.ok()) return parts.status();
    absl::StatusOr<pstrain::PsClient::PushResult> pushed =
        c->client->PushSparse(step, *parts);
    if (!pushed.ok()) return pushed.status();
    result[0] = pushed->blocks_duplicate;
    result[1] = pushed->blocks_late;
    return absl::OkStatus();
  });
}

void pstrain_client_set_group_rates(pstrain_client* c, const double* rates,
                                    const double* momentums, int num_groups) {
  c->client->SetGroupRates(
      std::vector<double>(rates, rates + num_groups),
      momentums == nullptr
          ? std::vector<double>()
          : std::vector<double>(momentums, momentums + num_groups));
}

void pstrain_client_set_gradient_clip(pstrain_client* c, double max_norm) {
  c->client->SetGradientClip(max_norm);
}

double pstrain_client_last_clip_norm(const pstrain_client* c) {
  return c->client->last_clip_norm();
}

int pstrain_client_leave(pstrain_client* c, char** error) {
  return Guard(error, [&] { return c->client->Leave(); });
}

int pstrain_client_leave_stopping(pstrain_client* c, double timeout_s,
                                  char** error) {
  return Guard(error, [&] {
    return c->client->LeaveStoppingWithin(pstrain::graceful_stop->grace(),
                                          absl::Seconds(timeout_s));
  });
}

int pstrain_client_stats(pstrain_client* c, char** stats_json, char** error) {
  return Guard(error, [&]() -> absl::Status {
    absl::StatusOr<std::vector<pstrain::StatsResponse>> stats =
        c->client->Stats();
    if (!stats.ok()) return stats.status();
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    std::vector<std::string> shards;
    for (const pstrain::StatsResponse& shard : *stats) {
      std::string json;
      // Cannot fail for a message this library parsed.
      (void)google::protobuf::util::MessageToJsonString(shard, &json, options);
      shards.push_back(std::move(json));
    }
    *stats_json =
        pstrain::CopyString(absl::StrCat("[", absl::StrJoin(shards, ","), "]"));
    return absl::OkStatus();
  });
}

int pstrain_client_steps_short(pstrain_client* c, int64_t* steps,
                               char** error) {
  return Guard(error, [&]() -> absl::Status {
    absl::StatusOr<int64_t> short_steps = c->client->StepsShort();
    if (!short_steps.ok()) return short_steps.status();
    *steps = *short_steps;
    return absl::OkStatus();
  });
}

int pstrain_client_await_final_model(pstrain_client* c,
                                     int64_t expected_version, double timeout_s,
                                     char** how, char** error) {
  return Guard(error, [&]() -> absl::Status {
    *how = pstrain::CopyString(
        c->client->AwaitFinalModel(expected_version, absl::Seconds(timeout_s)));
    return absl::OkStatus();
  });
}

int pstrain_client_secure_final_state(pstrain_client* c, int64_t final_version,
                                      char** state_json, char** error) {
  return Guard(error, [&]() -> absl::Status {
    absl::StatusOr<pstrain::FinalState> state =
        c->client->SecureFinalState(final_version);
    if (!state.ok()) return state.status();
    // Through protobuf's JSON printer: the problems are free text.
    google::protobuf::Struct json;
    auto& fields = *json.mutable_fields();
    fields["summary"].set_string_value(state->summary);
    auto* behind = fields["shards_behind"].mutable_list_value();
    for (int shard : state->shards_behind) {
      behind->add_values()->set_number_value(shard);
    }
    auto* problems = fields["problems"].mutable_list_value();
    for (const std::string& problem : state->problems) {
      problems->add_values()->set_string_value(problem);
    }
    std::string text;
    if (!google::protobuf::util::MessageToJsonString(json, &text).ok()) {
      return absl::InternalError("cannot print the final state as JSON");
    }
    *state_json = pstrain::CopyString(text);
    return absl::OkStatus();
  });
}

int pstrain_client_option_names(char** names_json, char** error) {
  return Guard(error, [&]() -> absl::Status {
    nlohmann::json names = nlohmann::json::array();
    for (const auto& [name, unused] : pstrain::ClientOptionParsers()) {
      names.push_back(name);
    }
    *names_json = pstrain::CopyString(names.dump());
    return absl::OkStatus();
  });
}

int pstrain_load_cluster_spec(const char* path, char** spec_json,
                              char** error) {
  return Guard(error, [&]() -> absl::Status {
    absl::StatusOr<std::optional<pstrain::ClusterSpec>> spec =
        pstrain::LoadClusterSpec(path);
    if (!spec.ok()) return spec.status();
    if (!spec->has_value()) {
      *spec_json = pstrain::CopyString("null");
      return absl::OkStatus();
    }
    const pstrain::ClusterSpec& s = **spec;
    nlohmann::json flags = nlohmann::json::object();
    for (const auto& [name, value] : s.worker_flags) flags[name] = value;
    // The worker flags that are client options, typed as the worker binary
    // would parse them; the rest (model flags) mean nothing to a script.
    nlohmann::json client_options = nlohmann::json::object();
    for (const auto& [name, value] : s.worker_flags) {
      auto parse = pstrain::ClientOptionParsers().find(name);
      if (parse == pstrain::ClientOptionParsers().end()) continue;
      std::string why;
      if (!parse->second(value, client_options[name], &why)) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.source, ": worker_flags.", name, "=", value, ": ", why));
      }
    }
    nlohmann::json out = {{"ps", s.ps},
                          {"workers", s.workers},
                          {"max_workers", s.max_workers},
                          {"mode", s.mode},
                          {"task_type", s.task_type},
                          {"task_index", s.task_index},
                          {"worker_flags", flags},
                          {"client_options", client_options},
                          {"source", s.source}};
    *spec_json = pstrain::CopyString(out.dump());
    return absl::OkStatus();
  });
}

int pstrain_open_idx(const char* dir, int train, pstrain_examples** out,
                     char** error) {
  return Guard(error, [&]() -> absl::Status {
    absl::StatusOr<pstrain::IdxDataset> files = pstrain::FindIdxDataset(dir);
    if (!files.ok()) return files.status();
    absl::StatusOr<std::unique_ptr<pstrain::ExampleSource>> source =
        train ? pstrain::OpenIdx(files->train_images, files->train_labels, 0)
              : pstrain::OpenIdx(files->test_images, files->test_labels, 0);
    if (!source.ok()) return source.status();
    *out = new pstrain_examples{std::move(*source)};
    return absl::OkStatus();
  });
}

int pstrain_synthetic(int64_t count, int64_t first_index, int64_t num_features,
                      int64_t num_classes, double label_noise, uint64_t seed,
                      pstrain_examples** out, char** error) {
  return Guard(error, [&]() -> absl::Status {
    pstrain::SyntheticOptions o;
    o.num_features = num_features;
    o.num_classes = num_classes;
    o.label_noise = label_noise;
    o.seed = seed;
    absl::StatusOr<pstrain::Dataset> data =
        pstrain::MakeSyntheticClassification(o, first_index, count, {0, 1});
    if (!data.ok()) return data.status();
    *out = new pstrain_examples{
        std::make_unique<pstrain::InMemorySource>(std::move(*data))};
    return absl::OkStatus();
  });
}

void pstrain_examples_destroy(pstrain_examples* examples) { delete examples; }

void pstrain_examples_shape(const pstrain_examples* examples,
                            int64_t shape[3]) {
  shape[0] = examples->source->size();
  shape[1] = examples->source->num_features();
  shape[2] = examples->source->num_classes();
}

int pstrain_examples_gather(pstrain_examples* examples, const int64_t* rows,
                            int64_t n, float* features, int64_t* labels,
                            char** error) {
  return Guard(error, [&]() -> absl::Status {
    const int64_t size = examples->source->size();
    for (int64_t i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= size) {
        return absl::InvalidArgumentError(
            absl::StrCat("index ", rows[i], " out of [0, ", size, ")"));
      }
    }
    std::vector<int32_t> narrow(n);
    if (absl::Status s = examples->source->Gather(absl::MakeConstSpan(rows, n),
                                                  features, narrow.data());
        !s.ok()) {
      return s;
    }
    for (int64_t i = 0; i < n; ++i) labels[i] = narrow[i];
    return absl::OkStatus();
  });
}

int pstrain_synthetic_ctr(int64_t count, int64_t first_index, int num_dense,
                          int num_fields, int64_t vocab_per_field,
                          const int64_t* field_vocab, int max_bag,
                          uint64_t seed, pstrain_ctr_data** out, char** error) {
  return Guard(error, [&]() -> absl::Status {
    pstrain::SyntheticCtrOptions o;
    o.num_dense = num_dense;
    o.num_fields = num_fields;
    o.vocab_per_field = vocab_per_field;
    if (field_vocab != nullptr && num_fields > 0) {
      o.field_vocab.assign(field_vocab, field_vocab + num_fields);
    }
    o.max_bag = max_bag;
    o.seed = seed;
    std::vector<double> truth;
    absl::StatusOr<pstrain::CtrDataset> data =
        pstrain::MakeSyntheticCtr(o, first_index, count, {0, 1}, &truth);
    if (!data.ok()) return data.status();
    *out = new pstrain_ctr_data{std::move(*data), std::move(truth)};
    return absl::OkStatus();
  });
}

int pstrain_criteo_kaggle_cardinalities(int64_t* out) {
  std::copy(std::begin(pstrain::kCriteoKaggleCardinalities),
            std::end(pstrain::kCriteoKaggleCardinalities), out);
  return static_cast<int>(std::size(pstrain::kCriteoKaggleCardinalities));
}

void pstrain_ctr_data_sizes(const pstrain_ctr_data* data, int64_t sizes[2]) {
  sizes[0] = data->data.size();
  sizes[1] = static_cast<int64_t>(data->data.ids.size());
}

void pstrain_ctr_data_arrays(pstrain_ctr_data* d, void* arrays[5]) {
  pstrain::CtrDataset& data = d->data;
  arrays[0] = data.labels.data();
  arrays[1] = data.dense.data();
  arrays[2] = data.offsets.data();
  arrays[3] = data.ids.data();
  arrays[4] = d->truth.data();
}

void pstrain_ctr_data_destroy(pstrain_ctr_data* data) { delete data; }

int pstrain_ctr_gather_bags(const int64_t* offsets, int64_t num_examples,
                            const uint64_t* ids, int num_fields,
                            const int64_t* rows, int64_t num_rows,
                            uint64_t* ids_out, int64_t room,
                            int64_t* bag_offsets, int64_t* field_ids,
                            char** error) {
  return Guard(error, [&]() -> absl::Status {
    const size_t num_offsets = num_examples * num_fields + 1;
    return pstrain::GatherFieldBags(
        absl::MakeConstSpan(offsets, num_offsets),
        absl::MakeConstSpan(ids, offsets[num_offsets - 1]), num_fields,
        absl::MakeConstSpan(rows, num_rows), absl::MakeSpan(ids_out, room),
        absl::MakeSpan(bag_offsets, num_rows * num_fields),
        absl::MakeSpan(field_ids, num_fields + 1));
  });
}

int pstrain_unique_ids(int count, const int64_t* ids, const int64_t* lengths,
                       const int64_t* bounds, uint64_t* keys, int64_t* index,
                       int64_t* unique_counts) {
  // Kept per thread: a steady step allocates nothing (the training thread
  // and the table lane may both call).
  thread_local pstrain::IdDeduplicator dedup;
  const int64_t total = std::accumulate(lengths, lengths + count, int64_t{0});
  return dedup.RunEach(
      absl::MakeConstSpan(ids, total), absl::MakeConstSpan(lengths, count),
      absl::MakeConstSpan(bounds, count), keys, index, unique_counts);
}

int pstrain_epoch_plan_create(int64_t num_examples, int64_t worker_batch,
                              int num_workers, int worker_index, int shuffle,
                              uint64_t seed, pstrain_epoch_plan** out,
                              char** error) {
  return Guard(error, [&]() -> absl::Status {
    pstrain::EpochPlan::Options o;
    o.num_examples = num_examples;
    o.worker_batch = worker_batch;
    o.num_workers = num_workers;
    o.worker_index = worker_index;
    o.shuffle = shuffle != 0;
    o.seed = seed;
    absl::StatusOr<pstrain::EpochPlan> plan = pstrain::EpochPlan::Create(o);
    if (!plan.ok()) return plan.status();
    *out = new pstrain_epoch_plan{std::move(*plan)};
    return absl::OkStatus();
  });
}

void pstrain_epoch_plan_destroy(pstrain_epoch_plan* plan) { delete plan; }

int64_t pstrain_epoch_plan_steps_per_epoch(const pstrain_epoch_plan* plan) {
  return plan->plan.steps_per_epoch();
}

int64_t pstrain_epoch_plan_global_batch(const pstrain_epoch_plan* plan) {
  return plan->plan.global_batch();
}

int64_t pstrain_epoch_plan_worker_indices(pstrain_epoch_plan* plan,
                                          int64_t step, int64_t* rows) {
  absl::Span<const int64_t> indices = plan->plan.WorkerIndices(step);
  std::memcpy(rows, indices.data(), indices.size() * sizeof(int64_t));
  return static_cast<int64_t>(indices.size());
}

}  // extern "C"
