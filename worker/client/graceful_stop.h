// How a worker stopped by a signal ends its step: the grace, then the
// interrupts. Shared by the C++ worker (worker/signal_watch.h) and the C
// API behind pstrain.torch (worker/python/c_api.h).
#ifndef PSTRAIN_WORKER_CLIENT_GRACEFUL_STOP_H_
#define PSTRAIN_WORKER_CLIENT_GRACEFUL_STOP_H_

#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/client/ps_client.h"

namespace pstrain {

// A worker asked to stop (SIGTERM from a launcher, scancel or Kubernetes;
// a first Ctrl-C) finishes the step in hand, its push whole, and leaves as
// stopping. The step in hand gets a grace to end by itself: a push cut
// halfway would leave the blocks it reached a step ahead of the others,
// and that step would be lost on resume. A call still going after the
// grace is a wait that may never end (the other workers stopped, a server
// is gone), so every client's calls in progress are interrupted
// (PsClient::Interrupt), again every 100 ms so that a wait begun since is
// cut too, until the worker goes quiet to leave.
//
// The grace follows the worker's steps: twice the longer of the last two
// steps' times (batch, forward, backward and push: what the step in hand
// may still have ahead when the signal comes), so a big model, or a push on
// a slow link, is not cut where a small one would be. Two, because a
// pipelined step's push is still in flight when it tells its time, and
// counts in the next step's (whose forward waits for its values): the first
// pipelined step after a plain one tells a time with no exchange in it. The
// first step's time is not known until it has pushed (and a first step is
// often the slowest: warm-up), so until then the grace is the longest;
// before any step (reaching the servers, registering) nothing is pushed,
// and a wait is cut after the shortest. A step that tells its time while the
// grace runs moves the deadline (signal + the new grace). A step's time holds
// its waits for its peers too, so a worker that leaves stopping tells the
// servers its grace, and they hold its step for the others that long
// (LeaveRequest.stopping_grace_s). Thread-safe.
class GracefulStop {
 public:
  // Twice `step_work`, at least 0.4 s (time for a step's end and the
  // Leave) and at most 5 s (launchers SIGKILL 10 s after their SIGTERM).
  static absl::Duration GraceAfter(absl::Duration step_work);

  // A step that will push begins its work / has pushed, having taken
  // `step_work` of its own (told by the trainer before any wait that
  // follows the push, such as the first step's wait for the job to start).
  void StepWorkBegins();
  void StepWorkDone(absl::Duration step_work);
  // A new job in this process: its first step's time is not known.
  void NewJob();
  absl::Duration grace() const;

  // The clients whose calls InterruptAll and InterruptAfterGrace cut; a
  // client must be removed (or the worker quiet) before it is destroyed.
  void Add(PsClient* client);
  void Remove(PsClient* client);
  // Cuts every client's calls in progress now (a second Ctrl-C).
  void InterruptAll();

  // Once the stop was asked: waits out the grace, or until Quiet, then
  // interrupts until Quiet. Blocks; run it on a thread of its own.
  void InterruptAfterGrace();
  // No more interrupts: the worker finished its step and leaves, or is
  // about to destroy its clients.
  void Quiet();
  // Interrupts again after a later stop (a process may train one job after
  // another).
  void Arm();

 private:
  mutable absl::Mutex mu_;
  std::set<PsClient*> clients_ ABSL_GUARDED_BY(mu_);
  absl::Duration grace_ ABSL_GUARDED_BY(mu_) = GraceAfter(absl::ZeroDuration());
  bool work_measured_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration last_step_work_ ABSL_GUARDED_BY(mu_);
  bool quiet_ ABSL_GUARDED_BY(mu_) = false;
};

// The grace `stop` gives a step now; zero without one (a worker that does
// not stop on signals). What a stopping leave tells the servers
// (PsClient::Leave).
absl::Duration GraceOf(const GracefulStop* stop);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_GRACEFUL_STOP_H_
