// The top-k dense kernel's three variants: topk_kernel.h compiled once per ISA, each time with its
// target attribute on every function (FT_ISA_FN; see common/isa.h) and in its own namespace.
#include "common/isa.h"
#include "topk/topk.h"

#if FT_HAS_ISA_VARIANTS
#include <immintrin.h>

#define FT_ISA_NS isa_avx512
#define FT_ISA_NAME "avx512"
#define FT_ISA_LEVEL 2
#define FT_ISA_FN FT_TARGET_AVX512
#include "topk/topk_kernel.h"
#undef FT_ISA_NS
#undef FT_ISA_NAME
#undef FT_ISA_LEVEL
#undef FT_ISA_FN

#define FT_ISA_NS isa_avx2
#define FT_ISA_NAME "avx2"
#define FT_ISA_LEVEL 1
#define FT_ISA_FN FT_TARGET_AVX2
#include "topk/topk_kernel.h"
#undef FT_ISA_NS
#undef FT_ISA_NAME
#undef FT_ISA_LEVEL
#undef FT_ISA_FN
#endif

// Any CPU (no ISA assumption beyond the compiler's default): GCC vector extensions lower the body
// to whatever the target has.
#define FT_ISA_NS isa_base
#define FT_ISA_NAME "base"
#define FT_ISA_LEVEL 0
#define FT_ISA_FN
#include "topk/topk_kernel.h"
