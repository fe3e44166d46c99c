"""choose_precision: decide bf16 or FP8 (e4m3 rows + f32 scale) per linear weight, and record why.

Precondition: a phase graph (lowered, possibly fused) whose linears are ``MATMUL`` / 2-input ``LM_HEAD``
nodes reading a ``WEIGHT`` node at argument 1; fused weights are declarations over several checkpoint
tensors (``concat_rows(...)``, sources may nest).

Established invariant: every linear chosen FP8 reads ``(x, W8, scale)`` where ``W8`` and ``scale`` are
``WEIGHT`` nodes declared ``fp8_e4m3_rows(<the old declaration>)[0]`` (``float8_e4m3fn [N, K]``) and
``[1]`` (``float32 [N]``); a ``MATMUL`` becomes ``MATMUL_FP8``, an ``LM_HEAD`` keeps its op in its 3-input
FP8 form. ``graph.meta["precision"]`` is a :class:`PrecisionMap` with one entry per linear weight of the
phase (name, choice, measured error or None, reason). Nothing else changes.

Naming (ModelOpt convention, which ``exclude`` globs match with ``fnmatch``): a linear is named by its
checkpoint weight without ``.weight``; the target's ``target.lm_head`` is ``lm_head``. A fused weight is
named by its sources joined with ``+`` and is FP8 only if none of its sources is excluded, because one
packed tensor has one precision.

Modes: ``bf16`` rewrites nothing; ``fp8`` converts every linear not excluded; ``auto`` quantizes each
candidate, measures ``‖x·Ŵᵀ − x·Wᵀ‖ / ‖x·Wᵀ‖`` on the calibration rows ``x`` and keeps FP8 only where
that is within ``fp8_error_budget``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

import numpy as np

from dflash_compiler.errors import Problem
from dflash_compiler.ir.graph import Graph, Node, Ref, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightDecl, fp8_rows_residual, materialize
from dflash_compiler.ir_passes._rewrite import fresh_name, in_original_order, replace_node
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.options import Precision
from dflash_compiler.plans import Choice, LinearPrecision, PlanError, PrecisionMap
from dflash_compiler.row_blocks import row_spans

FP8_DTYPE = "float8_e4m3fn"
FP8_TRANSFORM = "fp8_e4m3_rows"
_CANDIDATE_OPS = (Op.MATMUL, Op.LM_HEAD)
_ROW_PLACING = ("identity", "concat_rows", "interleave_rows")  # transforms that only place whole rows


@dataclass(frozen=True)
class _Linear:
    """One linear weight and the linear nodes that read it."""

    weight: str
    nodes: tuple[str, ...]
    decl: WeightDecl
    shape: tuple[int, int]
    blocker: str | None  # why it cannot be converted whatever the mode (a non-linear reader, ...)

    @property
    def sources(self) -> tuple[str, ...]:
        return self.decl.checkpoint_names()

    @property
    def name(self) -> str:
        return "+".join(linear_name(s) for s in self.sources)


def linear_name(checkpoint: str) -> str:
    """``layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj``; ``target.lm_head`` -> ``lm_head``."""
    return checkpoint.removeprefix("target.").removesuffix(".weight")


def _is_fp8_ready(graph: Graph, name: str) -> bool:
    node = graph.node(name)
    return node.op in _CANDIDATE_OPS and len(graph.inputs(name)) == 2


def _find_linears(graph: Graph) -> list[_Linear]:
    """Candidate linears grouped by the WEIGHT they read, in topological order of their first reader."""
    readers: dict[str, list[str]] = {}
    for name, _ in graph.nodes_of(*_CANDIDATE_OPS):
        weight = graph.inputs(name)[1].node
        if _is_fp8_ready(graph, name) and graph.node(weight).op is Op.WEIGHT:
            readers.setdefault(weight, []).append(name)
    linears = []
    for weight, nodes in readers.items():
        wtype = graph.node(weight).type
        if len(wtype.shape) != 2 or not all(isinstance(d, int) for d in wtype.shape):
            raise PlanError(
                "precision",
                [Problem(weight, wtype.render(), "a static [N, K] linear weight", "declare the weight with int dims")],
            )
        others = sorted({dst for dst, arg in graph.users(Ref(weight)) if dst not in nodes or arg != 1})
        blocker = f"weight also read by {others}" if others else None
        shape = (int(wtype.shape[0]), int(wtype.shape[1]))
        linears.append(_Linear(weight, tuple(nodes), graph.node(weight).attr("decl"), shape, blocker))
    return linears


def _exclusion(lin: _Linear, globs: tuple[str, ...]) -> str | None:
    """The reason ``lin`` is kept in bf16 by ``exclude``, or None."""
    for source in lin.sources:
        for glob in globs:
            if fnmatchcase(linear_name(source), glob):
                if len(lin.sources) == 1:
                    return f"excluded by {glob!r}"
                return f"source {linear_name(source)!r} excluded by {glob!r}"
    return None


def _unmatched(linears: list[_Linear], globs: tuple[str, ...]) -> tuple[str, ...]:
    names = [linear_name(s) for lin in linears for s in lin.sources]
    return tuple(g for g in globs if not any(fnmatchcase(n, g) for n in names))


# weight rows quantized and multiplied at a time by fp8_relative_error: ~16 Mi values (64 MiB in f32), so
# an lm_head-sized weight never has its f32 copy, reconstruction and error matrix in memory all at once
_ERROR_CHUNK_ELEMS = 1 << 24


def fp8_error_sums(x: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """``(‖x·Ŵᵀ − x·Wᵀ‖_F², ‖x·Wᵀ‖_F²)`` with ``Ŵ`` the e4m3-rows reconstruction of ``w``.

    Both are sums over output columns, so they are summed chunk of weight rows by chunk."""
    x = np.asarray(x, np.float32)
    err2 = ref2 = 0.0
    for lo, hi in row_spans(w.shape[0], w.shape[1], _ERROR_CHUNK_ELEMS):
        part = np.asarray(w[lo:hi], np.float32)
        ref2 += float(np.linalg.norm(x @ part.T)) ** 2
        err2 += float(np.linalg.norm(x @ fp8_rows_residual(part).T)) ** 2
    return err2, ref2


def fp8_relative_error(x: np.ndarray, w: np.ndarray) -> float:
    """``‖x·Ŵᵀ − x·Wᵀ‖_F / ‖x·Wᵀ‖_F`` with ``Ŵ`` the e4m3-rows reconstruction of ``w``."""
    return _relative(*fp8_error_sums(x, w))


def _relative(err2: float, ref2: float) -> float:
    return float(np.sqrt(err2 / ref2)) if ref2 > 0 else 0.0


def row_parts(decl: WeightDecl) -> tuple[WeightDecl, ...]:
    """Declarations whose rows, stacked in some order, are the rows of ``decl``: the checkpoint tensors
    under ``identity``, ``concat_rows`` and ``interleave_rows`` (which only place whole rows), else
    ``decl`` itself. Every output row of an FP8 weight has its own scale and every column of ``x·Wᵀ``
    its own weight row, so both error sums of ``decl`` are the sums of its parts' and a fused weight is
    measured without building it."""
    if decl.transform not in _ROW_PLACING or decl.output:
        return (decl,)
    parts: list[WeightDecl] = []
    for source in decl.sources:
        parts.extend((WeightDecl.of(source),) if isinstance(source, str) else row_parts(source))
    return tuple(parts)


def _calibration_rows(lin: _Linear, phase: str, calibration: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The rows recorded for the weight node (both phases: one decision for a weight both phases read),
    else for its first checkpoint source in this phase, else in any phase. A fused ``concat_rows`` weight
    multiplies the same rows each of its parts did, so its sources' rows are its rows."""
    phased = (f"{phase}/{s}" for s in lin.sources)
    for key in (lin.weight, *phased, *lin.sources):
        if key in calibration:
            return calibration[key]
    return None


