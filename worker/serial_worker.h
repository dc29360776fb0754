// A background thread that runs closures one after another: the network
// thread of the pipelined step (worker/trainer.cc, worker/python/c_api.cc)
// and of OverlappedPush.
#ifndef PSTRAIN_WORKER_SERIAL_WORKER_H_
#define PSTRAIN_WORKER_SERIAL_WORKER_H_

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pstrain {

// One background thread running closures in the order they were scheduled.
class SerialWorker {
 public:
  SerialWorker();
  // Runs what is still queued, then joins the thread.
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  void Schedule(std::function<void()> work);
  // Returns once every closure scheduled before the call has run.
  void Drain();

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the state above exists
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_SERIAL_WORKER_H_
