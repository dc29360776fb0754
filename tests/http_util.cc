#include "tests/http_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace pstrain::testing {
namespace {

// Parses `{a="x",b="y"}` (no escaped quotes: pstrain's label values have
// none).
std::map<std::string, std::string> ParseLabels(absl::string_view text) {
  std::map<std::string, std::string> labels;
  absl::ConsumePrefix(&text, "{");
  absl::ConsumeSuffix(&text, "}");
  for (absl::string_view pair :
       absl::StrSplit(text, "\",", absl::SkipEmpty())) {
    const size_t eq = pair.find("=\"");
    if (eq == absl::string_view::npos) continue;
    absl::string_view value = pair.substr(eq + 2);
    absl::ConsumeSuffix(&value, "\"");
    labels[std::string(pair.substr(0, eq))] = std::string(value);
  }
  return labels;
}

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path,
                                     absl::Duration timeout) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    const std::string error = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("connect 127.0.0.1:", port, ": ", error));
  }
  const std::string request =
      absl::StrCat("GET ", path,
                   " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string reply;
  char buffer[8192];
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      close(fd);
      return absl::DeadlineExceededError("reading the response timed out");
    }
    if (n == 0) break;  // Connection: close ends the body
    reply.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const size_t end = reply.find("\r\n\r\n");
  if (end == std::string::npos) {
    return absl::DataLossError(absl::StrCat("no HTTP header in: ", reply));
  }
  HttpResponse response;
  response.headers = reply.substr(0, end);
  response.body = reply.substr(end + 4);
  // "HTTP/1.0 200 OK"
  const std::vector<std::string> words = absl::StrSplit(
      response.headers.substr(0, response.headers.find('\r')), ' ');
  if (words.size() < 2 || !absl::SimpleAtoi(words[1], &response.status)) {
    return absl::DataLossError(
        absl::StrCat("bad status line: ", response.headers));
  }
  return response;
}

absl::StatusOr<double> MetricValue(
    const std::string& page, const std::string& name,
    const std::map<std::string, std::string>& labels) {
  std::string seen;
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos ||
        line.substr(0, name_end) != name) {
      continue;
    }
    absl::string_view rest = line.substr(name_end);
    std::map<std::string, std::string> line_labels;
    if (absl::StartsWith(rest, "{")) {
      const size_t close = rest.find('}');
      line_labels = ParseLabels(rest.substr(0, close + 1));
      rest = rest.substr(close + 1);
    }
    absl::StrAppend(&seen, "\n  ", line);
    if (line_labels != labels) continue;
    double value = 0;
    absl::string_view number = absl::StripAsciiWhitespace(rest);
    number = number.substr(0, number.find(' '));  // a timestamp may follow
    if (!absl::SimpleAtod(number, &value)) {
      return absl::DataLossError(absl::StrCat("not a number: ", line));
    }
    return value;
  }
  return absl::NotFoundError(absl::StrCat(
      "no sample ", name,
      " with the labels asked for; seen:", seen.empty() ? " none" : seen));
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

absl::StatusOr<int> WaitForPortFile(const std::string& path,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    int port = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text.str()), &port) &&
        port > 0) {
      return port;
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no port in ", path, " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

}  // namespace pstrain::testing
