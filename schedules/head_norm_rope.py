"""Per-head kernels of the attention input: head_rmsnorm (q_norm / k_norm) and rope (neox rotate-half).

Both take `x [m, heads * head_dim]` (bf16, `m` rows symbolic int32) and return the same shape. Two
kernels, as the graph has two nodes, over one indexing scheme (written once, below):

* the computation sees each row as `[heads, parts, seg]` with `seg = head_dim / parts`: parts = 1 for the
  norm, 2 for rope (the two rotate-half halves). `x_tap[i, h, s, f] = x[i, h*head_dim + s*seg + f]`, and
  the result is computed in the same 4-D index space and written to the 2-D output through a layout
  transform, so every index the schedule sees is affine (no `c // head_dim`, which TVM's region analysis
  cannot bound);
* the launch: blockIdx.x = row, blockIdx.y = group of `heads_per_block` heads, threadIdx.y = head of the
  group, threadIdx.x = lane; a lane owns one vector (up to 16 bytes) of every part of its head, loaded
  once into registers with vector loads and stored with vector stores.

head_rmsnorm: `y = x / sqrt(mean_head(x^2) + eps) * w` (w [head_dim]). The sum of squares is an in-thread
sum over the lane's registers plus a shuffle reduction across the head's lanes (TVM's cross-thread
reduction; lanes of several heads share a warp), then the same registers are scaled.

rope: `y = (x * cos + rotate_half(x) * sin) * attention_factor`, angles `positions[i] * inv_freq[f]` in f32
(inv_freq float32 [head_dim/2] and positions int32 [m] are inputs, so plain, linear and YaRN RoPE are one
kernel). A lane holds the same `f` of both halves, so it rotates in registers. cos and sin depend only on
the row, so each block computes its row's table once in shared memory (2 * head_dim/2 floats) for all of
its heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import FamilyRule, KernelSpec, OpInstance, Param, ScheduleError
from .elementwise import check_knobs, float_sample, number_tag, numpy_dtype, vector_elements

ROWS = "m"
DTYPE = "bfloat16"
_OP_ATTR = "dflash.op"
_SAMPLE_MAX_POSITION = 8192  # positions of a long context (f32 angles stay within 5e-4 rad of float64)


# ------------------------------------------------------------------------------ shared per-head indexing


@dataclass(frozen=True)
class HeadLayout:
    """How one row of `heads` heads splits over a thread block (see the module docstring)."""

    heads: int
    head_dim: int
    parts: int  # 1: the whole head; 2: the two rotate-half halves
    vector: int  # elements per vector access
    heads_per_block: int

    @property
    def seg(self) -> int:
        return self.head_dim // self.parts

    @property
    def lanes(self) -> int:
        return self.seg // self.vector


def head_layout(
    rule: str, target: Target, knobs: Mapping[str, int], heads: int, head_dim: int, parts: int
) -> HeadLayout:
    """The widest vector that tiles a part, and as many whole heads per block as `threads` allows."""
    threads, vector_bytes = knobs["threads"], knobs["vector_bytes"]
    check_knobs(rule, target, threads, vector_bytes)
    vector = vector_elements(vector_bytes, (DTYPE,), (head_dim // parts,))
    lanes = head_dim // parts // vector
    if lanes > threads:
        raise ScheduleError(
            f"{rule}: head_dim {head_dim} needs {lanes} lanes of {vector} elements per head, more than "
            f"threads={threads}. Fix: raise the threads or vector_bytes knob"
        )
    per_block = threads // lanes
    while heads % per_block:  # whole heads per block, and every block full: no predicate on heads
        per_block -= 1
    return HeadLayout(heads=heads, head_dim=head_dim, parts=parts, vector=vector, heads_per_block=per_block)


def head_view(x: Any, rows: Any, heads: int, head_dim: int, parts: int) -> Any:
    """`x_tap[i, h, s, f] = x[i, h*head_dim + s*seg + f]`: the stage each lane holds in registers."""
    from tvm import te

    seg = head_dim // parts
    return te.compute((rows, heads, parts, seg), lambda i, h, s, f: x[i, h * head_dim + s * seg + f], name="x_tap")


def as_rows(func: Any, name: str, op: Op, head_dim: int, parts: int) -> Any:
    """Make the 4-D result `y[i, h, s, f]` the 2-D parameter `y[i, h*head_dim + s*seg + f]`, and name the func."""
    from tvm import s_tir

    seg = head_dim // parts
    sch = s_tir.Schedule(func)
    sch.transform_layout(sch.get_sblock("y"), ("write", 0), lambda i, h, s, f: (i, h * head_dim + s * seg + f))
    return sch.mod["main"].with_attr("global_symbol", name).with_attr(_OP_ATTR, op.value)


def loops_below(sch: Any, block: Any, anchor: Any) -> list[Any]:
    """The loops of `block` nested inside `anchor` (compute_at leaves out loops of extent 1)."""
    loops = sch.get_loops(block)
    anchor_sref = sch.get_sref(anchor)
    for index, loop in enumerate(loops):
        if sch.get_sref(loop).same_as(anchor_sref):
            return loops[index + 1 :]
    raise ScheduleError("head_norm_rope: internal error, a staged block is not under its anchor loop")


def spread_lanes(sch: Any, part: Any | None, col: Any, layout: HeadLayout) -> tuple[Any, Any | None, Any]:
    """Split a head's (part, f) loops into (lane -> threadIdx.x, part, vector); `part` None when of extent 1."""
    lane, vec = sch.split(col, [layout.lanes, layout.vector])
    if part is not None:
        sch.reorder(lane, part, vec)
        sch.unroll(part)
    sch.bind(lane, "threadIdx.x")
    return lane, part, vec


