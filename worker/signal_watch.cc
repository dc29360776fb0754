#include "worker/signal_watch.h"

#include <csignal>
#include <thread>

#include "common/cli.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

const char* SignalName(int signal_number) {
  if (signal_number == SIGINT) return "SIGINT";
  if (signal_number == SIGTERM) return "SIGTERM";
  return "a signal";
}

}  // namespace

void SignalWatch::Start() {
  std::thread([this] { Run(); }).detach();
}

void SignalWatch::Add(PsClient* client) { graceful_.Add(client); }

void SignalWatch::Quiet() { graceful_.Quiet(); }

int SignalWatch::signal_number() const { return signal_.load(); }

void SignalWatch::Run() {
  const int signal_number = WaitForTerminationSignal();
  signal_.store(signal_number);
  LOG(INFO) << "signal " << signal_number
            << ": stopping after this step and leaving the job (a wait is cut "
               "after the step's grace, now "
            << graceful_.grace() << ")";
  stop_->store(true);
  graceful_.InterruptAfterGrace();
}

int StoppedWhileWaiting(SignalWatch& watch, StepOutput& output,
                        PsClient& client, int worker_id,
                        const std::string& waiting_for,
                        const absl::Status& status) {
  watch.Quiet();
  output.Finish();
  // A shard that cannot be reached must not hold a stopping worker.
  if (absl::Status left = client.LeaveStoppingWithin(watch.graceful()->grace(),
                                                     absl::Milliseconds(300));
      !left.ok()) {
    LOG(WARNING) << "leaving the job: " << left;
  }
  const int signal_number = watch.signal_number();
  LOG(ERROR) << "worker " << worker_id << ": stopped by "
             << SignalName(signal_number) << " while waiting " << waiting_for
             << ": " << status.message();
  return 128 + signal_number;
}

}  // namespace pstrain
