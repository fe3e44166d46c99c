"""Weight declarations: a packed tensor is a pure numpy function of named source tensors.

A graph's WEIGHT nodes carry a :class:`WeightDecl`. The declarations are data (recorded in the
artifact); :func:`materialize` applies them to checkpoint tensors, here at interpretation time and in
``pack-weights`` on the deploy box. Sources are checkpoint names; the target's tensors are
``target.embed_tokens`` and ``target.lm_head``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from dflash_compiler.row_blocks import for_row_blocks
from dflash_compiler.weight_tiles import to_tiles

FP8_E4M3_MAX = 448.0
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


@dataclass(frozen=True)
class WeightDecl:
    """``transform(*sources, **params)`` gives the tensor. ``output`` picks one of several results."""

    transform: str
    sources: tuple[str | WeightDecl, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()
    output: int = 0

    @staticmethod
    def of(source: str) -> WeightDecl:
        return WeightDecl("identity", (source,))

    def checkpoint_names(self) -> tuple[str, ...]:
        """The checkpoint tensors this declaration reads, nested declarations included."""
        out: list[str] = []
        for s in self.sources:
            out.extend([s] if isinstance(s, str) else s.checkpoint_names())
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        """A JSON form that `from_json` reads back to an equal declaration (the manifest stores it)."""
        return {
            "transform": self.transform,
            "sources": [s if isinstance(s, str) else s.to_json() for s in self.sources],
            "params": [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.params],
            "output": self.output,
        }

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> WeightDecl:
        return WeightDecl(
            str(raw["transform"]),
            tuple(s if isinstance(s, str) else WeightDecl.from_json(s) for s in raw["sources"]),
            tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in raw["params"]),
            int(raw["output"]),
        )

    def render(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params if not isinstance(v, tuple))
        names = [s if isinstance(s, str) else s.render() for s in self.sources]
        args = ", ".join(names) + (f"; {params}" if params else "")
        suffix = f"[{self.output}]" if self.output else ""
        return f"{self.transform}({args}){suffix}"


def _identity(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return (x,)


def _concat_rows(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Stack output rows: fused projections ``[W_a; W_b; ...]`` so one GEMM computes all of them. Exact in
    any dtype: sources of one dtype keep it, mixed ones meet in float32."""
    arrays = [np.asarray(x) for x in xs]
    if len({a.dtype for a in arrays}) > 1:
        arrays = [a.astype(np.float32, copy=False) for a in arrays]
    return (np.concatenate(arrays, axis=0),)


