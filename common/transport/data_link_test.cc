// RunExchanges: its window (a link sends a request only while fewer than
// `requests_in_flight` earlier ones are unanswered) and the grace of an
// exchange that follows another. The peers are minimal data-plane servers
// on loopback that answer by hand, so the test sees exactly which request
// bytes had arrived before they answered.
#include "common/transport/data_link.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
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

// Reads and answers the Hellos a new link sends.
void AnswerHellos(int fd) {
  for (int i = 0; i < kHellosTimed; ++i) {
    ReadRequest(fd);
    Answer(fd, "");
  }
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
    AnswerHellos(fd);
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
  // 127.0.0.1: this host. (A server elsewhere gets what its round trip
  // carries, WindowBytesForRoundTrip: the netns lab shows it,
  // bench/netns/link_speed.sh and fault_trials.sh's delay20.)
  EXPECT_EQ(NextRequestSeenBeforeEachAnswer(kWindowByHost),
            (std::vector<bool>{true, true}));
}

TEST(DataLinkTest, TheWindowByHostSendsLargeRequestsOneAtATime) {
  // Two of them do not fit in kSameHostBytesInFlight.
  EXPECT_EQ(NextRequestSeenBeforeEachAnswer(kWindowByHost,
                                            kSameHostBytesInFlight * 3 / 4),
            (std::vector<bool>{false, false}));
}

// The Hello's round trip is what the application waits for, however slow
// the server is to answer (a proxy's or a WAN's delay): the window of a link
// to another host is sized by it.
TEST(DataLinkTest, TheHelloRoundTripIncludesTheServersDelay) {
  int port = 0;
  absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0, 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  constexpr absl::Duration kDelay = absl::Milliseconds(30);
  std::thread server([&] {
    const int fd = accept(listener->get(), nullptr, nullptr);
    ASSERT_GE(fd, 0);
    for (int i = 0; i < kHellosTimed; ++i) {
      ReadRequest(fd);
      absl::SleepFor(kDelay);  // the delay under test, not a synchronisation
      Answer(fd, "");
    }
    close(fd);
  });
  absl::StatusOr<std::unique_ptr<DataLink>> link = DataLink::Open(
      "127.0.0.1", port, "", 1 << 20, absl::Now() + absl::Seconds(20));
  server.join();
  ASSERT_TRUE(link.ok()) << link.status();
  EXPECT_GE((*link)->hello_round_trip(), kDelay);
}

TEST(WindowBytesForRoundTripTest, OneRequestInADataCentreMegabytesAcrossAWan) {
  EXPECT_EQ(WindowBytesForRoundTrip(absl::Microseconds(100)), 0);
  EXPECT_EQ(WindowBytesForRoundTrip(kShortRoundTrip), 0);
  // 40 ms (20 each way): 39 ms at 1 Gbit/s.
  EXPECT_NEAR(
      static_cast<double>(WindowBytesForRoundTrip(absl::Milliseconds(40))),
      0.039 * kAssumedLinkBytesPerSecond, 1);
}

// A data-plane server on loopback that takes one connection, answers its
// Hellos and then runs `serve` on it (the thread is joined on destruction).
class OneConnectionServer {
 public:
  explicit OneConnectionServer(std::function<void(int fd)> serve) {
    absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0, 0, &port_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return;
    listener_ = std::move(*listener);
    thread_ = std::thread([this, serve = std::move(serve)] {
      const int fd = accept(listener_.get(), nullptr, nullptr);
      ASSERT_GE(fd, 0);
      AnswerHellos(fd);
      serve(fd);
      close(fd);
    });
  }
  ~OneConnectionServer() {
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }

 private:
  int port_ = 0;
  ScopedFd listener_;
  std::thread thread_;
};

// One that reads one request and answers it once `answer` is notified
// (never, if it is not by the time the test ends it).
class HeldServer {
 public:
  HeldServer()
      : server_([this](int fd) {
          ReadRequest(fd);
          request_read_.Notify();
          if (answer_.WaitForNotificationWithTimeout(absl::Seconds(30)) &&
              answers_) {
            Answer(fd, "ok");
          }
          done_.WaitForNotificationWithTimeout(absl::Seconds(30));
        }) {}
  ~HeldServer() {
    if (!answer_.HasBeenNotified()) answer_.Notify();
    done_.Notify();
  }

  int port() const { return server_.port(); }
  void WaitForRequest() {
    ASSERT_TRUE(
        request_read_.WaitForNotificationWithTimeout(absl::Seconds(20)));
  }
  void AnswerNow() { answer_.Notify(); }
  // The request is never answered (the server went silent).
  void NeverAnswer() { answers_ = false; }