def _measure(lin: _Linear, phase: str, ctx: PassContext) -> float | None:
    if ctx.calibration is None or ctx.tensors is None:
        return None
    rows = _calibration_rows(lin, phase, ctx.calibration)
    if rows is None:
        return None
    if rows.ndim != 2 or rows.shape[1] != lin.shape[1]:
        raise PlanError(
            "precision calibration",
            [
                Problem(
                    f"calibration[{lin.weight!r}]",
                    f"rows of shape {tuple(rows.shape)}",
                    f"[rows, {lin.shape[1]}] (the weight is {list(lin.shape)})",
                    "calibrate the program as it stands when choose_precision runs",
                )
            ],
        )
    err2 = ref2 = 0.0
    for part in row_parts(lin.decl):
        part_err2, part_ref2 = fp8_error_sums(rows, materialize(part, ctx.tensors))
        err2, ref2 = err2 + part_err2, ref2 + part_ref2
    return _relative(err2, ref2)


def _require_measurable(linears: list[_Linear], phase: str, ctx: PassContext) -> None:
    """``auto`` cannot decide without numbers: refuse with what is missing (nothing to decide: no refusal)."""
    if not linears:
        return
    problems = []
    fix = (
        "gather activations with dflash_compiler.calibrate.collect_calibration(program, tensors) and pass "
        "PassContext(tensors=..., calibration=...) (the pipeline does so when it is given tensors), or use "
        "precision fp8 or bf16"
    )
    if ctx.tensors is None:
        problems.append(Problem("PassContext.tensors", "None", "the checkpoint tensors to quantize", fix))
    if ctx.calibration is None:
        problems.append(Problem("PassContext.calibration", "None", "calibration activations per weight", fix))
    else:
        missing = [lin.weight for lin in linears if _calibration_rows(lin, phase, ctx.calibration) is None]
        if missing:
            problems.append(Problem("PassContext.calibration", f"no rows for {missing}", "rows for every linear", fix))
    if problems:
        raise PlanError("precision auto", problems)


