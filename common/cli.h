// Start-up plumbing both binaries share: flag errors reported one line each
// with a non-zero exit, the port file a launcher waits for, and SIGTERM/SIGINT
// turned into an ordinary wait.
#ifndef PSTRAIN_COMMON_CLI_H_
#define PSTRAIN_COMMON_CLI_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pstrain {

// Parses flags (absl), sets up glog to log to stderr, and calls
// KeepFreedMemory. Positional arguments are refused. Exits 2 on a parse
// error.
void InitProgram(int argc, char** argv, const char* usage);

// Tunes the process for moving tensors: keeps the allocator from returning
// freed memory to the OS (big message buffers would otherwise be
// page-faulted in again on every call), and turns off absl::Mutex deadlock
// detection, which Debian's absl leaves on and which cost ~2% of a 4 MiB
// push+pull's CPU (its lock graph). Under `bazel test` (TEST_TMPDIR set)
// the detection stays on: tests are where it finds bugs.
void TuneForTransport();

// Prints "<program>: <message>" for every failed status and exits with 2 if
// there was one. Collect the checks first so a user sees every problem found.
void ExitOnFlagErrors(const std::vector<absl::Status>& checks);

// Every failed status of `checks` as one: the first failure's code and all
// their messages, one per line (OK when none failed). A configuration's
// validation returns it; ExitOnFlagErrors below prints it.
absl::Status JoinProblems(const std::vector<absl::Status>& checks);

// ExitOnFlagErrors of a status from JoinProblems: one line per problem.
void ExitOnFlagErrors(const absl::Status& problems);

// OK, or InvalidArgument "--<flag> must be >= <minimum>, got <value>".
absl::Status CheckAtLeast(const char* flag, double value, double minimum);

// OK, or InvalidArgument "--<flag> must be a positive number, got <value>"
// (NaN and infinity are not).
absl::Status CheckPositive(const char* flag, double value);

// OK, or InvalidArgument "--<flag> must be in [<minimum>, 65535], got <p>".
absl::Status CheckPort(const char* flag, int port, int minimum = 0);

// Writes `contents` to `path` atomically (temporary file + rename), so a
// reader polling for the file never sees it half written.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::string& contents);

// From here on SIGINT and SIGTERM are caught on whichever thread they
// arrive, and WaitForTerminationSignal returns the number of each one
// caught, in order (blocking). A handler, not a signal mask: libraries
// start threads before main (OpenBLAS's pool), and a mask set in main
// cannot cover them, so a signal landing there would kill the process.
// A process started with SIGINT ignored (a background job of a script:
// deploy/local/launch.sh's servers and workers) keeps ignoring it, as
// shells and Python do: a terminal's Ctrl-C reaches the script's whole
// process group at once, and the script stops its children in order
// (workers, then servers) with SIGTERM.
void CatchTerminationSignals();
int WaitForTerminationSignal();
// Makes WaitForTerminationSignal return `reason` as if a signal of that
// number had been caught, from any thread: a process that must end for a
// reason of its own ends the way a SIGTERM ends it. Use a `reason` no
// signal has (above 64, at most 255).
void EndTerminationWait(int reason);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CLI_H_
