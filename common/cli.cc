#include "common/cli.h"

#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

std::string& ProgramName() {
  static std::string* name = new std::string("program");
  return *name;
}

// Written by the signal handler, read by WaitForTerminationSignal: a
// self-pipe, because only async-signal-safe calls may run in a handler.
int termination_pipe[2] = {-1, -1};

void OnTerminationSignal(int signal_number) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  // A full pipe already holds a signal to report: dropping this one is fine.
  if (write(termination_pipe[1], &byte, 1) < 0) {
  }
  errno = saved_errno;
}

}  // namespace

void InitProgram(int argc, char** argv, const char* usage) {
  const std::string path = argv[0];
  ProgramName() = path.substr(path.find_last_of('/') + 1);
  // absl prints "<program>: <usage>" itself: a usage already naming the
  // program would read "worker: worker: ...".
  absl::string_view usage_text(usage);
  absl::ConsumePrefix(&usage_text, ProgramName() + ": ");
  absl::SetProgramUsageMessage(usage_text);
  // --help lists this project's flags (absl's default keeps only those of a
  // file named after the program); --helpfull adds absl's own.
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return !absl::StrContains(file, "absl/");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  // absl exits 1 after --help; asking for help is no error, so the usage
  // flags are handled here, with exit 0.
  std::vector<char*> rest = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(
          std::cout, absl::ProgramUsageMessage()) >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  if (rest.size() > 1) {
    std::vector<std::string> extra(rest.begin() + 1, rest.end());
    std::fprintf(stderr,
                 "%s: unexpected argument(s): %s (flags are --name=value)\n",
                 ProgramName().c_str(), absl::StrJoin(extra, " ").c_str());
    std::exit(2);
  }
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  TuneForTransport();
}

void TuneForTransport() {
  if (std::getenv("TEST_TMPDIR") == nullptr) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  // Serve blocks of up to 32 MiB (glibc's largest mmap threshold) from the
  // heap and never trim it: measured 1.2-1.4x on push/pull of 4 MiB.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

void ExitOnFlagErrors(const std::vector<absl::Status>& checks) {
  bool failed = false;
  for (const absl::Status& status : checks) {
    if (status.ok()) continue;
    std::fprintf(stderr, "%s: %s\n", ProgramName().c_str(),
                 std::string(status.message()).c_str());
    failed = true;
  }
  if (failed) std::exit(2);
}

absl::Status JoinProblems(const std::vector<absl::Status>& checks) {
  absl::Status joined;
  std::vector<absl::string_view> messages;
  for (const absl::Status& status : checks) {
    if (status.ok()) continue;
    if (joined.ok()) joined = status;
    messages.push_back(status.message());
  }
  if (joined.ok()) return joined;
  return absl::Status(joined.code(), absl::StrJoin(messages, "\n"));
}

void ExitOnFlagErrors(const absl::Status& problems) {
  if (problems.ok()) return;
  std::vector<absl::Status> lines;
  for (absl::string_view line :
       absl::StrSplit(problems.message(), '\n', absl::SkipEmpty())) {
    lines.push_back(absl::Status(problems.code(), line));
  }
  if (lines.empty()) lines.push_back(problems);
  ExitOnFlagErrors(lines);
}

absl::Status CheckAtLeast(const char* flag, double value, double minimum) {
  if (value >= minimum) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be >= ", minimum, ", got ", value));
}

absl::Status CheckPositive(const char* flag, double value) {
  if (std::isfinite(value) && value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be a positive number, got ", value));
}

absl::Status CheckPort(const char* flag, int port, int minimum) {
  if (port >= minimum && port <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, " must be in [", minimum, ", 65535], got ", port));
}

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::string& contents) {
  const std::string temporary = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << contents;
    out.close();
    if (!out) {
      return absl::InternalError(absl::StrCat("cannot write ", temporary));
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    return absl::InternalError(
        absl::StrCat("cannot rename ", temporary, " to ", path));
  }
  return absl::OkStatus();
}

void CatchTerminationSignals() {
  if (termination_pipe[0] >= 0) return;
  PCHECK(pipe2(termination_pipe, O_CLOEXEC | O_NONBLOCK) == 0);
  // Only the write end is non-blocking: a reader waits for a signal.
  PCHECK(fcntl(termination_pipe[0], F_SETFL, 0) == 0);
  struct sigaction action = {};
  action.sa_handler = OnTerminationSignal;
  action.sa_flags = SA_RESTART;  // other threads' system calls go on
  sigemptyset(&action.sa_mask);
  struct sigaction interrupt = {};
  PCHECK(sigaction(SIGINT, nullptr, &interrupt) == 0);
  if (interrupt.sa_handler != SIG_IGN) {
    PCHECK(sigaction(SIGINT, &action, nullptr) == 0);
  }
  PCHECK(sigaction(SIGTERM, &action, nullptr) == 0);
}

void EndTerminationWait(int reason) {
  CHECK(reason > 64 && reason <= 255) << reason;
  CHECK_GE(termination_pipe[1], 0) << "CatchTerminationSignals first";
  OnTerminationSignal(reason);
}

int WaitForTerminationSignal() {
  CHECK_GE(termination_pipe[0], 0) << "CatchTerminationSignals first";
  unsigned char byte = 0;
  while (read(termination_pipe[0], &byte, 1) != 1) {
    PCHECK(errno == EINTR);
  }
  return byte;
}

}  // namespace pstrain