def bind_heads(sch: Any, block: Any, layout: HeadLayout) -> tuple[Any, Any, Any, Any, Any]:
    """Launch loops of a 4-D per-head block: (row, head group, head, lane, part); the vector loop is unrolled."""
    row, head, part, col = sch.get_loops(block)
    group, head = sch.split(head, [None, layout.heads_per_block])
    sch.bind(row, "blockIdx.x")
    sch.bind(group, "blockIdx.y")
    sch.bind(head, "threadIdx.y")
    lane, part, vec = spread_lanes(sch, part, col, layout)
    sch.unroll(vec)
    return row, group, head, lane, part


def stage_tap_and_store(sch: Any, block: Any, head: Any, part: Any, layout: HeadLayout) -> None:
    """Registers in and out of a per-head block scheduled by `bind_heads`.

    The x tap is loaded at the head loop (one vector per part per lane) so that every stage of the head
    (the norm's reduction, the rotation) reads registers; call this after placing those stages under
    `head`. The result goes through a local buffer and one vector store per part.
    """
    tap = sch.get_sblock("x_tap")
    sch.compute_at(tap, head)
    sch.set_scope(tap, 0, "local")
    tail = loops_below(sch, tap, head)
    _, _, tap_vec = spread_lanes(sch, tail[0] if len(tail) == 2 else None, tail[-1], layout)
    store = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(store, part)
    if layout.vector > 1:
        sch.vectorize(tap_vec)
        sch.vectorize(sch.get_loops(store)[-1])


def _check_heads(op: str, heads: int, head_dim: int, parts: int) -> None:
    if heads <= 0 or head_dim <= 0 or head_dim % parts:
        raise ScheduleError(
            f"{op}: {heads} heads of head_dim {head_dim}: expected positive sizes"
            + (" and an even head_dim (rotate-half)" if parts == 2 else "")
        )


# -------------------------------------------------------------------------------------- head_rmsnorm


@dataclass(frozen=True)
class HeadRMSNormSpec(KernelSpec):
    """Per-head RMSNorm of `x [m, heads*head_dim]` with weight `w [head_dim]` (bf16 in and out)."""

    heads: int
    head_dim: int
    eps: float
    name: str = ""

    def __post_init__(self) -> None:
        _check_heads("head_rmsnorm", self.heads, self.head_dim, 1)
        if not self.eps > 0:
            raise ScheduleError(f"head_rmsnorm: eps must be positive, found {self.eps}")
        if not self.name:
            eps = "" if self.eps == 1e-6 else f"_eps{number_tag(self.eps)}"  # 1e-6 everywhere so far
            object.__setattr__(self, "name", f"head_rmsnorm_h{self.heads}_d{self.head_dim}{eps}")

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def params(self) -> tuple[Param, ...]:
        return (
            Param("x", DTYPE, (ROWS, self.width)),
            Param("w", DTYPE, (self.head_dim,)),
            Param("y", DTYPE, (ROWS, self.width), "out"),
        )

    def prim_func(self) -> Any:
        from tvm import te, tirx

        d = self.head_dim
        rows = tirx.Var(ROWS, "int32")
        x = te.placeholder((rows, self.width), DTYPE, name="x")
        w = te.placeholder((d,), DTYPE, name="w")
        xt = head_view(x, rows, self.heads, d, 1)
        wt = te.compute((1, d), lambda s, f: w[s * d + f], name="w_tap")
        k = te.reduce_axis((0, d), name="k")
        ss = te.compute(
            (rows, self.heads),
            lambda i, h: te.sum(xt[i, h, 0, k].astype("float32") * xt[i, h, 0, k].astype("float32"), axis=k),
            name="ss",
        )

        def normed(i: Any, h: Any, s: Any, f: Any) -> Any:
            scale = te.rsqrt(ss[i, h] / float(d) + self.eps)
            return (xt[i, h, s, f].astype("float32") * scale * wt[s, f].astype("float32")).astype(DTYPE)

        y = te.compute((rows, self.heads, 1, d), normed, name="y")
        return as_rows(te.create_prim_func([x, w, y]), self.name, Op.HEAD_RMSNORM, d, 1)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        node = Node.make(Op.HEAD_RMSNORM, [TensorType(DTYPE, (ROWS, self.width))], eps=self.eps, head_dim=self.head_dim)
        (y,) = evaluate_node(node, [arrays["x"], arrays["w"]])
        return {"y": np.asarray(y, np.float32)}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        rows = sizes[ROWS]
        return {
            "x": float_sample(rng, (rows, self.width), DTYPE, 3.0),
            "w": rng.uniform(0.5, 1.5, self.head_dim).astype(numpy_dtype(DTYPE)),
            "y": np.zeros((rows, self.width), numpy_dtype(DTYPE)),
        }


