#include "common/cluster_spec.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/consistency_mode.h"
#include "nlohmann/json.hpp"

namespace pstrain {
namespace {

using Json = nlohmann::json;

absl::Status FieldError(absl::string_view source, absl::string_view field,
                        absl::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("cluster spec (", source, "): \"", field, "\": ", problem));
}

// A value as the user wrote it, for "got ..." in messages.
std::string Shown(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = absl::StrCat(text.substr(0, 37), "...");
  return text;
}

// Integers only: 2.0 or "2" are refused rather than guessed at.
absl::StatusOr<int> IntField(const Json& value, absl::string_view source,
                             absl::string_view field, int minimum) {
  if (value.is_number_integer()) {
    const int64_t n = value.get<int64_t>();
    if (n >= minimum && n <= (1 << 30)) return static_cast<int>(n);
  }
  return FieldError(
      source, field,
      absl::StrCat("must be an integer >= ", minimum, ", got ", Shown(value)));
}

// host:port with a non-empty host (an IPv6 host in brackets) and a port in
// [1, 65535]. Returns the port.
absl::StatusOr<int> ParseHostPort(absl::string_view text) {
  const size_t colon = text.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(text.substr(colon + 1), &port) || port < 1 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", text, "\" is not host:port (port in [1, 65535])"));
  }
  return port;
}

// {"name": value, ...} -> (name, value as typed on a command line).
absl::Status ParseFlagMap(
    const Json& value, absl::string_view source, const std::string& key,
    std::vector<std::pair<std::string, std::string>>* flags) {
  if (!value.is_object()) {
    return FieldError(source, key,
                      absl::StrCat("must be an object of flag values, e.g. "
                                   "{\"model\": \"mlp\"}, got ",
                                   Shown(value)));
  }
  for (const auto& [name, flag] : value.items()) {
    const std::string field = absl::StrCat(key, ".", name);
    if (flag.is_string()) {
      flags->emplace_back(name, flag.get<std::string>());
    } else if (flag.is_boolean()) {
      flags->emplace_back(name, flag.get<bool>() ? "true" : "false");
    } else if (flag.is_number_integer()) {
      flags->emplace_back(name, absl::StrCat(flag.get<int64_t>()));
    } else if (flag.is_number()) {
      flags->emplace_back(name, flag.dump());
    } else {
      return FieldError(source, field,
                        absl::StrCat("must be a string, number or boolean, "
                                     "got ",
                                     Shown(flag)));
    }
  }
  return absl::OkStatus();
}

// The flags a role derives from the spec's own keys.
bool DerivedFlag(ClusterRole role, const std::string& name) {
  static const char* const kPs[] = {
      "num_shards",    "shard_id",     "port",         "num_workers",
      "max_workers",   "mode",         "cluster_spec", "replicas",
      "replica_index", "replica_hosts"};
  static const char* const kWorker[] = {"ps_hosts", "worker_id", "num_workers",
                                        "cluster_spec"};
  if (role == ClusterRole::kPs) {
    return std::find(std::begin(kPs), std::end(kPs), name) != std::end(kPs);
  }
  return std::find(std::begin(kWorker), std::end(kWorker), name) !=
         std::end(kWorker);
}

