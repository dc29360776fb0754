// ps_bench's report (ps_bench.h): one Row per size and repeat, the median
// row over repeats, and the tables and JSON lines printed from them.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/transport/ps_bench.h"

namespace pstrain::bench::ps_bench {
namespace {

std::string HumanSize(int64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) {
    return absl::StrCat(bytes >> 20, " MiB");
  }
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) {
    return absl::StrCat(bytes >> 10, " KiB");
  }
  return absl::StrCat(bytes, " B");
}

// Every measured field of Row, for combining repeats.
constexpr double Row::*kRowFields[] = {
    &Row::tcp_gbps,
    &Row::tcp_oneway_gbps,
    &Row::tcp_rtt_p50_us,
    &Row::tcp_rtt_p99_us,
    &Row::grpc_floor_gbps,
    &Row::grpc_floor_p50_us,
    &Row::grpc_floor_p99_us,
    &Row::ps_push_gbps,
    &Row::ps_pull_gbps,
    &Row::ps_pushpull_gbps,
    &Row::ps_one_call_gbps,
    &Row::ps_push_p50_us,
    &Row::ps_push_p99_us,
    &Row::ratio_pushpull_vs_tcp,
    &Row::ratio_pushpull_vs_tcp_oneway,
    &Row::ratio_pushpull_vs_grpc,
    &Row::ratio_push_p50_vs_tcp_rtt,
    &Row::ratio_one_call_vs_tcp,
    &Row::tls_one_call_gbps,
    &Row::tls_grpc_one_call_gbps,
    &Row::tls_push_p50_us,
    &Row::tls_grpc_push_p50_us,
    &Row::ratio_tls_vs_plain_one_call,
    &Row::ratio_tls_vs_tls_grpc_one_call,
    &Row::ratio_tls_vs_plain_push_p50,
    &Row::ratio_tls_one_call_vs_tcp,
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  if (n == 0) return 0;
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

}  // namespace

// Field by field median of the repeats of one size. Ratios too are medians
// of the per-repeat ratios (each from baselines measured next to the PS),
// not ratios of medians.
Row MedianRow(const std::vector<Row>& repeats) {
  Row row = repeats.front();
  for (double Row::*field : kRowFields) {
    std::vector<double> values;
    for (const Row& r : repeats) values.push_back(r.*field);
    row.*field = Median(std::move(values));
  }
  row.ps_pushpull_ops = 0;
  for (const Row& r : repeats) row.ps_pushpull_ops += r.ps_pushpull_ops;
  row.repeats = static_cast<int>(repeats.size());
  return row;
}

Row MakeRow(const SizeResult& r) {
  const double n = static_cast<double>(r.size);
  Row row;
  row.size = r.size;
  row.tcp_gbps = r.tcp_pushpull.Gbps(2 * n);
  // N out per round trip of the RTT phase: close to a one-way stream (what
  // iperf3 reports) once N dwarfs the ack.
  row.tcp_oneway_gbps = r.tcp_rtt.Gbps(n);
  row.tcp_rtt_p50_us = r.tcp_rtt.PercentileUs(50);
  row.tcp_rtt_p99_us = r.tcp_rtt.PercentileUs(99);
  row.grpc_floor_gbps = r.grpc_floor.Gbps(2 * n);
  row.grpc_floor_p50_us = r.grpc_floor.PercentileUs(50);
  row.grpc_floor_p99_us = r.grpc_floor.PercentileUs(99);
  row.ps_push_gbps = r.ps.push.Gbps(n);
  row.ps_pull_gbps = r.ps.pull.Gbps(n);
  row.ps_pushpull_gbps = r.ps.pushpull.Gbps(2 * n);
  row.ps_one_call_gbps = r.ps.one_call.Gbps(2 * n);
  row.ps_push_p50_us = r.ps.push.PercentileUs(50);
  row.ps_push_p99_us = r.ps.push.PercentileUs(99);
  if (r.tls.one_call.operations > 0) {
    row.tls_one_call_gbps = r.tls.one_call.Gbps(2 * n);
    row.tls_grpc_one_call_gbps = r.tls_grpc.one_call.Gbps(2 * n);
    row.tls_push_p50_us = r.tls.push.PercentileUs(50);
    row.tls_grpc_push_p50_us = r.tls_grpc.push.PercentileUs(50);
    row.ratio_tls_vs_plain_one_call =
        Ratio(row.tls_one_call_gbps, row.ps_one_call_gbps);
    row.ratio_tls_vs_tls_grpc_one_call =
        Ratio(row.tls_one_call_gbps, row.tls_grpc_one_call_gbps);
    row.ratio_tls_vs_plain_push_p50 =
        Ratio(row.tls_push_p50_us, row.ps_push_p50_us);
    row.ratio_tls_one_call_vs_tcp = Ratio(row.tls_one_call_gbps, row.tcp_gbps);
  }
  row.ratio_pushpull_vs_tcp = Ratio(row.ps_pushpull_gbps, row.tcp_gbps);
  row.ratio_pushpull_vs_tcp_oneway =
      Ratio(row.ps_pushpull_gbps, row.tcp_oneway_gbps);
  row.ratio_pushpull_vs_grpc = Ratio(row.ps_pushpull_gbps, row.grpc_floor_gbps);
  row.ratio_push_p50_vs_tcp_rtt = Ratio(row.ps_push_p50_us, row.tcp_rtt_p50_us);
  row.ratio_one_call_vs_tcp = Ratio(row.ps_one_call_gbps, row.tcp_gbps);
  row.ps_pushpull_ops = r.ps.pushpull.operations;
  return row;
}

