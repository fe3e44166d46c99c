"""RMSNorm (and residual-add + RMSNorm): `y = w * x / sqrt(mean(x^2) + eps)` over the last dim.

bf16 in and out, f32 accumulation, `m` rows symbolic (int32), hidden size H static. The residual variant
takes `a`, `b`, `w` and returns `s = a + b` (bf16) and `y = rmsnorm(a + b)`; the norm reads the f32 sum,
as the numpy reference interpreter does, not the bf16-rounded `s`.

Schedule: one thread block per row. The sum of squares is an in-thread partial over 16-byte vector loads
followed by TVM's cross-thread reduction (warp shuffles + a shared staging buffer); the scale pass reloads
the row with vector loads and stores through a local buffer. Vector loads and stores go through
`cache_read`/`cache_write` into local buffers and the arithmetic is unrolled, because vectorizing the f32
arithmetic itself makes TVM emit `make_ulonglong4(<8 floats>)`, which does not compile. The residual
variant keeps the f32 sum of its row in shared memory (4·H bytes), so `a` and `b` are read once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import Kernel, KernelSpec, Param, Rule, ScheduleError

ROWS = "m"  # the symbolic row count every rmsnorm kernel takes; the launch plan binds it
DTYPE = "bfloat16"
_ELEMENT_BYTES = 2
_OP_ATTR = "dflash.op"


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


def schedule_rmsnorm(func: Any, spec: RMSNormSpec, threads: int, vector: int) -> Any:
    """CUDA schedule of `rmsnorm_func(spec)`: one block of `threads` per row, `vector` elements per load."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    ss, y = sch.get_sblock("ss"), sch.get_sblock("y")

    def spread(loop: Any) -> tuple[Any, Any]:
        """Split a row loop into (serial outer, vector) with `threads` threads in between, bound to threadIdx.x."""
        outer, vec = sch.split(loop, [None, vector])
        outer, thread = sch.split(outer, [None, threads])
        sch.reorder(thread, outer, vec)
        sch.bind(thread, "threadIdx.x")
        return outer, vec

    def stage_reads(block: Any, names: tuple[str, ...], at: Any) -> None:
        """Vector-load the named inputs of `block` into local buffers at loop `at` (nothing to do for scalars)."""
        for name in names if vector > 1 else ():
            reads = [r.source.name for r in sch.get(block).reads]
            if name in reads:
                cache = sch.cache_read(block, reads.index(name), "local", consumer_blocks=[block])
                sch.compute_at(cache, at)
                sch.vectorize(sch.get_loops(cache)[-1])

    if spec.residual:
        total, s = sch.get_sblock("sum_f32"), sch.get_sblock("s")
        row = sch.get_loops(total)[0]
        for consumer in (s, ss, y):  # everything of one row under the row loop of the first stage
            sch.reverse_compute_at(consumer, row)
        sch.set_scope(total, 0, "shared")
        outer, vec = spread(sch.get_loops(total)[-1])
        stage_reads(total, ("a", "b"), outer)
        sch.unroll(vec)
        _, vec = spread(sch.get_loops(s)[-1])
        if vector > 1:
            sch.vectorize(vec)  # a pure f32 -> bf16 copy vectorizes fine
    else:
        row = sch.get_loops(ss)[0]
        sch.reverse_compute_at(y, row)
    sch.bind(row, "blockIdx.x")

    outer, vec = spread(sch.get_loops(ss)[-1])
    stage_reads(ss, ("x",), outer)
    sch.unroll(vec)
    sch.set_scope(ss, 0, "shared")  # the reduced value is read by every thread of the row

    outer, vec = spread(sch.get_loops(y)[-1])
    stage_reads(y, ("x", "w"), outer)
    sch.unroll(vec)
    if vector > 1:
        sch.cache_write(y, 0, "local")
        store = sch.get_consumers(y)[0]
        sch.reverse_compute_at(store, outer)
        sch.vectorize(sch.get_loops(store)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


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
        if spec.residual and 4 * spec.hidden > target.max_static_shared_memory_per_block:
            raise ScheduleError(
                f"rmsnorm_residual with hidden {spec.hidden} needs {4 * spec.hidden} bytes of shared memory per "
                f"block; {target.name} allows {target.max_static_shared_memory_per_block} static. "
                "Fix: split the residual add from the norm (two nodes) for this hidden size"
            )
        reference = rmsnorm_func(spec)
        func = schedule_rmsnorm(reference, spec, threads, vector)
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