// "ps": a non-empty array of host:port strings; `field` names it in errors.
absl::Status ParsePsList(const Json& value, absl::string_view source,
                         absl::string_view field,
                         std::vector<std::string>* ps) {
  if (!value.is_array() || value.empty()) {
    return FieldError(source, field,
                      absl::StrCat("must be a non-empty array of "
                                   "\"host:port\" strings, got ",
                                   Shown(value)));
  }
  for (size_t i = 0; i < value.size(); ++i) {
    const std::string entry = absl::StrCat(field, "[", i, "]");
    if (!value[i].is_string()) {
      return FieldError(source, entry,
                        absl::StrCat("must be a \"host:port\" string, got ",
                                     Shown(value[i])));
    }
    // A replicated shard: its replicas' host:port joined by '|'.
    const std::string host = value[i].get<std::string>();
    const std::vector<std::string> replicas = absl::StrSplit(host, '|');
    for (const std::string& replica : replicas) {
      if (absl::Status s = ParseHostPort(replica).status(); !s.ok()) {
        return FieldError(source, entry, s.message());
      }
    }
    if (!ps->empty() &&
        std::count(ps->front().begin(), ps->front().end(), '|') + 1 !=
            static_cast<int>(replicas.size())) {
      return FieldError(source, entry,
                        absl::StrCat("lists ", replicas.size(),
                                     " replica(s), \"", ps->front(),
                                     "\" another number: every shard has as "
                                     "many"));
    }
    ps->push_back(host);
  }
  return absl::OkStatus();
}

// TensorFlow's TF_CONFIG, {"cluster": {"ps": [...], "worker": [...],
// "chief": [...]}, "task": {"type": ..., "index": i}}, rewritten into this
// spec's own keys: "ps" as is; "workers" counts the chief (TensorFlow's
// worker 0, when there is one) and the workers; a chief task is worker 0,
// worker task i is worker i + (1 if a chief). Worker addresses are not
// used: workers only dial out. pstrain's own keys (mode, ps_flags, ...) may
// sit beside "cluster".
absl::StatusOr<Json> FromTfConfig(const Json& root, absl::string_view source) {
  Json out = Json::object();
  const Json& cluster = root["cluster"];
  if (!cluster.is_object()) {
    return FieldError(source, "cluster",
                      absl::StrCat("must be an object {\"ps\": [...], "
                                   "\"worker\": [...]}, got ",
                                   Shown(cluster)));
  }
  int chiefs = 0, workers = 0;
  for (const auto& [job, hosts] : cluster.items()) {
    const std::string field = absl::StrCat("cluster.", job);
    if (job == "ps") {
      std::vector<std::string> ps;
      if (absl::Status s = ParsePsList(hosts, source, field, &ps); !s.ok()) {
        return s;
      }
      out["ps"] = hosts;
    } else if (job == "worker" || job == "chief") {
      if (!hosts.is_array() || (job == "chief" && hosts.size() > 1)) {
        return FieldError(source, field,
                          job == "chief"
                              ? "must be an array of at most one address"
                              : "must be an array of addresses");
      }
      (job == "chief" ? chiefs : workers) = static_cast<int>(hosts.size());
    } else {
      return FieldError(source, field,
                        "unknown job (pstrain runs \"ps\", \"worker\" and "
                        "\"chief\", which is worker 0)");
    }
  }
  if (!out.contains("ps")) {
    return FieldError(source, "cluster.ps",
                      "is required (host:port of every shard)");
  }
  if (chiefs + workers > 0) out["workers"] = chiefs + workers;
  for (const auto& [key, value] : root.items()) {
    if (key == "cluster" || key == "environment") continue;  // TF's own
    if (key == "rpc_layer") {
      if (value != "grpc") {
        return FieldError(
            source, key,
            absl::StrCat("pstrain speaks \"grpc\" only, got ", Shown(value)));
      }
      continue;
    }
    if (key == "ps" || key == "workers") {
      return FieldError(source, key,
                        "comes from \"cluster\" in a TF_CONFIG-style spec");
    }
    if (key != "task" || !value.is_object() || !value.contains("type") ||
        !value["type"].is_string()) {
      out[key] = value;  // checked as in a pstrain spec
      continue;
    }
    Json task = value;
    const std::string type = value["type"].get<std::string>();
    if (type == "chief") {
      if (chiefs == 0) {
        return FieldError(source, "task.type",
                          "is \"chief\" but cluster.chief is empty");
      }
      task["type"] = "worker";
      if (task.contains("index") && task["index"] != 0) {
        return FieldError(source, "task.index",
                          absl::StrCat("a chief task has index 0, got ",
                                       Shown(task["index"])));
      }
      task["index"] = 0;
    } else if (type == "worker" && chiefs > 0 && task.contains("index") &&
               task["index"].is_number_integer()) {
      task["index"] = task["index"].get<int64_t>() + chiefs;
    }
    out["task"] = task;
  }
  return out;
}

}  // namespace

