// pstrain_export: writes a trained model to a safetensors file
// (worker/model_file.h: dense tensors, sparse tables as <table>/ids +
// <table>/rows), from running servers or from a checkpoint directory.
//
//   pstrain_export --ps_hosts=ps0:5000,ps1:5000 --output=model.safetensors
//   pstrain_export --cluster_spec=job.json --output=model.safetensors
//   pstrain_export --checkpoint_dir=/ckpt --output=model.safetensors
//   pstrain_export --ps_hosts=... --since=model.safetensors --output=d1
//   pstrain_export --base=model.safetensors --apply=d1,d2 --output=now
//
// --since writes a delta file (worker/model_file.h): only the dense tensors
// and rows that changed since the base model file, and the rows evicted
// since; --apply applies deltas in order to a base, no servers needed.
// An export from servers of a model with tables ends every table's change
// epoch first (SparseChangesRequest.mark) and leaves the marks beside its
// output (<output>.changes, ExportChangeMarks as JSON); --since a file with
// its marks, from the same server processes, reads only the rows changed
// since (SparseChanges pages), else it compares whole models.
//
// From running servers: the schema comes from the servers' Stats, the dense
// tensors from a read-only pull as an observer (worker id -1) at the
// servers' current step; nothing on the servers changes. Sparse tables are
// never sent whole over Pull, so for a model with tables every server is
// asked to write a checkpoint now (the Checkpoint RPC; the servers need
// --checkpoint_dir on a filesystem this process also sees, under the same
// path) and the rows are read from those files.
//
// From a checkpoint directory (no server needed): the newest valid
// checkpoint of every shard of one layout (ps_server/checkpoint.h's restore,
// as a single shard that owns every block and row), dense tensors
// reassembled from their blocks.
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/cluster_spec.h"
#include "common/partition.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "common/transport/grpc_tuning.h"
#include "common/transport/tls.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "proto/ps.grpc.pb.h"
#include "ps_server/checkpoint.h"
#include "worker/client/client_config.h"
#include "worker/client/client_options.h"
#include "worker/client/ps_client.h"
#include "worker/model_file.h"

ABSL_FLAG(std::string, output, "",
          "The safetensors file to write (replaced atomically).");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Export from this checkpoint directory (the servers' "
          "--checkpoint_dir); no server needs to run.");
ABSL_FLAG(std::string, since, "",
          "Write only what changed since this model file (a delta: the dense "
          "tensors and rows that changed, the rows evicted) instead of the "
          "whole model.");
ABSL_FLAG(std::string, base, "",
          "With --apply: the model file the first delta was taken from.");
ABSL_FLAG(std::string, apply, "",
          "Apply these delta files (comma-separated, in the order they were "
          "taken) to --base and write the model they end at; no servers or "
          "checkpoint needed.");
ABSL_FLAG(std::string, ps_hosts, "",
          "Export from these running servers: host:port of every ps_server, "
          "in shard order.");
ABSL_FLAG(std::string, cluster_spec, "",
          "Export from the running servers of this cluster spec (its \"ps\" "
          "list), as the worker reads it; empty: $PSTRAIN_CLUSTER, if set and "
          "no other source is given.");
// Reaching the servers: the client's connection options, by the worker's
// flag names and with ClientConfig's defaults (worker/client/client_options.h).
#define PSTRAIN_CLIENT_FLAG(type, name, member, help) \
  ABSL_FLAG(type, name, pstrain::ClientConfig().member, help);
PSTRAIN_CLIENT_CONNECTION_OPTIONS(PSTRAIN_CLIENT_FLAG)
#undef PSTRAIN_CLIENT_FLAG

