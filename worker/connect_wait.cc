#include "worker/connect_wait.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/transport/connection_check.h"
#include "glog/logging.h"

namespace pstrain {
namespace {

// While Register waits for the servers (gRPC's wait-for-ready says nothing
// until the deadline), says every few seconds which shard it waits for,
// why (a TCP probe of its address: common/transport/connection_check.h) and how
// long is left, in the log and on the progress bar.
class ConnectWaitReport {
 public:
  ConnectWaitReport(const std::vector<std::string>& hosts, bool tls,
                    absl::Duration timeout,
                    std::function<void(const std::string&)> show)
      : thread_([=] { Run(hosts, tls, timeout, show); }) {}
  ~ConnectWaitReport() {
    done_.Notify();
    thread_.join();
  }

 private:
  static constexpr absl::Duration kEvery = absl::Seconds(3);

  void Run(const std::vector<std::string>& hosts, bool tls,
           absl::Duration timeout,
           const std::function<void(const std::string&)>& show) {
    const absl::Time give_up = absl::Now() + timeout;
    while (!done_.WaitForNotificationWithTimeout(kEvery)) {
      const int64_t left =
          std::max<int64_t>(0, absl::ToInt64Seconds(give_up - absl::Now()));
      std::vector<std::string> lines;
      for (size_t s = 0; s < hosts.size(); ++s) {
        // Each probe may take seconds (an address that drops SYNs): a
        // registration that ended, or Ctrl-C, does not wait for the rest.
        if (done_.HasBeenNotified()) return;
        // A replicated shard ("a:1|b:2") is reached when any replica is.
        std::string cause;
        for (absl::string_view replica : absl::StrSplit(hosts[s], '|')) {
          cause =
              DiagnoseConnection(std::string(replica), tls, absl::Seconds(1));
          if (cause.empty()) break;
          if (hosts[s].find('|') != std::string::npos) {
            cause = absl::StrCat(replica, ": ", cause);
          }
        }
        if (cause.empty()) continue;
        // The time left before the cause: a bar cut to the terminal's
        // width keeps it.
        lines.push_back(absl::StrCat("waiting to reach shard ", s, " (",
                                     hosts[s], ") to register, ", left,
                                     " s left (--connect_timeout_s): ", cause));
      }
      if (lines.empty()) {
        lines.push_back(absl::StrCat("waiting for the servers (",
                                     absl::StrJoin(hosts, ","),
                                     ") to answer the registration; ", left,
                                     " s left (--connect_timeout_s)"));
      }
      if (done_.HasBeenNotified()) return;
      for (const std::string& line : lines) LOG(INFO) << line;
      if (show) show(lines.front());
    }
  }

  absl::Notification done_;
  std::thread thread_;
};

}  // namespace

absl::StatusOr<Registration> RegisterShowingWait(
    PsClient& client, const PsClientOptions& options, const ModelSchema& schema,
    int num_workers, int worker_id,
    std::function<void(const std::string&)> show) {
  ConnectWaitReport report(options.hosts, options.credentials != nullptr,
                           options.connect_timeout, std::move(show));
  return client.Register(schema, num_workers, worker_id);
}

}  // namespace pstrain