absl::StatusOr<ClusterSpec> ParseClusterSpec(absl::string_view json,
                                             absl::string_view source) {
  Json root;
  try {
    root = Json::parse(json.begin(), json.end());
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster spec (", source, "): not JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster spec (", source, "): must be a JSON object, got ",
                     Shown(root)));
  }
  if (root.contains("cluster")) {
    absl::StatusOr<Json> converted = FromTfConfig(root, source);
    if (!converted.ok()) return converted.status();
    root = std::move(*converted);
  }
  ClusterSpec spec;
  spec.source = std::string(source);
  for (const auto& [key, value] : root.items()) {
    if (key == "ps") {
      if (absl::Status s = ParsePsList(value, source, "ps", &spec.ps);
          !s.ok()) {
        return s;
      }
    } else if (key == "workers") {
      absl::StatusOr<int> n = IntField(value, source, key, 1);
      if (!n.ok()) return n.status();
      spec.workers = *n;
    } else if (key == "max_workers") {
      absl::StatusOr<int> n = IntField(value, source, key, 1);
      if (!n.ok()) return n.status();
      spec.max_workers = *n;
    } else if (key == "mode") {
      if (!value.is_string() ||
          !ParseConsistencyMode(value.get<std::string>()).ok()) {
        return FieldError(source, key,
                          absl::StrCat("must be \"sync\", \"async\" or "
                                       "\"ssp\", got ",
                                       Shown(value)));
      }
      spec.mode = value.get<std::string>();
    } else if (key == "task") {
      if (!value.is_object()) {
        return FieldError(
            source, key,
            absl::StrCat("must be an object {\"type\": \"ps\"|\"worker\", "
                         "\"index\": i}, got ",
                         Shown(value)));
      }
      for (const auto& [task_key, task_value] : value.items()) {
        const std::string field = absl::StrCat("task.", task_key);
        if (task_key == "type") {
          if (!task_value.is_string() ||
              (task_value != "ps" && task_value != "worker")) {
            return FieldError(source, field,
                              absl::StrCat("must be \"ps\" or \"worker\", got ",
                                           Shown(task_value)));
          }
          spec.task_type = task_value.get<std::string>();
        } else if (task_key == "index") {
          absl::StatusOr<int> n = IntField(task_value, source, field, 0);
          if (!n.ok()) return n.status();
          spec.task_index = *n;
        } else if (task_key == "replica") {
          absl::StatusOr<int> n = IntField(task_value, source, field, 0);
          if (!n.ok()) return n.status();
          spec.task_replica = *n;
        } else {
          return FieldError(source, field,
                            "unknown field (task has \"type\", \"index\" "
                            "and, for a replicated ps, \"replica\")");
        }
      }
      if (spec.task_type.empty() || spec.task_index < 0) {
        return FieldError(source, "task", "needs both \"type\" and \"index\"");
      }
    } else if (key == "ps_flags") {
      if (absl::Status s = ParseFlagMap(value, source, key, &spec.ps_flags);
          !s.ok()) {
        return s;
      }
    } else if (key == "worker_flags") {
      if (absl::Status s = ParseFlagMap(value, source, key, &spec.worker_flags);
          !s.ok()) {
        return s;
      }
    } else {
      return FieldError(source, key,
                        "unknown field (known: ps, workers, max_workers, "
                        "mode, task, ps_flags, worker_flags; or TF_CONFIG's "
                        "cluster)");
    }
  }
  if (spec.ps.empty()) {
    return FieldError(source, "ps", "is required (host:port of every shard)");
  }
  if (spec.max_workers > 0 && spec.workers > 0 &&
      spec.max_workers < spec.workers) {
    return FieldError(source, "max_workers",
                      absl::StrCat("must be >= \"workers\" (", spec.workers,
                                   "), got ", spec.max_workers));
  }
  if (spec.task_type == "ps" &&
      spec.task_index >= static_cast<int>(spec.ps.size())) {
    return FieldError(
        source, "task.index",
        absl::StrCat("ps task ", spec.task_index, " out of range: \"ps\" has ",
                     spec.ps.size(), " entries"));
  }
  if (spec.task_type == "worker" && spec.workers > 0 &&
      spec.task_index >= std::max(spec.workers, spec.max_workers)) {
    return FieldError(source, "task.index",
                      absl::StrCat("worker task ", spec.task_index,
                                   " out of range: ", "workers ", spec.workers,
                                   ", max_workers ", spec.max_workers));
  }
  return spec;
}

