// Real processes for multi-process tests: ps_server and worker binaries
// started from the test's runfiles on loopback ports they pick themselves
// (reported through port files), every wait bounded, every process killed
// when the owning object goes away.
#ifndef PSTRAIN_TESTS_TEST_CLUSTER_H_
#define PSTRAIN_TESTS_TEST_CLUSTER_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/ps.pb.h"
#include "worker/client/ps_client.h"

namespace pstrain::testing {

// Path of a binary of this repository in the test's runfiles, e.g.
// BinaryPath("ps_server/ps_server").
std::string BinaryPath(const std::string& target_path);

// A directory for this test's files (under TEST_TMPDIR).
std::string TestDir();

class Process {
 public:
  // Starts argv with stdout and stderr redirected to files in `dir` named
  // <name>.out and <name>.log.
  static absl::StatusOr<std::unique_ptr<Process>> Start(
      const std::vector<std::string>& argv, const std::string& dir,
      const std::string& name);
  ~Process();  // SIGKILL if still running

  // The exit code (or 128 + signal) once the process ends, or
  // DeadlineExceeded (the process is then killed).
  absl::StatusOr<int> Wait(absl::Duration timeout);
  void Signal(int signal_number);
  bool running();

  std::string Stdout() const;
  std::string Stderr() const;
  pid_t pid() const { return pid_; }

 private:
  Process(pid_t pid, std::string stdout_path, std::string stderr_path)
      : pid_(pid),
        stdout_path_(std::move(stdout_path)),
        stderr_path_(std::move(stderr_path)) {}

  pid_t pid_;
  int exit_code_ = -1;
  std::string stdout_path_, stderr_path_;
};

struct ClusterOptions {
  int num_shards = 1;
  int num_workers = 1;
  std::string mode = "sync";
  std::vector<std::string> server_flags;  // extra, e.g. "--learning_rate=0.1"
  // Server processes per shard (ps_server --replicas). With more than one,
  // the ports are picked free before the servers start (each replica is
  // told the others'), and a shard's entry in PsHosts is its replicas'
  // addresses joined by '|'.
  int replicas = 1;
  // Replicas {shard, replica} that Start leaves down: the test starts each
  // with RestartReplica (a backup that comes up after the job began).
  std::vector<std::pair<int, int>> started_later;
};

// A set of running ps_server shards.
class TestCluster {
 public:
  static absl::StatusOr<std::unique_ptr<TestCluster>> Start(
      const ClusterOptions& options, const std::string& name);

  // "127.0.0.1:p0,127.0.0.1:p1,..."
  std::string PsHosts() const;
  std::vector<std::string> HostList() const;

  // Runs one worker per entry of `worker_flags` (each gets --ps_hosts,
  // --worker_id, --num_workers added) and waits for all of them. Returns
  // each worker's stdout; fails with its stderr tail if one exits non-zero.
  // `start_delays[k]`, when given, is how long after the call worker k
  // starts: a cluster whose workers come late (the delay is the scenario,
  // not a synchronisation).
  absl::StatusOr<std::vector<std::string>> RunWorkers(
      const std::vector<std::vector<std::string>>& worker_flags,
      absl::Duration timeout,
      const std::vector<absl::Duration>& start_delays = {});

  // Starts one worker; the caller waits for it.
  absl::StatusOr<std::unique_ptr<Process>> StartWorker(
      int worker_id, int num_workers, const std::vector<std::string>& flags);

  // Kills shard `shard` with SIGKILL / stops it with SIGTERM and waits.
  // With replicas: its replica 0.
  void KillServer(int shard);
  // Kills one replica of a replicated shard with SIGKILL and waits.
  void KillReplica(int shard, int replica);
  // The stats of one replica (a backup answers Stats too).
  absl::StatusOr<StatsResponse> ReplicaStats(int shard, int replica);
  absl::Status StopServer(int shard);
  // Starts shard `shard` again on the port it had, with the cluster's flags
  // plus `extra_flags`, and waits until it serves.
  absl::Status RestartServer(int shard,
                             const std::vector<std::string>& extra_flags = {});
  absl::Status RestartReplica(int shard, int replica,
                              const std::vector<std::string>& extra_flags = {});
  // Starts the given replicas of `shard` one right after the other, then
  // waits until each serves (a whole replica set coming back at once).
  absl::Status RestartReplicas(
      int shard, const std::vector<int>& replicas,
      const std::vector<std::string>& extra_flags = {});

  // Every shard's stats, read by an observer (not a worker).
  absl::StatusOr<std::vector<StatsResponse>> Stats();
  // Polls Stats until `done` holds for the stats of every shard, or fails
  // when `timeout` passes (the message shows the last stats seen).
  absl::Status WaitForStats(
      const std::function<bool(const StatsResponse&)>& done,
      absl::Duration timeout);

  Process& server(int shard) { return *servers_[shard * options_.replicas]; }
  Process& replica(int shard, int replica) {
    return *servers_[shard * options_.replicas + replica];
  }
  const std::string& dir() const { return dir_; }

 private:
  // Server `index` is replica index % replicas of shard index / replicas.
  std::vector<std::string> ServerArgv(int index, int port) const;
  absl::Status WaitForPortFile(int index, absl::Duration timeout);
  std::string ReplicaAddress(int index) const;

  ClusterOptions options_;
  std::string dir_;
  std::vector<std::unique_ptr<Process>> servers_;  // [shard][replica]
  std::vector<int> ports_;                         // [shard][replica]
  int restarts_ = 0;
  std::unique_ptr<PsClient> observer_;
};

// Runs deploy/tls/make_certs.sh into `dir` for localhost and 127.0.0.1:
// ca.pem, ca.key, server.{pem,key}, client.{pem,key}. The test lists
// //deploy/tls:make_certs.sh in its data.
absl::Status MakeTestCerts(const std::string& dir);

// The numeric value of "key" in the worker's final JSON line, or NotFound.
absl::StatusOr<double> FinalJsonNumber(const std::string& worker_stdout,
                                       const std::string& key);

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TEST_CLUSTER_H_