namespace pstrain {
namespace {

std::string ParentDir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The whole model of a checkpoint directory: restored as shard 0 of 1, which
// owns every block and every row.
absl::StatusOr<ModelSnapshot> SnapshotFromCheckpoint(
    const std::string& dir, std::vector<std::string>* files_used) {
  const CheckpointStore store(dir, /*keep_last=*/0);
  absl::StatusOr<RestoredShard> restored = store.LoadForShard(0, 1);
  if (!restored.ok()) {
    return absl::Status(restored.status().code(),
                        absl::StrCat("--checkpoint_dir=", dir, ": ",
                                     restored.status().message()));
  }
  for (const std::string& skipped : restored->files_skipped) {
    LOG(WARNING) << "skipped " << skipped;
  }
  *files_used = restored->files_used;
  absl::StatusOr<Partition> partition = Partition::Create(restored->schema, 1);
  if (!partition.ok()) return partition.status();
  ModelSnapshot snapshot;
  snapshot.schema = restored->schema;
  for (int t = 0; t < partition->NumTensors(); ++t) {
    snapshot.dense.emplace_back(partition->TensorElements(t));
  }
  int64_t step = -1, newest = -1;
  for (const BlockSnapshot& block : restored->blocks) {
    const BlockLocation& where = partition->blocks()[block.global_block];
    std::copy(block.value.begin(), block.value.end(),
              snapshot.dense[where.tensor].begin() + where.offset);
    step = step < 0 ? block.version : std::min(step, block.version);
    newest = std::max(newest, block.version);
  }
  snapshot.step = std::max<int64_t>(step, 0);
  if (restored->mode == "sync" && newest > snapshot.step) {
    // Each shard's newest valid file: one whose newer file was invalid, or
    // a job stopped between two steps, leaves them apart. The file says the
    // oldest step; the operator should know it is not one step's model.
    LOG(WARNING) << "the checkpoint's blocks are at steps " << snapshot.step
                 << " to " << newest
                 << " (sync: the shards' newest valid files are of different "
                    "steps), so the file mixes them; its step says "
                 << snapshot.step << ". Files used: "
                 << absl::StrJoin(restored->files_used, ", ");
  }
  snapshot.sparse.resize(snapshot.schema.sparse_size());
  for (const SparseTableSnapshot& table : restored->sparse) {
    for (int t = 0; t < snapshot.schema.sparse_size(); ++t) {
      if (snapshot.schema.sparse(t).name() != table.name) continue;
      snapshot.sparse[t].ids = table.ids;
      snapshot.sparse[t].rows = table.values;
    }
  }
  return snapshot;
}

// A context with the client's deadline and token, for the calls the
// exporter makes outside PsClient.
void PrepareContext(const PsClientOptions& options,
                    grpc::ClientContext* context) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + options.rpc_timeout));
  if (!options.auth_token.empty()) {
    context->AddMetadata("authorization",
                         absl::StrCat("Bearer ", options.auth_token));
  }
}

// One stub per shard, made once: a channel costs a connection. A replicated
// shard's ("a|b") is its primary's, the replica that answers Stats as the
// primary (StatsRequest.from_primary): a backup's checkpoint or change marks,
// or a stale primary's after a failover, are not the job's. The first
// replica when none says so (the calls then fail, naming it).
std::vector<std::unique_ptr<ParameterServer::Stub>> ShardStubs(
    const PsClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  ApplyGrpcTuning(options.grpc_tuning, &args);
  auto stub_of = [&](const std::string& host) {
    return ParameterServer::NewStub(grpc::CreateCustomChannel(
        host,
        options.credentials != nullptr ? options.credentials
                                       : grpc::InsecureChannelCredentials(),
        args));
  };
  std::vector<std::unique_ptr<ParameterServer::Stub>> stubs;
  for (const std::string& shard : options.hosts) {
    const std::vector<std::string> replicas = absl::StrSplit(shard, '|');
    std::unique_ptr<ParameterServer::Stub> chosen;
    for (size_t r = 0; r < replicas.size() && replicas.size() > 1; ++r) {
      std::unique_ptr<ParameterServer::Stub> stub = stub_of(replicas[r]);
      grpc::ClientContext context;
      PrepareContext(options, &context);
      StatsRequest request;
      request.set_from_primary(true);
      StatsResponse response;
      if (stub->Stats(&context, request, &response).ok()) {
        chosen = std::move(stub);
        break;
      }
    }
    stubs.push_back(chosen != nullptr ? std::move(chosen)
                                      : stub_of(replicas.front()));
  }
  return stubs;
}

