"""The integer e4m3 → bf16 conversion of fp8_convert.py, instruction by instruction in numpy, against
ml_dtypes' conversion for every byte; the constants are read from the CUDA text the kernels compile."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from dflash_compiler.fp8_convert import E4M3X4_TO_BF16, PRELUDE


def _constants() -> dict[str, int]:
    perms = re.findall(r"__byte_perm\(w, 0u, (0x[0-9a-f]+)u\)", PRELUDE)
    masks = re.search(r"\(t & (0x[0-9a-f]+)u\) \| \(\(t >> 4\) & (0x[0-9a-f]+)u\)", PRELUDE)
    fma = re.search(r'"r"\(r\), "r"\((0x[0-9a-f]+)u\), "r"\((0x[0-9a-f]+)u\)', PRELUDE)
    assert len(perms) == 2 and masks and fma, "the conversion's CUDA text changed shape; update this test"
    return {
        "perm_lo": int(perms[0], 16),
        "perm_hi": int(perms[1], 16),
        "sign": int(masks.group(1), 16),
        "body": int(masks.group(2), 16),
        "scale": int(fma.group(1), 16),
        "addend": int(fma.group(2), 16),
    }


def _byte_perm(x: np.ndarray, selector: int) -> np.ndarray:
    """CUDA's __byte_perm(x, 0, selector): result byte i is byte (selector >> 4i) & 7 of the pair (x, 0)."""
    out = np.zeros_like(x)
    for i in range(4):
        sel = (selector >> (4 * i)) & 7
        byte = (x >> np.uint32(8 * sel)) & np.uint32(0xFF) if sel < 4 else np.zeros_like(x)
        out |= byte << np.uint32(8 * i)
    return out


def _bf16_pairs(bits: np.ndarray) -> np.ndarray:
    """uint32 bf16x2 words as float32 [..., 2] (low half first)."""
    halves = np.stack([bits & np.uint32(0xFFFF), bits >> np.uint32(16)], axis=-1).astype(np.uint16)
    return halves.view(ml_dtypes.bfloat16).astype(np.float32)


def _convert(words: np.ndarray, c: dict[str, int]) -> np.ndarray:
    """The prelude on uint32 words of four e4m3 bytes: float32 [..., 4] in byte order."""
    out = []
    for perm in (c["perm_lo"], c["perm_hi"]):
        t = _byte_perm(words, perm)
        r = (t & np.uint32(c["sign"])) | ((t >> np.uint32(4)) & np.uint32(c["body"]))
        # fma.rn.bf16x2 r * scale + addend: exact here (a power of two times a bf16, plus -0)
        out.append(
            _bf16_pairs(r) * _bf16_pairs(np.full_like(r, c["scale"])) + _bf16_pairs(np.full_like(r, c["addend"]))
        )
    return np.concatenate(out, axis=-1)


def test_every_finite_e4m3_byte_converts_exactly():
    codes = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert finite.sum() == 254
    rng = np.random.default_rng(0)
    # every code in every byte position of the word
    words = np.stack([np.roll(codes, 37 * i) for i in range(4)], axis=-1)
    words = np.concatenate([words, rng.integers(0, 256, (4096, 4), dtype=np.uint8)])
    got = _convert(words.copy().view(np.uint32)[:, 0], _constants())
    want = words.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    # signed zeros keep their sign (the -0 addend), which the mma does not care about but a compare would
    np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    assert E4M3X4_TO_BF16 in PRELUDE


def test_nan_comes_out_as_the_documented_480():
    words = np.array([0x7F, 0xFF, 0x00, 0x80], dtype=np.uint8).view(np.uint32)
    got = _convert(words, _constants())
    np.testing.assert_array_equal(got[0], [480.0, -480.0, 0.0, -0.0])