def _choose(error: float | None, ctx: PassContext) -> tuple[Choice, str]:
    """The choice for a linear that is neither excluded nor blocked, and why."""
    budget = ctx.options.fp8_error_budget
    if ctx.options.precision is Precision.FP8:
        return Choice.FP8, "precision fp8"
    if error is None:  # auto refuses earlier (_require_measurable); kept so a record never lies
        return Choice.BF16, "not measured"
    if error <= budget:
        return Choice.FP8, f"error {error:.3g} <= budget {budget:g}"
    return Choice.BF16, f"error {error:.3g} > budget {budget:g}"


def _decide(lin: _Linear, phase: str, ctx: PassContext) -> LinearPrecision:
    choice, error, reason = Choice.BF16, None, "precision bf16"
    if ctx.options.precision is not Precision.BF16:
        excluded = lin.blocker or _exclusion(lin, ctx.options.exclude)
        if excluded is not None:
            reason = excluded
        else:
            error = _measure(lin, phase, ctx)
            choice, reason = _choose(error, ctx)
    return LinearPrecision(
        name=lin.name,
        weight=lin.weight,
        nodes=lin.nodes,
        sources=lin.sources,
        shape=lin.shape,
        choice=choice,
        error=error,
        reason=reason,
    )


def _to_fp8(graph: Graph, lin: _Linear) -> dict[str, str]:
    """Declare the e4m3 weight and its scales and point every reader at them; returns the new weights'
    anchors (the weight they stand in for) for :func:`in_original_order`."""
    n, k = lin.shape
    w8 = graph.add(
        fresh_name(graph, f"{lin.weight}.e4m3"),
        Node.make(Op.WEIGHT, [TensorType(FP8_DTYPE, (n, k))], decl=WeightDecl(FP8_TRANSFORM, (lin.decl,), output=0)),
    )
    scale = graph.add(
        fresh_name(graph, f"{lin.weight}.scale"),
        Node.make(Op.WEIGHT, [TensorType("float32", (n,))], decl=WeightDecl(FP8_TRANSFORM, (lin.decl,), output=1)),
    )
    for name in lin.nodes:
        node = graph.node(name)
        op = Op.MATMUL_FP8 if node.op is Op.MATMUL else node.op
        replace_node(graph, name, Node(op, node.outputs, node.attrs), [graph.inputs(name)[0], w8, scale])
    graph.remove([lin.weight])
    return {w8.node: lin.weight, scale.node: lin.weight}


def choose_precision(graph: Graph, ctx: PassContext) -> Graph:
    """Rewrite the linears chosen FP8 and record ``graph.meta["precision"]`` (see the module docstring)."""
    out = graph.copy()
    linears = _find_linears(out)
    if ctx.options.precision is Precision.AUTO:
        candidates = [lin for lin in linears if lin.blocker is None and _exclusion(lin, ctx.options.exclude) is None]
        _require_measurable(candidates, graph.name, ctx)
    decisions = [_decide(lin, graph.name, ctx) for lin in linears]
    anchors: dict[str, str] = {}
    for lin, decision in zip(linears, decisions, strict=True):
        if decision.choice is Choice.FP8:
            anchors |= _to_fp8(out, lin)
    if anchors:
        out = in_original_order(out, graph, anchors)
    out.meta["precision"] = PrecisionMap(
        mode=ctx.options.precision,
        error_budget=ctx.options.fp8_error_budget if ctx.options.precision is Precision.AUTO else None,
        exclude=ctx.options.exclude,
        unmatched_exclude=_unmatched(linears, ctx.options.exclude),
        linears=tuple(decisions),
    )
    return out