// Asks every shard to write a checkpoint now; returns the files' paths in
// shard order.
absl::StatusOr<std::vector<std::string>> CheckpointNow(
    const PsClientOptions& options,
    const std::vector<std::unique_ptr<ParameterServer::Stub>>& stubs) {
  std::vector<std::string> paths;
  for (size_t shard = 0; shard < options.hosts.size(); ++shard) {
    grpc::ClientContext context;
    PrepareContext(options, &context);
    CheckpointResponse response;
    const grpc::Status status =
        stubs[shard]->Checkpoint(&context, CheckpointRequest(), &response);
    if (!status.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the model has sparse tables, which are exported from a checkpoint "
          "the servers write now, but shard ",
          shard, " (", options.hosts[shard],
          ") could not write one: ", status.error_message(),
          " (start the servers with --checkpoint_dir, or export from a "
          "checkpoint directory with --checkpoint_dir)"));
    }
    paths.push_back(response.path());
  }
  return paths;
}

// Ends every shard's change epoch (SparseChangesRequest.mark): the marks a
// later --since asks the servers' changes from.
absl::StatusOr<ExportChangeMarks> MarkChanges(
    const PsClientOptions& options,
    const std::vector<std::unique_ptr<ParameterServer::Stub>>& stubs) {
  ExportChangeMarks marks;
  for (size_t shard = 0; shard < options.hosts.size(); ++shard) {
    grpc::ClientContext context;
    PrepareContext(options, &context);
    SparseChangesRequest request;
    request.set_protocol_version(kProtocolVersion);
    request.set_mark(true);
    SparseChangesResponse response;
    const grpc::Status status =
        stubs[shard]->SparseChanges(&context, request, &response);
    if (!status.ok()) {
      return absl::Status(
          static_cast<absl::StatusCode>(status.error_code()),
          absl::StrCat("shard ", shard, " (", options.hosts[shard],
                       "): marking its changes: ", status.error_message()));
    }
    ShardChangeMarks* marked = marks.add_shards();
    marked->set_server_life(response.server_life());
    *marked->mutable_marks() = response.marks();
  }
  return marks;
}

std::string ChangesPath(const std::string& model_file) {
  return absl::StrCat(model_file, ".changes");
}

// A file's size and modification time: what the marks beside it must name.
absl::StatusOr<std::pair<int64_t, int64_t>> FileIdentity(
    const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  return std::make_pair(
      static_cast<int64_t>(st.st_size),
      int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec);
}

// The marks beside `model_file`, when they are its own (its size and
// modification time), cover every table of `schema` and come from the
// server processes that gave `now`: what --since can ask the servers for.
// Otherwise why not.
absl::StatusOr<ExportChangeMarks> UsableMarks(
    const std::string& model_file, const absl::StatusOr<ExportChangeMarks>& now,
    const ModelSchema& schema) {
  if (!now.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "the servers gave no change marks: ", now.status().message()));
  }
  std::ifstream in(ChangesPath(model_file));
  if (!in) {
    return absl::NotFoundError(absl::StrCat("no change marks beside it (",
                                            ChangesPath(model_file), ")"));
  }
  std::stringstream text;
  text << in.rdbuf();
  ExportChangeMarks marks;
  absl::StatusOr<std::pair<int64_t, int64_t>> identity =
      FileIdentity(model_file);
  if (!google::protobuf::util::JsonStringToMessage(text.str(), &marks).ok() ||
      !identity.ok() || marks.file_bytes() != identity->first ||
      marks.file_mtime_ns() != identity->second) {
    return absl::NotFoundError(
        absl::StrCat(ChangesPath(model_file),
                     " does not describe this file (rewritten "
                     "since?)"));
  }
  if (marks.shards_size() != now->shards_size()) {
    return absl::NotFoundError(
        absl::StrCat("it was exported from ", marks.shards_size(),
                     " shards, the servers now have ", now->shards_size()));
  }
  for (int s = 0; s < now->shards_size(); ++s) {
    if (marks.shards(s).server_life() != now->shards(s).server_life()) {
      return absl::NotFoundError(
          absl::StrCat("shard ", s,
                       " is another server process than the one it was "
                       "exported from (restarted or failed over)"));
    }
    for (const SparseTableSpec& table : schema.sparse()) {
      const auto& given = marks.shards(s).marks();
      if (std::none_of(given.begin(), given.end(),
                       [&](const TableChangeMark& m) {
                         return m.table() == table.name();
                       })) {
        return absl::NotFoundError(
            absl::StrCat("its marks have no table '", table.name(), "'"));
      }
    }
  }
  return marks;
}