std::string TableHeader() {
  return absl::StrFormat(
      "%8s | %8s %8s | %8s %8s %8s %8s | %7s %7s %7s | %17s %17s %17s | "
      "%7s\n"
      "%8s | %8s %8s | %8s %8s %8s %8s | %7s %7s %7s | %17s %17s %17s | "
      "%7s\n",
      "size", "TCP p+p", "gRPC", "PS push", "PS pull", "PS p+p", "PS 1call",
      "p+p/", "p+p/", "1call/", "TCP RTT", "gRPC floor p+p", "PS push", "push/",
      "", "GB/s", "floor", "GB/s", "GB/s", "GB/s", "GB/s", "TCP", "gRPC", "TCP",
      "p50/p99 us", "p50/p99 us", "p50/p99 us", "RTT p50");
}

std::string TableRow(const Row& r) {
  auto pair = [](double p50, double p99) {
    return absl::StrFormat("%.0f/%.0f", p50, p99);
  };
  return absl::StrFormat(
      "%8s | %8.3f %8.3f | %8.3f %8.3f %8.3f %8.3f | %7.3f %7.3f %7.3f | %17s "
      "%17s %17s | %7.2f\n",
      HumanSize(r.size), r.tcp_gbps, r.grpc_floor_gbps, r.ps_push_gbps,
      r.ps_pull_gbps, r.ps_pushpull_gbps, r.ps_one_call_gbps,
      r.ratio_pushpull_vs_tcp, r.ratio_pushpull_vs_grpc,
      r.ratio_one_call_vs_tcp, pair(r.tcp_rtt_p50_us, r.tcp_rtt_p99_us),
      pair(r.grpc_floor_p50_us, r.grpc_floor_p99_us),
      pair(r.ps_push_p50_us, r.ps_push_p99_us), r.ratio_push_p50_vs_tcp_rtt);
}

