"""Warpgroup MMA (`wgmma.mma_async`, sm_90a) in the generated CUDA source, for the GEMM of linear_wgmma.py.

`mma.sync.m16n8k16` is issued by one warp and reads its operands from registers, so a GEMM on it spends
shared-memory loads and register moves on every fragment: on the H200 the drafter's bf16 GEMMs at 64-256
rows ran near 300 TFLOP/s on it, under half of what a memory-bound weight stream at 128 rows needs. A
`wgmma.mma_async.m64nNk16` is issued by a warpgroup (four warps) and reads both operands straight from
shared memory through 64-bit matrix descriptors.

The operand tiles are K-major with the 128-byte swizzle: rows of 64 bf16 (128 bytes, one swizzle atom
row), 8-row groups 1024 bytes apart, and within each group the 16-byte chunk c of row r stored at chunk
c xor (r mod 8). A tile's base must be 1024-byte aligned. The descriptor of the k16 slice kk of such a tile
is the tile's base address plus 32·kk bytes: the hardware applies the xor to the address bits it forms, as
it does for the base.

Descriptor bits (PTX ISA, "Matrix Descriptor Format"): 0-13 the shared-memory address >> 4, 16-29 the
leading byte offset >> 4 (unused by swizzled K-major tiles; 1 by convention), 32-45 the stride byte offset
>> 4 (1024 bytes between 8-row groups), 62-63 the swizzle mode (1: 128 bytes).

`PRELUDE` is prepended to every generated CUDA source (codegen.py); it defines the fences and group calls
and, through `mma_function(n)`, one `m64nNk16` call per N a kernel uses (`needed_prelude` adds them by name).
Every call is a warpgroup-wide instruction: all 128 threads of the warpgroup must reach it together.
"""

from __future__ import annotations

import re

FENCE = "dflash_wgmma_fence"  # orders register accesses of the accumulators before the next wgmma
COMMIT = "dflash_wgmma_commit"
WAIT_PRIOR = "dflash_wgmma_wait_prior"  # every committed group but the last has completed
FENCE_ASYNC_SHARED = "dflash_fence_async_shared"  # generic-proxy shared writes (cp.async) → wgmma's reads
REQUIRE_ALIGNED = "dflash_require_swizzle_aligned"  # traps unless a tile base is 1024-byte aligned
_MMA = "dflash_wgmma_m64n{n}k16"
_MMA_RS = "dflash_wgmma_rs_m64n{n}k16"
_MMA_RK = "dflash_wgmma_rk_m64n{n}k16"
_WAIT = "dflash_wgmma_wait_n{n}"
SWIZZLE_BYTES = 128  # one row of a tile: 64 bf16
ATOM_ALIGN = 1024  # a tile's base: 8 rows of 128 bytes
N_VALUES = tuple(range(8, 257, 8))  # wgmma's N for bf16 inputs

PRELUDE = f"""\
// warpgroup MMA (dflash_compiler.wgmma)
__device__ __forceinline__ void {FENCE}() {{ asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }}
__device__ __forceinline__ void {COMMIT}() {{ asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }}
__device__ __forceinline__ void {WAIT_PRIOR}() {{ asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }}
__device__ __forceinline__ void {FENCE_ASYNC_SHARED}() {{
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}}
__device__ __forceinline__ void {REQUIRE_ALIGNED}(const void* base) {{
  // the descriptors assume the swizzle pattern starts at the tile's base: misaligned, every product is wrong
  if ((unsigned)__cvta_generic_to_shared(base) & {ATOM_ALIGN - 1}u) __trap();
}}
__device__ __forceinline__ unsigned long long dflash_sw128_desc(const void* tile) {{
  unsigned address = (unsigned)__cvta_generic_to_shared(tile);
  return (unsigned long long)((address & 0x3FFFFu) >> 4) | (1ull << 16) | ({ATOM_ALIGN >> 4}ull << 32) | (1ull << 62);
}}
"""


def mma_name(n: int) -> str:
    """The call `mma(d, a, b)`: d[0 .. n/2) += A (64 × 16, at shared pointer a) · B (n × 16, at b), both
    K-major 128-byte-swizzled tiles; d holds the thread's accumulators in mma.sync's m16n8 order per 8 columns."""
    _check_n(n)
    return _MMA.format(n=n)