absl::Status WriteMarks(const std::string& model_file, ExportChangeMarks marks,
                        int64_t step) {
  absl::StatusOr<std::pair<int64_t, int64_t>> identity =
      FileIdentity(model_file);
  if (!identity.ok()) return identity.status();
  marks.set_step(step);
  marks.set_file_bytes(identity->first);
  marks.set_file_mtime_ns(identity->second);
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(marks, &json).ok()) {
    return absl::InternalError("cannot print the change marks as JSON");
  }
  return WriteFileAtomically(ChangesPath(model_file), json);
}

// The rows of every table changed on the servers since `since` (marks the
// same processes gave), and the ids evicted since. A row that comes in two
// pages keeps the later one's values (read later). FailedPrecondition when
// the servers cannot answer for the marks (evictions forgotten, a server
// restarted meanwhile).
absl::Status ChangedRows(
    const PsClientOptions& options,
    const std::vector<std::unique_ptr<ParameterServer::Stub>>& stubs,
    const ModelSchema& schema, const ExportChangeMarks& since,
    ModelChanges* out) {
  out->sparse.assign(schema.sparse_size(), {});
  out->deleted.assign(schema.sparse_size(), {});
  absl::flat_hash_map<std::string, int> table_index;
  for (int t = 0; t < schema.sparse_size(); ++t) {
    table_index[schema.sparse(t).name()] = t;
  }
  // Per table: where each id's row is in out->sparse.
  std::vector<absl::flat_hash_map<uint64_t, size_t>> row_of(
      schema.sparse_size());
  for (size_t shard = 0; shard < options.hosts.size(); ++shard) {
    SparseChangesRequest request;
    request.set_protocol_version(kProtocolVersion);
    *request.mutable_since() = since.shards(shard).marks();
    for (bool done = false; !done;) {
      grpc::ClientContext context;
      PrepareContext(options, &context);
      SparseChangesResponse page;
      const grpc::Status status =
          stubs[shard]->SparseChanges(&context, request, &page);
      if (!status.ok()) {
        return absl::Status(
            static_cast<absl::StatusCode>(status.error_code()),
            absl::StrCat("shard ", shard, " (", options.hosts[shard],
                         "): its changes: ", status.error_message()));
      }
      if (page.server_life() != since.shards(shard).server_life()) {
        return absl::FailedPreconditionError(
            absl::StrCat("shard ", shard, " (", options.hosts[shard],
                         ") restarted during the export"));
      }
      for (const TableChanges& changes : page.tables()) {
        auto it = table_index.find(changes.table());
        const int64_t dim =
            it == table_index.end() ? 0 : schema.sparse(it->second).dim();
        if (dim == 0 ||
            changes.values().size() != changes.ids_size() * dim * 4) {
          return absl::InternalError(
              absl::StrCat("shard ", shard, " answered ", changes.ids_size(),
                           " rows of '", changes.table(), "' with ",
                           changes.values().size(), " bytes of values"));
        }
        SparseTableRows& rows = out->sparse[it->second];
        absl::flat_hash_map<uint64_t, size_t>& where = row_of[it->second];
        for (int i = 0; i < changes.ids_size(); ++i) {
          const auto [known, added] =
              where.try_emplace(changes.ids(i), rows.ids.size());
          if (added) {
            rows.ids.push_back(changes.ids(i));
            rows.rows.resize(rows.rows.size() + dim);
          }
          std::memcpy(rows.rows.data() + known->second * dim,
                      changes.values().data() + i * dim * sizeof(float),
                      dim * sizeof(float));
        }
        std::vector<uint64_t>& deleted = out->deleted[it->second];
        deleted.insert(deleted.end(), changes.evicted_ids().begin(),
                       changes.evicted_ids().end());
      }
      // Every page moves the cursor on, or the loop would never end.
      const auto at = std::make_tuple(request.table_index(), request.stripe(),
                                      request.slot());
      const auto next = std::make_tuple(page.next_table_index(),
                                        page.next_stripe(), page.next_slot());
      done = page.done();
      if (!done && next <= at) {
        return absl::InternalError(absl::StrCat(
            "shard ", shard, " (", options.hosts[shard],
            ") answered a changes page that does not move its cursor on"));
      }
      request.set_table_index(page.next_table_index());
      request.set_stripe(page.next_stripe());
      request.set_slot(page.next_slot());
    }
  }
  return absl::OkStatus();
}

