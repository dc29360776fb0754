// How the worker stops on SIGINT/SIGTERM: training ends after the step in
// hand and the worker leaves the job; a wait that would not end by itself
// is cut short (SignalWatch), and a worker stopped while waiting says for
// what and exits 128 + the signal (StoppedWhileWaiting).
#ifndef PSTRAIN_WORKER_SIGNAL_WATCH_H_
#define PSTRAIN_WORKER_SIGNAL_WATCH_H_

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "worker/client/graceful_stop.h"
#include "worker/client/ps_client.h"
#include "worker/step_output.h"

namespace pstrain {

// SIGINT/SIGTERM: training stops after the step in hand and leaves the job
// (`stop`). The step in hand has a grace to end by itself (GracefulStop:
// twice the steps' own work); a call still going after it is a wait that would
// not end by itself (to reach a server, a retry, a sync pull held for a peer
// that stopped), and is cut short (GracefulStop). The signal handler only
// writes to a pipe (common/cli.h); all of this runs on a thread.
class SignalWatch {
 public:
  explicit SignalWatch(std::atomic<bool>* stop) : stop_(stop) {}

  // Never returns its thread: the object must live for the process.
  void Start();
  void Add(PsClient* client);
  // The trainer tells it when each step's own work begins and ends: the
  // grace.
  GracefulStop* graceful() { return &graceful_; }
  // No more interrupts: the worker is finishing (final model, leaving) or
  // about to destroy its clients.
  void Quiet();
  int signal_number() const;

 private:
  void Run();

  std::atomic<bool>* const stop_;
  GracefulStop graceful_;
  std::atomic<int> signal_{0};
};

// After a signal cut a wait short: leaves the job (this worker may have
// joined it), says in one line what it waited for, and returns the exit
// code, 128 + the signal as a shell reports a process it killed.
int StoppedWhileWaiting(SignalWatch& watch, StepOutput& output,
                        PsClient& client, int worker_id,
                        const std::string& waiting_for,
                        const absl::Status& status);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_SIGNAL_WATCH_H_
