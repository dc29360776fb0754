#include "common/run_output.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

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

std::string FormatProgressBar(int64_t step, int64_t steps, double loss,
                              double samples_per_sec, double eta_seconds,
                              int bar_width) {
  const double fraction =
      steps > 0 ? std::clamp(static_cast<double>(step) / steps, 0.0, 1.0) : 0;
  const int filled = static_cast<int>(fraction * bar_width);
  const int digits = static_cast<int>(absl::StrCat(steps).size());
  return absl::StrFormat(
      "[%s%s] %*d/%d %3d%%  loss %.4f  %.0f samples/s  ETA %s",
      std::string(filled, '#'), std::string(bar_width - filled, '.'), digits,
      step, steps, static_cast<int>(fraction * 100), loss, samples_per_sec,
      step >= steps ? "0:00" : FormatEta(eta_seconds));
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

absl::Status MetricsCsv::Append(int64_t step, double time_s, double loss,
                                double train_accuracy, double samples_per_sec,
                                double pull_ms, double push_ms,
                                double test_loss, double test_accuracy) {
  const std::string test =
      std::isnan(test_accuracy)
          ? ","
          : absl::StrFormat("%.6g,%.6g", test_loss, test_accuracy);
  if (std::fprintf(file_, "%lld,%.4f,%.6g,%.6g,%.1f,%.3f,%.3f,%s\n",
                   static_cast<long long>(step), time_s, loss, train_accuracy,
                   samples_per_sec, pull_ms, push_ms, test.c_str()) < 0 ||
      std::fflush(file_) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace pstrain
