"""head_prep: column windows of one projection, each copied or per-head RMS-normed and/or RoPE'd, in one kernel.

`x [m, width]` bf16 (m rows symbolic int32) holds whole heads of `head_dim`; window j is the columns
[start_j, stop_j) and goes to its own output `y_j [m, stop_j - start_j]`: RMS-normed per head with its
weight `w_j [head_dim]` if it norms (`y = x / sqrt(mean_head(x²) + eps) · w`), then rotated by neox
rotate-half RoPE if it ropes (angles `positions[i] · inv_freq[f]` in f32, cos and sin times the attention
factor), else copied. This is what fuse_head_prep puts in place of a fused projection's SLICE → q/k norm →
RoPE chains, so a layer's q, k and v (or every layer's context K and V) take one launch instead of seven.
The sum of squares and the rotation stay in f32 between the two steps.

Layout: a head is `head_dim / 16` lanes; a lane holds 8 elements (one 16-byte vector) of each half of its
head, the same 8 frequencies of both, so RoPE pairs element e with element e of the other vector in
registers, and the norm's sum is the lane's 16 squares plus a butterfly of `__shfl_xor_sync` over the
head's lanes (only they take part: heads of different windows may share a warp). Thread block = one row ×
`threads / lanes` consecutive heads of all windows together; the windows are static, so each thread takes
the branch of the window its head lies in.

Everything no kernel of the step writes is read before the wait for the grid that writes x
(dependent_launch.py): the norm weights, the positions (graph inputs, written by the host) and inv_freq, and
the angles' sines and cosines are computed there too, so after the wait a thread loads its two vectors of x
and makes no other trip to memory. H200, Qwen3-8B drafter step (one run): the five propose launches add 9.4
µs instead of 12.1 at nb = 1, the step unchanged (the time goes into the attention after it).

Measured and left out: this kernel prefetching into L2 (one `cp.async.bulk.prefetch.L2` per 64 KiB, before
the wait) the first 25 MiB of the weights the linears after its attention stream, so that the attention's
time would also fill L2 with them. H100, one run of four builds, Qwen3-8B step at nb = 1: bf16 1.264 → 1.294
ms, FP8 0.798 → 0.809 (40 MiB, or every call up to 128 rows, no better). Over five layers head_prep took
15.1 → 41.6 µs (its blocks stay until their bulk prefetches are out) and the split attention 55.3 → 75.7 µs
(its K/V reads queue behind the prefetches), while o gained little even with its whole FP8 weight in L2
(48.3 → 43.8 µs): the GEMVs of 16 rows are bound by their blocks' k chains, not by DRAM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, WAIT
from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import HEAD_PREP_HEAD_DIMS, Op
from dflash_compiler.targets import Target

from .base import FamilyRule, KernelSpec, OpInstance, Param, ScheduleError
from .elementwise import check_knobs, float_sample, number_tag, numpy_dtype

ROWS = "m"
DTYPE = "bfloat16"
VECTOR = 8  # bf16 elements per 16-byte access
_SAMPLE_MAX_POSITION = 8192


@dataclass(frozen=True)
class HeadPrepSpec(KernelSpec):
    """`windows` = ((start, stop, norm, rope), ...) over `x [m, width]`; see the module docstring."""

    width: int
    head_dim: int
    windows: tuple[tuple[int, int, bool, bool], ...]
    eps: float = 1e-6
    attention_factor: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if self.head_dim not in HEAD_PREP_HEAD_DIMS:
            raise ScheduleError(
                f"head_prep: head_dim {self.head_dim} is not 16·2^i up to 512; each of a head's lanes holds one "
                "16-byte vector of both halves. Fix: leave such heads to the head_rmsnorm and rope kernels"
            )
        if not self.windows:
            raise ScheduleError("head_prep: expected at least one window")
        for start, stop, _, _ in self.windows:
            if not 0 <= start < stop <= self.width or (stop - start) % self.head_dim:
                raise ScheduleError(
                    f"head_prep: window [{start}:{stop}] is not whole heads of {self.head_dim} within the width "
                    f"{self.width}"
                )
        if not self.name:
            parts = "_".join(f"{a}to{b}{'n' if n else ''}{'r' if r else ''}" for a, b, n, r in self.windows)
            factor = "" if float(self.attention_factor) == 1.0 else f"_af{number_tag(self.attention_factor)}"
            eps = f"_eps{number_tag(self.eps)}" if self.norms else ""
            name = f"head_prep_w{self.width}_d{self.head_dim}_{parts}{eps}{factor}"
            object.__setattr__(self, "name", name)

    @property
    def norms(self) -> int:
        return sum(bool(w[2]) for w in self.windows)

    @property
    def heads(self) -> int:
        return sum((stop - start) // self.head_dim for start, stop, _, _ in self.windows)

    def params(self) -> tuple[Param, ...]:
        d = self.head_dim
        return (
            Param("x", DTYPE, (ROWS, self.width)),
            Param("positions", "int32", (ROWS,)),
            Param("inv_freq", "float32", (d // 2,)),
            *(Param(f"w{j}", DTYPE, (d,)) for j in range(self.norms)),
            *(Param(f"y{j}", DTYPE, (ROWS, stop - start), "out") for j, (start, stop, _, _) in enumerate(self.windows)),
        )

    def node(self) -> Node:
        outs = [TensorType(DTYPE, (ROWS, stop - start)) for start, stop, _, _ in self.windows]
        return Node.make(Op.HEAD_PREP, outs, windows=self.windows, head_dim=self.head_dim, eps=self.eps,
                         attention_factor=self.attention_factor)  # fmt: skip

    def prim_func(self) -> Any:
        from tvm import s_tir, te, tirx

        d, half = self.head_dim, self.head_dim // 2
        rows = tirx.Var(ROWS, "int32")
        x = te.placeholder((rows, self.width), DTYPE, name="x")
        positions = te.placeholder((rows,), "int32", name="positions")
        inv_freq = te.placeholder((half,), "float32", name="inv_freq")
        weights = [te.placeholder((d,), DTYPE, name=f"w{j}") for j in range(self.norms)]
        norm_weights = iter(weights)
        outs = [
            _window_compute(x, positions, inv_freq, next(norm_weights) if window[2] else None, rows, window, j, self)
            for j, window in enumerate(self.windows)
        ]
        sch = s_tir.Schedule(te.create_prim_func([x, positions, inv_freq, *weights, *outs]))
        for j in range(len(self.windows)):  # y{j}[i, h, s, f] is the parameter's row i, column h*d + s*d/2 + f
            sch.transform_layout(sch.get_sblock(f"y{j}"), ("write", 0), lambda i, h, s, f: (i, h * d + s * half + f))
        return sch.mod["main"].with_attr("global_symbol", self.name)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        args = [arrays["x"], arrays["positions"], arrays["inv_freq"], *(arrays[f"w{j}"] for j in range(self.norms))]
        return {f"y{j}": np.asarray(y, np.float32) for j, y in enumerate(evaluate_node(self.node(), args))}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        from dflash_compiler.rope import RopeSpec, RopeType, rope_tables

        rows = sizes[ROWS]
        inv_freq, _ = rope_tables(RopeSpec(rope_type=RopeType.DEFAULT, theta=1e6), self.head_dim)
        arrays = {
            "x": float_sample(rng, (rows, self.width), DTYPE, 2.0),
            "positions": rng.integers(0, _SAMPLE_MAX_POSITION, rows, dtype=np.int32),
            "inv_freq": inv_freq.astype(np.float32),
        }
        for j in range(self.norms):
            arrays[f"w{j}"] = (1.0 + 0.2 * rng.standard_normal(self.head_dim)).astype(numpy_dtype(DTYPE))
        for j, (start, stop, _, _) in enumerate(self.windows):
            arrays[f"y{j}"] = np.zeros((rows, stop - start), numpy_dtype(DTYPE))
        return arrays


def _window_compute(x: Any, positions: Any, inv_freq: Any, w: Any, rows: Any, window: tuple[int, int, bool, bool],
                    j: int, spec: HeadPrepSpec) -> Any:  # fmt: skip
    """Window j of the TE oracle as `y{j}[i, h, s, f]` (head h, half s, element f of the half): every index
    affine, as TVM's region analysis needs (head_norm_rope.py); `prim_func` lays it out as rows."""
    from tvm import te, tirx

    start, stop, _, rope = window
    d, half = spec.head_dim, spec.head_dim // 2
    shape = (rows, (stop - start) // d, 2, half)

    def value(i: Any, h: Any, s: Any, f: Any) -> Any:
        return x[i, start + h * d + s * half + f].astype("float32")

    at = value
    if w is not None:
        rs, rf = te.reduce_axis((0, 2), name=f"rs{j}"), te.reduce_axis((0, half), name=f"rf{j}")
        ss = te.compute(shape[:2], lambda i, h: te.sum(value(i, h, rs, rf) * value(i, h, rs, rf), axis=[rs, rf]),
                        name=f"ss{j}")  # fmt: skip
        scale, eps = tirx.const(1.0 / d, "float32"), tirx.const(float(spec.eps), "float32")

        def norm(i: Any, h: Any, s: Any, f: Any) -> Any:
            return value(i, h, s, f) * tirx.rsqrt(ss[i, h] * scale + eps) * w[s * half + f].astype("float32")

        normed = te.compute(shape, norm, name=f"normed{j}")

        def at(i: Any, h: Any, s: Any, f: Any) -> Any:
            return normed[i, h, s, f]

    if not rope:
        return te.compute(shape, lambda i, h, s, f: at(i, h, s, f).astype(DTYPE), name=f"y{j}")
    factor = tirx.const(float(spec.attention_factor), "float32")

    def rotated(i: Any, h: Any, s: Any, f: Any) -> Any:
        angle = positions[i].astype("float32") * inv_freq[f]
        other = at(i, h, 1 - s, f)  # the same element of the other half
        signed = tirx.Select(s == 0, -other, other)
        return (at(i, h, s, f) * (te.cos(angle) * factor) + signed * (te.sin(angle) * factor)).astype(DTYPE)

    return te.compute(shape, rotated, name=f"y{j}")


def head_prep_func(spec: HeadPrepSpec, threads: int) -> Any:
    """The CUDA-scheduled PrimFunc of `spec`: `threads` per block, one row per block along x (docstring)."""
    import tvm
    from tvm.script import tirx as T

    d, half = spec.head_dim, spec.head_dim // 2
    lanes = d // 16
    heads_per_block = threads // lanes
    groups = -(-spec.heads // heads_per_block)
    eps, factor = float(spec.eps), float(spec.attention_factor)
    group_bits = (1 << lanes) - 1  # the lanes of one head, as a shuffle mask before shifting to its place

    def window_macros(first_head: int, last_head: int, start: int, norm: bool, rope: bool) -> tuple[Any, Any]:
        """(prepare, apply) of one window: `prepare` runs before the wait and reads only what no kernel of the
        step writes (the norm weight, the positions, which are graph inputs, and inv_freq); `apply` reads x."""

        @T.macro
        def prepare(positions, inv_freq, w, row, group, tid, wv, sn, cs):
            head = T.meta_var(group * heads_per_block + tid // lanes)
            if first_head <= head and head < last_head:
                if norm:
                    for e in T.unroll(VECTOR):
                        wv[e] = T.Cast("float32", w[tid % lanes * VECTOR + e])
                        wv[VECTOR + e] = T.Cast("float32", w[half + tid % lanes * VECTOR + e])
                if rope:
                    # the angles' sines and cosines in a loop that is not unrolled, one sincosf each: unrolled,
                    # every window held 16 inlined sinf/cosf (their slow paths included) and the kernel's
                    # code outgrew the instruction cache
                    for e in T.serial(VECTOR, unroll=False):
                        T.evaluate(T.call_extern(
                            "void", "sincosf",
                            T.Cast("float32", positions[row]) * inv_freq[tid % lanes * VECTOR + e],
                            T.address_of(sn[e]), T.address_of(cs[e]),
                        ))  # fmt: skip

        @T.macro
        def apply(x, y, row, group, tid, xl, a, ss, wv, sn, cs):
            head = T.meta_var(group * heads_per_block + tid // lanes)
            if first_head <= head and head < last_head:
                column = T.meta_var((head - first_head) * d + tid % lanes * VECTOR)
                for v in T.vectorized(VECTOR):
                    xl[v] = x[row, start + column + v]
                for v in T.vectorized(VECTOR):
                    xl[VECTOR + v] = x[row, start + column + half + v]
                for e in T.unroll(2 * VECTOR):
                    a[e] = T.Cast("float32", xl[e])
                if norm:
                    ss[0] = T.float32(0)
                    for e in T.unroll(2 * VECTOR):
                        ss[0] = ss[0] + a[e] * a[e]
                    for b in T.unroll(lanes.bit_length() - 1):  # butterfly over the head's lanes
                        ss[0] = ss[0] + T.call_extern(
                            "float32", "__shfl_xor_sync",
                            T.shift_left(T.uint32(group_bits), T.Cast("uint32", tid % 32 // lanes * lanes)),
                            ss[0], T.shift_left(1, b), lanes,
                        )  # fmt: skip
                    ss[0] = T.rsqrt(ss[0] / T.float32(d) + T.float32(eps))
                    for e in T.unroll(2 * VECTOR):
                        a[e] = a[e] * ss[0] * wv[e]
                if rope:
                    for e in T.unroll(VECTOR):
                        ss[2] = cs[e] * T.float32(factor)
                        ss[3] = sn[e] * T.float32(factor)
                        ss[1] = a[e]
                        a[e] = a[e] * ss[2] - a[VECTOR + e] * ss[3]
                        a[VECTOR + e] = a[VECTOR + e] * ss[2] + ss[1] * ss[3]
                for e in T.unroll(2 * VECTOR):
                    xl[e] = T.Cast(DTYPE, a[e])
                for v in T.vectorized(VECTOR):
                    y[row, column + v] = xl[v]
                for v in T.vectorized(VECTOR):
                    y[row, column + half + v] = xl[VECTOR + v]

        return prepare, apply

    @T.macro
    def wait_for_inputs():
        # every thread waits, whichever window it prepared: the grid completes only after its predecessor
        T.evaluate(T.call_extern("void", WAIT))
        T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))

    macros: dict[str, Any] = {"wait_for_inputs": wait_for_inputs}
    prepares, applies, head, norm_index = [], [], 0, 0
    for j, (start, stop, norm, rope) in enumerate(spec.windows):
        macros[f"prepare{j}"], macros[f"apply{j}"] = window_macros(head, head + (stop - start) // d, start, norm, rope)
        weight = f"w{norm_index}" if norm else "x"  # a window that does not norm never reads its weight
        norm_index += int(norm)
        prepares.append(f"prepare{j}(positions, inv_freq, {weight}, row, group, tid, wv, sn, cs)")
        applies.append(f"apply{j}(x, y{j}, row, group, tid, xl, a, ss, wv, sn, cs)")
        head += (stop - start) // d
    calls = [*prepares, "wait_for_inputs()", *applies]
    params = [p for p in spec.params()]
    lines = [
        "@T.prim_func(s_tir=True)",
        f"def head_prep({', '.join(f'{p.name}_h: T.handle' for p in params)}):",
        f"    T.func_attr({{'global_symbol': {spec.name!r}, 'tirx.noalias': True, 'tirx.is_scheduled': True}})",
        "    m = T.int32()",
    ]
    for p in params:
        shape = ", ".join(str(s) for s in p.shape)
        lines.append(f"    {p.name} = T.match_buffer({p.name}_h, ({shape},), {p.dtype!r})")
    lines += [
        "    for row in T.thread_binding(m, thread='blockIdx.x'):",
        f"        for group in T.thread_binding({groups}, thread='blockIdx.y'):",
        f"            for tid in T.thread_binding({threads}, thread='threadIdx.x'):",
        "                with T.sblock('head_prep'):",
        "                    T.reads()",
        "                    T.writes()",
        f"                    xl = T.sblock_alloc_buffer(({2 * VECTOR},), {DTYPE!r}, scope='local')",
        f"                    a = T.sblock_alloc_buffer(({2 * VECTOR},), 'float32', scope='local')",
        "                    ss = T.sblock_alloc_buffer((4,), 'float32', scope='local')",
        f"                    wv = T.sblock_alloc_buffer(({2 * VECTOR},), 'float32', scope='local')",
        f"                    sn = T.sblock_alloc_buffer(({VECTOR},), 'float32', scope='local')",
        f"                    cs = T.sblock_alloc_buffer(({VECTOR},), 'float32', scope='local')",
        *(f"                    {call}" for call in calls),
    ]
    return tvm.script.from_source("\n".join(lines), extra_vars={"T": T, **macros})


class HeadPrepRule(FamilyRule):
    """head_prep nodes (bf16 projection, int32 positions, f32 inv_freq, bf16 norm weights).

    Knob: `threads` per block (a multiple of the warp size; each head takes head_dim / 16 of them).
    """

    name = "head_prep"
    knob_names = ("threads",)

    def default_knobs(self, target: Target) -> dict[str, int]:
        # 16 heads of 128 per block: one draft block's 16 rows of a Qwen3 layer's 48 q/k/v heads make 48
        # blocks, and 7 context rows of 5 layers' 80 K/V heads make 35
        return {"threads": min(128, target.max_threads_per_block)}

    def spec_of(self, subject: Any) -> HeadPrepSpec | None:
        if isinstance(subject, HeadPrepSpec):
            return subject
        if not isinstance(subject, OpInstance) or subject.op is not Op.HEAD_PREP:
            return None
        x, positions, inv_freq = subject.inputs[:3]
        if x.dtype != DTYPE or len(x.shape) != 2 or not isinstance(x.shape[1], int) or positions.dtype != "int32":
            return None
        d = int(subject.attr("head_dim"))
        weights = subject.inputs[3:]
        if inv_freq != TensorType("float32", (d // 2,)) or any(w != TensorType(DTYPE, (d,)) for w in weights):
            return None
        windows = tuple(tuple(w) for w in subject.attr("windows"))
        try:
            return HeadPrepSpec(width=x.shape[1], head_dim=d, windows=windows, eps=float(subject.attr("eps")),
                                attention_factor=float(subject.attr("attention_factor")))  # fmt: skip
        except ScheduleError:
            return None  # head dims this kernel does not lay out

    def schedule(self, spec: HeadPrepSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        threads = knobs["threads"]
        check_knobs(self.name, target, threads=threads, vector_bytes=16)
        return head_prep_func(spec, threads)
