"""Row-wise elementwise kernels: silu_mul, add, scale, softcap, slice (and the shared row-wise machinery).

Every op here is `y[i, j] = f(taps)` over `m` rows (int32, symbolic) and a static width, where each *tap*
is one input element at a fixed column offset of the same row: `silu_mul` of one input reads its gate at
`j` and its up at `j + w`, `slice` reads `j + start`. The computation is built as one copy stage per tap
followed by the arithmetic stage `y`, so the schedule can stage every tap in registers with one 16-byte
load per thread, compute in f32, and store 16 bytes at a time. `embed` and `drop_anchor` (embed.py) are
the same shape of kernel with a gathered row index, and reuse `rowwise_func` / `schedule_rowwise`.

Schedule (one launch per node): blockIdx.x = row, blockIdx.y = column chunk of `threads * vector`
elements, threadIdx.x = one vector of the chunk. Rows on x because gridDim.y/z stop at 65535 and the
context phase can have more rows. The vector is the widest power of two that divides the width and every
column offset (so all accesses are aligned); odd widths fall back to scalar accesses. Copies in and out of
the local buffers are vectorized and the arithmetic is unrolled: vectorizing f32 arithmetic makes TVM emit
8-float vector types that do not compile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import gcd
from typing import Any

import numpy as np

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import FamilyRule, KernelSpec, OpInstance, Param, ScheduleError

ROWS = "m"  # the symbolic row count; the launch plan binds it to the node's row dim (nb*blk, ctx, ...)
FLOAT_DTYPES = ("bfloat16", "float32")
ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}
VECTOR_BYTES = (2, 4, 8, 16)  # 16 bytes is the widest global load/store a CUDA thread issues
MAX_GRID_Y = 65535
_OP_ATTR = "dflash.op"


# ---------------------------------------------------------------------------------- shared helpers


def number_tag(value: float) -> str:
    """A float as a symbol-safe name fragment that round-trips: 0.2 -> '0p2', 20.0 -> '20', 1e-06 -> '1em06'."""
    value = float(value)
    text = str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return text.replace("-", "m").replace("+", "").replace(".", "p")


def dtype_tag(in_dtype: str, out_dtype: str) -> str:
    """'' for bf16 -> bf16 (the common case), else '_f32' or '_bf16to_f32'."""
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    if in_dtype == out_dtype:
        return "" if in_dtype == "bfloat16" else f"_{short[in_dtype]}"
    return f"_{short[in_dtype]}to_{short[out_dtype]}"


def check_knobs(rule: str, target: Target, threads: int, vector_bytes: int) -> None:
    """Refuse knob values no CUDA launch can use; the message says what is accepted."""
    if vector_bytes not in VECTOR_BYTES:
        raise ScheduleError(f"{rule} knob vector_bytes={vector_bytes}: expected one of {VECTOR_BYTES}")
    if threads <= 0 or threads % target.warp_size or threads > target.max_threads_per_block:
        raise ScheduleError(
            f"{rule} knob threads={threads}: expected a multiple of {target.warp_size} up to "
            f"{target.max_threads_per_block} on {target.name}"
        )


def vector_elements(vector_bytes: int, dtypes: Sequence[str], extents: Sequence[int]) -> int:
    """Elements per vector access: at most `vector_bytes` of the widest dtype, dividing every extent.

    `extents` are the width and every column offset and row stride: a vector that divides them all keeps
    every access aligned to its own size.
    """
    vector = max(1, vector_bytes // max(ITEM_BYTES[d] for d in dtypes))
    common = 0
    for extent in extents:
        common = gcd(common, int(extent))
    while vector > 1 and common % vector:
        vector //= 2
    return vector


def block_threads(threads: int, vectors: int, warp: int) -> int:
    """`threads`, or fewer when a row has fewer vectors (whole warps, so no launch is less than a warp)."""
    return min(threads, -(-vectors // warp) * warp)


def rowwise_func(
    name: str,
    op: Op,
    params: Sequence[Any],
    rows: Any,
    width: int,
    taps: Sequence[Callable[[Any, Any], Any]],
    combine: Callable[[list[Any]], Any],
    out_dtype: str,
) -> Any:
    """The unscheduled PrimFunc `y[i, j] = combine([tap(i, j) for tap in taps])` over `rows` x `width`.

    `params` are the input placeholders in parameter order; the output `y` is appended. Each tap becomes its
    own copy stage (`tap0`, `tap1`, ...), which `schedule_rowwise` stages through registers.
    """
    from tvm import te

    stages = [te.compute((rows, width), tap, name=f"tap{k}") for k, tap in enumerate(taps)]

    def value(i: Any, j: Any) -> Any:
        return combine([stage[i, j] for stage in stages]).astype(out_dtype)  # no-op when the dtype matches

    y = te.compute((rows, width), value, name="y")
    func = te.create_prim_func([*params, y])
    return func.with_attr("global_symbol", name).with_attr(_OP_ATTR, op.value)


def schedule_rowwise(func: Any, threads: int, vector: int) -> Any:
    """CUDA schedule of a `rowwise_func` PrimFunc: rows x column chunks of `threads` vectors.

    Every tap is loaded into a local buffer with one vector access per thread; the arithmetic runs on the
    registers (unrolled) into a local result, which is stored with one vector access.
    """
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    y = sch.get_sblock("y")
    row, col = sch.get_loops(y)
    chunk, lane = sch.split(col, [None, vector])  # vector divides the width: no predicate inside a vector
    chunk, thread = sch.split(chunk, [None, threads])
    sch.bind(row, "blockIdx.x")
    sch.bind(chunk, "blockIdx.y")
    sch.bind(thread, "threadIdx.x")
    store = sch.cache_write(y, 0, "local")
    sch.reverse_compute_at(store, thread)
    staged = [*sch.get_producers(y), store]
    for tap in staged[:-1]:
        sch.compute_at(tap, thread)
        sch.set_scope(tap, 0, "local")
    if vector > 1:  # with one element there is no vector loop: the innermost loop is the thread binding
        for stage in staged:
            sch.vectorize(sch.get_loops(stage)[-1])
        sch.unroll(lane)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def launch_fit(
    rule: str, target: Target, knobs: Mapping[str, int], width: int, dtypes: Sequence[str], extents: Sequence[int]
) -> tuple[int, int]:
    """(threads, elements per vector) of a row-wise kernel; knob values out of range are errors."""
    threads, vector_bytes = knobs["threads"], knobs["vector_bytes"]
    check_knobs(rule, target, threads, vector_bytes)
    vector = vector_elements(vector_bytes, dtypes, [width, *extents])
    vectors = width // vector
    threads = block_threads(threads, vectors, target.warp_size)
    if -(-vectors // threads) > MAX_GRID_Y:
        raise ScheduleError(
            f"{rule}: a row of {width} elements needs {-(-vectors // threads)} column chunks, more than CUDA's "
            f"gridDim.y limit {MAX_GRID_Y}. Fix: raise the threads or vector_bytes knob"
        )
    return threads, vector


def float_sample(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    """Normal values of `dtype` (bf16 through ml_dtypes), generated in f32 so real sizes stay cheap."""
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(scale)
    return values.astype(numpy_dtype(dtype))


def numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


# ------------------------------------------------------------------------------------------ the spec

_ATTRS: dict[Op, tuple[str, ...]] = {
    Op.SILU_MUL: (),
    Op.ADD: (),
    Op.SCALE: ("factor",),
    Op.SOFTCAP: ("cap",),
    Op.SLICE: ("start", "stop"),
}
_SAMPLE_SCALE = {Op.SOFTCAP: 30.0}  # softcap inputs wide enough that tanh saturates on some elements


@dataclass(frozen=True)
class ElementwiseSpec(KernelSpec):
    """One elementwise kernel: `op` over `m` rows of `width` output columns.

    `arity` is the number of inputs (2 for add and the two-input silu_mul). `in_width` is the columns of each
    input: 2 * width for one-input silu_mul (gate | up), the source width for slice, else width. `attrs`
    are the node's attributes (factor, cap, start/stop) as sorted pairs.
    """

    op: Op
    width: int
    in_dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    arity: int = 1
    in_width: int = 0
    attrs: tuple[tuple[str, Any], ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.op not in _ATTRS:
            raise ScheduleError(f"elementwise: op {self.op.value} is not one of {', '.join(o.value for o in _ATTRS)}")
        for dtype in (self.in_dtype, self.out_dtype):
            if dtype not in FLOAT_DTYPES:
                raise ScheduleError(f"{self.op.value}: dtype {dtype} not supported; expected one of {FLOAT_DTYPES}")
        if self.width <= 0:
            raise ScheduleError(f"{self.op.value}: width must be positive, found {self.width}")
        expected_arity = (1, 2) if self.op is Op.SILU_MUL else (2,) if self.op is Op.ADD else (1,)
        if self.arity not in expected_arity:
            raise ScheduleError(
                f"{self.op.value}: {self.arity} inputs, expected {' or '.join(map(str, expected_arity))}"
            )
        attrs = dict(self.attrs)
        if sorted(attrs) != sorted(_ATTRS[self.op]):
            raise ScheduleError(f"{self.op.value}: attributes {sorted(attrs)}, expected {sorted(_ATTRS[self.op])}")
        object.__setattr__(self, "attrs", tuple(sorted(attrs.items())))
        if not self.in_width:
            default = 2 * self.width if (self.op is Op.SILU_MUL and self.arity == 1) else self.width
            object.__setattr__(self, "in_width", int(attrs.get("stop", default)) if self.op is Op.SLICE else default)
        self._check_columns(attrs)
        if not self.name:
            object.__setattr__(self, "name", self._default_name(attrs))

    def _check_columns(self, attrs: dict[str, Any]) -> None:
        op = self.op.value
        if self.op is Op.SLICE:
            start, stop = int(attrs["start"]), int(attrs["stop"])
            if not 0 <= start < stop <= self.in_width or stop - start != self.width:
                raise ScheduleError(
                    f"slice [{start}:{stop}] of {self.in_width} columns into {self.width}: expected "
                    "0 <= start < stop <= source width and width == stop - start"
                )
        elif self.op is Op.SILU_MUL and self.arity == 1:
            if self.in_width != 2 * self.width:
                raise ScheduleError(f"{op}: one input of {self.in_width} columns; expected gate|up = 2 x {self.width}")
        elif self.in_width != self.width:
            raise ScheduleError(f"{op}: inputs of {self.in_width} columns, output {self.width}; expected equal")
        if self.op is Op.SOFTCAP and not float(attrs["cap"]) > 0:
            raise ScheduleError(f"softcap: cap must be positive, found {attrs['cap']}")

    def _default_name(self, attrs: dict[str, Any]) -> str:
        base = f"{self.op.value}{'2' if self.op is Op.SILU_MUL and self.arity == 2 else ''}_w{self.width}"
        if self.op is Op.SLICE:
            base += f"_of{self.in_width}_at{int(attrs['start'])}"
        for key in ("factor", "cap"):
            if key in attrs:
                base += f"_{key}{number_tag(attrs[key])}"
        return base + dtype_tag(self.in_dtype, self.out_dtype)

    # -- the contract

    def input_names(self) -> tuple[str, ...]:
        if self.op is Op.ADD:
            return ("a", "b")
        return ("gate", "up") if self.arity == 2 else ("x",)

    def column_offsets(self) -> tuple[int, ...]:
        """The column each tap reads at output column 0 (alignment of the vector accesses)."""
        if self.op is Op.SLICE:
            return (int(dict(self.attrs)["start"]),)
        if self.op is Op.SILU_MUL and self.arity == 1:
            return (0, self.width)
        return (0,) * self.arity

    def params(self) -> tuple[Param, ...]:
        inputs = tuple(Param(n, self.in_dtype, (ROWS, self.in_width)) for n in self.input_names())
        return (*inputs, Param("y", self.out_dtype, (ROWS, self.width), "out"))

    def node(self) -> Node:
        return Node.make(self.op, [TensorType(self.out_dtype, (ROWS, self.width))], **dict(self.attrs))

    def prim_func(self) -> Any:
        from tvm import te, tirx

        rows = tirx.Var(ROWS, "int32")
        inputs = [te.placeholder((rows, self.in_width), self.in_dtype, name=n) for n in self.input_names()]
        offsets = self.column_offsets()
        sources = inputs * len(offsets) if len(inputs) == 1 else inputs  # one silu_mul input: gate and up halves
        taps = [_tap(src, off) for src, off in zip(sources, offsets, strict=True)]
        return rowwise_func(self.name, self.op, inputs, rows, self.width, taps, self._combine, self.out_dtype)

    def _combine(self, values: list[Any]) -> Any:
        from tvm import te

        attrs = dict(self.attrs)
        if self.op is Op.SLICE:
            return values[0]
        f = [v.astype("float32") for v in values]
        if self.op is Op.SILU_MUL:
            return f[0] / (1.0 + te.exp(-f[0])) * f[1]
        if self.op is Op.ADD:
            return f[0] + f[1]
        if self.op is Op.SCALE:
            return f[0] * float(attrs["factor"])
        cap = float(attrs["cap"])
        return te.tanh(f[0] / cap) * cap

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        (y,) = evaluate_node(self.node(), [arrays[n] for n in self.input_names()])
        return {"y": np.asarray(y, np.float32)}

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """DRAM bytes of one call: the columns each tap reads (a slice reads only its range) and the output."""
        taps = len(self.column_offsets())
        return sizes[ROWS] * self.width * (taps * ITEM_BYTES[self.in_dtype] + ITEM_BYTES[self.out_dtype])

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        rows = sizes[ROWS]
        scale = _SAMPLE_SCALE.get(self.op, 2.0)
        arrays = {n: float_sample(rng, (rows, self.in_width), self.in_dtype, scale) for n in self.input_names()}
        arrays["y"] = np.zeros((rows, self.width), numpy_dtype(self.out_dtype))
        return arrays


def _tap(source: Any, offset: int) -> Callable[[Any, Any], Any]:
    return lambda i, j: source[i, j + offset] if offset else source[i, j]


# ------------------------------------------------------------------------------------------ the rule


class ElementwiseRule(FamilyRule):
    """silu_mul (one input gate|up, or two), add, scale, softcap and slice nodes of 2-D float tensors.

    Knobs: `threads` per block (a multiple of the warp size) and `vector_bytes` per access (2, 4, 8, 16).
    """

    name = "elementwise"
    knob_names = ("threads", "vector_bytes")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # A quarter of the block limit: small row counts (16 rows of a draft block) still spread over
        # several blocks per row, and a block is at least a few warps for the wide rows.
        return {"threads": target.max_threads_per_block // 4, "vector_bytes": 16}

    def spec_of(self, subject: Any) -> ElementwiseSpec | None:
        if isinstance(subject, ElementwiseSpec):
            return subject
        if not isinstance(subject, OpInstance) or subject.op not in _ATTRS:
            return None
        out, inputs = subject.outputs, subject.inputs
        if len(out) != 1 or not inputs or not all(_is_matrix(t) for t in (*out, *inputs)):
            return None
        in_dtypes = {t.dtype for t in inputs}
        rows = out[0].shape[0]
        if len(in_dtypes) != 1 or any(t.shape[0] != rows for t in inputs):
            return None
        if len({t.shape[1] for t in inputs}) != 1:
            return None
        (in_dtype,) = in_dtypes
        if in_dtype not in FLOAT_DTYPES or out[0].dtype not in FLOAT_DTYPES:
            return None
        attrs = {k: subject.attr(k) for k in _ATTRS[subject.op] if subject.node.has(k)}
        try:
            return ElementwiseSpec(
                op=subject.op,
                width=int(out[0].shape[1]),
                in_dtype=in_dtype,
                out_dtype=out[0].dtype,
                arity=len(inputs),
                in_width=int(inputs[0].shape[1]),
                attrs=tuple(sorted(attrs.items())),
            )
        except ScheduleError:
            return None  # a shape or attribute combination this family does not implement

    def schedule(self, spec: ElementwiseSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        dtypes, extents = (spec.in_dtype, spec.out_dtype), (spec.in_width, *spec.column_offsets())
        threads, vector = launch_fit(self.name, target, knobs, spec.width, dtypes, extents)
        return schedule_rowwise(spec.prim_func(), threads, vector)


def _is_matrix(t: TensorType) -> bool:
    """A 2-D tensor with a static column count (the row count may be symbolic)."""
    return len(t.shape) == 2 and isinstance(t.shape[1], int)
