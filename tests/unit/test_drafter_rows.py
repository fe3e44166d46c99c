"""How Drafter.append_context takes host taps (no GPU needed: the conversion happens before any copy)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dflash_compiler.runtime.drafter import Drafter

BF16 = ml_dtypes.bfloat16


def test_host_bf16_taps_are_used_as_given():
    taps = np.random.default_rng(0).standard_normal((5, 64)).astype(BF16)
    assert Drafter._rows(taps, 64, "taps[0]") is taps


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_other_host_taps_are_rounded_to_bf16_through_float32(dtype):
    rng = np.random.default_rng(1)
    taps = (rng.standard_normal((2100, 600)) * 3).astype(dtype)  # several row blocks
    got = Drafter._rows(taps, 600, "taps[0]")
    assert got.dtype == BF16 and got.shape == taps.shape
    want = taps.astype(np.float32).astype(BF16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    rows = Drafter._rows([[1.5, -2.0]], 2, "taps[1]")
    np.testing.assert_array_equal(rows.astype(np.float32), [[1.5, -2.0]])


def test_host_taps_of_the_wrong_width_name_the_argument():
    with pytest.raises(ValueError, match=r"taps\[2\]: expected \[rows, 64\], found \[5, 63\]"):
        Drafter._rows(np.zeros((5, 63), BF16), 64, "taps[2]")
