"""The tensor-core instruction the hand-written kernels share: `mma.sync.m16n8k16`, bf16 × bf16 → f32.

Operands are local buffers holding each thread's fragment in the PTX ISA's layout for m16n8k16 (A: 8 bf16,
B: 4 bf16, C/D: 4 f32 per thread), addressed by element offset; the accumulator is updated in place.
"""

from __future__ import annotations

from typing import Any

from dflash_compiler.fp8_convert import E4M3X4_TO_BF16


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


def a_fragments_macro(fp8: bool, row_tiles: int, mmas_per_step: int) -> Any:
    """A TVMScript macro `a_fragments(wl, af, slot, u, j0, count)`: the A fragments of mmas j0 .. j0 + count
    of each of `row_tiles` 16-row weight tiles, from the raw weight vectors `wl[slot, u, tile, h, :]` (h = 0:
    row g of the tile, 1: row g + 8; one 16-byte vector per row in the linear kernels' k mapping) into `af`
    (8 bf16 per mma, tile-major).

    Pair c = 0..3 of mma j's fragment holds row g (c even) or g + 8 (c odd) at physical 4j + {0, 1} (c < 2)
    or 4j + {2, 3}; FP8 converts each row's 4 bytes into its two pairs at once (fp8_convert.py).
    """
    from tvm.script import tirx as T

    @T.macro
    def a_fragments(wl, af, slot, u, j0, count):
        for rt in T.unroll(row_tiles):
            for j in T.unroll(j0, j0 + count):
                if fp8:
                    for h in T.unroll(2):
                        T.evaluate(T.call_extern(
                            "void", E4M3X4_TO_BF16,
                            T.address_of(af[(rt * mmas_per_step + j) * 8 + h * 2]),
                            T.address_of(af[(rt * mmas_per_step + j) * 8 + 4 + h * 2]),
                            T.address_of(wl[slot, u, rt, h, 4 * j]),
                        ))  # fmt: skip
                else:
                    for c in T.unroll(4):
                        for e in T.unroll(2):
                            af[(rt * mmas_per_step + j) * 8 + c * 2 + e] = wl[
                                slot, u, rt, c % 2, 4 * j + c // 2 * 2 + e
                            ]

    return a_fragments
