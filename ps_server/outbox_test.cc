#include "ps_server/outbox.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/transport/data_plane.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

// A connected pair: the outbox writes `server`, the test reads `client`.
class OutboxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    server_ = fds[0];
    client_ = fds[1];
  }
  void TearDown() override {
    if (server_ >= 0) close(server_);
    if (client_ >= 0) close(client_);
  }

  // So that a 4 MiB answer fills the socket long before it is sent.
  bool ShrinkSendBuffer() {
    const int small = 16 << 10;
    return setsockopt(server_, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)) ==
           0;
  }

  static std::unique_ptr<Outbox::Answer> Text(
      std::string text, std::atomic<int>* sent = nullptr) {
    auto answer = std::make_unique<Outbox::Answer>();
    answer->owned = std::move(text);
    answer->Frame(absl::StatusCode::kOk, {answer->owned});
    if (sent != nullptr) answer->after_sent = [sent] { ++*sent; };
    return answer;
  }

  // The next framed answer's body from `client_`; empty with a failure when
  // the stream ends first.
  std::string ReadAnswer() {
    char header[data_plane::kResponseHeaderBytes];
    if (!ReadExactly(header, sizeof(header))) return "";
    absl::StatusOr<data_plane::ResponseHeader> decoded =
        data_plane::DecodeResponseHeader(header, 1 << 30);
    EXPECT_TRUE(decoded.ok()) << decoded.status();
    if (!decoded.ok()) return "";
    std::string body(decoded->body_bytes, '\0');
    if (!ReadExactly(body.data(), body.size())) return "";
    return body;
  }

  bool ReadExactly(char* out, size_t bytes) {
    size_t got = 0;
    while (got < bytes) {
      const ssize_t n = read(client_, out + got, bytes - got);
      if (n <= 0) {
        ADD_FAILURE() << "stream ended after " << got << " of " << bytes;
        return false;
      }
      got += static_cast<size_t>(n);
    }
    return true;
  }

  int server_ = -1;
  int client_ = -1;
};

TEST_F(OutboxTest, AnswersCompletedOutOfOrderLeaveInRequestOrder) {
  Outbox outbox(server_);
  const uint64_t first = outbox.Reserve();
  const uint64_t second = outbox.Reserve();
  const uint64_t third = outbox.Reserve();
  std::atomic<int> sent{0};
  outbox.Complete(third, Text("third", &sent));
  outbox.Complete(second, Text("second", &sent));
  // Nothing may leave before the first answer: its request came first.
  EXPECT_EQ(sent.load(), 0);
  pollfd readable = {client_, POLLIN, 0};
  EXPECT_EQ(poll(&readable, 1, 0), 0);
  outbox.Complete(first, Text("first", &sent));
  EXPECT_EQ(sent.load(), 3);
  EXPECT_EQ(ReadAnswer(), "first");
  EXPECT_EQ(ReadAnswer(), "second");
  EXPECT_EQ(ReadAnswer(), "third");
  outbox.Close();
}

TEST_F(OutboxTest, AFullSocketIsLeftToTheConnectionsThreadInsteadOfBlocking) {
  ASSERT_TRUE(ShrinkSendBuffer());
  Outbox outbox(server_);
  const std::string big(4 << 20, 'x');
  std::atomic<int> sent{0};
  // From another thread, as the shard completes a step: it must return
  // although nobody reads (a blocking send would wait for the reader).
  std::future<void> completing = std::async(std::launch::async, [&] {
    outbox.Complete(outbox.Reserve(), Text(big, &sent));
    outbox.Complete(outbox.Reserve(), Text("behind", &sent));
  });
  ASSERT_EQ(completing.wait_for(std::chrono::seconds(30)),
            std::future_status::ready);
  EXPECT_TRUE(outbox.wants_write());
  EXPECT_EQ(sent.load(), 0);
  pollfd woken = {outbox.wake_fd(), POLLIN, 0};
  EXPECT_EQ(poll(&woken, 1, 0), 1);

  // The connection's thread sends the rest as the reader drains it.
  std::thread owner([&] {
    while (outbox.wants_write()) {
      pollfd writable = {server_, POLLOUT, 0};
      ASSERT_GE(poll(&writable, 1, 10000), 0);
      ASSERT_TRUE(outbox.OwnerFlush(absl::Seconds(30)).ok());
    }
  });
  EXPECT_EQ(ReadAnswer(), big);
  EXPECT_EQ(ReadAnswer(), "behind");
  owner.join();
  EXPECT_EQ(sent.load(), 2);
  EXPECT_FALSE(outbox.wants_write());
  outbox.Close();
}

