// Test helpers for the operations endpoints: a minimal HTTP/1.0 GET over a
// plain socket (so the tests need no HTTP client), a lookup in Prometheus'
// text format, and a free loopback port.
#ifndef PSTRAIN_TESTS_HTTP_UTIL_H_
#define PSTRAIN_TESTS_HTTP_UTIL_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pstrain::testing {

struct HttpResponse {
  int status = 0;  // 200, 404, ...
  std::string headers;
  std::string body;
};

// GET http://127.0.0.1:<port><path>, every step bounded by `timeout`.
absl::StatusOr<HttpResponse> HttpGet(
    int port, const std::string& path,
    absl::Duration timeout = absl::Seconds(10));

// The value of the sample `name` whose labels are exactly `labels` in a
// /metrics page (text format 0.0.4), or NotFound listing the samples of
// that name.
absl::StatusOr<double> MetricValue(
    const std::string& page, const std::string& name,
    const std::map<std::string, std::string>& labels = {});

// A TCP port on 127.0.0.1 that was free a moment ago (bound, then closed).
int FreePort();

// Reads an integer port from `path` once it appears, or fails at `timeout`.
absl::StatusOr<int> WaitForPortFile(const std::string& path,
                                    absl::Duration timeout);

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_HTTP_UTIL_H_
