#include "worker/step_output.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_text.h"
#include "glog/logging.h"

namespace pstrain {

void StepOutput::Start(int64_t start_step) {
  start_ = last_draw_ = absl::Now();
  start_step_ = start_step;
}

void StepOutput::OnStep(const StepReport& r) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  const double step_rate = r.step_seconds > 0 ? r.examples / r.step_seconds : 0;
  if (metrics_ != nullptr) {
    metrics_->Observe({r.step, r.steps, r.loss, r.train_accuracy, r.examples,
                       r.step_seconds, r.pull_seconds, r.push_seconds,
                       r.compute_seconds, r.network_wait_seconds,
                       r.sparse_rows_pulled, r.sparse_cache_hits,
                       r.sparse_cache_bytes_saved});
  }
  if (r.evaluated) {
    last_test_accuracy_ = r.test_accuracy;
    if (metrics_ != nullptr) {
      metrics_->ObserveEvaluation(r.test_loss, r.test_accuracy);
    }
  }
  if (csv_ != nullptr) {
    MetricsCsv::Row row;
    row.step = r.step;
    row.time_s = absl::ToDoubleSeconds(now - start_);
    row.loss = r.loss;
    row.train_accuracy = r.train_accuracy;
    row.samples_per_sec = step_rate;
    row.pull_ms = r.pull_seconds * 1e3;
    row.push_ms = r.push_seconds * 1e3;
    if (r.evaluated) {
      row.test_loss = r.test_loss;
      row.test_accuracy = r.test_accuracy;
    }
    row.compute_ms = r.compute_seconds * 1e3;
    row.network_wait =
        r.step_seconds > 0 ? r.network_wait_seconds / r.step_seconds : 0;
    absl::Status written = csv_->Append(row);
    if (!written.ok()) {
      LOG(ERROR) << written << "; no more CSV rows";
      csv_.reset();
    }
  }
  window_examples_ += r.examples;
  window_seconds_ += r.step_seconds;
  window_loss_ += r.loss;
  window_accuracy_ += r.train_accuracy;
  ++window_steps_;
  if (log_every_ <= 0) return;
  if (r.evaluated) {
    // An evaluation gets a line of its own, whatever the progress style.
    std::printf(
        "%sworker %d step %lld/%lld epoch %lld test_loss %.4f "
        "test_acc %.4f\n",
        line_open_ ? "\r\033[K" : "", worker_id_,
        static_cast<long long>(r.step), static_cast<long long>(r.steps),
        static_cast<long long>(r.epoch), r.test_loss, r.test_accuracy);
    std::fflush(stdout);
    line_open_ = false;
  }
  if (bar_) {
    // Redrawn at most 10 times a second: a terminal is slower than a step.
    if (now - last_draw_ < absl::Milliseconds(100) && r.step != r.steps) {
      return;
    }
    const double elapsed = absl::ToDoubleSeconds(now - start_);
    const int64_t done = r.step - start_step_;
    const double eta =
        done > 0 ? elapsed / done * static_cast<double>(r.steps - r.step) : -1;
    std::printf("\r%s\033[K",
                FormatProgressBar(
                    r.step, r.steps, r.loss,
                    window_examples_ / std::max(window_seconds_, 1e-9), eta)
                    .c_str());
    line_open_ = r.step != r.steps;
    if (!line_open_) std::printf("\n");
    std::fflush(stdout);
    last_draw_ = now;
    ResetWindow();
    return;
  }
  if (r.step % log_every_ != 0 && r.step != r.steps) return;
  std::printf(
      "worker %d step %lld/%lld loss %.4f train_acc %.3f samples/s %.0f%s\n",
      worker_id_, static_cast<long long>(r.step),
      static_cast<long long>(r.steps), window_loss_ / window_steps_,
      window_accuracy_ / window_steps_,
      window_examples_ / std::max(window_seconds_, 1e-9),
      last_test_accuracy_ < 0
          ? ""
          : absl::StrFormat(" test_acc %.4f", last_test_accuracy_).c_str());
  std::fflush(stdout);
  ResetWindow();
}

void StepOutput::OnWaitingForWorkers(const JobStart& waiting) {
  absl::MutexLock lock(&mu_);
  if (!bar_ || log_every_ <= 0) return;
  std::string missing = FormatIdList(waiting.missing_workers());
  if (missing.size() > 60) missing = absl::StrCat(missing.substr(0, 57), "...");
  std::printf(
      "\rworker %d: waiting for workers %s (%d of %d missing), %.0f s\033[K",
      worker_id_, missing.c_str(), waiting.missing_workers_size(),
      waiting.num_workers(), waiting.waited_s());
  std::fflush(stdout);
  line_open_ = true;
}

void StepOutput::ShowWait(const std::string& line) {
  absl::MutexLock lock(&mu_);
  if (!bar_ || log_every_ <= 0) return;
  std::string shown = absl::StrCat("worker ", worker_id_, ": ", line);
  if (shown.size() > 160) shown = absl::StrCat(shown.substr(0, 157), "...");
  std::printf("\r%s\033[K", shown.c_str());
  std::fflush(stdout);
  line_open_ = true;
}

void StepOutput::Finish() {
  absl::MutexLock lock(&mu_);
  if (line_open_) {
    std::printf("\n");
    std::fflush(stdout);
  }
}

void StepOutput::ResetWindow() {
  window_examples_ = window_seconds_ = window_loss_ = window_accuracy_ = 0;
  window_steps_ = 0;
}

}  // namespace pstrain
