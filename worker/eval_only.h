// `worker --eval_only --model_file=F`: evaluates an exported model
// (worker/model_file.h) on the held-out set with no servers at all, and
// optionally writes its logits for comparison with another implementation.
#ifndef PSTRAIN_WORKER_EVAL_ONLY_H_
#define PSTRAIN_WORKER_EVAL_ONLY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/data.h"
#include "worker/model.h"

namespace pstrain {

struct EvalOnlyOptions {
  bool eval_only = false;
  std::string model_file;   // required with eval_only
  std::string logits_file;  // optional: .csv (one row per example) or .npy
  int64_t batch_size = 64;  // the model's max_batch
};

// Flag problems, one status per problem (for ExitOnFlagErrors): a
// --model_file or --logits_file without --eval_only, --eval_only without
// --model_file or with a model that has no dense logits (probe, ctr), a
// --logits_file that is neither .csv nor .npy.
std::vector<absl::Status> CheckEvalOnlyFlags(const EvalOnlyOptions& options,
                                             const std::string& model_name);

struct EvalOnlyResult {
  double test_loss = 0;
  double test_accuracy = 0;
  int64_t test_examples = 0;
  double wall_time_s = 0;
};

// Loads options.model_file into `model`'s parameters, evaluates `test` (may
// be null: no held-out set), and writes the logits when asked. A model file
// that does not fit the model is InvalidArgument naming the file and the
// tensor; an empty test set is FailedPrecondition.
absl::StatusOr<EvalOnlyResult> EvaluateModelFile(const EvalOnlyOptions& options,
                                                 Model& model,
                                                 kernels::Backend& backend,
                                                 const ExampleSource* test);

// The final JSON line ({"event":"final","mode":"eval_only",...}) with the
// fields of training's final line that apply to an evaluation.
std::string EvalOnlyJson(const EvalOnlyResult& result,
                         const EvalOnlyOptions& options,
                         const std::string& device);

// The worker's whole --eval_only run: evaluates, prints the JSON line, and
// returns the exit status (2 for a model file or data that does not fit,
// 1 for a compute failure, 0 otherwise).
int RunEvalOnly(const EvalOnlyOptions& options, Model& model,
                kernels::Backend& backend, const ExampleSource* test);

// Logits [rows, classes] as CSV text (one row per example, %.9g: float32
// round-trips exactly) or as a .npy array (<f4, C order).
std::string LogitsCsv(const std::vector<float>& logits, int64_t classes);
std::string LogitsNpy(const std::vector<float>& logits, int64_t classes);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_EVAL_ONLY_H_
