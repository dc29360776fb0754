#include "worker/learning_watch.h"

#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pstrain {
namespace {

// How many recent steps' losses are averaged before comparing.
constexpr size_t kRecent = 20;
// "Fallen below the first value" by a clear margin: Adam at a rate 100x too
// high hovers a few percent under a first loss near chance (1.41 -> ~1.35
// on 4 classes) without learning anything.
constexpr double kMargin = 0.9;

}  // namespace

LearningWatch::LearningWatch(int64_t patience, std::string optimizer,
                             double learning_rate)
    : patience_(patience),
      optimizer_(std::move(optimizer)),
      learning_rate_(learning_rate) {}

std::string LearningWatch::Warning(const std::string& what) const {
  const std::string servers =
      optimizer_.empty()
          ? std::string("the servers' optimizer (they did not say which)")
          : absl::StrCat("the servers' optimizer ", optimizer_,
                         " at learning rate ", learning_rate_);
  return absl::StrCat(
      what, ": the job may not be learning; check ", servers,
      " (ps_server --optimizer, --learning_rate: too high diverges, too low "
      "crawls). Training goes on; the final JSON says \"not_learning\":true");
}

std::string LearningWatch::OnStep(int64_t step, double loss) {
  if (fired_) return "";
  if (!std::isfinite(loss)) {
    fired_ = true;
    return Warning(absl::StrCat("training loss is ", loss, " at step ", step));
  }
  if (!have_first_) {
    have_first_ = true;
    first_step_ = step;
    first_loss_ = loss;
    return "";
  }
  if (recent_.size() < kRecent) {
    recent_.push_back(loss);
  } else {
    recent_[next_] = loss;
    next_ = (next_ + 1) % kRecent;
  }
  if (patience_ <= 0 || fall_checked_ || step - first_step_ < patience_) {
    return "";
  }
  fall_checked_ = true;  // once; from here on only NaN/Inf is watched
  const double mean = std::accumulate(recent_.begin(), recent_.end(), 0.0) /
                      static_cast<double>(recent_.size());
  if (mean < kMargin * first_loss_) return "";
  fired_ = true;
  return Warning(absl::StrFormat(
      "training loss has not fallen below its first value (%.4f at step "
      "%d) in %d steps (mean of the last %d: %.4f, not under 90%% of it)",
      first_loss_, first_step_, step - first_step_, recent_.size(), mean));
}

}  // namespace pstrain