def schedule_head_rmsnorm(spec: HeadRMSNormSpec, layout: HeadLayout) -> Any:
    from tvm import s_tir

    sch = s_tir.Schedule(spec.prim_func())
    y = sch.get_sblock("y")
    _, _, head, lane, part = bind_heads(sch, y, layout)
    ss = sch.get_sblock("ss")
    sch.compute_at(ss, head)
    sch.set_scope(ss, 0, "local")  # every lane of the head gets the reduced value (shuffle broadcast)
    ss_lane, ss_vec = sch.split(sch.get_loops(ss)[-1], [layout.lanes, layout.vector])
    sch.bind(ss_lane, "threadIdx.x")
    sch.unroll(ss_vec)
    stage_tap_and_store(sch, y, head, part, layout)
    weight = sch.get_sblock("w_tap")
    sch.compute_at(weight, lane)  # this lane's vector of w
    sch.set_scope(weight, 0, "local")
    if layout.vector > 1:
        sch.vectorize(loops_below(sch, weight, lane)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


# ----------------------------------------------------------------------------------------------- rope


@dataclass(frozen=True)
class HeadRopeSpec(KernelSpec):
    """Neox rotate-half RoPE of `x [m, heads*head_dim]` from `positions [m]` and `inv_freq [head_dim/2]`."""

    heads: int
    head_dim: int
    attention_factor: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        _check_heads("rope", self.heads, self.head_dim, 2)
        if not self.name:
            factor = "" if float(self.attention_factor) == 1.0 else f"_af{number_tag(self.attention_factor)}"
            object.__setattr__(self, "name", f"rope_h{self.heads}_d{self.head_dim}{factor}")

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def params(self) -> tuple[Param, ...]:
        return (
            Param("x", DTYPE, (ROWS, self.width)),
            Param("positions", "int32", (ROWS,)),
            Param("inv_freq", "float32", (self.head_dim // 2,)),
            Param("y", DTYPE, (ROWS, self.width), "out"),
        )

    def prim_func(self) -> Any:
        from tvm import te, tirx

        d, half, factor = self.head_dim, self.head_dim // 2, float(self.attention_factor)
        rows = tirx.Var(ROWS, "int32")
        x = te.placeholder((rows, self.width), DTYPE, name="x")
        positions = te.placeholder((rows,), "int32", name="positions")
        inv_freq = te.placeholder((half,), "float32", name="inv_freq")
        xt = head_view(x, rows, self.heads, d, 2)

        def angle(i: Any, f: Any) -> Any:
            return positions[i].astype("float32") * inv_freq[f]

        cos = te.compute((rows, half), lambda i, f: te.cos(angle(i, f)) * factor, name="cos")
        sin = te.compute((rows, half), lambda i, f: te.sin(angle(i, f)) * factor, name="sin")

        def rotated(i: Any, h: Any, s: Any, f: Any) -> Any:
            own = xt[i, h, s, f].astype("float32")
            other = xt[i, h, 1 - s, f].astype("float32")  # the same f of the other half
            return (own * cos[i, f] + tirx.Select(s == 0, -other, other) * sin[i, f]).astype(DTYPE)

        y = te.compute((rows, self.heads, 2, half), rotated, name="y")
        return as_rows(te.create_prim_func([x, positions, inv_freq, y]), self.name, Op.ROPE, d, 2)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        node = Node.make(
            Op.ROPE,
            [TensorType(DTYPE, (ROWS, self.width))],
            head_dim=self.head_dim,
            attention_factor=self.attention_factor,
        )
        (y,) = evaluate_node(node, [arrays["x"], arrays["positions"], arrays["inv_freq"]])
        return {"y": np.asarray(y, np.float32)}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        from dflash_compiler.rope import RopeSpec, RopeType, rope_tables

        rows = sizes[ROWS]
        inv_freq, _ = rope_tables(RopeSpec(rope_type=RopeType.DEFAULT, theta=1e6), self.head_dim)
        return {
            "x": float_sample(rng, (rows, self.width), DTYPE, 2.0),
            "positions": rng.integers(0, _SAMPLE_MAX_POSITION, rows, dtype=np.int32),
            "inv_freq": inv_freq.astype(np.float32),
            "y": np.zeros((rows, self.width), numpy_dtype(DTYPE)),
        }


def schedule_rope(spec: HeadRopeSpec, layout: HeadLayout) -> Any:
    from tvm import s_tir

    sch = s_tir.Schedule(spec.prim_func())
    y = sch.get_sblock("y")
    _, group, head, _, part = bind_heads(sch, y, layout)
    stage_tap_and_store(sch, y, head, part, layout)
    for name in ("cos", "sin"):  # the row's table, once per block, shared by its heads
        table = sch.get_sblock(name)
        sch.compute_at(table, group)
        sch.set_scope(table, 0, "shared")
        _, head, lane = sch.split(sch.get_loops(table)[-1], [None, layout.heads_per_block, layout.lanes])
        sch.bind(head, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


# ------------------------------------------------------------------------------------------- the rule


class HeadNormRopeRule(FamilyRule):
    """head_rmsnorm and rope nodes (bf16 activations; rope with its int32 positions and f32 inv_freq table).

    Knobs: `threads`, the most threads per block (a multiple of the warp size; blocks hold whole heads, so
    they may use fewer), and `vector_bytes` per access (2, 4, 8, 16).
    """

    name = "head_norm_rope"
    knob_names = ("threads", "vector_bytes")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # A quarter of the block limit: 16 heads of 128 (16 lanes each) per block, so a 32-head row is
        # two blocks and the 16-row draft block still spreads over 32 SMs.
        return {"threads": target.max_threads_per_block // 4, "vector_bytes": 16}

    def spec_of(self, subject: Any) -> KernelSpec | None:
        if isinstance(subject, HeadRMSNormSpec | HeadRopeSpec):
            return subject
        if not isinstance(subject, OpInstance) or subject.op not in (Op.HEAD_RMSNORM, Op.ROPE):
            return None
        try:
            return _head_rmsnorm_spec(subject) if subject.op is Op.HEAD_RMSNORM else _rope_spec(subject)
        except ScheduleError:
            return None  # sizes this family does not implement

    def schedule(self, spec: KernelSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        if isinstance(spec, HeadRMSNormSpec):
            return schedule_head_rmsnorm(spec, head_layout(self.name, target, knobs, spec.heads, spec.head_dim, 1))
        if isinstance(spec, HeadRopeSpec):
            table_bytes = 2 * 4 * (spec.head_dim // 2)
            if table_bytes > target.max_static_shared_memory_per_block:
                raise ScheduleError(
                    f"rope: the cos/sin table of head_dim {spec.head_dim} needs {table_bytes} bytes of shared "
                    f"memory; {target.name} allows {target.max_static_shared_memory_per_block} static"
                )
            return schedule_rope(spec, head_layout(self.name, target, knobs, spec.heads, spec.head_dim, 2))
        raise ScheduleError(f"head_norm_rope rule: cannot schedule a {type(spec).__name__}")


def _heads_of(x: TensorType, out: TensorType, head_dim: int) -> int | None:
    """Heads of a [rows, heads*head_dim] bf16 activation whose output has the same type; None otherwise."""
    if x.dtype != DTYPE or out != x or len(x.shape) != 2 or not isinstance(x.shape[1], int):
        return None
    if head_dim <= 0 or x.shape[1] % head_dim:
        return None
    return x.shape[1] // head_dim


def _head_rmsnorm_spec(inst: OpInstance) -> HeadRMSNormSpec | None:
    if len(inst.inputs) != 2 or len(inst.outputs) != 1:
        return None
    head_dim = int(inst.attr("head_dim"))
    heads = _heads_of(inst.inputs[0], inst.outputs[0], head_dim)
    if heads is None or inst.inputs[1] != TensorType(DTYPE, (head_dim,)):
        return None
    return HeadRMSNormSpec(heads=heads, head_dim=head_dim, eps=float(inst.attr("eps")))


def _rope_spec(inst: OpInstance) -> HeadRopeSpec | None:
    if len(inst.inputs) != 3 or len(inst.outputs) != 1:  # the table-less form (attr `rope`) is not a kernel input
        return None
    x, positions, inv_freq = inst.inputs
    head_dim = int(inst.attr("head_dim"))
    heads = _heads_of(x, inst.outputs[0], head_dim)
    if heads is None or head_dim % 2:
        return None
    if positions.dtype != "int32" or positions.shape != x.shape[:1]:
        return None
    if inv_freq != TensorType("float32", (head_dim // 2,)):
        return None
    return HeadRopeSpec(heads=heads, head_dim=head_dim, attention_factor=float(inst.attr("attention_factor")))
