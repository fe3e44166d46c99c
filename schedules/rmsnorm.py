"""RMSNorm (and residual-add + RMSNorm): `y = w * x / sqrt(mean(x^2) + eps)` over the last dim.

bf16 in and out, f32 accumulation, `m` rows symbolic (int32), hidden size H static. The residual variant
takes `a`, `b`, `w` and returns `s = a + b` (bf16) and `y = rmsnorm(a + b)`; the norm reads the f32 sum,
as the numpy reference interpreter does, not the bf16-rounded `s`.

Schedule (`rmsnorm_kernel`, TVMScript): one thread block per row, the row held in registers from load to
store, 16-byte vector accesses. The weight is loaded before the wait for the grid that writes the inputs,
by relaxed loads, which ptxas keeps above the wait (plain read-only loads it scheduled below it:
dependent_launch.py), so after the wait the kernel reads its inputs once and makes no other trip to memory;
the sum of squares is a warp butterfly plus one exchange through shared memory.

In a drafter step these kernels sit between weight streams (twice per layer), so their latency is what
counts. H200, Qwen3-8B drafter step (`bench/propose.py --timeline`, one run, against the TE schedule that
staged the row's f32 sum in shared memory and loaded the weight after the reduction): the ten
rmsnorm_residual launches add 16.5 µs to the step instead of 34.7 at nb = 1 (26.8 against 31.6 at nb = 8),
yet the step is unchanged (bf16 961.2 against 960.4 µs at nb = 1, 1399.2 against 1400.0 at nb = 8; FP8
651.2 against 648.9): the GEMV after a norm has its first weight slots in flight before its wait, and the
time the norm gives back goes into that GEMV's stream. (Those figures are of machine code that loaded the
weight after the wait: plain loads then.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, LOAD_BEFORE_WAIT, WAIT
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import Kernel, KernelSpec, Param, Rule, ScheduleError

ROWS = "m"  # the symbolic row count every rmsnorm kernel takes; the launch plan binds it
DTYPE = "bfloat16"
_ELEMENT_BYTES = 2
_OP_ATTR = "dflash.op"
MAX_HELD = 32  # row elements a thread holds from load to store (f32 sum, input and weight)


@dataclass(frozen=True)
class RMSNormSpec(KernelSpec):
    """What one rmsnorm kernel computes. `name` is the PrimFunc's global symbol."""

    hidden: int
    eps: float
    residual: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.hidden <= 0:
            raise ScheduleError(f"rmsnorm: hidden size must be positive, found {self.hidden}")
        if not self.eps > 0:
            raise ScheduleError(f"rmsnorm: eps must be positive, found {self.eps}")
        if not self.name:
            base = "rmsnorm_residual" if self.residual else "rmsnorm"
            object.__setattr__(self, "name", f"{base}_h{self.hidden}")

    @property
    def op(self) -> str:
        return Op.RMSNORM_RESIDUAL.value if self.residual else Op.RMSNORM.value

    def params(self) -> tuple[Param, ...]:
        row = (ROWS, self.hidden)
        weight = Param("w", DTYPE, (self.hidden,))
        if self.residual:
            return (
                Param("a", DTYPE, row),
                Param("b", DTYPE, row),
                weight,
                Param("s", DTYPE, row, "out"),
                Param("y", DTYPE, row, "out"),
            )
        return (Param("x", DTYPE, row), weight, Param("y", DTYPE, row, "out"))

    def prim_func(self) -> Any:
        return rmsnorm_func(self)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        w = arrays["w"].astype(np.float32)
        if self.residual:
            x = arrays["a"].astype(np.float32) + arrays["b"].astype(np.float32)
            extra = {"s": x.astype(arrays["a"].dtype)}
        else:
            x, extra = arrays["x"].astype(np.float32), {}
        x64 = x.astype(np.float64)
        y = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + self.eps) * w
        return {**extra, "y": y.astype(np.float32)}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        import ml_dtypes

        rows, bf16 = sizes[ROWS], ml_dtypes.bfloat16
        out = {p.name: np.zeros((rows, self.hidden), bf16) for p in self.params() if p.written}
        w = rng.uniform(0.5, 1.5, self.hidden).astype(bf16)
        if self.residual:
            a = rng.standard_normal((rows, self.hidden)).astype(bf16)
            b = (rng.standard_normal((rows, self.hidden)) * 0.5).astype(bf16)
            return {"a": a, "b": b, "w": w, **out}
        return {"x": (rng.standard_normal((rows, self.hidden)) * 3).astype(bf16), "w": w, **out}


