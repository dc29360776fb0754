// One description of a job that ps_server, worker and every launcher share,
// in the spirit of TensorFlow's TF_CONFIG: a JSON object, from the file named
// by --cluster_spec or else from the environment variable PSTRAIN_CLUSTER.
//
//   {"ps": ["ps0:5000", "ps1:5000"], "workers": 4, "max_workers": 8,
//    "mode": "sync", "task": {"type": "worker", "index": 2},
//    "ps_flags": {"optimizer": "adam"}, "worker_flags": {"model": "mlp"}}
//
// A replicated shard (ps_server --replicas) is its replicas' addresses
// joined by '|' ("ps0a:5000|ps0b:5000"), and its ps tasks say which replica
// they are: {"type": "ps", "index": 0, "replica": 1}; ps_server then derives
// --replicas --replica_index --replica_hosts too.
//
// Every key but "ps" is optional. A binary derives its job flags from it
// (ps_server: --num_shards --shard_id --port --num_workers --max_workers
// --mode; worker: --ps_hosts --worker_id --num_workers), takes any other
// flag from "ps_flags" / "worker_flags", and a flag given on the command
// line always wins over the spec, so one spec can be shared by every process
// of a job and each process adds only its own --shard_id or --worker_id (or
// its own "task").
#ifndef PSTRAIN_COMMON_CLUSTER_SPEC_H_
#define PSTRAIN_COMMON_CLUSTER_SPEC_H_

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain {

inline constexpr char kClusterSpecEnv[] = "PSTRAIN_CLUSTER";
// TensorFlow's variable, read when PSTRAIN_CLUSTER is not set:
//   {"cluster": {"ps": ["ps0:5000"], "worker": ["w0:1", "w1:1"],
//                "chief": ["c:1"]},
//    "task": {"type": "worker", "index": 1}}
// A spec in this shape (a "cluster" key) is accepted from any source.
// "chief" is worker 0 and worker i is worker i + 1 when there is a chief,
// as in TensorFlow's multi-worker training; worker addresses are not used.
inline constexpr char kTfConfigEnv[] = "TF_CONFIG";

struct ClusterSpec {
  std::vector<std::string> ps;  // host:port of every shard, in shard order
  int workers = 0;              // 0: not given
  int max_workers = 0;          // 0: not given
  std::string mode;             // empty: not given
  std::string task_type;        // "ps", "worker" or empty (no task)
  int task_index = -1;
  // A ps task of a replicated shard ("ps" entries "h1:p|h2:p"): which
  // replica of shard task_index this process is.
  int task_replica = 0;
  // More flags of each binary, name -> value as on a command line.
  std::vector<std::pair<std::string, std::string>> ps_flags, worker_flags;
  std::string source;  // where it came from, for messages
};

// Parses the JSON text of a spec. Unknown keys and wrong types are errors
// that name the field (e.g. `"workers": must be an integer >= 1, got "two"`),
// prefixed by `source`.
absl::StatusOr<ClusterSpec> ParseClusterSpec(absl::string_view json,
                                             absl::string_view source);

// The spec of this process: the file `path` when not empty, else the JSON in
// $PSTRAIN_CLUSTER when set and not empty, else $TF_CONFIG, else nullopt.
absl::StatusOr<std::optional<ClusterSpec>> LoadClusterSpec(
    const std::string& path);

enum class ClusterRole { kPs, kWorker };

struct FlagSetting {
  std::string name;
  std::string value;
  bool operator==(const FlagSetting& o) const {
    return name == o.name && value == o.value;
  }
};

// The flag values `role` takes from `spec`, leaving out those named in
// `explicit_flags` (given on the command line). `current` returns the
// parsed value of a flag (used for --shard_id / --worker_id when the spec
// has no task of this role). Fails when the spec's task is for the other
// role or out of range, or when "ps_flags"/"worker_flags" names a flag the
// spec derives itself.
absl::StatusOr<std::vector<FlagSetting>> FlagsFromClusterSpec(
    ClusterRole role, const ClusterSpec& spec,
    const std::set<std::string>& explicit_flags,
    const std::function<std::string(const std::string&)>& current);

// Names of the flags on a command line (--name=v, --name v, -name, --noname
// for booleans), up to a "--". Flags from --flagfile are not seen.
std::set<std::string> FlagsOnCommandLine(int argc, char** argv);

// What both binaries do right after parsing their flags: load the spec named
// by `spec_path` (or $PSTRAIN_CLUSTER), derive this role's flags and set
// every one not given on the command line. Returns the settings applied (for
// a log line); an error names the spec's source and field.
absl::StatusOr<std::vector<FlagSetting>> ApplyClusterSpec(
    ClusterRole role, const std::string& spec_path, int argc, char** argv);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CLUSTER_SPEC_H_
