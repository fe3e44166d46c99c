"""The plans the planning passes attach to ``Graph.meta``: precision map, KV-cache plan, memory plan.

They are frozen pydantic models because the artifact's manifest records them verbatim (DESIGN.md
"Artifact"), and a runtime that reads them back must get exactly what the compiler decided. Each has a
one-line ``summary()``, which the IR text dump prints for ``meta`` entries.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import ml_dtypes
import numpy as np
from pydantic import BaseModel, ConfigDict

from dflash_compiler.errors import InputError
from dflash_compiler.options import Precision

DTYPE_BYTES: dict[str, int] = {
    "float8_e4m3fn": 1,
    "int8": 1,
    "uint8": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int32": 4,
    "int64": 8,
}


class PlanError(InputError):
    """A plan cannot be made from the build options (budget too small, nothing to measure, ...)."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element; an unknown dtype is refused rather than guessed."""
    if dtype not in DTYPE_BYTES:
        raise KeyError(f"no element size known for dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def numpy_dtype(dtype: str) -> np.dtype[Any]:
    """The host (numpy / ml_dtypes) dtype of a graph dtype; an unknown one is refused rather than guessed."""
    dtype_bytes(dtype)
    return np.dtype(getattr(ml_dtypes, dtype) if dtype in ("bfloat16", "float8_e4m3fn") else dtype)


def human_bytes(n: int) -> str:
    """``512 B``, ``208.0 KiB``, ``70.5 MiB``, ``1.3 GiB``: readable in summaries of tiny and real drafters."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# precision ---------------------------------------------------------------------------------------------


class Choice(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"


class LinearPrecision(_Frozen):
    """The precision of one linear weight and why. All linear nodes reading the weight share it."""

    name: str  # checkpoint name without ".weight" (target.lm_head -> lm_head); fused: sources joined by "+"
    weight: str  # the WEIGHT node (of the input graph) that the linear nodes read
    nodes: tuple[str, ...]  # the linear nodes reading it
    sources: tuple[str, ...]  # checkpoint tensors of its declaration
    shape: tuple[int, int]  # [N, K]
    choice: Choice
    error: float | None  # relative output error of the fp8 weight on calibration rows; None: not measured
    reason: str

    @property
    def bytes(self) -> int:
        """Packed weight bytes: bf16 [N, K], or e4m3 [N, K] plus an f32 scale per row."""
        n, k = self.shape
        return n * k + 4 * n if self.choice is Choice.FP8 else 2 * n * k


class PrecisionMap(_Frozen):
    mode: Precision
    error_budget: float | None  # auto only
    exclude: tuple[str, ...]
    unmatched_exclude: tuple[str, ...]  # globs that matched no linear of this phase (checked across phases)
    linears: tuple[LinearPrecision, ...]

    def names(self, choice: Choice) -> list[str]:
        return [lin.name for lin in self.linears if lin.choice is choice]

    def get(self, name: str) -> LinearPrecision:
        for lin in self.linears:
            if lin.name == name:
                return lin
        raise KeyError(f"no linear named {name!r}; known: {[lin.name for lin in self.linears]}")

    def summary(self) -> str:
        fp8 = self.names(Choice.FP8)
        errors = [lin.error for lin in self.linears if lin.error is not None and lin.choice is Choice.FP8]
        worst = f", max fp8 error {max(errors):.4f}" if errors else ""
        bf16_bytes = sum(2 * lin.shape[0] * lin.shape[1] for lin in self.linears)
        now = sum(lin.bytes for lin in self.linears)
        return (
            f"precision {self.mode.value}: {len(fp8)}/{len(self.linears)} linears fp8{worst}; "
            f"linear weights {human_bytes(now)} (bf16 {human_bytes(bf16_bytes)})"
        )


# KV cache ----------------------------------------------------------------------------------------------


class SizedBy(StrEnum):
    MAX_BATCH = "max_batch"  # pages_per_seq x max_batch + the scratch page
    BUDGET = "budget"  # as many pages as fit in kv_budget_bytes


class LayerRetention(_Frozen):
    """Which context rows one layer must keep: all of them, or the last ``window`` rows."""

    layer: int
    window: int | None  # None: the layer keeps every row (full attention, or sliding_window_only off)

    def render(self) -> str:
        return "full" if self.window is None else f"window {self.window}"


class KVCachePlan(_Frozen):
    page_size: int
    block_size: int
    max_batch: int
    max_seq_len: int
    retention: tuple[LayerRetention, ...]
    retained_rows: int  # rows a sequence needs pages for (max_seq_len, or the largest window)
    pages_per_seq: int
    num_pages: int  # page 0 (scratch) included
    bytes_per_page: int  # one page of K and V in every layer
    total_bytes: int
    sized_by: SizedBy
    budget_bytes: int | None

    @property
    def sequences_at_full_length(self) -> int:
        """How many sequences fit at their longest at once (page 0 is scratch)."""
        return (self.num_pages - 1) // self.pages_per_seq

    def summary(self) -> str:
        return (
            f"kv {self.num_pages} pages x {self.bytes_per_page} B = {human_bytes(self.total_bytes)} "
            f"({self.pages_per_seq} pages/seq, {self.sequences_at_full_length} full sequences, "
            f"sized by {self.sized_by.value})"
        )


# memory ------------------------------------------------------------------------------------------------


class Buffer(_Frozen):
    """One scratch value: its place in the arena and the steps (indices into ``order``) it is live."""

    node: str
    port: int
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    offset: int
    first_use: int  # the step that produces it
    last_use: int  # the last step that reads it (through views too)

    @property
    def end(self) -> int:
        return self.offset + self.bytes


class View(_Frozen):
    """A value that aliases another (SLICE): no bytes of its own, it keeps its base alive."""

    node: str
    port: int
    base_node: str
    base_port: int


class MemoryPlan(_Frozen):
    phase: str
    bindings: tuple[tuple[str, int], ...]  # the dims' maxima the sizes were computed with
    alignment: int
    order: tuple[str, ...]  # the node order the live ranges refer to
    buffers: tuple[Buffer, ...]
    views: tuple[View, ...]
    arena_bytes: int
    naive_bytes: int  # every scratch value in its own buffer
    peak_live_bytes: int  # most bytes live at one step: no arena can be smaller

    def buffer(self, node: str, port: int = 0) -> Buffer:
        for buf in self.buffers:
            if buf.node == node and buf.port == port:
                return buf
        raise KeyError(f"{self.phase}: {node}:{port} is not a scratch buffer of this plan")

    def summary(self) -> str:
        share = 100 * self.arena_bytes / self.naive_bytes if self.naive_bytes else 0.0
        return f"arena {human_bytes(self.arena_bytes)} (naive {human_bytes(self.naive_bytes)}, {share:.0f}%)"

    def render(self) -> str:
        """One line per buffer (offset order), for golden files and --dump-dir."""
        lines = [f"memory {self.phase} {dict(self.bindings)} align {self.alignment}: {self.summary()}"]
        for buf in sorted(self.buffers, key=lambda b: (b.offset, b.first_use)):
            ref = buf.node if buf.port == 0 else f"{buf.node}:{buf.port}"
            lines.append(
                f"  [{buf.offset:>10}, {buf.end:>10}) {ref:<24} {buf.dtype}{list(buf.shape)} "
                f"live {buf.first_use}..{buf.last_use}"
            )
        for view in self.views:
            base = view.base_node if view.base_port == 0 else f"{view.base_node}:{view.base_port}"
            lines.append(f"  view {view.node} of {base}")
        return "\n".join(lines) + "\n"