// The servers' schema and dense tensors (no rows yet). For a model with
// tables, every shard's change epoch is ended first: `marks`.
absl::StatusOr<ModelSnapshot> DenseFromServers(
    const PsClientOptions& options,
    const std::vector<std::unique_ptr<ParameterServer::Stub>>& stubs,
    absl::StatusOr<ExportChangeMarks>* marks) {
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  if (!client.ok()) return client.status();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*client)->Stats();
  if (!stats.ok()) {
    return absl::Status(
        stats.status().code(),
        absl::StrCat("cannot reach the servers: ", stats.status().message()));
  }
  const StatsResponse& first = stats->front();
  int64_t step = first.version();
  for (size_t s = 0; s < stats->size(); ++s) {
    const StatsResponse& shard = (*stats)[s];
    const std::string where =
        absl::StrCat("shard ", s, " (", options.hosts[s], ")");
    if (shard.num_shards() != static_cast<int>(stats->size()) ||
        shard.shard_id() != static_cast<int>(s)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " says it is shard ", shard.shard_id(), " of ",
                       shard.num_shards(),
                       ": --ps_hosts must list every shard, in shard order"));
    }
    if (!shard.model_registered()) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, " holds no model yet: nothing to export"));
    }
    if (!shard.has_schema()) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       " does not report its schema (a ps_server older than "
                       "pstrain_export?)"));
    }
    if (const std::string difference =
            FirstSchemaDifference(first.schema(), shard.schema());
        !difference.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, " holds a different model than shard 0: ", difference));
    }
    step = std::min(step, shard.version());
  }
  ModelSnapshot snapshot;
  snapshot.schema = first.schema();
  if (snapshot.schema.sparse_size() > 0) {
    // Without marks the export still is the model; only the next --since
    // will have to compare whole models.
    *marks = MarkChanges(options, stubs);
    if (!marks->ok()) {
      LOG(WARNING) << "no change marks for a later --since: "
                   << marks->status();
    }
  }
  absl::StatusOr<Registration> registration = (*client)->Register(
      snapshot.schema, first.num_workers(), /*worker_id=*/-1);
  if (!registration.ok()) return registration.status();
  std::vector<float*> tensors;
  for (const DenseTensorSpec& spec : snapshot.schema.dense()) {
    snapshot.dense.emplace_back(NumElements(spec));
    tensors.push_back(snapshot.dense.back().data());
  }
  // Sync: the model after `step` updates, which every shard has reached;
  // async/ssp: the current model.
  absl::StatusOr<int64_t> pulled = (*client)->Pull(step, tensors);
  if (!pulled.ok()) return pulled.status();
  snapshot.step = *pulled;
  snapshot.sparse.resize(snapshot.schema.sparse_size());
  return snapshot;
}

