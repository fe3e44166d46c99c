"""KV write: scatter K or V rows of one layer into their paged-cache slots (`kv_write`, `kv_writes` nodes).

The kernel sees one layer's K (or V) pages, `cache: bfloat16[pages, page_size, kv_heads, head_dim]`, a
view of the graph's `[layers, 2, pages, page_size, kv_heads, head_dim]` cache bound through
`KVWriteRule.views` ({"cache": (layer, which)}), so one kernel serves every layer and both halves.
Row `i` of `rows: bfloat16[m, kv_heads*head_dim]` goes to slot `slots[i]`, i.e. page `slot // page_size`,
row `slot % page_size`. Slots outside `[0, pages*page_size)` are skipped: the numpy interpreter refuses
them, and a kernel cannot raise, so it leaves memory it does not own untouched instead.

`kv_writes` nodes (fuse_kv_writes: a chain of such writes over the same slots, e.g. every layer's K and V
of a context append) are one kernel on the whole cache: target j of `targets = ((layer, which), ...)` reads
`rows{j}`, and copy c belongs to target c // (m · copies per row).

Schedule: every (row, head, vector) triple is one 16-byte copy; the copies are spread over a 1-D grid of
`threads`-wide blocks (a row of 1024 values is 128 threads, so blocks span rows and stay full).
The same TVMScript builds the CPU oracle: `device=False` turns the thread loops into serial loops.
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

ROWS = "m"
PAGES = "pages"
DTYPE = "bfloat16"
_ELEMENT_BYTES = 2


@dataclass(frozen=True)
class KVWriteSpec(KernelSpec):
    """Scatter `m` rows of `kv_heads*head_dim` bf16 values into one layer's K or V pages."""

    kv_heads: int
    head_dim: int
    page_size: int = 16

    def __post_init__(self) -> None:
        for key in ("kv_heads", "head_dim", "page_size"):
            if getattr(self, key) <= 0:
                raise ScheduleError(f"kv_write: {key} must be positive, found {getattr(self, key)}")

    @property
    def name(self) -> str:
        page = "" if self.page_size == 16 else f"_p{self.page_size}"
        return f"kv_write_kv{self.kv_heads}_d{self.head_dim}{page}"

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    def params(self) -> tuple[Param, ...]:
        return (
            Param("cache", DTYPE, (PAGES, self.page_size, self.kv_heads, self.head_dim), "inout"),
            Param("rows", DTYPE, (ROWS, self.width)),
            Param("slots", "int32", (ROWS,)),
        )

    def prim_func(self) -> Any:
        return kv_write_func(self, KVWriteLayout(threads=64, vector=_vector(self, 16)), device=False)

    def node(self) -> Node:
        """The graph node this kernel implements, on a one-layer cache (the view), as the interpreter sees it."""
        cache = TensorType(DTYPE, (1, 1, PAGES, self.page_size, self.kv_heads, self.head_dim))
        return Node.make(Op.KV_WRITE, [cache], layer=0, which=0, page_size=self.page_size)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        cache = np.array(arrays["cache"], copy=True)[None, None]  # the view as layer 0, K half
        (written,) = evaluate_node(self.node(), [cache, arrays["rows"], arrays["slots"]])
        return {"cache": written[0, 0]}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        import ml_dtypes

        rows, pages = sizes[ROWS], sizes[PAGES]
        capacity = pages * self.page_size
        if rows > capacity:
            raise ScheduleError(f"kv_write sample: {rows} rows need distinct slots, the cache has {capacity}")
        bf16 = ml_dtypes.bfloat16
        cache = rng.standard_normal((pages, self.page_size, self.kv_heads, self.head_dim), np.float32).astype(bf16)
        values = rng.standard_normal((rows, self.width), np.float32).astype(bf16)
        slots = rng.choice(capacity, size=rows, replace=False).astype(np.int32)  # distinct: no write races
        return {"cache": cache, "rows": values, "slots": slots}


@dataclass(frozen=True)
class KVWriteLayout:
    """How the copy is spread: `threads` per block, `vector` elements per copy (divides head_dim)."""

    threads: int
    vector: int


