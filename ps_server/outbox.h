// The answers of one plaintext data-plane connection, sent in the order its
// requests came, by whichever thread completes the one due next.
//
// Why: a sync pull is answered when its step completes, and that happens on
// the thread of the last worker's push (Shard::ReleaseReadyWaiters), which
// is another connection's thread. The connection's own thread used to sleep
// until then and wake up to send, two context switches per block group and
// worker: with the small groups a shaped link wants, that cost a loopback
// job 27% (bench/results/block_size_tradeoff.txt). Now the completing
// thread sends the answer itself, and the connection's thread goes on
// reading the requests behind it.
//
// A send never blocks a thread other than the connection's own: when the
// peer's socket buffer is full (it is not reading, or the answer is large),
// what is left is handed to the connection's thread, woken through
// wake_fd(), which sends it as the socket drains (OwnerFlush).
#ifndef PSTRAIN_PS_SERVER_OUTBOX_H_
#define PSTRAIN_PS_SERVER_OUTBOX_H_

#include <sys/uio.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/transport/data_plane.h"
#include "common/transport/socket.h"

namespace pstrain {

class Outbox {
 public:
  // One framed answer. `pieces` may view `owned`, `header`, the length
  // prefixes and whatever `keep_alive` holds; an Answer is never moved once
  // made (it travels as a unique_ptr), so those views stay valid.
  struct Answer {
    // Frames `body` behind a response header with `code`.
    void Frame(absl::StatusCode code, absl::Span<const absl::string_view> body);

    std::vector<absl::string_view> pieces;
    std::shared_ptr<const void> keep_alive;
    std::string owned;
    char header[data_plane::kResponseHeaderBytes];
    char push_length[data_plane::kLengthPrefixBytes];
    char meta_length[data_plane::kLengthPrefixBytes];
    // Runs once the answer is wholly sent (for metrics), on the sending
    // thread; not run for an answer dropped with a broken connection.
    std::function<void()> after_sent;
  };

  // `fd` stays owned by the connection's thread, which must call Close
  // before it closes the descriptor.
  explicit Outbox(int fd);
  ~Outbox();

  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  // The place of the next request's answer; every reserved place must be
  // completed, or the answers behind it are never sent. An answer promised
  // by `answer_by` (a pull's deadline) that is still missing 5 s after it
  // makes OwnerFlush fail: the handler broke its promise, and the answers
  // behind it would wait forever.
  uint64_t Reserve(absl::Time answer_by = absl::InfiniteFuture());
  // From any thread: the answer for place `seq`. Sends it and the answers
  // due behind it, unless another thread is sending or the connection's
  // thread has taken over (either sends it too).
  void Complete(uint64_t seq, std::unique_ptr<Answer> answer);

  // For the connection's thread, which polls wake_fd() for reading and its
  // socket for writing while wants_write().
  int wake_fd() const { return wake_.get(); }
  bool wants_write() const;
  // Answers reserved and not yet sent. The connection's thread reads no
  // more requests while this is at kMaxOutstanding, so a client that sends
  // pulls without reading their answers holds a bounded amount.
  static constexpr uint64_t kMaxOutstanding = 4096;
  uint64_t outstanding() const;
  // When OwnerFlush must run next at the latest (a promised answer's
  // deadline, or the stall limit), or InfiniteFuture.
  absl::Time next_check(absl::Duration stall_limit) const;
  // Sends what is due as far as the socket takes it now. Not OK (ABORTED
  // or INTERNAL; never DEADLINE_EXCEEDED, which a reader takes for an idle
  // peer): the connection is broken, its peer read nothing for
  // `stall_limit`, or an answer is overdue (Reserve).
  absl::Status OwnerFlush(absl::Duration stall_limit);
  // At the end of the connection (the peer closed its side, or broke the
  // framing): sends what is still due, as the connection's own thread
  // would have, until every reserved answer is out, the connection breaks
  // or `until` passes.
  void FlushBeforeClose(absl::Time until);
  // Nothing more is sent; waits for a send in progress on another thread.
  // Later Completes drop their answers.
  void Close();
  // Why a send failed, or OK.
  absl::Status error() const;

 private:
  // Sends due answers while the socket takes them, starting with the
  // partly sent one, then ends this thread's turn: nothing left due, the
  // socket full (the connection's thread takes over), or the connection
  // broken. Called with sending_ set by this thread and mu_ released.
  void SendDue() ABSL_LOCKS_EXCLUDED(mu_);
  // OwnerFlush's verdict after sending.
  absl::Status CheckHealthy(absl::Duration stall_limit)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The answer due next, or null; takes it out of `due_`.
  std::unique_ptr<Answer> TakeHeadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WakeOwner();

  const int fd_;
  ScopedFd wake_;  // eventfd
  mutable absl::Mutex mu_;
  uint64_t next_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  // The promised deadlines of reserved answers not completed yet.
  absl::flat_hash_map<uint64_t, absl::Time> answer_by_ ABSL_GUARDED_BY(mu_);
  uint64_t next_to_send_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Answer>> due_
      ABSL_GUARDED_BY(mu_);
  // Some thread is in SendDue.
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  // The socket was full: only the connection's thread sends until it has
  // sent everything due.
  bool owner_sends_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // A send failed: answers are dropped from then on.
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // When the socket last took bytes while owner_sends_.
  absl::Time last_progress_ ABSL_GUARDED_BY(mu_);
  // The answer being sent, its bytes not yet taken by the socket. Touched
  // only by the thread with sending_ set.
  std::unique_ptr<Answer> partial_;
  std::vector<iovec> partial_iov_;
  size_t partial_first_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_OUTBOX_H_