// Every table's rows, from a checkpoint the servers write now.
absl::Status RowsFromCheckpoint(
    const PsClientOptions& options,
    const std::vector<std::unique_ptr<ParameterServer::Stub>>& stubs,
    ModelSnapshot& snapshot) {
  absl::StatusOr<std::vector<std::string>> paths =
      CheckpointNow(options, stubs);
  if (!paths.ok()) return paths.status();
  // Each file is <dir>/shard-<i>-of-<n>/ckpt-<sequence>.pstrain. A
  // replicated job's shards write under their primary's own replica-<r>/
  // directory, which after a failover differs from shard to shard: the
  // files are then gathered, as links, in one layout of their own.
  std::string dir = ParentDir(ParentDir(paths->front()));
  std::vector<std::string> expected = *paths;
  struct RemoveOnExit {
    std::string dir;
    ~RemoveOnExit() {
      std::error_code ignored;
      if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
    }
  } gathered;
  if (std::any_of(paths->begin(), paths->end(), [&](const std::string& path) {
        return ParentDir(ParentDir(path)) != dir;
      })) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "pstrain_export.XXXXXX")
            .string();
    if (mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(absl::StrCat(
          "cannot make a directory to gather the checkpoints the servers "
          "wrote (",
          absl::StrJoin(*paths, ", "), "): ", std::strerror(errno)));
    }
    gathered.dir = dir = pattern;
    expected.clear();
    for (const std::string& path : *paths) {
      const std::filesystem::path shard_dir =
          std::filesystem::path(dir) /
          std::filesystem::path(ParentDir(path)).filename();
      const std::filesystem::path link =
          shard_dir / std::filesystem::path(path).filename();
      std::error_code error;
      std::filesystem::create_directories(shard_dir, error);
      if (!error) std::filesystem::create_symlink(path, link, error);
      if (error) {
        return absl::InternalError(absl::StrCat("cannot link ", path, " as ",
                                                link.string(), ": ",
                                                error.message()));
      }
      expected.push_back(link.string());
    }
  }
  std::vector<std::string> files_used;
  absl::StatusOr<ModelSnapshot> saved =
      SnapshotFromCheckpoint(dir, &files_used);
  if (!saved.ok()) return saved.status();
  // Restore picks the newest complete layout; another job's files in the
  // same directory must not pass for these servers' rows.
  if (std::set<std::string>(files_used.begin(), files_used.end()) !=
      std::set<std::string>(expected.begin(), expected.end())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the servers wrote ", absl::StrJoin(*paths, ", "), " but reading ", dir,
        " chose ", absl::StrJoin(files_used, ", "),
        ": the directory holds checkpoints of another shard layout; "
        "export those with --checkpoint_dir or move them away"));
  }
  if (const std::string difference =
          FirstSchemaDifference(snapshot.schema, saved->schema);
      !difference.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the checkpoint the servers wrote in ", dir,
                     " holds a different model: ", difference));
  }
  snapshot.sparse = std::move(saved->sparse);
  return absl::OkStatus();
}

// Writes `file` to `output`, and beside it `marks` when given (the file's
// own, at `step`). Marks of an earlier file at that path go first: they must
// not outlive it, whatever happens next. False (logged) when there is no
// file (a bug); an unwritable output exits 2 with one line, as a bad flag.
bool WrittenOrExit(const absl::StatusOr<SafetensorsFile>& file,
                   const std::string& output,
                   const ExportChangeMarks* marks = nullptr, int64_t step = 0) {
  if (!file.ok()) {
    LOG(ERROR) << file.status();
    return false;
  }
  std::error_code ignored;
  std::filesystem::remove(ChangesPath(output), ignored);
  if (absl::Status s = WriteSafetensorsFile(output, *file); !s.ok()) {
    ExitOnFlagErrors({absl::InvalidArgumentError(
        absl::StrCat("--output=", output, ": ", s.message()))});
  }
  if (marks != nullptr) {
    if (absl::Status s = WriteMarks(output, *marks, step); !s.ok()) {
      LOG(WARNING) << "the next --since=" << output
                   << " will compare whole models: " << s;
    }
  }
  return true;
}

// --base with --apply: the model the deltas end at, written to `output`.
int ApplyDeltas(const std::string& base_path, const std::string& deltas,
                const std::string& output) {
  absl::StatusOr<ModelSnapshot> model = ReadModelSnapshot(base_path);
  if (!model.ok()) {
    ExitOnFlagErrors({absl::InvalidArgumentError(
        absl::StrCat("--base=", base_path, ": ", model.status().message()))});
  }
  std::vector<std::string> paths = absl::StrSplit(deltas, ',');
  for (const std::string& path : paths) {
    absl::StatusOr<SafetensorsFile> delta = ReadSafetensorsFile(path);
    if (delta.ok()) {
      absl::StatusOr<ModelSnapshot> next =
          ApplyModelDelta(*model, *delta, path);
      if (next.ok()) {
        model = std::move(next);
        continue;
      }
      delta = next.status();
    }
    ExitOnFlagErrors({absl::InvalidArgumentError(
        absl::StrCat("--apply: ", delta.status().message()))});
  }
  absl::StatusOr<SafetensorsFile> file = ModelFileFromSnapshot(*model);
  if (!WrittenOrExit(file, output)) return 1;
  std::printf("applied %zu delta(s) to %s: the model at step %lld in %s\n",
              paths.size(), base_path.c_str(),
              static_cast<long long>(model->step), output.c_str());
  return 0;
}

