#ifndef PSTRAIN_COMMON_HANDLER_THREADS_H_
#define PSTRAIN_COMMON_HANDLER_THREADS_H_

#include <deque>
#include <functional>
#include <list>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pstrain {

// Threads for request handlers that may wait (for a backup's answer, a
// step to complete, a checkpoint to be written), so that the few threads
// gRPC runs its callbacks on stay free for the calls that must never
// queue behind such a wait: a worker's heartbeat (its lease), Stats, a
// replica's probe. With the waits on gRPC's threads, a backup that stopped
// answering held every one of them for --replica forward's timeout and the
// primary let its workers' leases lapse (tests/replication_test.cc,
// AFrozenBackupHoldsTheJobButDropsNoWorker).
//
// A handler starts at once: a thread is started whenever none is idle, up
// to `max_threads` (past it handlers queue, or TryRun declines them). Every
// wait a handler makes has a deadline, so the threads in use are bounded by the
// calls that arrive within one; a thread idle for `idle_exit` ends.
class HandlerThreads {
 public:
  explicit HandlerThreads(int max_threads = 512,
                          absl::Duration idle_exit = absl::Seconds(10));
  // Runs what is queued, then ends every thread.
  ~HandlerThreads();

  HandlerThreads(const HandlerThreads&) = delete;
  HandlerThreads& operator=(const HandlerThreads&) = delete;

  void Run(std::function<void()> handler);
  // Runs `handler` now, on an idle thread or a new one, or returns false
  // (and does not run it) when max_threads are busy or no thread can be
  // started: for work its caller would rather do itself than queue.
  bool TryRun(std::function<void()> handler);

  // Threads running now (busy or idle), and the most there were at once.
  int threads() const;
  int peak_threads() const;

 private:
  using Threads = std::list<std::thread>;
  void Loop(Threads::iterator self);
  // Joins threads that ended; their handles are collected under mu_.
  void JoinEnded();

  const int max_threads_;
  const absl::Duration idle_exit_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  Threads running_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> ended_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  int peak_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_HANDLER_THREADS_H_
