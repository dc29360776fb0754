#include "ps_server/outbox.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pstrain {

void Outbox::Answer::Frame(absl::StatusCode code,
                           absl::Span<const absl::string_view> body) {
  size_t body_bytes = 0;
  for (absl::string_view piece : body) body_bytes += piece.size();
  data_plane::EncodeResponseHeader({code, body_bytes}, header);
  pieces.clear();
  pieces.reserve(body.size() + 1);
  pieces.emplace_back(header, sizeof(header));
  pieces.insert(pieces.end(), body.begin(), body.end());
}

Outbox::Outbox(int fd)
    : fd_(fd), wake_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  // Without the eventfd a stalled send could not be handed over: fail
  // loudly at once rather than hang later.
  CHECK(wake_.valid()) << SocketError("eventfd", errno);
}

Outbox::~Outbox() = default;

// How long past its promised deadline an answer may be missing before the
// connection is given up (the shard's deadline sweeper runs now and then).
constexpr absl::Duration kOverdueMargin = absl::Seconds(5);

uint64_t Outbox::Reserve(absl::Time answer_by) {
  absl::MutexLock lock(&mu_);
  if (answer_by != absl::InfiniteFuture()) {
    answer_by_[next_reserved_] = answer_by;
  }
  return next_reserved_++;
}

bool Outbox::wants_write() const {
  absl::MutexLock lock(&mu_);
  return owner_sends_ && !broken_;
}

uint64_t Outbox::outstanding() const {
  absl::MutexLock lock(&mu_);
  return next_reserved_ - next_to_send_;
}

absl::Time Outbox::next_check(absl::Duration stall_limit) const {
  absl::MutexLock lock(&mu_);
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [seq, answer_by] : answer_by_) {
    next = std::min(next, answer_by + kOverdueMargin);
  }
  if (owner_sends_) next = std::min(next, last_progress_ + stall_limit);
  return next;
}

absl::Status Outbox::error() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

void Outbox::Complete(uint64_t seq, std::unique_ptr<Answer> answer) {
  {
    absl::MutexLock lock(&mu_);
    answer_by_.erase(seq);
    if (closed_ || broken_) return;  // `answer` is dropped on return
    due_.emplace(seq, std::move(answer));
    if (sending_ || owner_sends_ || seq != next_to_send_) return;
    sending_ = true;
  }
  SendDue();
}

absl::Status Outbox::OwnerFlush(absl::Duration stall_limit) {
  uint64_t wakes;
  while (read(wake_.get(), &wakes, sizeof(wakes)) > 0) {
  }
  bool send;
  {
    absl::MutexLock lock(&mu_);
    if (broken_) return error_;
    send = owner_sends_;
    if (send) sending_ = true;
  }
  if (send) SendDue();
  return CheckHealthy(stall_limit);
}

absl::Status Outbox::CheckHealthy(absl::Duration stall_limit) {
  absl::MutexLock lock(&mu_);
  if (broken_) return error_;
  const absl::Time now = absl::Now();
  if (owner_sends_ && now - last_progress_ > stall_limit) {
    return absl::AbortedError(
        absl::StrCat("the peer read none of its answers for ",
                     absl::FormatDuration(stall_limit)));
  }
  for (const auto& [seq, answer_by] : answer_by_) {
    if (now > answer_by + kOverdueMargin) {
      return absl::InternalError("pull not answered by its deadline");
    }
  }
  return absl::OkStatus();
}

void Outbox::FlushBeforeClose(absl::Time until) {
  while (absl::Now() < until) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(
                                +[](Outbox* o) {
                                  o->mu_.AssertHeld();
                                  return o->broken_ || o->owner_sends_ ||
                                         o->next_to_send_ == o->next_reserved_;
                                },
                                this),
                            until);
      if (broken_ || next_to_send_ == next_reserved_) return;
      if (!owner_sends_) continue;
    }
    pollfd writable = {fd_, POLLOUT, 0};
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return;
    if (poll(&writable, 1,
             static_cast<int>(
                 std::max<int64_t>(1, absl::ToInt64Milliseconds(left)))) < 0 &&
        errno != EINTR) {
      return;
    }
    if (!OwnerFlush(until - absl::Now()).ok()) return;
  }
}

void Outbox::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  mu_.Await(absl::Condition(
      +[](bool* sending) { return !*sending; }, &sending_));
  due_.clear();
  answer_by_.clear();
  partial_.reset();
  // Pending pulls keep this object alive until they are answered: the
  // descriptor is not theirs to hold (nothing wakes the owner any more).
  wake_.Reset();
}

std::unique_ptr<Outbox::Answer> Outbox::TakeHeadLocked() {
  if (closed_ || broken_) {
    due_.clear();
    return nullptr;
  }
  auto it = due_.find(next_to_send_);
  if (it == due_.end()) return nullptr;
  std::unique_ptr<Answer> head = std::move(it->second);
  due_.erase(it);
  ++next_to_send_;
  return head;
}

void Outbox::SendDue() {
  bool progress = false;
  absl::Status failed;
  bool full = false;
  while (true) {
    if (partial_ == nullptr) {
      absl::MutexLock lock(&mu_);
      if (progress) last_progress_ = absl::Now();
      progress = false;
      partial_ = TakeHeadLocked();
      if (partial_ == nullptr) {
        // Ends the turn under the lock that found nothing due, so that an
        // answer completed meanwhile is never left unsent.
        sending_ = false;
        owner_sends_ = false;
        return;
      }
      partial_iov_.clear();
      for (absl::string_view piece : partial_->pieces) {
        if (!piece.empty()) {
          partial_iov_.push_back(
              {const_cast<char*>(piece.data()), piece.size()});
        }
      }
      partial_first_ = 0;
    }
    while (partial_first_ < partial_iov_.size()) {
      msghdr message = {};
      message.msg_iov = partial_iov_.data() + partial_first_;
      message.msg_iovlen =
          std::min<size_t>(IOV_MAX, partial_iov_.size() - partial_first_);
      const ssize_t sent = sendmsg(fd_, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          full = true;
        } else {
          failed = SocketError("send", errno);
        }
        break;
      }
      progress = true;
      ConsumeIovecs(static_cast<size_t>(sent), partial_iov_, &partial_first_);
    }
    if (full || !failed.ok()) break;
    if (partial_->after_sent) partial_->after_sent();
    partial_.reset();
  }
  absl::MutexLock lock(&mu_);
  if (progress) last_progress_ = absl::Now();
  sending_ = false;
  if (!failed.ok()) {
    broken_ = true;
    error_ = failed;
    due_.clear();
    // The connection's thread learns it from its socket.
    shutdown(fd_, SHUT_RDWR);
    return;
  }
  if (!owner_sends_) {
    owner_sends_ = true;
    last_progress_ = absl::Now();
    WakeOwner();
  }
}

void Outbox::WakeOwner() {
  const uint64_t one = 1;
  // A full eventfd counter still wakes its reader: nothing to handle.
  if (write(wake_.get(), &one, sizeof(one)) < 0 && errno != EAGAIN) {
    LOG_EVERY_N(ERROR, 100) << SocketError("eventfd write", errno);
  }
}

}  // namespace pstrain