int Main() {
  const std::string output = absl::GetFlag(FLAGS_output);
  const std::string since = absl::GetFlag(FLAGS_since);
  const std::string apply = absl::GetFlag(FLAGS_apply);
  const std::string base = absl::GetFlag(FLAGS_base);
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  std::string ps_hosts = absl::GetFlag(FLAGS_ps_hosts);
  const std::string spec_path = absl::GetFlag(FLAGS_cluster_spec);
  std::vector<absl::Status> checks;
  if (output.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        "--output is required (the safetensors file to write)"));
  }
  if (apply.empty() != base.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        "--apply and --base go together: the deltas and the model file the "
        "first was taken from"));
  }
  if (!apply.empty()) {
    if (!since.empty() || !ps_hosts.empty() || !spec_path.empty() ||
        !checkpoint_dir.empty()) {
      checks.push_back(absl::InvalidArgumentError(
          "--apply reads only --base and the deltas: drop --since and the "
          "model source"));
    }
    ExitOnFlagErrors(checks);
    return ApplyDeltas(base, apply, output);
  }
  // Like the worker, an empty --cluster_spec falls back on $PSTRAIN_CLUSTER.
  if (!spec_path.empty() || (ps_hosts.empty() && checkpoint_dir.empty())) {
    absl::StatusOr<std::optional<ClusterSpec>> spec =
        LoadClusterSpec(spec_path);
    checks.push_back(spec.status());
    if (spec.ok() && spec->has_value() && ps_hosts.empty()) {
      ps_hosts = absl::StrJoin((*spec)->ps, ",");
    }
  }
  if (checkpoint_dir.empty() == ps_hosts.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        "give exactly one source: --checkpoint_dir, or running servers "
        "(--ps_hosts or --cluster_spec)"));
  }
  ClientConfig client;
