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

// The message for an embedding index outside its table, shared so that a
// caller can match it whichever backend found it.
inline std::string IndexOutOfRangeMessage(absl::string_view op, int64_t i,
                                          int64_t index, int64_t table_rows) {
  return absl::StrCat(op, ": indices[", i, "] = ", index,
                      " is outside the table's rows [0, ", table_rows, ")");
}

}  // namespace pstrain::kernels::internal

#endif  // PSTRAIN_KERNELS_OP_CHECKS_H_