 private:
  bool answers_ = true;  // set before the thread may read it: by AnswerNow
  absl::Notification request_read_, answer_, done_;
  OneConnectionServer server_;  // last: its thread uses the members above
};

// Exchange 0 goes to `first`, exchange 1 (after = 0, `grace`) to `second`;
// `first` answers as soon as both requests are in. Returns exchange 1's
// status and how long RunExchanges took.
std::pair<absl::Status, absl::Duration> ExchangeAfterAnother(
    HeldServer& first, HeldServer& second, absl::Duration grace) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<DataLink>> a =
      DataLink::Open("127.0.0.1", first.port(), "", 1 << 20, deadline);
  absl::StatusOr<std::unique_ptr<DataLink>> b =
      DataLink::Open("127.0.0.1", second.port(), "", 1 << 20, deadline);
  EXPECT_TRUE(a.ok() && b.ok());
  if (!a.ok() || !b.ok()) return {absl::InternalError("no links"), {}};
  std::vector<DataExchange> exchanges(2);
  exchanges[0].link = a->get();
  exchanges[1].link = b->get();
  exchanges[1].after = 0;
  exchanges[1].grace = grace;
  for (DataExchange& e : exchanges) e.body = {"req"};
  std::thread answer_first([&] {
    first.WaitForRequest();
    second.WaitForRequest();
    first.AnswerNow();
  });
  const absl::Time start = absl::Now();
  RunExchanges(absl::MakeSpan(exchanges), deadline);
  const absl::Duration took = absl::Now() - start;
  answer_first.join();
  EXPECT_TRUE(exchanges[0].status.ok()) << exchanges[0].status;
  return {exchanges[1].status, took};
}

TEST(DataLinkTest, AnExchangeAfterAnotherFailsOnceItsGraceIsOut) {
  HeldServer first, second;
  second.NeverAnswer();
  const auto [status, took] =
      ExchangeAfterAnother(first, second, absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(status)) << status;
  EXPECT_NE(status.message().find("grace"), absl::string_view::npos) << status;
  // Far sooner than the 20 s deadline: the grace bounded the wait.
  EXPECT_LT(took, absl::Seconds(10));
}

TEST(DataLinkTest, AnExchangeAfterAnotherAnsweredWithinItsGraceSucceeds) {
  HeldServer first, second;
  second.AnswerNow();  // answers as soon as its request is in
  const auto [status, took] =
      ExchangeAfterAnother(first, second, absl::Seconds(10));
  EXPECT_TRUE(status.ok()) << status;
}

// An exchange whose link is aborted under it (PsClient::Interrupt) fails
// as interrupted, not as a server that closed the connection.
TEST(DataLinkTest, AnAbortedExchangeFailsAsInterrupted) {
  HeldServer server;
  server.NeverAnswer();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<DataLink>> link =
      DataLink::Open("127.0.0.1", server.port(), "", 1 << 20, deadline);
  ASSERT_TRUE(link.ok()) << link.status();
  std::vector<DataExchange> exchanges(1);
  exchanges[0].link = link->get();
  exchanges[0].body = {"req"};
  std::thread interrupter([&] {
    server.WaitForRequest();
    (*link)->Abort();
  });
  RunExchanges(absl::MakeSpan(exchanges), deadline);
  interrupter.join();
  EXPECT_TRUE(absl::IsCancelled(exchanges[0].status)) << exchanges[0].status;
  EXPECT_NE(exchanges[0].status.message().find(
                "interrupted by this process while waiting for its answer"),
            absl::string_view::npos)
      << exchanges[0].status;
  EXPECT_FALSE((*link)->usable());
}

// One aborted before its request has all left says so: a push cut there
// did not go in whole. The server never reads past the Hellos, so 64 MiB
// cannot all leave, whenever the abort comes.
TEST(DataLinkTest, AnExchangeAbortedWhileSendingSaysItsRequestDidNotAllLeave) {
  absl::Notification end;
  OneConnectionServer server(
      [&](int fd) { end.WaitForNotificationWithTimeout(absl::Seconds(30)); });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<DataLink>> link =
      DataLink::Open("127.0.0.1", server.port(), "", 1 << 20, deadline);
  ASSERT_TRUE(link.ok()) << link.status();
  const std::string body(64 << 20, 'g');
  std::vector<DataExchange> exchanges(1);
  exchanges[0].link = link->get();
  exchanges[0].method = data_plane::Method::kPush;
  exchanges[0].body = {body};
  std::thread interrupter([&] { (*link)->Abort(); });
  RunExchanges(absl::MakeSpan(exchanges), deadline);
  interrupter.join();
  end.Notify();
  EXPECT_TRUE(absl::IsCancelled(exchanges[0].status)) << exchanges[0].status;
  EXPECT_NE(exchanges[0].status.message().find("did not go in whole"),
            absl::string_view::npos)
      << exchanges[0].status;
}