def rmsnorm_func(spec: RMSNormSpec) -> Any:
    """The unscheduled TE PrimFunc: the CPU oracle, and the input of the CUDA schedule.

    Parameters: `(x, w, y)`, or `(a, b, w, s, y)` for the residual variant (graph input order, then outputs).
    """
    from tvm import te, tirx

    h, eps = spec.hidden, spec.eps
    m = tirx.Var(ROWS, "int32")  # int32: an int64 row var mixed with int32 constants breaks dlight rules
    w = te.placeholder((h,), DTYPE, name="w")
    if spec.residual:
        a = te.placeholder((m, h), DTYPE, name="a")
        b = te.placeholder((m, h), DTYPE, name="b")
        total = te.compute((m, h), lambda i, j: a[i, j].astype("float32") + b[i, j].astype("float32"), name="sum_f32")
        s = te.compute((m, h), lambda i, j: total[i, j].astype(DTYPE), name="s")

        def row(i: Any, j: Any) -> Any:
            return total[i, j]

        inputs, extra_outputs = [a, b, w], [s]
    else:
        x = te.placeholder((m, h), DTYPE, name="x")

        def row(i: Any, j: Any) -> Any:
            return x[i, j].astype("float32")

        inputs, extra_outputs = [x, w], []
    k = te.reduce_axis((0, h), name="k")
    ss = te.compute((m,), lambda i: te.sum(row(i, k) * row(i, k), axis=k), name="ss")
    y = te.compute(
        (m, h),
        lambda i, j: (row(i, j) * te.rsqrt(ss[i] / float(h) + eps) * w[j].astype("float32")).astype(DTYPE),
        name="y",
    )
    func = te.create_prim_func([*inputs, *extra_outputs, y])
    attrs = {"global_symbol": spec.name, _OP_ATTR: spec.op, "dflash.hidden": h, "dflash.eps": float(eps)}
    for key, value in attrs.items():
        func = func.with_attr(key, value)
    return func