def _quantize_rows(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.abs(part).max(axis=1)
    scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    return (part / scale[:, None]).astype(ml_dtypes.float8_e4m3fn), scale


def _require_matrix(w: np.ndarray, what: str) -> tuple[int, int]:
    if np.ndim(w) != 2:
        raise ValueError(f"{what}: expected a 2-D [rows, cols] weight, got shape {np.shape(w)}")
    rows, cols = np.shape(w)
    return rows, cols


def quantize_fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 weights with one fp32 scale per output row: ``w ≈ w8 * scale[:, None]`` (``w`` is 2-D).

    Row by row, so it runs in row blocks on every core (:mod:`dflash_compiler.row_blocks`); each block
    computes exactly what the whole-matrix expression would for its rows."""
    rows, cols = _require_matrix(w, "quantize_fp8_rows")
    w8 = np.empty((rows, cols), ml_dtypes.float8_e4m3fn)
    scale = np.empty(rows, np.float32)

    def block(lo: int, hi: int) -> None:
        w8[lo:hi], scale[lo:hi] = _quantize_rows(np.asarray(w[lo:hi], np.float32))

    for_row_blocks(rows, cols, block)
    return w8, scale


def fp8_rows_residual(w: np.ndarray) -> np.ndarray:
    """``Ŵ − w`` in float32, with ``Ŵ`` the e4m3 rows of :func:`quantize_fp8_rows` times their scales: the
    error an FP8 weight adds, computed a row block at a time without the whole e4m3 copy."""
    rows, cols = _require_matrix(w, "fp8_rows_residual")
    out = np.empty((rows, cols), np.float32)

    def block(lo: int, hi: int) -> None:
        part = np.asarray(w[lo:hi], np.float32)
        w8, scale = _quantize_rows(part)
        residual = e4m3_as_f32(w8)
        residual *= scale[:, None]
        residual -= part
        out[lo:hi] = residual

    for_row_blocks(rows, cols, block)
    return out


def e4m3_as_f32(w8: np.ndarray) -> np.ndarray:
    """The float32 values of e4m3 bytes: a 256-entry table lookup, the same values as ``w8.astype(float32)``
    several times faster (ml_dtypes converts one element at a time through a generic cast)."""
    return _E4M3_VALUES[np.asarray(w8).view(np.uint8)]


def _fp8_rows(w: np.ndarray) -> tuple[np.ndarray, ...]:
    return quantize_fp8_rows(w)


def interleave_rows(x: np.ndarray, *, group: int) -> tuple[np.ndarray, ...]:
    """The two row halves of ``x`` ([2h, ...], e.g. gate | up) interleaved ``group`` rows at a time:
    first-half rows [0, group), second-half rows [0, group), first-half [group, 2 group), ... (h a multiple
    of ``group``)."""
    half = x.shape[0] // 2
    if x.shape[0] % 2 or half % group:
        raise ValueError(f"interleave_rows: {x.shape[0]} rows are not two halves of a multiple of {group}")
    blocks = x.reshape(2, half // group, group, *x.shape[1:])
    return (np.ascontiguousarray(blocks.swapaxes(0, 1)).reshape(x.shape),)


def _tiles(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return (to_tiles(x),)


def _rope_inv_freq(*, inv_freq: tuple[float, ...]) -> tuple[np.ndarray, ...]:
    return (np.asarray(inv_freq, np.float32),)


TRANSFORMS: dict[str, Callable[..., tuple[np.ndarray, ...]]] = {
    "identity": _identity,
    "concat_rows": _concat_rows,
    "fp8_e4m3_rows": _fp8_rows,
    "interleave_rows": interleave_rows,
    "tiles": _tiles,  # 64 x 64 tiles, for the kernels that read the weight so (dflash_compiler/weight_tiles.py)
    "rope_inv_freq": _rope_inv_freq,
}


def materialize(decl: WeightDecl, source: Callable[[str], np.ndarray]) -> np.ndarray:
    """Compute one declared tensor from ``source(name)`` (checkpoint tensors); sources may nest."""
    return WeightCache(source).get(decl)


def _base(decl: WeightDecl) -> WeightDecl:
    """The computation behind ``decl``: the same transform of the same sources, whichever output it picks."""
    return replace(decl, output=0) if decl.output else decl


@functools.cache
def _computations(decl: WeightDecl) -> frozenset[WeightDecl]:
    """Every computation ``decl`` needs, its own and its nested sources'."""
    nested = [_computations(s) for s in decl.sources if isinstance(s, WeightDecl)]
    return frozenset({_base(decl)}).union(*nested)


class WeightCache:
    """Materialized declarations; each transform runs once for all of its outputs (interpreter and packing).

    Without ``expected`` (the interpreter), what :meth:`get` returned stays cached for the next call;
    intermediate results of nested declarations are dropped after each call. With ``expected``, every
    declaration the caller will :meth:`take` (in any order, once per listing): a result, intermediate or
    not, is kept exactly as long as a declaration still to be taken needs it, so packing holds one fused
    weight's working set at a time and computes a quantization shared by ``.e4m3`` and ``.scale`` once.
    """

    def __init__(
        self,
        source: Callable[[str], np.ndarray] | Mapping[str, np.ndarray],
        expected: Iterable[WeightDecl] | None = None,
    ) -> None:
        self._source: Callable[[str], np.ndarray] = source.__getitem__ if isinstance(source, Mapping) else source
        self._results: dict[WeightDecl, tuple[np.ndarray, ...]] = {}
        self._pending: Counter[WeightDecl] | None = None if expected is None else Counter(expected)
        self._asked: set[WeightDecl] = set()

    def _compute(self, decl: WeightDecl) -> tuple[np.ndarray, ...]:
        key = _base(decl)
        if key not in self._results:
            if key.transform not in TRANSFORMS:
                raise KeyError(f"unknown weight transform {key.transform!r}; known: {sorted(TRANSFORMS)}")
            inputs = [self._source(s) if isinstance(s, str) else self._compute(s)[s.output] for s in key.sources]
            self._results[key] = TRANSFORMS[key.transform](*inputs, **dict(key.params))
        return self._results[key]

    def _keep_only(self, keep: set[WeightDecl] | frozenset[WeightDecl]) -> None:
        for key in [k for k in self._results if k not in keep]:
            del self._results[key]

    def held(self) -> int:
        """How many computed results (each a tuple of a transform's outputs) the cache holds now."""
        return len(self._results)

    def get(self, decl: WeightDecl) -> np.ndarray:
        value = self._compute(decl)[decl.output]
        if self._pending is None:
            self._asked.add(_base(decl))
            self._keep_only(self._asked)
        return value

    def take(self, decl: WeightDecl) -> np.ndarray:
        """The tensor of one of the ``expected`` declarations; drops what nothing left to take needs."""
        if self._pending is None or self._pending[decl] <= 0:
            listed = "was not listed in `expected`" if self._pending is not None else "has no `expected` list"
            raise KeyError(f"take({decl.render()}): this WeightCache {listed} or it was already taken; use get()")
        value = self._compute(decl)[decl.output]
        self._pending[decl] -= 1
        self._keep_only(frozenset().union(*(_computations(d) for d, n in self._pending.items() if n > 0)))
        return value