// When the requests of AnsweringThreads may be sent.
enum class Made {
  kAtOnce,
  // As the pipelined step's: each waits for a flag, which another thread
  // sets 200 ms into the call, waking it through one eventfd.
  kLater,
  // The first link's request at once, the others' later: the calling
  // thread (which drives link 0) is done before the others may send.
  kFirstAtOnce,
};

struct Answered {
  std::vector<std::thread::id> threads;  // where each on_response ran
  std::vector<pid_t> thread_ids;         // the same, as the kernel's ids
  std::vector<absl::Status> statuses;
  absl::Duration took;
};

// One exchange on each of `links` links to servers that answer at once,
// each request `body_bytes` long.
Answered AnsweringThreads(int links, size_t body_bytes, Made made) {
  std::vector<std::unique_ptr<HeldServer>> servers;
  std::vector<std::unique_ptr<DataLink>> opened;
  const absl::Time open_by = absl::Now() + absl::Seconds(20);
  for (int i = 0; i < links; ++i) {
    servers.push_back(std::make_unique<HeldServer>());
    servers.back()->AnswerNow();
    absl::StatusOr<std::unique_ptr<DataLink>> link = DataLink::Open(
        "127.0.0.1", servers.back()->port(), "", 1 << 20, open_by);
    EXPECT_TRUE(link.ok()) << link.status();
    if (!link.ok()) return {};
    opened.push_back(std::move(*link));
  }
  const std::string body(body_bytes, 'g');
  ScopedFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  std::atomic<bool> sendable{false};
  Answered answered;
  answered.threads.resize(links);
  answered.thread_ids.resize(links);
  std::vector<DataExchange> exchanges(links);
  for (int i = 0; i < links; ++i) {
    exchanges[i].link = opened[i].get();
    exchanges[i].body = {body};
    exchanges[i].on_response = [&answered, i](absl::string_view) {
      answered.threads[i] = std::this_thread::get_id();
      answered.thread_ids[i] = static_cast<pid_t>(syscall(SYS_gettid));
      return absl::OkStatus();
    };
    if (made == Made::kAtOnce || (made == Made::kFirstAtOnce && i == 0)) {
      continue;
    }
    exchanges[i].can_send = [&sendable] { return sendable.load(); };
    exchanges[i].send_wake_fd = wake.get();
  }
  std::thread maker([&] {
    if (made == Made::kAtOnce) return;
    absl::SleepFor(absl::Milliseconds(200));
    sendable = true;
    const uint64_t one = 1;
    (void)!write(wake.get(), &one, sizeof(one));
  });
  const absl::Time start = absl::Now();
  RunExchanges(absl::MakeSpan(exchanges), start + absl::Seconds(20));
  answered.took = absl::Now() - start;
  maker.join();
  for (const DataExchange& e : exchanges) answered.statuses.push_back(e.status);
  return answered;
}

void ExpectAllOkSoon(const Answered& answered) {
  for (const absl::Status& status : answered.statuses) {
    EXPECT_TRUE(status.ok()) << status;
  }
  // Woken when the bodies were made, not by the 20 s deadline.
  EXPECT_LT(answered.took, absl::Seconds(10));
}

// The kernel copies a socket's bytes on the thread that sends or receives
// them: large requests on several plaintext links are driven by several
// threads, so one core does not copy them all; the pipelined step's too,
// each thread woken when a body is made.
TEST(DataLinkTest, LargeExchangesOnSeveralLinksRunOnSeveralThreads) {
  for (const Made made : {Made::kAtOnce, Made::kLater}) {
    const Answered answered =
        AnsweringThreads(2, kPlaintextThreadsFromBytes / 2, made);
    ExpectAllOkSoon(answered);
    ASSERT_EQ(answered.threads.size(), 2u);
    EXPECT_NE(answered.threads[0], answered.threads[1]);
  }
}