def rmsnorm_kernel(spec: RMSNormSpec, threads: int, vector: int, warp: int) -> Any:
    """The CUDA kernel of `spec` as TVMScript: one block of `threads` per row, `vector` elements per access.

    Thread t holds the row's vectors t, t + threads, ... in registers from load to store, so the row is read
    once. The weight is loaded first, before the wait for the grid that writes the inputs (weights are never
    written by a kernel; dependent_launch.py), so after the wait the kernel makes one round trip to memory:
    its inputs' loads, all issued before any is used. The sum of squares is a xor butterfly within each warp,
    then every thread adds the warps' sums from shared memory (one barrier). The kernel lets the next grid
    in right after its wait: it is short, and the weight stream after it starts while it runs.
    """
    from tvm.script import tirx as T

    h, eps, residual = spec.hidden, float(spec.eps), spec.residual
    chunks = h // vector
    per = -(-chunks // threads)  # vectors per thread
    warps = threads // warp
    ragged = chunks % threads != 0  # the last round of vectors leaves some threads idle
    width = per * vector
    full = T.uint32(0xFFFFFFFF)

    def column(c: Any, tid: Any) -> Any:
        """The first element of thread `tid`'s vector `c` in the row."""
        return (c * threads + tid) * vector

    def active(c: Any, tid: Any) -> Any:
        """Whether thread `tid` has a vector `c` (statically true where the row's vectors fill every round)."""
        return not ragged or c * threads + tid < chunks

    @T.macro
    def load(dst, src, row, tid):
        for c in T.unroll(per):
            if active(c, tid):
                for v in T.vectorized(vector):
                    dst[c * vector + v] = src[row, column(c, tid) + v]

    @T.macro
    def load_weight(dst, w, tid):
        # relaxed loads: ptxas would schedule plain read-only ones after the wait (dependent_launch.py)
        for c in T.unroll(per):
            if active(c, tid):
                T.evaluate(T.call_extern(
                    "void", LOAD_BEFORE_WAIT, dst.access_ptr("w", offset=c * vector, extent=vector),
                    T.address_of(w[column(c, tid)]), vector * _ELEMENT_BYTES,
                ))  # fmt: skip

    @T.macro
    def norm(total, wl, stage, y, shared, row, tid):
        ss = T.sblock_alloc_buffer((1,), "float32", scope="local")
        ss[0] = T.float32(0)
        for e in T.unroll(width):
            ss[0] = ss[0] + total[e] * total[e]  # idle vectors hold zeros
        for o in T.unroll(warp.bit_length() - 1):
            ss[0] = ss[0] + T.call_extern("float32", "__shfl_xor_sync", full, ss[0], warp >> (o + 1), warp)
        if warps > 1:
            if tid % warp == 0:
                shared[tid // warp] = ss[0]
            T.tvm_storage_sync("shared")
            ss[0] = T.float32(0)
            for i in T.unroll(warps):
                ss[0] = ss[0] + shared[i]
        ss[0] = T.rsqrt(ss[0] / T.float32(h) + T.float32(eps))
        for e in T.unroll(width):
            stage[e] = T.Cast(DTYPE, total[e] * ss[0] * T.Cast("float32", wl[e]))
        for c in T.unroll(per):
            if active(c, tid):
                for v in T.vectorized(vector):
                    y[row, column(c, tid) + v] = stage[c * vector + v]

    @T.macro
    def prologue(w, wl, total, tid):
        for e in T.unroll(width):
            total[e] = T.float32(0)  # idle vectors keep zeros: they add nothing to the sum of squares
        load_weight(wl, w, tid)
        T.evaluate(T.call_extern("void", WAIT))
        T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))

    @T.macro
    def rows(a, b, w, s, y, m):
        # the plain variant passes its x as `a` and never touches `b` or `s` (`residual` is static)
        for row in T.thread_binding(m, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("rmsnorm"):
                    T.reads()
                    T.writes()
                    wl = T.sblock_alloc_buffer((width,), DTYPE, scope="local")
                    al = T.sblock_alloc_buffer((width,), DTYPE, scope="local")
                    bl = T.sblock_alloc_buffer((width,), DTYPE, scope="local")
                    total = T.sblock_alloc_buffer((width,), "float32", scope="local")
                    shared = T.sblock_alloc_buffer((warps,), "float32", scope="shared")
                    prologue(w, wl, total, tid)
                    load(al, a, row, tid)
                    if residual:
                        load(bl, b, row, tid)
                    for c in T.unroll(per):
                        if active(c, tid):
                            for v in T.unroll(vector):
                                if residual:
                                    total[c * vector + v] = T.Cast("float32", al[c * vector + v]) + T.Cast(
                                        "float32", bl[c * vector + v]
                                    )
                                    bl[c * vector + v] = T.Cast(DTYPE, total[c * vector + v])
                                else:
                                    total[c * vector + v] = T.Cast("float32", al[c * vector + v])
                            if residual:
                                for v in T.vectorized(vector):
                                    s[row, column(c, tid) + v] = bl[c * vector + v]
                    norm(total, wl, al, y, shared, row, tid)

    if residual:

        @T.prim_func(s_tir=True)
        def rmsnorm_residual(a_h: T.handle, b_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle) -> None:
            T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
            m = T.int32()
            a = T.match_buffer(a_h, (m, h), DTYPE)
            b = T.match_buffer(b_h, (m, h), DTYPE)
            w = T.match_buffer(w_h, (h,), DTYPE)
            s = T.match_buffer(s_h, (m, h), DTYPE)
            y = T.match_buffer(y_h, (m, h), DTYPE)
            rows(a, b, w, s, y, m)

        func = rmsnorm_residual
    else:

        @T.prim_func(s_tir=True)
        def rmsnorm(x_h: T.handle, w_h: T.handle, y_h: T.handle) -> None:
            T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
            m = T.int32()
            x = T.match_buffer(x_h, (m, h), DTYPE)
            w = T.match_buffer(w_h, (h,), DTYPE)
            y = T.match_buffer(y_h, (m, h), DTYPE)
            rows(x, x, w, y, y, m)

        func = rmsnorm
    return func.with_attr(_OP_ATTR, spec.op).with_attr("tirx.is_scheduled", True)


class RMSNormRule(Rule):
    """rmsnorm / rmsnorm_residual nodes (bf16), or PrimFuncs made by `rmsnorm_func`.

    Knobs: `threads` per block (a multiple of the warp size) and `vector_bytes` per load (2, 4, 8, 16).
    """

    name = "rmsnorm"
    knob_names = ("threads", "vector_bytes")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # Half the block limit: a 4096-wide row is one 16-byte load per thread, and two or three such
        # blocks still fit an SM (2048 or 1536 resident threads) for the many-row context phase.
        return {"threads": target.max_threads_per_block // 2, "vector_bytes": 16}

    def spec_of(self, subject: Any) -> RMSNormSpec | None:
        return spec_of(subject)

    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        spec = spec_of(subject)
        if spec is None:
            return None
        chosen = self.resolve_knobs(target, knobs)
        threads, vector = self._fit(spec, target, chosen["threads"], chosen["vector_bytes"])
        held = -(-spec.hidden // (threads * vector)) * vector
        if held > MAX_HELD:
            raise ScheduleError(
                f"rmsnorm with hidden {spec.hidden} and {threads} threads holds {held} elements of its row per "
                f"thread in registers; at most {MAX_HELD} keep it out of local memory. Fix: raise the threads "
                f"knob to at least {-(-spec.hidden // MAX_HELD)} (up to {target.max_threads_per_block})"
            )
        reference = rmsnorm_func(spec)
        func = rmsnorm_kernel(spec, threads, vector, target.warp_size)
        used = {**chosen, "threads": threads, "vector_bytes": vector * _ELEMENT_BYTES}
        return Kernel(name=spec.name, func=func, reference=reference, rule=self.name, knobs=used, spec=spec)

    def _fit(self, spec: RMSNormSpec, target: Target, threads: int, vector_bytes: int) -> tuple[int, int]:
        """(threads, elements per vector) for this row width; knob values out of range are errors."""
        if vector_bytes not in (2, 4, 8, 16):
            raise ScheduleError(f"rmsnorm knob vector_bytes={vector_bytes}: expected 2, 4, 8 or 16")
        if threads <= 0 or threads % target.warp_size or threads > target.max_threads_per_block:
            raise ScheduleError(
                f"rmsnorm knob threads={threads}: expected a multiple of {target.warp_size} up to "
                f"{target.max_threads_per_block} on {target.name}"
            )
        vector = vector_bytes // _ELEMENT_BYTES
        while spec.hidden % vector:  # the widest load that tiles the row exactly (odd widths: scalar)
            vector //= 2
        chunks = -(-spec.hidden // vector)
        warps = -(-chunks // target.warp_size)
        return min(threads, warps * target.warp_size), vector


def spec_of(subject: Any) -> RMSNormSpec | None:
    """The RMSNormSpec a graph node or an `rmsnorm_func` PrimFunc describes; None when it is neither."""
    if isinstance(subject, RMSNormSpec):
        return subject
    op = getattr(subject, "op", None)
    if op in (Op.RMSNORM, Op.RMSNORM_RESIDUAL) and hasattr(subject, "outputs"):
        out = subject.outputs[-1]
        width = out.shape[-1]
        if out.dtype != DTYPE or not isinstance(width, int):
            return None
        return RMSNormSpec(hidden=width, eps=float(subject.attr("eps")), residual=op is Op.RMSNORM_RESIDUAL)
    attrs = getattr(subject, "attrs", None)
    if (
        attrs is not None
        and hasattr(attrs, "get")
        and attrs.get(_OP_ATTR) in (Op.RMSNORM.value, Op.RMSNORM_RESIDUAL.value)
    ):
        return RMSNormSpec(
            hidden=int(attrs["dflash.hidden"]),
            eps=float(attrs["dflash.eps"]),
            residual=attrs[_OP_ATTR] == Op.RMSNORM_RESIDUAL.value,
            name=str(attrs["global_symbol"]),
        )
    return None
