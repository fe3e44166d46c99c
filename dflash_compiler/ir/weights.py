"""Weight declarations: a packed tensor is a pure numpy function of named source tensors.

A graph's WEIGHT nodes carry a :class:`WeightDecl`. The declarations are data (recorded in the
artifact); :func:`materialize` applies them to checkpoint tensors, here at interpretation time and in
``pack-weights`` on the deploy box. Sources are checkpoint names; the target's tensors are
``target.embed_tokens`` and ``target.lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FP8_E4M3_MAX = 448.0


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
    """Stack output rows: fused projections ``[W_a; W_b; ...]`` so one GEMM computes all of them."""
    return (np.concatenate([np.asarray(x, np.float32) for x in xs], axis=0),)


def quantize_fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 weights with one fp32 scale per output row: ``w ≈ w8 * scale[:, None]``."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    w8 = (w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    return w8, scale


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


def _rope_inv_freq(*, inv_freq: tuple[float, ...]) -> tuple[np.ndarray, ...]:
    return (np.asarray(inv_freq, np.float32),)


TRANSFORMS: dict[str, Callable[..., tuple[np.ndarray, ...]]] = {
    "identity": _identity,
    "concat_rows": _concat_rows,
    "fp8_e4m3_rows": _fp8_rows,
    "interleave_rows": interleave_rows,
    "rope_inv_freq": _rope_inv_freq,
}


def materialize(decl: WeightDecl, source: Callable[[str], np.ndarray]) -> np.ndarray:
    """Compute one declared tensor from ``source(name)`` (checkpoint tensors); sources may nest."""
    if decl.transform not in TRANSFORMS:
        raise KeyError(f"unknown weight transform {decl.transform!r}; known: {sorted(TRANSFORMS)}")
    fn = TRANSFORMS[decl.transform]
    inputs = [source(s) if isinstance(s, str) else materialize(s, source) for s in decl.sources]
    results = fn(*inputs, **dict(decl.params))
    return results[decl.output]


class WeightCache:
    """Materialized declarations keyed by declaration, computed once (interpreter and packing)."""

    def __init__(self, source: Callable[[str], np.ndarray] | Mapping[str, np.ndarray]) -> None:
        self._source: Callable[[str], np.ndarray] = source.__getitem__ if isinstance(source, Mapping) else source
        self._done: dict[WeightDecl, np.ndarray] = {}

    def get(self, decl: WeightDecl) -> np.ndarray:
        if decl not in self._done:
            self._done[decl] = materialize(decl, self._source)
        return self._done[decl]