// The helpers are kept from call to call (starting a thread for each cost
// a fifth of a 1 MiB pull): calls one after another find the same few. The
// kernel's thread ids, unlike std::thread::id, are not handed again to the
// next thread started.
TEST(DataLinkTest, HelperThreadsAreKeptFromCallToCall) {
  const pid_t caller = static_cast<pid_t>(syscall(SYS_gettid));
  std::set<pid_t> helpers;
  for (int call = 0; call < 8; ++call) {
    const Answered answered =
        AnsweringThreads(2, kPlaintextThreadsFromBytes / 2, Made::kAtOnce);
    ExpectAllOkSoon(answered);
    for (pid_t id : answered.thread_ids) {
      if (id != caller) helpers.insert(id);
    }
  }
  // Each call needs one, and the last one is idle again well before the
  // next call (which first starts two servers): one, or a few where a call
  // came before it was; one per call without the keeping.
  EXPECT_GE(helpers.size(), 1u);
  EXPECT_LE(helpers.size(), 4u);
}

// A child made by fork (a PyTorch DataLoader's worker) has none of its
// parent's helpers: its large calls get helpers of its own, not a wait
// for threads that are not there.
TEST(DataLinkTest, AForkedChildsCallsGetHelpersOfItsOwn) {
  ExpectAllOkSoon(
      AnsweringThreads(2, kPlaintextThreadsFromBytes / 2, Made::kAtOnce));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const Answered answered =
        AnsweringThreads(2, kPlaintextThreadsFromBytes / 2, Made::kAtOnce);
    bool ok = answered.statuses.size() == 2 &&
              answered.threads[0] != answered.threads[1];
    for (const absl::Status& status : answered.statuses) ok &= status.ok();
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  pid_t ended = 0;
  while ((ended = waitpid(child, &status, WNOHANG)) == 0 &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));  // polling a child; bounded
  }
  if (ended == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the forked child's call did not end in 30 s";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A streamed call on more links than threads, and one whose calling
// thread is done before a helper's link may send: each helper is woken
// through the calling thread, which goes on relaying after its own links
// are done.
TEST(DataLinkTest, AStreamedCallEndsWhenItsBodiesAreMade) {
  const Answered many =
      AnsweringThreads(6, kPlaintextThreadsFromBytes / 4, Made::kLater);
  ExpectAllOkSoon(many);
  EXPECT_GT(std::set<std::thread::id>(many.threads.begin(), many.threads.end())
                .size(),
            1u);
  const Answered first =
      AnsweringThreads(2, kPlaintextThreadsFromBytes / 2, Made::kFirstAtOnce);
  ExpectAllOkSoon(first);
  EXPECT_NE(first.threads[0], first.threads[1]);
}

// Bodies never made: every thread's links fail at the call's deadline, and
// the call ends there.
TEST(DataLinkTest, AStreamedCallOnSeveralThreadsEndsAtItsDeadline) {
  std::vector<std::unique_ptr<OneConnectionServer>> servers;
  std::vector<std::unique_ptr<DataLink>> links;
  std::vector<DataExchange> exchanges(4);
  const std::string body(kPlaintextThreadsFromBytes / 2, 'g');
  ScopedFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  for (DataExchange& e : exchanges) {
    // Reads until its peer closes, answering nothing.
    servers.push_back(std::make_unique<OneConnectionServer>([](int fd) {
      char sink[4096];
      while (recv(fd, sink, sizeof(sink), 0) > 0) {
      }
    }));
    absl::StatusOr<std::unique_ptr<DataLink>> link =
        DataLink::Open("127.0.0.1", servers.back()->port(), "", 1 << 20,
                       absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(link.ok()) << link.status();
    links.push_back(std::move(*link));
    e.link = links.back().get();
    e.body = {body};
    e.can_send = [] { return false; };
    e.send_wake_fd = wake.get();
  }
  const absl::Time start = absl::Now();
  RunExchanges(absl::MakeSpan(exchanges), start + absl::Seconds(1));
  const absl::Duration took = absl::Now() - start;
  for (const DataExchange& e : exchanges) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(e.status)) << e.status;
  }
  EXPECT_GE(took, absl::Milliseconds(990));
  EXPECT_LT(took, absl::Seconds(3));  // no thread left waiting past it
  links.clear();  // the servers read until their peer closes
}

// Smaller ones would pay more for waking a thread than they save: tiny
// requests, and large ones that add up to less than
// kPlaintextThreadsFromBytes.
TEST(DataLinkTest, SmallerExchangesStayOnTheCallingThread) {
  for (const size_t body_bytes :
       {size_t{1000}, size_t{kPlaintextThreadsFromBytes / 4}}) {
    for (const Made made : {Made::kAtOnce, Made::kLater}) {
      const Answered answered = AnsweringThreads(2, body_bytes, made);
      ExpectAllOkSoon(answered);
      for (const std::thread::id& id : answered.threads) {
        EXPECT_EQ(id, std::this_thread::get_id()) << body_bytes << " bytes";
      }
    }
  }
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