absl::StatusOr<std::optional<ClusterSpec>> LoadClusterSpec(
    const std::string& path) {
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) {
      return absl::NotFoundError(
          absl::StrCat("--cluster_spec=", path, ": cannot read the file"));
    }
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<ClusterSpec> spec =
        ParseClusterSpec(text.str(), absl::StrCat("--cluster_spec=", path));
    if (!spec.ok()) return spec.status();
    return std::optional<ClusterSpec>(std::move(*spec));
  }
  for (const char* name : {kClusterSpecEnv, kTfConfigEnv}) {
    const char* env = std::getenv(name);
    if (env == nullptr || *env == '\0') continue;
    absl::StatusOr<ClusterSpec> spec = ParseClusterSpec(env, name);
    if (!spec.ok()) return spec.status();
    return std::optional<ClusterSpec>(std::move(*spec));
  }
  return std::optional<ClusterSpec>();
}

absl::StatusOr<std::vector<FlagSetting>> FlagsFromClusterSpec(
    ClusterRole role, const ClusterSpec& spec,
    const std::set<std::string>& explicit_flags,
    const std::function<std::string(const std::string&)>& current) {
  std::vector<FlagSetting> settings;
  auto set = [&](const std::string& name, const std::string& value) {
    if (explicit_flags.count(name) == 0) settings.push_back({name, value});
  };
  // "ps_flags" / "worker_flags", applied after the derived ones.
  const char* const map_key =
      role == ClusterRole::kPs ? "ps_flags" : "worker_flags";
  std::vector<FlagSetting> extra;
  for (const auto& [name, value] :
       role == ClusterRole::kPs ? spec.ps_flags : spec.worker_flags) {
    if (DerivedFlag(role, name)) {
      return FieldError(spec.source, absl::StrCat(map_key, ".", name),
                        "is set by the spec itself (use its own keys: ps, "
                        "workers, max_workers, mode, task)");
    }
    if (explicit_flags.count(name) == 0) extra.push_back({name, value});
  }
  // The id this process ends up with: the flag when given, else the task's,
  // else the flag's default.
  auto own_index = [&](const char* flag, const char* type) {
    int index = -1;
    if (explicit_flags.count(flag) == 0 && spec.task_type == type) {
      index = spec.task_index;
    } else if (!absl::SimpleAtoi(current(flag), &index)) {
      index = -1;
    }
    return index;
  };
  if (role == ClusterRole::kPs) {
    if (spec.task_type == "worker" && explicit_flags.count("shard_id") == 0) {
      return FieldError(spec.source, "task.type",
                        "is \"worker\" but this is a ps_server (give "
                        "--shard_id, or a spec with a ps task)");
    }
    set("num_shards", absl::StrCat(spec.ps.size()));
    const int shard = own_index("shard_id", "ps");
    if (spec.task_type == "ps") set("shard_id", absl::StrCat(shard));
    // The shard's port is the one the others will dial; out of range is
    // left to ps_server's own --shard_id check.
    if (shard >= 0 && shard < static_cast<int>(spec.ps.size())) {
      const std::vector<std::string> replicas =
          absl::StrSplit(spec.ps[shard], '|');
      int replica = 0;
      if (replicas.size() > 1) {
        replica = explicit_flags.count("replica_index") == 0
                      ? spec.task_replica
                      : std::atoi(current("replica_index").c_str());
        if (replica < 0 || replica >= static_cast<int>(replicas.size())) {
          return FieldError(
              spec.source, "task.replica",
              absl::StrCat("replica ", replica, " out of range: shard ", shard,
                           " has ", replicas.size(), " replicas"));
        }
        set("replicas", absl::StrCat(replicas.size()));
        set("replica_index", absl::StrCat(replica));
        set("replica_hosts", absl::StrJoin(replicas, ","));
      }
      set("port", absl::StrCat(*ParseHostPort(replicas[replica])));
    }
    if (spec.workers > 0) set("num_workers", absl::StrCat(spec.workers));
    if (spec.max_workers > 0) {
      set("max_workers", absl::StrCat(spec.max_workers));
    }
    if (!spec.mode.empty()) set("mode", spec.mode);
    settings.insert(settings.end(), extra.begin(), extra.end());
    return settings;
  }
  if (spec.task_type == "ps" && explicit_flags.count("worker_id") == 0) {
    return FieldError(spec.source, "task.type",
                      "is \"ps\" but this is a worker (give --worker_id, or "
                      "a spec with a worker task)");
  }
  set("ps_hosts", absl::StrJoin(spec.ps, ","));
  const int worker = own_index("worker_id", "worker");
  if (spec.task_type == "worker") set("worker_id", absl::StrCat(worker));
  if (spec.workers > 0) {
    // A worker beyond "workers" (an elastic job growing towards
    // max_workers) splits the data as if it were the last of worker+1, as
    // a worker started by hand with --num_workers=worker+1 would.
    int num_workers = spec.workers;
    if (worker >= spec.workers && worker < spec.max_workers) {
      num_workers = worker + 1;
    }
    set("num_workers", absl::StrCat(num_workers));
  }
  settings.insert(settings.end(), extra.begin(), extra.end());
  return settings;
}

