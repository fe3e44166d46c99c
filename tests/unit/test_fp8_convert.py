"""The integer e4m3 → bf16 conversion of fp8_convert.py, instruction by instruction in numpy, against
ml_dtypes' conversion for every byte; the constants are read from the CUDA text the kernels compile."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from dflash_compiler.fp8_convert import E4M3_A_FRAGMENT, E4M3X4_TO_BF16, PRELUDE


def _constants() -> dict[str, int]:
    perms = re.findall(r"dflash_e4m3x2_to_bf16x2\(w, 0u, (0x[0-9a-f]+)u\)", PRELUDE)
    mask = re.search(r"unsigned r = \(t << 4\) & (0x[0-9a-f]+)u;", PRELUDE)
    fma = re.search(r'"r"\(r\), "r"\((0x[0-9a-f]+)u\), "r"\((0x[0-9a-f]+)u\)', PRELUDE)
    assert len(perms) == 2 and mask and fma, "the conversion's CUDA text changed shape; update this test"
    return {
        "perm_lo": int(perms[0], 16),
        "perm_hi": int(perms[1], 16),
        "mask": int(mask.group(1), 16),
        "scale": int(fma.group(1), 16),
        "addend": int(fma.group(2), 16),
    }


def _prmt(x: np.ndarray, y: np.ndarray, selector: int) -> np.ndarray:
    """PTX prmt.b32 (default mode) of the pair (x, y): result byte i is byte (selector >> 4i) & 7 of the
    pair, or, where that nibble's bit 3 is set, eight copies of that byte's top bit."""
    out = np.zeros_like(x)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        word = x if nibble & 7 < 4 else y
        byte = (word >> np.uint32(8 * (nibble & 3))) & np.uint32(0xFF)
        if nibble & 8:
            byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def _bf16_pairs(bits: np.ndarray) -> np.ndarray:
    """uint32 bf16x2 words as float32 [..., 2] (low half first)."""
    halves = np.stack([bits & np.uint32(0xFFFF), bits >> np.uint32(16)], axis=-1).astype(np.uint16)
    return halves.view(ml_dtypes.bfloat16).astype(np.float32)


def _pair(lo: np.ndarray, hi: np.ndarray, selector: int, c: dict[str, int]) -> np.ndarray:
    """dflash_e4m3x2_to_bf16x2(lo, hi, selector) on uint32 arrays: float32 [..., 2]."""
    t = _prmt(lo, hi, selector)
    r = (t << np.uint32(4)) & np.uint32(c["mask"])
    # fma.rn.bf16x2 r * scale + addend: exact here (a power of two times a bf16, plus -0)
    return _bf16_pairs(r) * _bf16_pairs(np.full_like(r, c["scale"])) + _bf16_pairs(np.full_like(r, c["addend"]))


def _convert(words: np.ndarray, c: dict[str, int]) -> np.ndarray:
    """The prelude on uint32 words of four e4m3 bytes: float32 [..., 4] in byte order."""
    zero = np.zeros_like(words)
    return np.concatenate([_pair(words, zero, c["perm_lo"], c), _pair(words, zero, c["perm_hi"], c)], axis=-1)


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


def _a_fragment_lines() -> tuple[int, int, list[tuple[int, str, str, str]]]:
    """The fragment helper's selector (quad · a + b) and its four `f[i] = convert(R.x, R.y, sel)` lines as
    (i, row, low word, high word)."""
    body = PRELUDE[PRELUDE.index(f"void {E4M3_A_FRAGMENT}(") :]
    sel = re.search(r"unsigned sel = quad \* (0x[0-9a-f]+)u \+ (0x[0-9a-f]+)u;", body)
    lines = re.findall(r"f\[(\d)\] = dflash_e4m3x2_to_bf16x2\((\w)\.(\w), \w\.(\w), sel\);", body)
    assert sel and len(lines) == 4, "the fragment helper's CUDA text changed shape; update this test"
    return int(sel.group(1), 16), int(sel.group(2), 16), [(int(i), r, lo, hi) for i, r, lo, hi in lines]


def test_the_a_fragment_holds_mma_sync_s_layout():
    """Thread t of a quad gets, from the 16 e4m3 of rows g and g + 8 at one k16 step, the m16n8k16 A fragment
    (PTX ISA): pair 0 row g at k 2t, 2t + 1; pair 1 row g + 8 there; pairs 2 and 3 the same at k 2t + 8, 2t + 9."""
    scale, base, lines = _a_fragment_lines()
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (2, 64, 16), dtype=np.uint8)  # rows g and g + 8, many cases, k 0..15
    codes[codes & 0x7F == 0x7F] = 0  # no NaN
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    words = {r: dict(zip("xyzw", codes[h].copy().view(np.uint32).T, strict=True)) for h, r in enumerate("ab")}
    c = _constants()
    for quad in range(4):
        got = np.zeros((4, 64, 2), np.float32)
        for i, row, lo, hi in lines:
            got[i] = _pair(words[row][lo], words[row][hi], quad * scale + base, c)
        for pair, (h, k0) in enumerate(((0, 2 * quad), (1, 2 * quad), (0, 2 * quad + 8), (1, 2 * quad + 8))):
            np.testing.assert_array_equal(got[pair], values[h, :, k0 : k0 + 2], err_msg=f"quad {quad} pair {pair}")