#define PSTRAIN_READ_CLIENT_FLAG(type, name, member, help) \
  client.member = absl::GetFlag(FLAGS_##name);
  PSTRAIN_CLIENT_CONNECTION_OPTIONS(PSTRAIN_READ_CLIENT_FLAG)
#undef PSTRAIN_READ_CLIENT_FLAG
  absl::StatusOr<GrpcTuning> tuning = GrpcTuningFromFlags();
  checks.push_back(tuning.status());
  if (tuning.ok()) client.grpc_tuning = *tuning;
  absl::StatusOr<PsClientOptions> options = MakePsClientOptions(client);
  if (!options.ok()) checks.push_back(options.status());
  ExitOnFlagErrors(checks);

  absl::StatusOr<ModelSnapshot> snapshot;
  std::string source;
  // From servers, with tables: the epochs this export ended, or why none.
  absl::StatusOr<ExportChangeMarks> marks =
      absl::NotFoundError("not exported from servers");
  // --since from servers whose marks it has: only the changes are read.
  absl::StatusOr<ExportChangeMarks> since_marks =
      absl::NotFoundError("not exported from these servers");
  ModelChanges changes;
  if (!checkpoint_dir.empty()) {
    std::vector<std::string> files_used;
    snapshot = SnapshotFromCheckpoint(checkpoint_dir, &files_used);
    source = absl::StrJoin(files_used, ", ");
  } else {
    options->hosts = absl::StrSplit(ps_hosts, ',');
    // An observer: no lease to renew, one connection, and no retrying
    // beyond the wait for the servers to come up.
    options->retry_window = options->connect_timeout;
    options->heartbeat_interval = absl::ZeroDuration();
    options->connections_per_shard = 1;
    const auto stubs = ShardStubs(*options);
    snapshot = DenseFromServers(*options, stubs, &marks);
    source = ps_hosts;
    if (snapshot.ok() && snapshot->schema.sparse_size() > 0) {
      if (!since.empty()) {
        since_marks = UsableMarks(since, marks, snapshot->schema);
      }
      absl::Status rows = absl::OkStatus();
      if (since_marks.ok()) {
        rows = ChangedRows(*options, stubs, snapshot->schema, *since_marks,
                           &changes);
        if (absl::IsFailedPrecondition(rows)) {  // compare instead
          LOG(WARNING) << "comparing whole models: " << rows;
          since_marks = rows;
          changes = ModelChanges();
          rows = absl::OkStatus();
        }
      }
      if (rows.ok() && !since_marks.ok()) {
        rows = RowsFromCheckpoint(*options, stubs, *snapshot);
      }
      if (!rows.ok()) snapshot = rows;
    }
  }
  // What the user pointed at is wrong (missing, corrupt, another model):
  // exit 2 with one line, like a bad flag.
  if (absl::IsInvalidArgument(snapshot.status()) ||
      absl::IsNotFound(snapshot.status()) ||
      absl::IsDataLoss(snapshot.status()) ||
      absl::IsFailedPrecondition(snapshot.status())) {
    ExitOnFlagErrors({snapshot.status()});
  }
  if (!snapshot.ok()) {
    LOG(ERROR) << "export failed: " << snapshot.status();
    return 1;
  }
  absl::StatusOr<SafetensorsFile> file;
  if (since.empty()) {
    file = ModelFileFromSnapshot(*snapshot);
  } else if (since_marks.ok()) {
    changes.schema = snapshot->schema;
    changes.step = snapshot->step;
    changes.base_step = since_marks->step();
    changes.dense = snapshot->dense;
    file = ModelDeltaFile(changes);
  } else {
    absl::StatusOr<ModelSnapshot> base_model = ReadModelSnapshot(since);
    if (base_model.ok()) file = ModelDelta(*base_model, *snapshot);
    absl::Status refused =
        base_model.ok() ? file.status() : base_model.status();
    if (!refused.ok()) {
      // A delta file is a base only for the servers that gave its marks.
      if (!since_marks.ok() && snapshot->schema.sparse_size() > 0 &&
          checkpoint_dir.empty()) {
        refused = absl::InvalidArgumentError(
            absl::StrCat(refused.message(),
                         "; and the servers cannot give the changes "
                         "since it: ",
                         since_marks.status().message()));
      }
      ExitOnFlagErrors({absl::InvalidArgumentError(
          absl::StrCat("--since=", since, ": ", refused.message()))});
    }
  }
  if (!WrittenOrExit(file, output, marks.ok() ? &*marks : nullptr,
                     snapshot->step)) {
    return 1;
  }
  int64_t sparse_rows = 0;
  for (const SparseTableRows& table : snapshot->sparse) {
    sparse_rows += table.ids.size();
  }
  if (!since.empty()) {
    int64_t dense = 0, rows = 0, deleted = 0;
    for (const SafetensorsTensor& tensor : file->tensors) {
      if (absl::EndsWith(tensor.name, "/deleted_ids")) {
        deleted += tensor.NumElements();
      } else if (absl::EndsWith(tensor.name, "/ids")) {
        rows += tensor.NumElements();
      } else if (!absl::EndsWith(tensor.name, "/rows")) {
        ++dense;
      }
    }
    const std::string how = since_marks.ok() ? "the servers' change marks"
                                             : "comparing the whole models";
    std::printf(
        "exported the changes since %s (step %s) at step %lld, by %s: %lld "
        "dense tensors, %lld rows changed or added, %lld evicted, from %s to "
        "%s\n",
        since.c_str(), file->metadata["base_step"].c_str(),
        static_cast<long long>(snapshot->step), how.c_str(),
        static_cast<long long>(dense), static_cast<long long>(rows),
        static_cast<long long>(deleted), source.c_str(), output.c_str());
    return 0;
  }
  std::printf(
      "exported %d dense tensors and %d sparse tables (%lld rows) at step "
      "%lld from %s to %s\n",
      snapshot->schema.dense_size(), snapshot->schema.sparse_size(),
      static_cast<long long>(sparse_rows),
      static_cast<long long>(snapshot->step), source.c_str(), output.c_str());
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(
      argc, argv,
      "pstrain_export: writes a trained model to a safetensors file, from "
      "running servers (--ps_hosts or --cluster_spec) or from a checkpoint "
      "directory (--checkpoint_dir)");
  return pstrain::Main();
}
