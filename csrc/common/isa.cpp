// cpu_isa() / set_cpu_isa(): the ISA variant every CPU kernel follows (see isa.h).
#include "common/isa.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace freetoken {
namespace {

Isa pick_isa(const std::string& want) {
  bool has512 = false, has2 = false;
#if FT_HAS_ISA_VARIANTS
  __builtin_cpu_init();
  has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi2");
#endif
  has2 = has2 || has512;
  if (want == "avx512") {
    TORCH_CHECK(has512, "freetoken: the avx512 kernel is not available on this CPU/build");
    return Isa::kAvx512;
  }
  if (want == "avx2") {
    TORCH_CHECK(has2, "freetoken: the avx2 kernel is not available on this CPU/build");
    return Isa::kAvx2;
  }
  if (want == "base") return Isa::kBase;
  TORCH_CHECK(want.empty() || want == "auto", "freetoken: unknown ISA '", want,
              "' (auto, avx512, avx2, base)");
  if (has512) return Isa::kAvx512;
  if (has2) return Isa::kAvx2;
  return Isa::kBase;
}

std::atomic<Isa>& isa_in_use() {
  static std::atomic<Isa> isa{pick_isa("auto")};
  return isa;
}

}  // namespace

Isa current_isa() { return isa_in_use().load(std::memory_order_relaxed); }

std::string cpu_isa() {
  switch (current_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "base";
  }
}

void set_cpu_isa(const std::string& name) { isa_in_use().store(pick_isa(name)); }

}  // namespace freetoken
