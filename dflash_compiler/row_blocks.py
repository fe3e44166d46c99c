"""Row-wise numpy work on large tensors, a block of rows at a time, on every core.

Packing a Qwen3-8B-sized drafter touches ~1.6 billion values (the 151936 × 4096 lm_head alone is 2.5 GB in
float32). Whole-tensor numpy expressions allocate a fresh multi-GiB temporary per step, and faulting those
pages in cost more than the arithmetic. Blocks of ~1 Mi elements keep every temporary a few MiB (reused by
the allocator) and are shared among worker threads: numpy's casts and ufunc loops release the GIL. A block
function only writes its own rows of a preallocated output, so the result does not depend on the order the
blocks run in, and it is the same as the whole-tensor expression for any row-wise computation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK_ELEMS = 1 << 20


def row_spans(rows: int, cols: int, block_elems: int = BLOCK_ELEMS) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` row ranges covering ``[0, rows)``, each of about ``block_elems`` values."""
    step = max(1, block_elems // max(cols, 1))
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def for_row_blocks(rows: int, cols: int, fn: Callable[[int, int], None], block_elems: int = BLOCK_ELEMS) -> None:
    """Call ``fn(lo, hi)`` once for each span of :func:`row_spans`, on up to one thread per core.

    The first exception a block raises is raised here, after the running blocks finish."""
    spans = row_spans(rows, cols, block_elems)
    workers = min(len(spans), os.cpu_count() or 1)
    if workers <= 1:
        for lo, hi in spans:
            fn(lo, hi)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for done in [pool.submit(fn, lo, hi) for lo, hi in spans]:
            done.result()


def cast_rows(x: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """``x.astype(dtype)`` (same rounding: numpy's cast), computed a block of rows at a time."""
    out = np.empty(x.shape, dtype)
    if x.ndim < 2 or x.size == 0:
        out[...] = x
        return out
    flat_in, flat_out = x.reshape(x.shape[0], -1), out.reshape(x.shape[0], -1)

    def block(lo: int, hi: int) -> None:
        flat_out[lo:hi] = flat_in[lo:hi]

    for_row_blocks(flat_in.shape[0], flat_in.shape[1], block)
    return out
