"""Row-block helpers and the FP8 row quantizer built on them, against whole-tensor numpy."""

from __future__ import annotations

import itertools
import threading

import ml_dtypes
import numpy as np
import pytest

from dflash_compiler.ir.weights import FP8_E4M3_MAX, fp8_rows_residual, quantize_fp8_rows
from dflash_compiler.row_blocks import BLOCK_ELEMS, cast_rows, for_row_blocks, row_spans

E4M3 = ml_dtypes.float8_e4m3fn


def test_row_spans_cover_every_row_once_in_blocks_of_the_budget():
    spans = row_spans(2500, 1001)
    step = BLOCK_ELEMS // 1001
    assert spans[0] == (0, step) and spans[-1][1] == 2500
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(hi - lo == step for lo, hi in spans[:-1]) and 0 < spans[-1][1] - spans[-1][0] <= step
    assert row_spans(3, 10 * BLOCK_ELEMS) == [(0, 1), (1, 2), (2, 3)], "a row wider than a block is its own block"
    assert row_spans(0, 5) == []


def test_for_row_blocks_runs_each_block_once_and_raises_a_blocks_error():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(lo: int, hi: int) -> None:
        with lock:
            seen.append((lo, hi))

    for_row_blocks(5000, 1000, record)
    assert sorted(seen) == row_spans(5000, 1000)

    def fail(lo: int, hi: int) -> None:
        if lo > 0:
            raise ValueError(f"block at row {lo}")

    with pytest.raises(ValueError, match="block at row"):
        for_row_blocks(5000, 1000, fail)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, E4M3, np.float16, np.float32])
def test_cast_rows_is_numpys_cast(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3000, 999)) * 40).astype(np.float32)
    x[7, :5] = [0.0, -0.0, 1e-9, 448.0, -300.5]
    for arr in (x, x[:, 3], x[:2400].reshape(4, 600, 999), x[:0]):
        got = cast_rows(arr, dtype)
        assert got.dtype == np.dtype(dtype) and got.shape == arr.shape
        np.testing.assert_array_equal(got.view(np.uint8), arr.astype(dtype).view(np.uint8))


def test_quantize_fp8_rows_matches_a_row_by_row_reference():
    """Rows spread over several blocks (ragged last block), an all-zero row, a row of subnormal e4m3
    values and values exactly halfway between e4m3 neighbours (round half to even)."""
    rng = np.random.default_rng(1)
    rows, cols = 3001, 700
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.logspace(-3, 2, rows, dtype=np.float32)[:, None]
    w[10] = 0.0
    w[11] = 0.0
    w[11, :4] = [448.0, 2.0**-8, 3 * 2.0**-10, 2.0**-11]  # scale 1; below e4m3's smallest normal 2^-6
    w[12, :4] = [448.0, 416.0, 424.0, 440.0]  # 424 and 440 lie halfway between 416, 432 and 448
    w8, scale = quantize_fp8_rows(w)
    assert w8.dtype == E4M3 and w8.shape == w.shape and scale.dtype == np.float32 and scale.shape == (rows,)
    for r in range(rows):
        amax = np.abs(w[r]).max()
        want_scale = np.float32(amax / np.float32(FP8_E4M3_MAX)) if amax > 0 else np.float32(1.0)
        assert scale[r] == want_scale, r
        np.testing.assert_array_equal(w8[r].view(np.uint8), (w[r] / want_scale).astype(E4M3).view(np.uint8), str(r))
    np.testing.assert_array_equal(w8[12, :4].astype(np.float32), [448.0, 416.0, 416.0, 448.0])
    assert np.all(w8[10].astype(np.float32) == 0) and scale[10] == 1.0
    # subnormal e4m3 steps of 2^-9: 2^-8 exact, 3·2^-10 halfway between 2^-9 and 2^-8 (to even), 2^-11 → 0
    np.testing.assert_array_equal(w8[11, :4].astype(np.float32), [448.0, 2.0**-8, 2.0**-8, 0.0])
    assert np.abs(w8.astype(np.float32)).max() <= FP8_E4M3_MAX


def test_quantize_fp8_rows_refuses_a_non_matrix():
    with pytest.raises(ValueError, match=r"expected a 2-D \[rows, cols\] weight, got shape \(4,\)"):
        quantize_fp8_rows(np.ones(4, np.float32))


def test_fp8_rows_residual_is_the_dequantized_weight_minus_the_weight():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((2100, 900)) * rng.uniform(0.01, 5, (2100, 1))).astype(np.float32)
    w[5] = 0.0
    w8, scale = quantize_fp8_rows(w)
    want = w8.astype(np.float32) * scale[:, None] - w
    np.testing.assert_array_equal(fp8_rows_residual(w), want)
    with pytest.raises(ValueError, match=r"fp8_rows_residual: expected a 2-D"):
        fp8_rows_residual(w[None])
