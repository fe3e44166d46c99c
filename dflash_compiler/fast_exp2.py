"""2^x in one `ex2.approx.ftz.f32`, for the softmax of the attention kernels.

Kernels are compiled without `--use_fast_math` (norms, SiLU and the FP8 scales keep CUDA's accurate
functions), so CUDA's `exp2f` becomes the special-function unit's `ex2` wrapped in a range fix for
subnormal results: a compare and two predicated multiplies around every exponential. The softmax takes
one exponential per score and does not need that fix: a weight below 2^-126 next to the row's maximum
weight of 1 adds nothing to a float32 sum, so flushing it to zero changes no output. `ex2.approx` is
within 2 ulp of 2^x (PTX ISA), below the bf16 rounding of the probabilities that feed the P·V mma.

`PRELUDE` is prepended to every generated CUDA source (codegen.py); a schedule calls
`T.call_extern("float32", EXP2, x)`.
"""

from __future__ import annotations

EXP2 = "dflash_exp2"

PRELUDE = f"""\
// 2^x for softmax weights, subnormal results flushed to zero (dflash_compiler.fast_exp2)
__device__ __forceinline__ float {EXP2}(float x) {{
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}}
"""
