// RunExchanges' window: a link sends a request only while fewer than
// `requests_in_flight` earlier ones are unanswered. The peer is a minimal
// data-plane server on loopback that answers by hand, so the test sees
// exactly which request bytes had arrived before it answered.
#include "common/transport/data_link.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/transport/data_plane.h"
#include "common/transport/socket.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using data_plane::kRequestHeaderBytes;
using data_plane::kResponseHeaderBytes;

// Reads one request; returns its body.
std::string ReadRequest(int fd) {
  char header[kRequestHeaderBytes];
  EXPECT_TRUE(RecvAll(fd, header, sizeof(header)).ok());
  absl::StatusOr<data_plane::RequestHeader> decoded =
      data_plane::DecodeRequestHeader(header, 1 << 20);
  EXPECT_TRUE(decoded.ok()) << decoded.status();
  std::string body(decoded.ok() ? decoded->body_bytes : 0, '\0');
  EXPECT_TRUE(RecvAll(fd, body.data(), body.size()).ok());
  return body;
}

void Answer(int fd, const std::string& body) {
  char header[kResponseHeaderBytes];
  data_plane::ResponseHeader response;
  response.body_bytes = body.size();
  data_plane::EncodeResponseHeader(response, header);
  ASSERT_TRUE(SendAll(fd, header, sizeof(header)).ok());
  ASSERT_TRUE(SendAll(fd, body.data(), body.size()).ok());
}

// Whether any byte arrives on `fd` within `wait` (a bounded look for
// something that must not come, or must).
bool BytesArrive(int fd, absl::Duration wait) {
  pollfd p = {fd, POLLIN, 0};
  return poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait))) > 0;
}

// Three pushes on one link with the given window; returns, for each
// request the server answers in turn, whether the next request's bytes had
// already arrived before that answer.
std::vector<bool> NextRequestSeenBeforeEachAnswer(size_t requests_in_flight,
                                                  size_t body_bytes = 1000) {
  int port = 0;
  absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0, 0, &port);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return {};
  std::vector<bool> seen;
  std::thread server([&] {
    const int fd = accept(listener->get(), nullptr, nullptr);
    ASSERT_GE(fd, 0);
    ReadRequest(fd);  // the Hello
    Answer(fd, "");
    ReadRequest(fd);
    for (int k = 0; k < 3; ++k) {
      if (k < 2) seen.push_back(BytesArrive(fd, absl::Milliseconds(300)));
      Answer(fd, "ok");
      if (k < 2) ReadRequest(fd);
    }
    close(fd);
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<DataLink>> link =
      DataLink::Open("127.0.0.1", port, "", 1 << 20, deadline);
  EXPECT_TRUE(link.ok()) << link.status();
  if (link.ok()) {
    const std::string body(body_bytes, 'g');
    std::vector<DataExchange> exchanges(3);
    for (DataExchange& e : exchanges) {
      e.link = link->get();
      e.method = data_plane::Method::kPush;
      e.body = {body};
    }
    RunExchanges(absl::MakeSpan(exchanges), deadline, requests_in_flight);
    for (const DataExchange& e : exchanges) EXPECT_TRUE(e.status.ok());
  }
  server.join();
  return seen;
}

TEST(DataLinkTest, OneRequestInFlightWaitsForEachAnswer) {
  EXPECT_EQ(NextRequestSeenBeforeEachAnswer(1),
            (std::vector<bool>{false, false}));
}

TEST(DataLinkTest, AWiderWindowSendsAheadOfTheAnswers) {
  EXPECT_EQ(NextRequestSeenBeforeEachAnswer(2),
            (std::vector<bool>{true, true}));
}

TEST(DataLinkTest, TheWindowByHostSendsEverythingToAServerOnThisHost) {
  // 127.0.0.1: this host. (A server elsewhere gets a window of one: the
  // netns lab shows it, bench/netns/link_speed.sh.)
  EXPECT_EQ(NextRequestSeenBeforeEachAnswer(kWindowByHost),
            (std::vector<bool>{true, true}));
}

TEST(DataLinkTest, TheWindowByHostSendsLargeRequestsOneAtATime) {
  // Two of them do not fit in kSameHostBytesInFlight.
  EXPECT_EQ(NextRequestSeenBeforeEachAnswer(kWindowByHost,
                                            kSameHostBytesInFlight * 3 / 4),
            (std::vector<bool>{false, false}));
}

TEST(ConnectsToThisHostTest, LoopbackIsThisHostAndAUnixSocketIsNot) {
  int port = 0;
  absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0, 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<ScopedFd> connected =
      ConnectTcp("127.0.0.1", port, 0, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(connected.ok()) << connected.status();
  EXPECT_TRUE(ConnectsToThisHost(connected->get()));
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_FALSE(ConnectsToThisHost(pair[0]));
  close(pair[0]);
  close(pair[1]);
}

}  // namespace
}  // namespace pstrain
