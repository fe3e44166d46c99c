"""Context launches padded to a multiple of 16 rows (`steps.padded_context`): what the pad rows are, and that
the context phase's graph, run with them, writes the cache as without them and leaves the scratch page zero."""

from __future__ import annotations

import numpy as np
import pytest
from pass_harness import tiny

from dflash_compiler.ir.interpret import interpret
from dflash_compiler.ir.weights import WeightCache
from dflash_compiler.lower import PAGE_SIZE
from dflash_compiler.runtime.pages import SCRATCH_PAGE, PageAllocator
from dflash_compiler.runtime.steps import CONTEXT_ROW_QUANTUM, ContextStep, context_step, padded_context


def _step(rows: int, first_slot: int = 100) -> ContextStep:
    return ContextStep(
        positions=np.arange(5, 5 + rows, dtype=np.int32), slots=np.arange(first_slot, first_slot + rows, dtype=np.int32)
    )


@pytest.mark.parametrize(
    ("rows", "most", "padded"),
    [(0, 128, 0), (1, 128, 16), (7, 128, 16), (16, 128, 16), (17, 128, 32), (17, 20, 20), (20, 20, 20), (3, 8, 8)],
)
def test_rows_are_padded_to_the_quantum_within_the_launch_limit(rows, most, padded):
    step = _step(rows)
    got = padded_context(step, most, PAGE_SIZE)
    assert len(got.slots) == len(got.positions) == padded
    assert got.slots.dtype == got.positions.dtype == np.int32
    # the rows given come first, unchanged; the pad rows sit at position 0 in the scratch page
    np.testing.assert_array_equal(got.slots[:rows], step.slots)
    np.testing.assert_array_equal(got.positions[:rows], step.positions)
    assert np.all(got.positions[rows:] == 0)
    assert np.all(got.slots[rows:] // PAGE_SIZE == SCRATCH_PAGE)
    assert len(set(got.slots[rows:].tolist())) == padded - rows  # distinct while the pad fits one page


def test_pad_slots_wrap_inside_a_page_smaller_than_the_pad():
    got = padded_context(_step(3), 64, page_size=4)
    np.testing.assert_array_equal(got.slots[3:], SCRATCH_PAGE * 4 + np.arange(CONTEXT_ROW_QUANTUM - 3) % 4)


def test_more_rows_than_a_launch_takes_are_refused():
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        padded_context(_step(17), 16, PAGE_SIZE)


def _append(program, weights, kv, step: ContextStep, taps: np.ndarray) -> None:
    interpret(
        program.append_context,
        {"taps": taps, "ctx_positions": step.positions, "ctx_slots": step.slots},
        weights,
        {"kv_cache": kv},
        {"ctx": len(step.slots), "pages": kv.shape[2]},
    )


@pytest.mark.parametrize("rows", [(7, 3), (16, 1), (5, 12, 9)])
def test_padded_rows_leave_the_cache_as_unpadded_ones_do(rows):
    t = tiny("tiny-dflash")
    weights = WeightCache(t.tensors)
    shape = t.program.append_context.node("kv_cache").type.shape
    pages = 8
    kv = {name: np.zeros(tuple(pages if d == "pages" else d for d in shape), np.float32) for name in ("plain", "pad")}
    rng = np.random.default_rng(3)
    alloc = PageAllocator(pages, PAGE_SIZE, 256)
    seqs = list(range(len(rows)))
    for s in seqs:
        alloc.create(s)
    step = context_step(alloc, seqs, [np.arange(n) for n in rows])
    taps = rng.standard_normal((sum(rows), t.config.fc_in_features)).astype(np.float32)
    _append(t.program, weights, kv["plain"], step, taps)
    padded = padded_context(step, 64, PAGE_SIZE)
    pad = len(padded.slots) - sum(rows)
    assert pad > 0 or sum(rows) % CONTEXT_ROW_QUANTUM == 0
    _append(t.program, weights, kv["pad"], padded, np.concatenate([taps, np.zeros((pad, taps.shape[1]), np.float32)]))
    # zero taps give zero K and V rows: the scratch page stays zero
    assert not np.any(kv["pad"][:, :, SCRATCH_PAGE])
    assert np.any(kv["plain"]), "the unpadded run wrote nothing"
    # numpy's matmul rounds a 16-row product apart from a 7-row one in the last bits
    np.testing.assert_allclose(kv["pad"], kv["plain"], rtol=1e-5, atol=1e-5)
