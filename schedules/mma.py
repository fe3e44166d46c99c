"""The tensor-core instruction the hand-written kernels share: `mma.sync.m16n8k16`, bf16 × bf16 → f32.

Operands are local buffers holding each thread's fragment in the PTX ISA's layout for m16n8k16 (A: 8 bf16,
B: 4 bf16, C/D: 4 f32 per thread), addressed by element offset; the accumulator is updated in place.
"""

from __future__ import annotations

from typing import Any


def mma_m16n8k16() -> Any:
    """A TVMScript macro `mma(a, a_offset, b, b_offset, acc, acc_offset)`: acc += A · B for the fragments
    starting at those element offsets of the local buffers `a`, `b` (bf16) and `acc` (f32)."""
    from tvm.script import tirx as T

    @T.macro
    def mma(a, a_offset, b, b_offset, acc, acc_offset):
        T.evaluate(
            T.ptx_legacy.mma(
                "m16n8k16", "row", "col", "bf16", "bf16", "fp32",
                a.data, a_offset, b.data, b_offset, acc.data, acc_offset, False, dtype="float32",
            )
        )  # fmt: skip

    return mma
