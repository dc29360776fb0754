// What the benchmarks share to run real ps_server (and peer) processes:
// child processes that never outlive the bench, a guardian thread that
// enforces --deadline_s and termination signals, and the machine
// description printed above every table.
#ifndef PSTRAIN_BENCH_CHILD_PROCESS_H_
#define PSTRAIN_BENCH_CHILD_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"

namespace pstrain::bench {

// Polling interval of waits on port files and child exits; every such wait
// is bounded by its own deadline.
inline constexpr absl::Duration kPoll = absl::Milliseconds(5);
// ps_server finishes in-flight calls on SIGTERM; past this it gets SIGKILL.
inline constexpr absl::Duration kStopGrace = absl::Seconds(5);

std::string ReadFile(const std::string& path);
std::string Tail(const std::string& text, size_t max_chars = 2000);

// What must not outlive the bench: child pids and the scratch directory.
class Leftovers {
 public:
  static Leftovers& Get() {
    static Leftovers* leftovers = new Leftovers();  // never destroyed: the
    return *leftovers;  // guardian thread may use it during exit
  }
  void AddChild(pid_t pid) {
    absl::MutexLock lock(&mu_);
    children_.insert(pid);
  }
  void RemoveChild(pid_t pid) {
    absl::MutexLock lock(&mu_);
    children_.erase(pid);
  }
  void SetScratchDir(const std::string& dir) {
    absl::MutexLock lock(&mu_);
    scratch_dir_ = dir;
  }
  // Last resort (signal, deadline): SIGKILL every child and remove the
  // scratch directory.
  void KillAll() {
    absl::MutexLock lock(&mu_);
    for (pid_t pid : children_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    children_.clear();
    RemoveScratchLocked();
  }
  void RemoveScratch() {
    absl::MutexLock lock(&mu_);
    RemoveScratchLocked();
  }

 private:
  void RemoveScratchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (scratch_dir_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(scratch_dir_, ignored);
    scratch_dir_.clear();
  }

  absl::Mutex mu_;
  std::set<pid_t> children_ ABSL_GUARDED_BY(mu_);
  std::string scratch_dir_ ABSL_GUARDED_BY(mu_);
};

// Blocks SIGINT/SIGTERM/SIGHUP and starts a thread that, on one of them or
// once `deadline` has passed, SIGKILLs every child, removes the scratch
// directory and exits (128 + signal, or 3). Must run before any other
// thread exists (gRPC starts its own), so that the signals reach only it.
void StartGuardian(absl::Duration deadline);

class ChildProcess {
 public:
  // Starts argv (argv[0] a path) with stdin from /dev/null and stdout and
  // stderr appended to `log_path`. Call from the main thread only: the
  // kernel delivers PR_SET_PDEATHSIG when the *thread* that forked exits.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(
      const std::string& name, const std::vector<std::string>& argv,
      const std::string& log_path) {
    // Everything the child needs is prepared before fork: between fork and
    // exec only async-signal-safe calls are allowed (this process has
    // threads).
    std::vector<char*> args;
    for (const std::string& arg : argv) {
      args.push_back(const_cast<char*>(arg.c_str()));
    }
    args.push_back(nullptr);
    const pid_t parent = getpid();
    sigset_t none;
    sigemptyset(&none);
    const pid_t pid = fork();
    if (pid < 0) {
      return absl::InternalError(
          absl::StrCat("fork for ", name, ": ", std::strerror(errno)));
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the bench died meanwhile
      // The bench blocks termination signals for its guardian thread; the
      // child must be stoppable by SIGTERM.
      sigprocmask(SIG_SETMASK, &none, nullptr);
      const int in = open("/dev/null", O_RDONLY);
      const int log =
          open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (in < 0 || log < 0) _exit(127);
      dup2(in, STDIN_FILENO);
      dup2(log, STDOUT_FILENO);
      dup2(log, STDERR_FILENO);
      execv(args[0], args.data());
      _exit(127);
    }
    Leftovers::Get().AddChild(pid);
    LOG(INFO) << "started pid " << pid << " (" << name << ")";
    return std::unique_ptr<ChildProcess>(new ChildProcess(name, pid, log_path));
  }

  ~ChildProcess() { Stop(); }

  // SIGTERM, then SIGKILL once kStopGrace has passed. Idempotent.
  void Stop() {
    if (!Running()) return;
    kill(pid_, SIGTERM);
    const absl::Time deadline = absl::Now() + kStopGrace;
    while (Running() && absl::Now() < deadline) absl::SleepFor(kPoll);
    if (Running()) {
      LOG(WARNING) << name_ << " (pid " << pid_ << ") ignored SIGTERM for "
                   << kStopGrace << "; sending SIGKILL";
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);  // SIGKILL cannot be ignored
      exited_ = true;
      Leftovers::Get().RemoveChild(pid_);
    }
  }

  bool Running() {
    if (exited_) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_code_ =
          WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      Leftovers::Get().RemoveChild(pid_);
    }
    return !exited_;
  }

  // The port the child writes to `port_file` once it serves.
  absl::StatusOr<int> WaitForPort(const std::string& port_file,
                                  absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int port = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFile(port_file)),
                           &port) &&
          port > 0) {
        return port;
      }
      if (!Running()) {
        return absl::InternalError(
            absl::StrCat(name_, " exited with ", exit_code_,
                         " before serving; its log:\n", Tail(Log())));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            name_, " wrote no port file in ", absl::FormatDuration(timeout),
            "; its log:\n", Tail(Log())));
      }
      absl::SleepFor(kPoll);
    }
  }

  // Waits until the child exits, at most `timeout`: its exit code (128 +
  // signal when killed), or DEADLINE_EXCEEDED with the child still running.
  absl::StatusOr<int> WaitForExit(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (Running()) {
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            name_, " still running after ", absl::FormatDuration(timeout),
            "; its log:\n", Tail(Log())));
      }
      absl::SleepFor(kPoll);
    }
    return exit_code_;
  }

  std::string Log() const { return ReadFile(log_path_); }

 private:
  ChildProcess(std::string name, pid_t pid, std::string log_path)
      : name_(std::move(name)), pid_(pid), log_path_(std::move(log_path)) {}

  std::string name_;
  pid_t pid_;
  std::string log_path_;
  bool exited_ = false;
  int exit_code_ = -1;
};

// "# machine: ...", "# kernel: ..." and "# load average at start: ..."
// lines, and the load average alone.
std::string MachineDescription();
std::string LoadAverage();

// `flag` (--ps_server) when set, else the ps_server in the runfiles of the
// running binary; NotFound naming how to run `bench_target` otherwise.
absl::StatusOr<std::string> FindPsServer(const std::string& flag,
                                         const char* argv0,
                                         const std::string& bench_target);

}  // namespace pstrain::bench

#endif  // PSTRAIN_BENCH_CHILD_PROCESS_H_