TEST_F(OutboxTest, APeerThatReadsNothingIsCutOffByTheStallLimit) {
  ASSERT_TRUE(ShrinkSendBuffer());
  Outbox outbox(server_);
  outbox.Complete(outbox.Reserve(), Text(std::string(4 << 20, 'x')));
  ASSERT_TRUE(outbox.wants_write());
  EXPECT_TRUE(outbox.OwnerFlush(absl::Seconds(30)).ok());
  // Not DEADLINE_EXCEEDED: a reader takes that for an idle peer.
  const absl::Status stalled = outbox.OwnerFlush(absl::ZeroDuration());
  EXPECT_TRUE(absl::IsAborted(stalled)) << stalled;
  outbox.Close();
}

TEST_F(OutboxTest, AnAnswerMissingLongPastItsDeadlineEndsTheConnection) {
  Outbox outbox(server_);
  const uint64_t overdue = outbox.Reserve(absl::Now() - absl::Seconds(10));
  EXPECT_EQ(outbox.outstanding(), 1);
  EXPECT_LE(outbox.next_check(absl::Seconds(30)), absl::Now());
  const absl::Status broken = outbox.OwnerFlush(absl::Seconds(30));
  EXPECT_TRUE(absl::IsInternal(broken)) << broken;
  // Answered after all: nothing is overdue any more.
  outbox.Complete(overdue, Text("late"));
  EXPECT_TRUE(outbox.OwnerFlush(absl::Seconds(30)).ok());
  EXPECT_EQ(outbox.outstanding(), 0);
  EXPECT_EQ(ReadAnswer(), "late");
  outbox.Close();
}

TEST_F(OutboxTest, FlushBeforeCloseSendsWhatIsStillDue) {
  ASSERT_TRUE(ShrinkSendBuffer());
  Outbox outbox(server_);
  const std::string big(4 << 20, 'x');
  outbox.Complete(outbox.Reserve(), Text(big));
  const uint64_t pending = outbox.Reserve(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(outbox.wants_write());
  // The peer has closed its sending side but reads; the pending answer
  // comes from another thread meanwhile.
  std::thread reader([&] {
    EXPECT_EQ(ReadAnswer(), big);
    EXPECT_EQ(ReadAnswer(), "pending");
  });
  std::thread completing([&] { outbox.Complete(pending, Text("pending")); });
  outbox.FlushBeforeClose(absl::Now() + absl::Seconds(30));
  EXPECT_EQ(outbox.outstanding(), 0);
  completing.join();
  reader.join();
  outbox.Close();
}

TEST_F(OutboxTest, AVanishedPeerBreaksTheConnectionAndLaterAnswersAreDropped) {
  Outbox outbox(server_);
  close(client_);
  client_ = -1;
  std::atomic<int> sent{0};
  outbox.Complete(outbox.Reserve(), Text("lost", &sent));
  EXPECT_EQ(sent.load(), 0);
  const absl::Status broken = outbox.OwnerFlush(absl::Seconds(30));
  EXPECT_FALSE(broken.ok());
  outbox.Complete(outbox.Reserve(), Text("after", &sent));
  EXPECT_EQ(sent.load(), 0);
  outbox.Close();
}

TEST_F(OutboxTest, AnswersCompletedAfterCloseAreNeitherSentNorCounted) {
  auto outbox = std::make_shared<Outbox>(server_);
  const uint64_t pending = outbox->Reserve();
  outbox->Close();
  std::atomic<int> sent{0};
  outbox->Complete(pending, Text("late", &sent));
  EXPECT_EQ(sent.load(), 0);
  pollfd readable = {client_, POLLIN, 0};
  EXPECT_EQ(poll(&readable, 1, 0), 0);
}

}  // namespace
}  // namespace pstrain
