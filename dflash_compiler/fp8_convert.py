"""e4m3 → bf16 in registers, in integer instructions and one packed multiply.

The FP8 linears convert every weight byte they stream to bf16 before the mma. CUDA's scalar conversion
(`(nv_bfloat16)__nv_fp8_e4m3`) goes e4m3 → f16 → f32 → bf16, three `cvt` per value, and `cvt` issues at a
quarter of the integer rate: on the H200 the FP8 GEMV was bound by it, not by DRAM. Here two values take
four instructions: one byte permute, one shift, one bitwise and, one packed bf16 multiply.

* An e4m3 byte `s eeee mmm` placed as bf16 bits `s 0000eeee mmm0000` is the bf16 number
  2^(e - 127) · 1.mmm, or for e = 0 the subnormal 2^-126 · 0.mmm; multiplying by 2^120 (exact: a power of
  two, and every result is a normal bf16) gives 2^(e - 7) · 1.mmm and 2^-6 · 0.mmm, the e4m3 value.
* The permute (`prmt.b32`) puts byte a at byte 0 and byte b at byte 2, and fills byte 1 with a's sign and
  byte 3 with b's (its sign-replicating selector nibbles, 8 + byte). Shifted left 4 bits, each 16-bit half
  is `ssss s eeee mmm 0000` (the upper half's low nibble is the lower sign's spill): one mask keeps the top
  sign bit and `eeee mmm`, which is the bf16 pattern above. Without the replicated sign the sign bit would
  need its own mask and or (five instructions a pair). Four a pair against five took the FP8 Qwen3-8B step
  at nb = 8 from 1.379 / 1.375 ms to 1.337 and at nb = 16 from 2.516 / 2.510 to 2.450 (H100, bench/propose.py,
  the five-a-pair build before and after in one run), where the warpgroup GEMMs convert a 128-row tile per
  k step; nb = 1 and 4 moved within noise (0.801 / 0.810 → 0.800, 1.017 / 1.021 → 1.021).
* The multiply is `fma.rn.bf16x2` with -0.0 as the addend (keeps -0 · x = -0), which handles subnormal
  operands (sm_80 and newer).

e4m3 NaN (`s 1111 111`) comes out as ±480 rather than NaN: packed weights never hold it, because
`quantize_fp8_rows` scales every row into ±448.

`PRELUDE` is prepended to every generated CUDA source (codegen.py); a kernel calls
`E4M3X4_TO_BF16(lo, hi, src)` with `src` four e4m3 bytes (4-byte aligned) and `lo`, `hi` two bf16 pairs
(4-byte aligned each): `lo` gets bytes 0 and 1, `hi` bytes 2 and 3, the lower byte in the lower half.

`E4M3_A_FRAGMENT(frag, row, row8, quad)` builds a thread's A fragment of one k16 step of a 16-row weight tile
(mma.sync m16n8k16's layout, which wgmma's register A operand takes per warp) straight from e4m3 rows:
`row` and `row8` are the 16 e4m3 of that k16 step of rows g and g + 8 (16-byte aligned), `quad` the thread's
t = lane % 4, and `frag` gets four bf16 pairs: row g at k 2t, 2t + 1; row g + 8 there; row g at k 2t + 8,
2t + 9; row g + 8 there. Each pair's permute picks its two bytes 2t and 2t + 1 out of an 8-byte half of the
row (selector 0x9180 + t · 0x2222).
"""

from __future__ import annotations

E4M3X4_TO_BF16 = "dflash_e4m3x4_to_bf16"
E4M3_A_FRAGMENT = "dflash_e4m3_a_fragment"

PRELUDE = f"""\
// e4m3 -> bf16 in integer instructions (dflash_compiler.fp8_convert)
__device__ __forceinline__ unsigned dflash_e4m3x2_to_bf16x2(unsigned lo, unsigned hi, unsigned sel) {{
  // sel: byte a to byte 0 and its sign over byte 1, byte b to byte 2 and its sign over byte 3
  unsigned t, d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(lo), "r"(hi), "r"(sel));
  // each half s eeee mmm at bits 4..10 under its sign at bit 15, scaled by 2^120
  unsigned r = (t << 4) & 0x87f087f0u;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(0x7b807b80u), "r"(0x80008000u));
  return d;
}}
__device__ __forceinline__ void {E4M3X4_TO_BF16}(void* lo, void* hi, const void* src) {{
  unsigned w = *(const unsigned*)src;
  *(unsigned*)lo = dflash_e4m3x2_to_bf16x2(w, 0u, 0x9180u);
  *(unsigned*)hi = dflash_e4m3x2_to_bf16x2(w, 0u, 0xb3a2u);
}}
__device__ __forceinline__ void {E4M3_A_FRAGMENT}(void* frag, const void* row, const void* row8, unsigned quad) {{
  // bytes 2t and 2t + 1 of an 8-byte half, each with its sign above it
  unsigned sel = quad * 0x2222u + 0x9180u;
  uint4 a = *(const uint4*)row, b = *(const uint4*)row8;
  unsigned* f = (unsigned*)frag;
  f[0] = dflash_e4m3x2_to_bf16x2(a.x, a.y, sel);
  f[1] = dflash_e4m3x2_to_bf16x2(b.x, b.y, sel);
  f[2] = dflash_e4m3x2_to_bf16x2(a.z, a.w, sel);
  f[3] = dflash_e4m3x2_to_bf16x2(b.z, b.w, sel);
}}
"""