std::string JsonLine(const Row& r, int servers, int clients) {
  return absl::StrFormat(
      "{\"bench\":\"ps_bench\",\"size\":%d,\"servers\":%d,\"clients\":%d,"
      "\"block_elements\":%d,"
      "\"tcp_gbps\":%.4f,\"tcp_oneway_gbps\":%.4f,\"tcp_rtt_p50_us\":%.1f,"
      "\"tcp_rtt_p99_us\":%.1f,"
      "\"grpc_floor_gbps\":%.4f,\"grpc_floor_p50_us\":%.1f,"
      "\"grpc_floor_p99_us\":%.1f,"
      "\"ps_push_gbps\":%.4f,\"ps_pull_gbps\":%.4f,\"ps_pushpull_gbps\":%.4f,"
      "\"ps_push_p50_us\":%.1f,\"ps_push_p99_us\":%.1f,"
      "\"ratio_pushpull_vs_tcp\":%.4f,\"ratio_pushpull_vs_tcp_oneway\":%.4f,"
      "\"ratio_pushpull_vs_grpc\":%.4f,"
      "\"ratio_push_p50_vs_tcp_rtt\":%.4f,\"ps_pushpull_ops\":%d,"
      "\"ps_one_call_gbps\":%.4f,\"ratio_one_call_vs_tcp\":%.4f,"
      "\"repeats\":%d%s}",
      r.size, servers, clients, BenchSchema(r.size).block_elements(),
      r.tcp_gbps, r.tcp_oneway_gbps, r.tcp_rtt_p50_us, r.tcp_rtt_p99_us,
      r.grpc_floor_gbps, r.grpc_floor_p50_us, r.grpc_floor_p99_us,
      r.ps_push_gbps, r.ps_pull_gbps, r.ps_pushpull_gbps, r.ps_push_p50_us,
      r.ps_push_p99_us, r.ratio_pushpull_vs_tcp, r.ratio_pushpull_vs_tcp_oneway,
      r.ratio_pushpull_vs_grpc, r.ratio_push_p50_vs_tcp_rtt, r.ps_pushpull_ops,
      r.ps_one_call_gbps, r.ratio_one_call_vs_tcp, r.repeats,
      r.tls_one_call_gbps > 0
          ? absl::StrFormat(
                ",\"tls_one_call_gbps\":%.4f,\"tls_grpc_one_call_gbps\":%.4f,"
                "\"tls_push_p50_us\":%.1f,\"tls_grpc_push_p50_us\":%.1f,"
                "\"ratio_tls_vs_plain_one_call\":%.4f,"
                "\"ratio_tls_vs_tls_grpc_one_call\":%.4f,"
                "\"ratio_tls_vs_plain_push_p50\":%.4f,"
                "\"ratio_tls_one_call_vs_tcp\":%.4f",
                r.tls_one_call_gbps, r.tls_grpc_one_call_gbps,
                r.tls_push_p50_us, r.tls_grpc_push_p50_us,
                r.ratio_tls_vs_plain_one_call, r.ratio_tls_vs_tls_grpc_one_call,
                r.ratio_tls_vs_plain_push_p50, r.ratio_tls_one_call_vs_tcp)
          : std::string());
}

// The TLS table (--tls_dir): PushPull on each transport and the ratios the
// goals of issue 25 are stated in.
std::string TlsTableHeader() {
  return absl::StrFormat(
      "%8s | %8s %8s %8s %8s | %8s %8s %8s | %8s %8s %8s | %8s\n"
      "%8s | %8s %8s %8s %8s | %8s %8s %8s | %8s %8s %8s | %8s\n",
      "size", "TCP p+p", "plain", "TLS", "gRPC+TLS", "push p50", "push p50",
      "push p50", "TLS/", "TLS/", "TLS/", "TLS p50/", "", "GB/s", "1call",
      "1call", "1call", "plain us", "TLS us", "g+TLS us", "plain", "gRPC+TLS",
      "TCP", "plain");
}

std::string TlsTableRow(const Row& r) {
  return absl::StrFormat(
      "%8s | %8.3f %8.3f %8.3f %8.3f | %8.0f %8.0f %8.0f | %8.3f %8.3f %8.3f "
      "| %8.2f\n",
      HumanSize(r.size), r.tcp_gbps, r.ps_one_call_gbps, r.tls_one_call_gbps,
      r.tls_grpc_one_call_gbps, r.ps_push_p50_us, r.tls_push_p50_us,
      r.tls_grpc_push_p50_us, r.ratio_tls_vs_plain_one_call,
      r.ratio_tls_vs_tls_grpc_one_call, r.ratio_tls_one_call_vs_tcp,
      r.ratio_tls_vs_plain_push_p50);
}

// min..max over the repeats of the numbers the goals are stated in.
std::string SpreadRow(const std::vector<Row>& repeats) {
  auto range = [&](double Row::*field, const char* format) {
    double lo = repeats.front().*field, hi = lo;
    for (const Row& r : repeats) {
      lo = std::min(lo, r.*field);
      hi = std::max(hi, r.*field);
    }
    return absl::StrCat(absl::StrFormat(absl::ParsedFormat<'f'>(format), lo),
                        "..",
                        absl::StrFormat(absl::ParsedFormat<'f'>(format), hi));
  };
  return absl::StrFormat(
      "%8s | %15s %15s %15s | %13s %13s %13s | %13s %13s\n",
      HumanSize(repeats.front().size), range(&Row::tcp_gbps, "%.3f"),
      range(&Row::tcp_oneway_gbps, "%.3f"),
      range(&Row::ps_pushpull_gbps, "%.3f"),
      range(&Row::ratio_pushpull_vs_tcp, "%.3f"),
      range(&Row::ratio_one_call_vs_tcp, "%.3f"),
      range(&Row::ratio_pushpull_vs_tcp_oneway, "%.3f"),
      range(&Row::tcp_rtt_p50_us, "%.0f"), range(&Row::ps_push_p50_us, "%.0f"));
}

}  // namespace pstrain::bench::ps_bench
