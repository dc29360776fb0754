#include "common/init.h"

#include <cmath>

#include "common/hash.h"

namespace pstrain {
namespace {

// A uniform in (0, 1) from 53 random bits; never 0, so log() is safe.
double UnitUniform(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

}  // namespace

void FillInitialValues(const InitSpec& init, uint64_t seed,
                       absl::string_view tensor_name, int64_t offset,
                       absl::Span<float> out) {
  FillInitialValuesOfHashedName(init, seed, Fnv1a64(tensor_name), offset, out);
}

void FillInitialValuesOfHashedName(const InitSpec& init, uint64_t seed,
                                   uint64_t name_hash, int64_t offset,
                                   absl::Span<float> out) {
  const uint64_t stream = SplitMix64(seed ^ SplitMix64(name_hash));
  for (size_t j = 0; j < out.size(); ++j) {
    const uint64_t index = static_cast<uint64_t>(offset) + j;
    switch (init.kind()) {
      case InitSpec::CONSTANT:
        out[j] = init.value();
        break;
      case InitSpec::UNIFORM: {
        const double u = UnitUniform(SplitMix64(stream ^ SplitMix64(index)));
        out[j] = static_cast<float>((2 * u - 1) * init.scale());
        break;
      }
      case InitSpec::NORMAL: {
        // Box-Muller on two independent draws keyed by the element index.
        const uint64_t h = SplitMix64(stream ^ SplitMix64(2 * index));
        const double u1 = UnitUniform(h);
        const double u2 = UnitUniform(SplitMix64(h ^ 0x5851f42d4c957f2dULL));
        out[j] = static_cast<float>(std::sqrt(-2 * std::log(u1)) *
                                    std::cos(2 * M_PI * u2) * init.scale());
        break;
      }
      default:
        out[j] = 0;
    }
  }
}

}  // namespace pstrain