std::set<std::string> FlagsOnCommandLine(int argc, char** argv) {
  std::set<std::string> names;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      continue;
    }
    const size_t eq = arg.find('=');
    std::string name(arg.substr(0, eq));
    if (eq == absl::string_view::npos && absl::StartsWith(name, "no") &&
        absl::FindCommandLineFlag(name) == nullptr) {
      name = name.substr(2);  // --noflag of a boolean
    }
    names.insert(name);
  }
  return names;
}

absl::StatusOr<std::vector<FlagSetting>> ApplyClusterSpec(
    ClusterRole role, const std::string& spec_path, int argc, char** argv) {
  absl::StatusOr<std::optional<ClusterSpec>> spec = LoadClusterSpec(spec_path);
  if (!spec.ok()) return spec.status();
  if (!spec->has_value()) return std::vector<FlagSetting>();
  auto current = [](const std::string& name) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    return flag == nullptr ? std::string() : flag->CurrentValue();
  };
  absl::StatusOr<std::vector<FlagSetting>> settings = FlagsFromClusterSpec(
      role, **spec, FlagsOnCommandLine(argc, argv), current);
  if (!settings.ok()) return settings.status();
  for (const FlagSetting& setting : *settings) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(setting.name);
    if (flag == nullptr) {
      return FieldError(
          (*spec)->source,
          absl::StrCat(role == ClusterRole::kPs ? "ps_flags." : "worker_flags.",
                       setting.name),
          absl::StrCat("no such flag of ",
                       role == ClusterRole::kPs ? "ps_server" : "worker"));
    }
    std::string error;
    if (!flag->ParseFrom(setting.value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cluster spec (", (*spec)->source, "): cannot set --",
                       setting.name, "=", setting.value, ": ", error));
    }
  }
  return settings;
}

}  // namespace pstrain
