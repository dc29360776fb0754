#include "common/run_output.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pstrain {

std::string FormatEta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t total = static_cast<int64_t>(std::llround(seconds));
  const int64_t h = total / 3600, m = (total / 60) % 60, s = total % 60;
  if (h > 0) return absl::StrFormat("%d:%02d:%02d", h, m, s);
  return absl::StrFormat("%d:%02d", m, s);
}

namespace {

constexpr int kMaxBarWidth = 24;

struct ProgressParts {
  std::string counts;  // " 150/300  50%"
  std::string loss;    // "  loss 0.4123"
  std::string rate;    // "  2310 samples/s"
  std::string eta;     // "  ETA 0:12"
  double fraction = 0;
};

ProgressParts Parts(int64_t step, int64_t steps, double loss,
                    double samples_per_sec, double eta_seconds) {
  ProgressParts p;
  p.fraction =
      steps > 0 ? std::clamp(static_cast<double>(step) / steps, 0.0, 1.0) : 0;
  const int digits = static_cast<int>(absl::StrCat(steps).size());
  p.counts = absl::StrFormat(" %*d/%d %3d%%", digits, step, steps,
                             static_cast<int>(p.fraction * 100));
  p.loss = absl::StrFormat("  loss %.4f", loss);
  p.rate = absl::StrFormat("  %.0f samples/s", samples_per_sec);
  p.eta =
      absl::StrCat("  ETA ", step >= steps ? "0:00" : FormatEta(eta_seconds));
  return p;
}

std::string Bar(double fraction, int width) {
  const int filled = static_cast<int>(fraction * width);
  return absl::StrCat("[", std::string(filled, '#'),
                      std::string(width - filled, '.'), "]");
}

}  // namespace

int TerminalColumns() {
  winsize size{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) {
    return size.ws_col;
  }
  int columns = 0;
  const char* env = std::getenv("COLUMNS");
  if (env != nullptr && absl::SimpleAtoi(env, &columns) && columns > 0) {
    return columns;
  }
  return 80;
}

std::string FormatProgressBar(int64_t step, int64_t steps, double loss,
                              double samples_per_sec, double eta_seconds,
                              int bar_width) {
  if (bar_width == kFitTerminal) {
    return FitProgressBar(step, steps, loss, samples_per_sec, eta_seconds,
                          TerminalColumns());
  }
  const ProgressParts p =
      Parts(step, steps, loss, samples_per_sec, eta_seconds);
  return absl::StrCat(Bar(p.fraction, bar_width), p.counts, p.loss, p.rate,
                      p.eta);
}

std::string FitProgressBar(int64_t step, int64_t steps, double loss,
                           double samples_per_sec, double eta_seconds,
                           int columns) {
  const int room = std::max(columns - 1, 1);
  ProgressParts p = Parts(step, steps, loss, samples_per_sec, eta_seconds);
  // Cheapest to lose first: the bar's cells (the counts say the same), then
  // samples/s, then the loss.
  for (int dropped = 0; dropped < 3; ++dropped) {
    if (dropped == 1) p.rate.clear();
    if (dropped == 2) p.loss.clear();
    const std::string text = absl::StrCat(p.counts, p.loss, p.rate, p.eta);
    const int cells =
        std::min(kMaxBarWidth, room - static_cast<int>(text.size()) - 2);
    if (dropped == 0 && cells >= 5) {
      return absl::StrCat(Bar(p.fraction, cells), text);
    }
    // Without the bar the line starts with the counts' padding.
    const std::string bare(absl::StripLeadingAsciiWhitespace(text));
    if (dropped > 0 && static_cast<int>(bare.size()) <= room) return bare;
  }
  return std::string(
             absl::StripLeadingAsciiWhitespace(absl::StrCat(p.counts, p.eta)))
      .substr(0, static_cast<size_t>(room));
}

absl::StatusOr<std::unique_ptr<MetricsCsv>> MetricsCsv::Open(
    const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_csv=", path, ": cannot create: ", std::strerror(errno)));
  }
  std::unique_ptr<MetricsCsv> csv(new MetricsCsv(file, path));
  if (std::fprintf(file, "%s\n", kHeader) < 0 || std::fflush(file) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return csv;
}

MetricsCsv::~MetricsCsv() { std::fclose(file_); }

absl::Status MetricsCsv::Append(const Row& row) {
  const std::string test =
      std::isnan(row.test_accuracy)
          ? ","
          : absl::StrFormat("%.6g,%.6g", row.test_loss, row.test_accuracy);
  if (std::fprintf(file_, "%lld,%.4f,%.6g,%.6g,%.1f,%.3f,%.3f,%s,%.3f,%.3f\n",
                   static_cast<long long>(row.step), row.time_s, row.loss,
                   row.train_accuracy, row.samples_per_sec, row.pull_ms,
                   row.push_ms, test.c_str(), row.compute_ms,
                   row.network_wait) < 0 ||
      std::fflush(file_) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace pstrain