def _vector(spec: KVWriteSpec | KVWritesSpec, vector_bytes: int) -> int:
    """The widest copy of at most `vector_bytes` that tiles a head exactly."""
    vector = max(1, vector_bytes // _ELEMENT_BYTES)
    while spec.head_dim % vector:
        vector //= 2
    return vector


def kv_write_func(spec: KVWriteSpec, layout: KVWriteLayout, device: bool) -> Any:
    """The kernel as TVMScript; `device=False` is the CPU oracle (serial loops), `True` the CUDA kernel."""
    from tvm.script import tirx as T

    ps, heads, dim, width = spec.page_size, spec.kv_heads, spec.head_dim, spec.width
    nthreads, vec = layout.threads, layout.vector
    per_row = heads * (dim // vec)  # copies per row

    def grid(n: Any) -> Any:
        return T.thread_binding(n, thread="blockIdx.x") if device else T.serial(n)

    def lanes() -> Any:
        return T.thread_binding(nthreads, thread="threadIdx.x") if device else T.serial(nthreads)

    @T.prim_func(s_tir=True)
    def kv_write(cache_h: T.handle, rows_h: T.handle, slots_h: T.handle) -> None:
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        m = T.int32()
        pages = T.int32()
        cache = T.match_buffer(cache_h, (pages, ps, heads, dim), DTYPE)
        rows = T.match_buffer(rows_h, (m, width), DTYPE)
        slots = T.match_buffer(slots_h, (m,), "int32")
        for bx in grid(T.ceildiv(m * per_row, nthreads)):
            for tx in lanes():
                with T.sblock("copy"):
                    T.reads()
                    T.writes()
                    copy = T.meta_var(bx * nthreads + tx)
                    row = T.meta_var(copy // per_row)
                    head = T.meta_var(copy % per_row // (dim // vec))
                    d0 = T.meta_var(copy % (dim // vec) * vec)
                    if row < m:
                        slot: T.let[T.int32] = slots[row]
                        if slot >= 0 and slot < pages * ps:
                            for v in T.vectorized(vec):
                                cache[slot // ps, slot % ps, head, d0 + v] = rows[row, head * dim + d0 + v]

    return kv_write


@dataclass(frozen=True)
class KVWritesSpec(KernelSpec):
    """Several writes of `m` rows sharing the slots, each into its (layer, K or V) pages of the whole cache
    `[layers, 2, pages, page_size, kv_heads, head_dim]`: the kv_writes node (fuse_kv_writes), one launch."""

    layers: int
    kv_heads: int
    head_dim: int
    targets: tuple[tuple[int, int], ...]
    page_size: int = 16

    def __post_init__(self) -> None:
        KVWriteSpec(self.kv_heads, self.head_dim, self.page_size)  # the same size checks
        if not self.targets or any(not (0 <= layer < self.layers and which in (0, 1)) for layer, which in self.targets):
            raise ScheduleError(
                f"kv_writes: targets {self.targets} must be (layer < {self.layers}, 0 for K or 1 for V) pairs"
            )

    @property
    def name(self) -> str:
        page = "" if self.page_size == 16 else f"_p{self.page_size}"
        targets = "_".join(f"{layer}{'kv'[which]}" for layer, which in self.targets)
        return f"kv_writes_l{self.layers}_kv{self.kv_heads}_d{self.head_dim}{page}_{targets}"

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    def params(self) -> tuple[Param, ...]:
        cache = (self.layers, 2, PAGES, self.page_size, self.kv_heads, self.head_dim)
        rows = tuple(Param(f"rows{j}", DTYPE, (ROWS, self.width)) for j in range(len(self.targets)))
        return (Param("cache", DTYPE, cache, "inout"), Param("slots", "int32", (ROWS,)), *rows)

    def prim_func(self) -> Any:
        return kv_writes_func(self, KVWriteLayout(threads=64, vector=_vector(self, 16)), device=False)

    def node(self) -> Node:
        cache = TensorType(DTYPE, (self.layers, 2, PAGES, self.page_size, self.kv_heads, self.head_dim))
        return Node.make(Op.KV_WRITES, [cache], targets=self.targets, page_size=self.page_size)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        rows = [arrays[f"rows{j}"] for j in range(len(self.targets))]
        (written,) = evaluate_node(self.node(), [np.array(arrays["cache"], copy=True), arrays["slots"], *rows])
        return {"cache": written}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        import ml_dtypes

        one = KVWriteSpec(self.kv_heads, self.head_dim, self.page_size).sample(rng, sizes)
        shape = (self.layers, 2, *one["cache"].shape)
        cache = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
        rows = {f"rows{j}": rng.standard_normal(one["rows"].shape, np.float32).astype(ml_dtypes.bfloat16)
                for j in range(len(self.targets))}  # fmt: skip
        return {"cache": cache, "slots": one["slots"], **rows}


def kv_writes_func(spec: KVWritesSpec, layout: KVWriteLayout, device: bool) -> Any:
    """kv_write_func's copy for every target in one grid: copy c is target c // (m · copies per row), whose
    branch (static, one per target) reads its own rows buffer. `device=False` is the CPU oracle."""
    import tvm
    from tvm.script import tirx as T

    ps, heads, dim = spec.page_size, spec.kv_heads, spec.head_dim
    nthreads, vec = layout.threads, layout.vector
    per_row = heads * (dim // vec)

    def target_macro(j: int, layer: int, which: int) -> Any:
        @T.macro
        def write(cache, slots, rows, m, copy):
            if copy // (m * per_row) == j:
                row = T.meta_var(copy % (m * per_row) // per_row)
                head = T.meta_var(copy % per_row // (dim // vec))
                d0 = T.meta_var(copy % (dim // vec) * vec)
                slot: T.let[T.int32] = slots[row]
                if slot >= 0 and slot < cache.shape[2] * ps:
                    for v in T.vectorized(vec):
                        cache[layer, which, slot // ps, slot % ps, head, d0 + v] = rows[row, head * dim + d0 + v]

        return write

    macros = {f"write{j}": target_macro(j, layer, which) for j, (layer, which) in enumerate(spec.targets)}
    n = len(spec.targets)
    grid = "T.thread_binding({}, thread='blockIdx.x')" if device else "T.serial({})"
    lanes = f"T.thread_binding({nthreads}, thread='threadIdx.x')" if device else f"T.serial({nthreads})"
    params = spec.params()
    lines = [
        "@T.prim_func(s_tir=True)",
        f"def kv_writes({', '.join(f'{p.name}_h: T.handle' for p in params)}):",
        f"    T.func_attr({{'global_symbol': {spec.name!r}, 'tirx.noalias': True}})",
        "    m = T.int32()",
        "    pages = T.int32()",
        *(f"    {p.name} = T.match_buffer({p.name}_h, ({', '.join(map(str, p.shape))},), {p.dtype!r})" for p in params),
        f"    for bx in {grid.format(f'T.ceildiv({n} * m * {per_row}, {nthreads})')}:",
        f"        for tx in {lanes}:",
        "            with T.sblock('copy'):",
        "                T.reads()",
        "                T.writes()",
        *(f"                write{j}(cache, slots, rows{j}, m, bx * {nthreads} + tx)" for j in range(n)),
    ]
    return tvm.script.from_source("\n".join(lines), extra_vars={"T": T, **macros})


class KVWriteRule(FamilyRule):
    """`kv_write` nodes on a bf16 paged cache (or a KVWriteSpec).

    Knobs: `threads` per block (a multiple of the warp size) and `vector_bytes` per copy (2, 4, 8, 16).
    """

    name = "kv_write"
    knob_names = ("threads", "vector_bytes")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # A pure copy: 256 threads keep blocks small enough that a few-row write still spreads over SMs.
        return {"threads": min(256, target.max_threads_per_block), "vector_bytes": 16}

    def spec_of(self, subject: Any) -> KVWriteSpec | KVWritesSpec | None:
        if isinstance(subject, KVWriteSpec | KVWritesSpec):
            return subject
        if isinstance(subject, OpInstance) and subject.op is Op.KV_WRITES:
            return _kv_writes_spec(subject)
        if not isinstance(subject, OpInstance) or subject.op is not Op.KV_WRITE or len(subject.inputs) != 3:
            return None
        cache, rows, slots = subject.inputs
        if cache.dtype != DTYPE or rows.dtype != DTYPE or slots.dtype != "int32" or len(cache.shape) != 6:
            return None
        page, heads, dim = cache.shape[3:]
        if not all(isinstance(x, int) for x in (page, heads, dim)) or page != subject.attr("page_size", page):
            return None
        if rows.shape[-1] != heads * dim:
            return None
        return KVWriteSpec(kv_heads=heads, head_dim=dim, page_size=page)

    def views(self, op: OpInstance) -> dict[str, tuple[int, ...]]:
        if op.op is Op.KV_WRITES:
            return {}  # the whole cache: each target picks its layer and half
        return {"cache": (int(op.attr("layer")), int(op.attr("which")))}

    def schedule(self, spec: KVWriteSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        threads, vector_bytes = knobs["threads"], knobs["vector_bytes"]
        if vector_bytes not in (2, 4, 8, 16):
            raise ScheduleError(f"kv_write knob vector_bytes={vector_bytes}: expected 2, 4, 8 or 16")
        if threads <= 0 or threads % target.warp_size or threads > target.max_threads_per_block:
            raise ScheduleError(
                f"kv_write knob threads={threads}: expected a multiple of {target.warp_size} up to "
                f"{target.max_threads_per_block} on {target.name}"
            )
        layout = KVWriteLayout(threads=threads, vector=_vector(spec, vector_bytes))
        func = kv_writes_func if isinstance(spec, KVWritesSpec) else kv_write_func
        return func(spec, layout, device=True).with_attr("tirx.is_scheduled", True)


def _kv_writes_spec(inst: OpInstance) -> KVWritesSpec | None:
    cache, slots, rows = inst.inputs[0], inst.inputs[1], inst.inputs[2:]
    if cache.dtype != DTYPE or slots.dtype != "int32" or len(cache.shape) != 6:
        return None
    layers, _, _, page, heads, dim = cache.shape
    if not all(isinstance(x, int) for x in (layers, page, heads, dim)) or page != inst.attr("page_size", page):
        return None
    if any(r.dtype != DTYPE or r.shape[-1] != heads * dim for r in rows):
        return None
    try:
        targets = tuple((int(layer), int(which)) for layer, which in inst.attr("targets"))
        return KVWritesSpec(layers=layers, kv_heads=heads, head_dim=dim, targets=targets, page_size=page)
    except ScheduleError:
        return None
