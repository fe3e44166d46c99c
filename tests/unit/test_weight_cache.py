"""WeightCache: each transform runs once for all its outputs; with `expected`, results live only while needed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dflash_compiler.ir import weights as weights_module
from dflash_compiler.ir.weights import WeightCache, WeightDecl, materialize, quantize_fp8_rows

RNG = np.random.default_rng(0)
TENSORS = {name: RNG.standard_normal((16, 64)).astype(np.float32) for name in ("a", "b", "c", "d")}


def _fp8(*names: str, output: int) -> WeightDecl:
    return WeightDecl("fp8_e4m3_rows", (WeightDecl("concat_rows", names),), output=output)


QKV_E4M3, QKV_SCALE = _fp8("a", "b", output=0), _fp8("a", "b", output=1)
GATE_UP_E4M3, GATE_UP_SCALE = (
    WeightDecl("interleave_rows", (_fp8("c", "d", output=k),), (("group", 8),)) for k in (0, 1)
)
ALL = (QKV_E4M3, QKV_SCALE, GATE_UP_E4M3, GATE_UP_SCALE)


@pytest.fixture
def counted(monkeypatch):
    """(reads per checkpoint name, runs per transform) while the test runs."""
    reads: Counter[str] = Counter()
    runs: Counter[str] = Counter()
    for name, fn in dict(weights_module.TRANSFORMS).items():

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            runs[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setitem(weights_module.TRANSFORMS, name, wrapped)

    def source(name: str) -> np.ndarray:
        reads[name] += 1
        return TENSORS[name]

    return source, reads, runs


def _want(decl: WeightDecl) -> np.ndarray:
    """Numpy written out for the four declarations above."""
    pair = ("a", "b") if decl in (QKV_E4M3, QKV_SCALE) else ("c", "d")
    w8, scale = quantize_fp8_rows(np.concatenate([TENSORS[n] for n in pair]))
    value = w8 if decl in (QKV_E4M3, GATE_UP_E4M3) else scale
    if decl in (GATE_UP_E4M3, GATE_UP_SCALE):  # rows [c0..c7, d0..d7, c8..c15, d8..d15]
        half = value.shape[0] // 2
        order = [h * half + g * 8 + i for g in range(half // 8) for h in (0, 1) for i in range(8)]
        value = value[order]
    return value


def test_take_runs_every_transform_once_and_holds_nothing_at_the_end(counted):
    source, reads, runs = counted
    cache = WeightCache(source, expected=ALL)
    held = []
    for decl in ALL:
        got = cache.take(decl)
        np.testing.assert_array_equal(got.view(np.uint8), _want(decl).view(np.uint8), err_msg=decl.render())
        held.append(cache.held())
    assert reads == Counter({"a": 1, "b": 1, "c": 1, "d": 1})
    assert runs == Counter({"concat_rows": 2, "fp8_e4m3_rows": 2, "interleave_rows": 2})
    # after an .e4m3 its quantization and the concat under it wait for .scale; after .scale nothing is left
    assert held == [2, 0, 2, 0]


def test_take_refuses_what_was_not_listed_or_was_already_taken(counted):
    source, _, _ = counted
    cache = WeightCache(source, expected=[QKV_E4M3])
    with pytest.raises(KeyError, match=r"was not listed in `expected` or it was already taken"):
        cache.take(QKV_SCALE)
    cache.take(QKV_E4M3)
    with pytest.raises(KeyError, match=r"already taken"):
        cache.take(QKV_E4M3)
    with pytest.raises(KeyError, match=r"has no `expected` list"):
        WeightCache(source).take(QKV_E4M3)


def test_get_keeps_what_it_returned_and_drops_intermediates(counted):
    source, reads, runs = counted
    cache = WeightCache(source)
    first = cache.get(QKV_E4M3)
    assert cache.get(QKV_E4M3) is first
    np.testing.assert_array_equal(cache.get(QKV_SCALE), _want(QKV_SCALE))
    assert runs["fp8_e4m3_rows"] == 1, "both outputs of one quantization"
    assert cache.held() == 1, "the concat under it was dropped"
    np.testing.assert_array_equal(cache.get(GATE_UP_SCALE), _want(GATE_UP_SCALE))
    assert cache.held() == 2 and reads["c"] == 1


def test_materialize_is_the_caches_value_and_unknown_transforms_are_named():
    for decl in ALL:
        np.testing.assert_array_equal(materialize(decl, TENSORS.__getitem__).view(np.uint8), _want(decl).view(np.uint8))
    with pytest.raises(KeyError, match=r"unknown weight transform 'transpose'; known: \['concat_rows'"):
        materialize(WeightDecl("transpose", ("a",)), TENSORS.__getitem__)


def test_concat_rows_keeps_one_dtype_and_meets_mixed_ones_in_float32():
    """pack-weights reads tensors as stored: a bf16 fused weight stays bf16 (the bytes pack writes), and
    sources of different dtypes are stacked as float32 values (exact for bf16, f16 and f32)."""
    import ml_dtypes

    a, b = TENSORS["a"].astype(ml_dtypes.bfloat16), TENSORS["b"].astype(ml_dtypes.bfloat16)
    same = materialize(WeightDecl("concat_rows", ("a", "b")), {"a": a, "b": b}.__getitem__)
    assert same.dtype == a.dtype
    np.testing.assert_array_equal(same.view(np.uint16), np.concatenate([a, b]).view(np.uint16))
    half = TENSORS["c"].astype(np.float16)
    mixed = materialize(WeightDecl("concat_rows", ("a", "c")), {"a": a, "c": half}.__getitem__)
    assert mixed.dtype == np.float32
    np.testing.assert_array_equal(mixed, np.concatenate([a.astype(np.float32), half.astype(np.float32)]))
