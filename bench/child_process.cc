#include "bench/child_process.h"

#include <sys/utsname.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "tools/cpp/runfiles/runfiles.h"

namespace pstrain::bench {

namespace {

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  return set;
}

}  // namespace

void StartGuardian(absl::Duration deadline) {
  sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set, deadline] {
    const absl::Time end = absl::Now() + deadline;
    while (true) {
      const absl::Duration left = end - absl::Now();
      if (left <= absl::ZeroDuration()) {
        LOG(ERROR) << "--deadline_s=" << absl::ToDoubleSeconds(deadline)
                   << " passed; killing every child process";
        Leftovers::Get().KillAll();
        std::fflush(stdout);
        _exit(3);
      }
      const timespec wait = absl::ToTimespec(std::min(left, absl::Seconds(1)));
      const int signal_number = sigtimedwait(&set, nullptr, &wait);
      if (signal_number > 0) {
        LOG(ERROR) << "got signal " << signal_number
                   << "; killing every child process";
        Leftovers::Get().KillAll();
        std::fflush(stdout);
        _exit(128 + signal_number);
      }
    }
  }).detach();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

std::string Tail(const std::string& text, size_t max_chars) {
  return text.size() <= max_chars ? text : text.substr(text.size() - max_chars);
}

std::string FirstLineWith(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
    }
  }
  return "unknown";
}

std::string LoadAverage() {
  return std::string(absl::StripAsciiWhitespace(ReadFile("/proc/loadavg")));
}

std::string MachineDescription() {
  utsname name = {};
  uname(&name);
  return absl::StrCat("# machine: nproc ", sysconf(_SC_NPROCESSORS_ONLN),
                      ", cpu ", FirstLineWith("/proc/cpuinfo", "model name"),
                      ", memory ", FirstLineWith("/proc/meminfo", "MemTotal"),
                      "\n# kernel: ", name.sysname, " ", name.release, " ",
                      name.version, " ", name.machine,
                      "\n# load average at start: ", LoadAverage(), "\n");
}

absl::StatusOr<std::string> FindPsServer(const std::string& flag,
                                         const char* argv0,
                                         const std::string& bench_target) {
  if (!flag.empty()) {
    if (access(flag.c_str(), X_OK) != 0) {
      return absl::NotFoundError(
          absl::StrCat("--ps_server=", flag, " is not an executable file"));
    }
    return flag;
  }
  using bazel::tools::cpp::runfiles::Runfiles;
  // argv[0] works for `bazel run` and bazel-bin/...; the resolved
  // /proc/self/exe when started through a symlink (a test's runfiles);
  // TEST_SRCDIR inside a test.
  std::vector<std::unique_ptr<Runfiles>> candidates;
  std::string error;
  candidates.emplace_back(Runfiles::Create(argv0, &error));
  std::error_code ignored;
  const std::string self =
      std::filesystem::canonical("/proc/self/exe", ignored).string();
  if (!self.empty()) candidates.emplace_back(Runfiles::Create(self, &error));
  candidates.emplace_back(Runfiles::CreateForTest(&error));
  for (const std::unique_ptr<Runfiles>& runfiles : candidates) {
    if (runfiles == nullptr) continue;
    const std::string path = runfiles->Rlocation("pstrain/ps_server/ps_server");
    if (!path.empty() && access(path.c_str(), X_OK) == 0) return path;
  }
  return absl::NotFoundError(absl::StrCat(
      "ps_server is not in this binary's runfiles; run it "
      "through bazel (bazel run ",
      bench_target, " or bazel-bin/...) or pass --ps_server=PATH"));
}

}  // namespace pstrain::bench
