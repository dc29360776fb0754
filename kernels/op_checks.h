// Argument checks shared by the backends, so that every backend rejects the
// same bad arguments with the same message (the CUDA backend must fail
// exactly where the CPU reference does, before touching the device).
#ifndef PSTRAIN_KERNELS_OP_CHECKS_H_
#define PSTRAIN_KERNELS_OP_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace pstrain::kernels::internal {

struct Dim {
  const char* name;
  int64_t value;
};

struct Ptr {
  const char* name;
  const void* ptr;
  bool needed;  // whether the op touches it for the given sizes
};

// Sizes are checked before pointers so that "needed" (computed from the
// sizes by the caller) is only trusted once the sizes are known to be sane.
inline absl::Status Validate(absl::string_view op,
                             std::initializer_list<Dim> dims,
                             std::initializer_list<Ptr> ptrs) {
  for (const Dim& dim : dims) {
    if (dim.value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", dim.name, " must be non-negative, got ", dim.value));
    }
  }
  for (const Ptr& p : ptrs) {
    if (p.needed && p.ptr == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": ", p.name, " is null"));
    }
  }
  return absl::OkStatus();
}

// Checks a sliding-window geometry: sizes non-negative, kernel and stride
// at least 1, the padding smaller than the kernel (a window of padding
// alone would have no input), the window no larger than the padded image
// (unless the batch is empty), and no padding when `allow_pad` is false.
inline absl::Status ValidateWindow(absl::string_view op, const Window2D& w,
                                   bool allow_pad) {
  if (absl::Status s = Validate(op,
                                {{"batch", w.batch},
                                 {"height", w.height},
                                 {"width", w.width},
                                 {"channels", w.channels},
                                 {"pad", w.pad}},
                                {});
      !s.ok()) {
    return s;
  }
  if (w.kernel < 1 || w.stride < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": kernel and stride must be at least 1, got kernel ",
                     w.kernel, " and stride ", w.stride));
  }
  if (!allow_pad && w.pad != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": pad must be 0, got ", w.pad));
  }
  if (w.pad >= w.kernel) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": pad ", w.pad, " must be smaller than the kernel ", w.kernel));
  }
  if (w.batch > 0 && w.channels > 0 &&
      (w.height + 2 * w.pad < w.kernel || w.width + 2 * w.pad < w.kernel)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": a ", w.kernel, "x", w.kernel, " window does not fit a ",
        w.height, "x", w.width, " image padded by ", w.pad));
  }
  return absl::OkStatus();
}

// True when a window op has anything to compute.
inline bool WindowHasWork(const Window2D& w) {
  return w.batch > 0 && w.channels > 0 && w.height + 2 * w.pad >= w.kernel &&
         w.width + 2 * w.pad >= w.kernel;
}

// The message for an embedding index outside its table, shared so that a
// caller can match it whichever backend found it.
inline std::string IndexOutOfRangeMessage(absl::string_view op, int64_t i,
                                          int64_t index, int64_t table_rows) {
  return absl::StrCat(op, ": indices[", i, "] = ", index,
                      " is outside the table's rows [0, ", table_rows, ")");
}

}  // namespace pstrain::kernels::internal

#endif  // PSTRAIN_KERNELS_OP_CHECKS_H_