def mma_rs_name(n: int) -> str:
    """The call `mma(d, a, b, lbo)`: d[0 .. n/2) += A (64 × 16, the thread's fragment in registers: 8 bf16 at
    a, mma.sync's m16n8k16 A layout for its warp's 16 rows) · B (16 × n at shared pointer b, N-major: the
    128-byte-swizzled rows of a tile run along N, one row per k; 64-column blocks of N `lbo` bytes apart and
    8-row groups of k 1024 bytes apart)."""
    _check_n(n)
    return _MMA_RS.format(n=n)


def mma_rk_name(n: int) -> str:
    """The call `mma(d, a, b)`: d[0 .. n/2) += A (64 × 16, the thread's fragment in registers, as for
    `mma_rs_name`) · B (n × 16 at shared pointer b, a K-major 128-byte-swizzled tile, as for `mma_name`)."""
    _check_n(n)
    return _MMA_RK.format(n=n)


def wait_name(n: int) -> str:
    """The call `wait(d)`: waits for every committed wgmma group of the thread's warpgroup, then pins the
    accumulators d[0 .. n/2) so that no access to them moves above the wait."""
    _check_n(n)
    return _WAIT.format(n=n)


def _check_n(n: int) -> None:
    if n not in N_VALUES:
        raise ValueError(f"wgmma m64nNk16: N must be a multiple of 8 from 8 to 256, found {n}")


def mma_function(n: int) -> str:
    """CUDA source of `mma_name(n)` and `wait_name(n)`."""
    regs = n // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    dlist = ", ".join(f"%{i}" for i in range(regs))
    return f"""\
__device__ __forceinline__ void {mma_name(n)}(float* d, const void* a, const void* b) {{
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{dlist}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"
      : {outs}
      : "l"(dflash_sw128_desc(a)), "l"(dflash_sw128_desc(b)), "r"(1));
}}
__device__ __forceinline__ void {wait_name(n)}(float* d) {{
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  asm volatile("" : {outs} :: "memory");
}}
"""


def mma_rs_function(n: int) -> str:
    """CUDA source of `mma_rs_name(n)`: B read N-major (transposed), its 64-column blocks `lbo` bytes apart."""
    return _register_a_function(
        mma_rs_name(n), n, ", unsigned lbo",
        "(unsigned long long)((address & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16)\n"
        f"      | ({ATOM_ALIGN >> 4}ull << 32) | (1ull << 62)", 1,
    )  # fmt: skip


def mma_rk_function(n: int) -> str:
    """CUDA source of `mma_rk_name(n)`: B read K-major, as `mma_function`'s operands."""
    return _register_a_function(mma_rk_name(n), n, "", "dflash_sw128_desc(b)", 0)


def _register_a_function(name: str, n: int, extra: str, desc: str, transpose_b: int) -> str:
    """A `wgmma.mma_async` with A from the thread's four fragment registers and B through descriptor `desc`
    (a CUDA expression of b, of its shared address `address` and of the function's `extra` parameters)."""
    address = "  unsigned address = (unsigned)__cvta_generic_to_shared(b);\n" if "address" in desc else ""
    regs = n // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    dlist = ", ".join(f"%{i}" for i in range(regs))
    alist = ", ".join(f"%{regs + i}" for i in range(4))
    # d, the A fragment, B's descriptor, scale-d (p), scale-a, scale-b, transpose-b
    mma = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{dlist}}}, {{{alist}}}, %{regs + 4}, "
    mma += f"p, 1, 1, {transpose_b}"
    return f"""\
__device__ __forceinline__ void {name}(float* d, const void* a, const void* b{extra}) {{
  const unsigned* f = (const unsigned*)a;
{address}  unsigned long long desc = {desc};
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"
      "{mma};\\n}}\\n"
      : {outs}
      : "r"(f[0]), "r"(f[1]), "r"(f[2]), "r"(f[3]), "l"(desc), "r"(1));
}}
"""


_CALL = re.compile(r"\bdflash_wgmma_(m64n|wait_n|rs_m64n|rk_m64n)(\d+)")
_FUNCTIONS = {"m64n": mma_function, "wait_n": mma_function, "rs_m64n": mma_rs_function, "rk_m64n": mma_rk_function}


def needed_prelude(source: str) -> str:
    """The `mma_function`, `mma_rs_function` and `mma_rk_function` definitions `source` calls, in N order (""
    when it calls none)."""
    wanted = {(_FUNCTIONS[kind], int(n)) for kind, n in _CALL.findall(source)}
    return "".join(make(n) for make, n in sorted(wanted, key=lambda item: (item[1], item[0].__name__)))
