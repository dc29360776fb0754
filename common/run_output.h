// What a worker shows and records about its run: the progress bar for a
// terminal and the per-step metrics CSV (--metrics_csv) that
// bench/plot/plot_runs.sh turns into plots.
#ifndef PSTRAIN_COMMON_RUN_OUTPUT_H_
#define PSTRAIN_COMMON_RUN_OUTPUT_H_

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pstrain {

// "1:02:03" or "2:03" (m:ss under an hour); "?" for a negative or
// non-finite number of seconds.
std::string FormatEta(double seconds);

// The columns of the terminal on stdout; where stdout is no terminal (a
// launcher's log file), $COLUMNS; else 80.
int TerminalColumns();

// `bar_width` of FormatProgressBar: fit the whole line to the terminal
// (TerminalColumns(), asked on every call, so a resized window is followed).
inline constexpr int kFitTerminal = -1;

// One progress line, without "\r" or newline, e.g.
//   [##########..........]  150/300  50%  loss 0.4123  2310 samples/s  ETA 0:12
// `bar_width` is the number of cells between the brackets, or kFitTerminal.
std::string FormatProgressBar(int64_t step, int64_t steps, double loss,
                              double samples_per_sec, double eta_seconds,
                              int bar_width = kFitTerminal);

// The same line, made to fit in `columns` - 1 characters (a line that
// reaches the last column, or wraps, breaks the "\r" redraw: every redraw
// would start a new line): the bar shrinks (at most 24 cells), then goes,
// then samples/s, then the loss; at worst the line is cut.
std::string FitProgressBar(int64_t step, int64_t steps, double loss,
                           double samples_per_sec, double eta_seconds,
                           int columns);

// One row per step:
//   step,time_s,loss,train_accuracy,samples_per_sec,pull_ms,push_ms,
//   test_loss,test_accuracy,compute_ms,network_wait
// (test_* empty unless the model after that step was evaluated;
// network_wait: the share of the step blocked on the network, 0 to 1).
// time_s counts from the start of training, so runs can be compared against
// wall time. Rows are flushed as written: a crashed run keeps its curve.
class MetricsCsv {
 public:
  static constexpr char kHeader[] =
      "step,time_s,loss,train_accuracy,samples_per_sec,pull_ms,push_ms,"
      "test_loss,test_accuracy,compute_ms,network_wait";

  struct Row {
    int64_t step = 0;
    double time_s = 0;
    double loss = 0;
    double train_accuracy = 0;
    double samples_per_sec = 0;
    double pull_ms = 0;
    double push_ms = 0;
    double test_loss = std::nan("");  // NaN: not evaluated at this step
    double test_accuracy = std::nan("");
    double compute_ms = 0;
    double network_wait = 0;
  };

  // Creates (truncates) `path` and writes the header.
  static absl::StatusOr<std::unique_ptr<MetricsCsv>> Open(
      const std::string& path);
  ~MetricsCsv();

  absl::Status Append(const Row& row);

 private:
  MetricsCsv(std::FILE* file, std::string path)
      : file_(file), path_(std::move(path)) {}
  std::FILE* file_;
  std::string path_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RUN_OUTPUT_H_
