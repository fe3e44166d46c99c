"""plan_memory: place one phase's intermediate activations in one scratch arena, reusing dead space.

Precondition: a verified phase graph whose symbolic dims are among ``ctx`` (append_context) and ``nb``,
``blk``, ``maxp``, ``pages`` (propose); ``graph.meta["kv_cache"]`` if ``size_kv_cache`` ran (else the same
plan is computed here).

Established invariant: ``graph.meta["memory"]`` is a :class:`MemoryPlan` for the graph's ``topo()`` order
with every dim bound to its maximum (``ctx`` = max_ctx_rows, ``nb`` = max_batch, ``blk`` = the serving
block, ``maxp`` = pages_per_seq, ``pages`` = num_pages): every scratch value has a 256-byte aligned offset,
and two values live at the same step never share a byte. Nodes are unchanged.

What is scratch: every node output except graph inputs, weights, the KV state (KV_WRITE and KV_WRITES update it in
place) and the values OUTPUT nodes return (the runtime hands those to the caller). A SLICE output is a
column range of a row-major value, which no kernel can read as a contiguous tensor, so the slice kernel
copies it into a buffer of its own like any other node. ``_VIEWS`` lists ops whose output would alias
their input (none today); a view keeps its base alive. A value is live from the step that produces it to
the last step that reads it or a view of it (inclusive: a node's inputs and outputs coexist).

Placement is greedy by size with best fit: largest values first (ties: earliest producer, then name), each
at the smallest gap between values it overlaps in time that holds it, else above them. It is
deterministic, and close to the peak of simultaneously live bytes on these chain-like graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_compiler.errors import Problem
from dflash_compiler.ir.graph import Graph, Ref, TensorType, eval_dim
from dflash_compiler.ir.ops import CACHE_WRITES, Op
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.ir_passes.size_kv_cache import make_kv_plan, serving_block_size
from dflash_compiler.plans import Buffer, KVCachePlan, MemoryPlan, PlanError, View, dtype_bytes

ALIGNMENT = 256
_NOT_SCRATCH = (Op.INPUT, Op.WEIGHT, Op.STATE, Op.OUTPUT, *CACHE_WRITES)
_VIEWS: tuple[Op, ...] = ()


@dataclass(frozen=True)
class _Value:
    ref: Ref
    type: TensorType
    shape: tuple[int, ...]
    bytes: int
    first: int
    last: int


def dim_maxima(graph: Graph, ctx: PassContext) -> dict[str, int]:
    """Each symbolic dim of the phase bound to the largest value the runtime will use."""
    kv = graph.meta.get("kv_cache")
    plan = kv if isinstance(kv, KVCachePlan) else make_kv_plan(ctx.config, ctx.options)
    known = {
        "ctx": ctx.options.max_ctx_rows,
        "nb": ctx.options.max_batch,
        "blk": serving_block_size(ctx.config, ctx.options),
        "maxp": plan.pages_per_seq,
        "pages": plan.num_pages,
    }
    unknown = sorted(set(graph.dims) - set(known))
    if unknown:
        raise PlanError(
            "memory plan",
            [
                Problem(
                    f"{graph.name}.dims",
                    f"{unknown}",
                    f"dims with a known maximum ({sorted(known)})",
                    "give the new dim a maximum in plan_memory.dim_maxima",
                )
            ],
        )
    return {d: known[d] for d in graph.dims}


def _base(graph: Graph, ref: Ref) -> Ref:
    """The value a view chain ends at (a SLICE of a SLICE of x is x)."""
    while graph.node(ref.node).op in _VIEWS:
        ref = graph.inputs(ref.node)[0]
    return ref


def _returned(graph: Graph) -> set[Ref]:
    """Values OUTPUT nodes return (through views): they live in caller-visible buffers, not the arena."""
    return {_base(graph, graph.inputs(name)[0]) for name in graph.outputs()}


def _live_ranges(graph: Graph, order: list[str]) -> dict[Ref, tuple[int, int]]:
    """``base value -> (producer step, last reader step)``; readers of a view count for its base."""
    step = {name: i for i, name in enumerate(order)}
    ranges: dict[Ref, tuple[int, int]] = {}
    for name in order:
        for port in range(len(graph.node(name).outputs)):
            ranges[Ref(name, port)] = (step[name], step[name])
    for name in order:
        for ref in graph.inputs(name):
            base = _base(graph, ref)
            first, last = ranges[base]
            ranges[base] = (first, max(last, step[name]))
    return ranges


def _scratch_values(graph: Graph, order: list[str], dims: dict[str, int]) -> list[_Value]:
    returned = _returned(graph)
    ranges = _live_ranges(graph, order)
    values = []
    for name in order:
        node = graph.node(name)
        if node.op in _NOT_SCRATCH or node.op in _VIEWS:
            continue
        for port, t in enumerate(node.outputs):
            ref = Ref(name, port)
            if ref in returned:
                continue
            shape = tuple(eval_dim(d, dims) for d in t.shape)
            first, last = ranges[ref]
            values.append(_Value(ref, t, shape, math.prod(shape) * dtype_bytes(t.dtype), first, last))
    return values


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _place(values: list[_Value]) -> dict[Ref, int]:
    """Greedy by size, best fit among the gaps left by values whose live ranges overlap."""
    placed: list[tuple[int, int, _Value]] = []  # (offset, aligned size, value)
    offsets: dict[Ref, int] = {}
    for v in sorted(values, key=lambda v: (-_align(v.bytes), v.first, v.ref)):
        size = _align(v.bytes)
        busy = sorted((o, o + s) for o, s, u in placed if u.first <= v.last and v.first <= u.last)
        cursor, best, best_gap = 0, None, None
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offset = cursor if best is None else best
        offsets[v.ref] = offset
        placed.append((offset, size, v))
    return offsets


def _peak(values: list[_Value], steps: int) -> int:
    live = [0] * max(steps, 1)
    for v in values:
        for i in range(v.first, v.last + 1):
            live[i] += v.bytes
    return max(live)


def _views(graph: Graph, order: list[str]) -> tuple[View, ...]:
    out = []
    for name in order:
        if graph.node(name).op in _VIEWS:
            base = _base(graph, Ref(name))
            out.append(View(node=name, port=0, base_node=base.node, base_port=base.port))
    return tuple(out)


def make_memory_plan(graph: Graph, ctx: PassContext) -> MemoryPlan:
    """The arena plan of ``graph`` in its ``topo()`` order (see the module docstring)."""
    order = graph.topo()
    dims = dim_maxima(graph, ctx)
    values = _scratch_values(graph, order, dims)
    offsets = _place(values)
    buffers = tuple(
        Buffer(
            node=v.ref.node,
            port=v.ref.port,
            dtype=v.type.dtype,
            shape=v.shape,
            bytes=v.bytes,
            offset=offsets[v.ref],
            first_use=v.first,
            last_use=v.last,
        )
        for v in values
    )
    return MemoryPlan(
        phase=graph.name,
        bindings=tuple(dims.items()),
        alignment=ALIGNMENT,
        order=tuple(order),
        buffers=buffers,
        views=_views(graph, order),
        arena_bytes=max((_align(b.end) for b in buffers), default=0),
        naive_bytes=sum(v.bytes for v in values),
        peak_live_bytes=_peak(values, len(order)),
    )


def plan_memory(graph: Graph, ctx: PassContext) -> Graph:
    """Record ``graph.meta["memory"]``; nodes are unchanged."""
    out = graph.copy()
    out.meta["memory"] = make_memory_plan(out, ctx)
    return out
