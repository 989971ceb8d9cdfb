// The dense kernel for any CPU (no ISA assumption beyond the compiler's default); the body is
// cpu_kernel_impl.h (see there). GCC vector extensions lower it to whatever the target has.
#include "ops.h"

#define FT_ISA_NS isa_base
#define FT_ISA_NAME "base"
#define FT_ISA_LEVEL 0
#include "cpu_kernel_impl.h"
