"""ARGMAX and TOPK over float32 logit rows `[m, vocab]`, two-stage so a few rows still fill the GPU.

Both ops are selections: no arithmetic touches the logits, so the kernels agree with numpy bit for bit,
ties included. Every candidate is ranked by (value, index): the larger value wins and on equal values the
lower index wins, which is `np.argmax`'s and the stable descending sort's rule. The comparison is a total
order, so any reduction tree gives the same winner.

The pair is reduced with TVM's registered "argmax with index tie-break" reducer (cross-thread reduction
only accepts registered reducers). Its identity is `(-1, lowest float)`, so candidates enter as
`(rank, key) = (index - 2**24, max(value, lowest))` in float32: every rank is exact and below -1, so a
real entry beats the identity on a tie, and -inf is lifted to the lowest float so a row of -inf still
yields its first index. (The lift equates -inf with -3.4e38; only a row whose maximum is one of those two
values could tell.) NaN is not handled. The rank is a float rather than an int32 because TVM's
CompactBufferAllocation keeps every int32 value a block binds for the rest of the function, which made
compiling these many-reduction functions quadratic (minutes for top-16).

Stage 1 (many blocks per row): block (row, c) reduces vocabulary chunk c (`chunk` elements) to one pair
(argmax) or to its k best pairs (top-k: k rounds, each the best pair ranked after the previous round's
pick, over the chunk staged in shared memory). Stage 2 (one block per row) reduces the `ceil(vocab /
chunk)` partials the same way. The partials live in host-allocated workspaces between the two kernels.
The chunk is part of the computation (the spec: the prim_func has both stages), the thread counts are
knobs. Rows are blockIdx.x everywhere (gridDim.y stops at 65535).

ARGMAX's CUDA kernels are written out (`argmax_func`) rather than scheduled from the TE reduction, whose
stage 1 loaded one float per step of a serial chain: a stage-1 thread first loads its whole share of the
chunk as 16-byte vectors, then ranks them in index order, and the block combines its threads' pairs with
xor shuffles and one shared-memory round, by the same (value, index) order. On the H200 (Qwen3-8B drafter
step, `bench/propose.py --timeline`) stage 1 took 4.8 µs at nb = 1 and 23.2 at nb = 8 against 9.7 and
50.2 for the scheduled reduction. TOPK keeps the TE schedule.

`m` (rows) is the only variable; the launch plan binds it to the logits' row count (`nb*(blk-1)` in the
propose graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import EXACT, FamilyRule, KernelSpec, OpInstance, Param, ScheduleError, Tolerance

ROWS = "m"  # logit rows; the launch plan binds it
LOGITS = "float32"
IDS = "int32"
RANK = "float32"  # ranks are float32, not int32 (see the module docstring)
NO_RANK = -1.0  # the rank of the reducer's identity
RANK_BASE = 1 << 24  # rank = index - RANK_BASE, a float32: exact, and below the identity's -1 for every index
DEFAULT_CHUNK = 4096  # vocabulary elements per stage-1 block (151936 -> 38 blocks per row)


# ------------------------------------------------------------------------------------ shared helpers


def default_chunk(vocab: int, preferred: int = DEFAULT_CHUNK, granule: int = 256) -> int:
    """`preferred`, or the vocabulary rounded up to `granule` when it is smaller (one chunk per row)."""
    return min(preferred, -(-vocab // granule) * granule)


def check_chunk(family: str, vocab: int, chunk: int) -> None:
    if not 0 < vocab < RANK_BASE:
        raise ScheduleError(
            f"{family}: vocabulary size must be in 1..{RANK_BASE - 1} (float32 ranks are exact below 2**24), "
            f"found {vocab}"
        )
    if chunk <= 0 or chunk % 32:
        raise ScheduleError(
            f"{family}: chunk must be a positive multiple of 32 (the warp size), found {chunk}. "
            "Fix: pass chunk=0 for the default"
        )


def pick_reducer() -> Any:
    """The (rank, key) argmax reducer, written exactly as TVM registers it (higher key; lower rank on ties)."""
    from tvm import te, tirx

    def combine(x: Any, y: Any) -> tuple[Any, Any]:
        better = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(better, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(rank_dtype: Any, key_dtype: Any) -> tuple[Any, Any]:
        return tirx.const(-1, rank_dtype), tirx.min_value(key_dtype)

    return te.comm_reducer(combine, identity, name="pick")


def lowest() -> Any:
    from tvm import tirx

    return tirx.min_value(LOGITS)


def candidate(valid: Any, index: Any, value: Any, guarded: bool = True) -> tuple[Any, Any]:
    """The (rank, key) pair of vocabulary `index` holding `value`, or the identity where `valid` is false.

    With `guarded`, `value` is only evaluated where `valid` holds (if_then_else), so it may read out of
    range otherwise; without, a plain select for values that are always safe to evaluate.
    """
    from tvm import tirx

    choose = tirx.if_then_else if guarded else tirx.Select
    return choose(valid, rank_of(index), NO_RANK), choose(valid, tirx.max(value, lowest()), lowest())


def ranked_after(key: Any, rank: Any, prev_key: Any, prev_rank: Any) -> Any:
    """True where (key, rank) comes strictly after (prev_key, prev_rank) in the pick order."""
    from tvm import tirx

    return tirx.Or(key < prev_key, tirx.And(key == prev_key, rank > prev_rank))


def chunk_partials(
    name: str, rows: Sequence[Any], vocab: int, chunk: int, value: Callable[..., Any]
) -> tuple[Any, Any]:
    """(rank, key) tensors of shape `(*rows, chunks)`: the best vocabulary entry of each chunk of each row.

    `value(*row, k)` is the score of vocabulary entry k; it is only evaluated for k < vocab.
    """
    from tvm import te

    chunks = -(-vocab // chunk)
    e = te.reduce_axis((0, chunk), name="e")
    pick = pick_reducer()

    def body(*idx: Any) -> Any:
        *row, c = idx
        k = c * chunk + e
        return pick(candidate(k < vocab, k, value(*row, k)), axis=e)

    return te.compute((*rows, chunks), body, name=name)


def merge_partials(name: str, rows: Sequence[Any], part: tuple[Any, Any], chunks: int) -> tuple[Any, Any]:
    """(rank, key) tensors of shape `rows`: the best of each row's `chunks` partials."""
    from tvm import te

    c = te.reduce_axis((0, chunks), name="c")
    pick = pick_reducer()
    return te.compute(tuple(rows), lambda *row: pick((part[0][(*row, c)], part[1][(*row, c)]), axis=c), name=name)


def rank_of(index: Any) -> Any:
    """The float32 rank of an int32 vocabulary index (exact below 2**24)."""
    from tvm import tirx

    return tirx.Cast(RANK, index) - float(RANK_BASE)


def index_of(rank: Any) -> Any:
    """The int32 index (vocabulary id, or candidate slot) a rank stands for."""
    from tvm import tirx

    return tirx.Cast(IDS, rank + float(RANK_BASE))


def bind_reduction(sch: Any, block: Any, threads: int) -> tuple[Any, Any]:
    """Spread the block's innermost (reduction) loop over threadIdx.x; returns the (thread, serial) loops.

    Threads are outer, so each thread reduces a strided serial share (coalesced loads) and TVM's
    cross-thread lowering finishes with warp shuffles; threads past the extent are predicated off.
    """
    serial, thread = sch.split(sch.get_loops(block)[-1], [None, threads])
    sch.reorder(thread, serial)
    sch.bind(thread, "threadIdx.x")
    return thread, serial


def bind_spread(sch: Any, loop: Any, threads: int) -> Any:
    """Split a spatial loop into (serial, threads) and bind the threads; returns the serial loop."""
    serial, thread = sch.split(loop, [None, threads])
    sch.reorder(thread, serial)
    sch.bind(thread, "threadIdx.x")
    return serial


def fit_threads(family: str, target: Target, threads: int, work: int) -> int:
    """`threads` checked against the target, trimmed to whole warps covering `work` items."""
    if threads <= 0 or threads % target.warp_size or threads > target.max_threads_per_block:
        raise ScheduleError(
            f"{family} knob threads={threads}: expected a multiple of {target.warp_size} up to "
            f"{target.max_threads_per_block} on {target.name}"
        )
    warps = -(-work // target.warp_size)
    return min(threads, warps * target.warp_size)


def scheduled(sch: Any) -> Any:
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def with_attrs(func: Any, name: str, op: Op) -> Any:
    return func.with_attr("global_symbol", name).with_attr("dflash.op", op.value)


def distinct_rows(rng: np.random.Generator, rows: int, vocab: int, top: int, scale: float = 3.0) -> np.ndarray:
    """float32 [rows, vocab] normals whose `top` largest values in every row are distinct (no ties)."""
    out = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    top = min(top, vocab)
    for r in range(rows):
        while True:
            best = np.sort(np.partition(out[r], vocab - top)[vocab - top :])
            if top < 2 or np.all(np.diff(best) > 0):
                break
            out[r] = (rng.standard_normal(vocab) * scale).astype(np.float32)
    return out


def coarse_bf16(rng: np.random.Generator, shape: tuple[int, ...], steps: int = 8, span: int = 8) -> np.ndarray:
    """bf16 multiples of 1/steps in [-span/steps, span/steps].

    Products of two or three such values and their sums over a few hundred terms are exact in f32, so
    a kernel's sums agree with numpy's bit for bit whatever the order: samples for greedy walks, whose
    argmax must not flip on a rounding difference.
    """
    import ml_dtypes

    ints = rng.integers(-span, span + 1, size=shape, dtype=np.int8)
    return (ints.astype(np.float32) / steps).astype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------------------- ARGMAX


@dataclass(frozen=True)
class ArgmaxSpec(KernelSpec):
    """`ids[i] = argmax(logits[i])` (int32, lowest index on ties) over `m` rows of `vocab` float32 logits."""

    vocab: int
    chunk: int = 0  # 0: default_chunk(vocab)
    name: str = ""

    def __post_init__(self) -> None:
        if self.chunk == 0:
            object.__setattr__(self, "chunk", default_chunk(self.vocab))
        check_chunk("argmax", self.vocab, self.chunk)
        if not self.name:
            object.__setattr__(self, "name", f"argmax_v{self.vocab}_c{self.chunk}")

    @property
    def chunks(self) -> int:
        return -(-self.vocab // self.chunk)

    def params(self) -> tuple[Param, ...]:
        return (Param("logits", LOGITS, (ROWS, self.vocab)), Param("ids", IDS, (ROWS,), "out"))

    def node(self) -> Node:
        return Node.make(Op.ARGMAX, [TensorType(IDS, (ROWS,))])

    def prim_func(self) -> Any:
        from tvm import te, tirx

        m = tirx.Var(ROWS, "int32")
        logits = te.placeholder((m, self.vocab), LOGITS, name="logits")
        part = chunk_partials("part", (m,), self.vocab, self.chunk, lambda i, k: logits[i, k])
        best = merge_partials("best", (m,), part, self.chunks)
        ids = te.compute((m,), lambda i: index_of(best[0][i]), name="ids")
        return with_attrs(te.create_prim_func([logits, ids]), self.name, Op.ARGMAX)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        (ids,) = evaluate_node(self.node(), [arrays["logits"]])
        return {"ids": ids}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        rows = sizes[ROWS]
        return {"logits": distinct_rows(rng, rows, self.vocab, 2), "ids": np.full(rows, -7, np.int32)}


@dataclass(frozen=True)
class PickMacros:
    """TVMScript macros that reduce (key, rank) pairs by the pick order, in registers and shared memory.

    `take(key, rank, other_key, other_rank)`: the pair in the one-element local buffers key and rank
    becomes the better of it and the other. `warp_reduce(key, rank)`: every lane of the warp ends with the
    warp's best (xor shuffles). `block_reduce(key, rank, shared, lane, w, nw)`: warp 0 ends with the best
    of the block's `nw` warps (`shared` is float32 [2, nw]; every thread of the block must call it).
    """

    take: Any
    warp_reduce: Any
    block_reduce: Any


def pick_macros(warp: int) -> PickMacros:
    """The pick-order reductions for warps of `warp` lanes."""
    from tvm.script import tirx as T

    full = T.uint32(0xFFFFFFFF)
    floor = T.float32(float(np.finfo(np.float32).min))

    @T.macro
    def take(key, rank, other_key, other_rank):
        # the pick order: the larger key, then on equal keys the lower rank (the identity's -1 loses)
        if other_key > key[0] or (other_key == key[0] and other_rank < rank[0]):
            key[0] = other_key
            rank[0] = other_rank

    @T.macro
    def warp_reduce(key, rank):
        for o in T.unroll(5):
            other_key: T.let[T.float32] = T.call_extern("float32", "__shfl_xor_sync", full, key[0], 16 >> o, warp)
            other_rank: T.let[T.float32] = T.call_extern("float32", "__shfl_xor_sync", full, rank[0], 16 >> o, warp)
            take(key, rank, other_key, other_rank)

    @T.macro
    def block_reduce(key, rank, shared, lane, w, nw):
        # every lane of a warp holds its warp's winner; warp 0 picks among the warps'
        warp_reduce(key, rank)
        if nw > 1:
            if lane == 0:
                shared[0, w] = key[0]
                shared[1, w] = rank[0]
            T.tvm_storage_sync("shared")
            if w == 0:
                key[0] = T.if_then_else(lane < nw, shared[0, T.min(lane, nw - 1)], floor)
                rank[0] = T.if_then_else(lane < nw, shared[1, T.min(lane, nw - 1)], T.float32(NO_RANK))
                warp_reduce(key, rank)

    return PickMacros(take, warp_reduce, block_reduce)


PARTIALS_IN_FLIGHT = 16  # (key, rank) pairs a thread of a partials merge loads before it ranks them


def take_partials_macro(count: int, threads: int, warp: int) -> Any:
    """`take_partials(key, rank, part, row, tid)`: fold into (key, rank) the pairs (part[1, row, i], part[0, row,
    i]) of i = tid, tid + threads, .. below `count`: a stage-2 thread's share of the row's partials in a `[2, m,
    count]` float32 workspace (ranks, then keys).

    Every load of a batch of up to PARTIALS_IN_FLIGHT pairs is issued before the batch is ranked, at indices
    clamped to the last pair (taking a pair twice leaves the pick unchanged), so the loads carry no condition.
    Ranked as they arrive, each load sat behind the branch on the one before and a thread paid one L2 round
    trip per pair: the lm_head_argmax merge over the 2,374 blocks of the few-rows GEMM (ten pairs a thread)
    issued its loads one at a time in the machine code. H100, Qwen3-8B drafter step (bench/propose.py
    --timeline, both builds in one run), µs the merge adds: 6.5 → 1.8 (bf16) and 6.3 → 1.6 (FP8) at nb = 1,
    3.7 → 1.7 and 3.7 → 1.8 at nb = 8."""
    from tvm.script import tirx as T

    take = pick_macros(warp).take
    per_thread = -(-count // threads)
    batch = min(per_thread, PARTIALS_IN_FLIGHT)
    batches = -(-per_thread // batch)

    @T.macro
    def take_partials(key, rank, part, row, tid):
        keys = T.sblock_alloc_buffer((batch,), "float32", scope="local")
        ranks = T.sblock_alloc_buffer((batch,), RANK, scope="local")
        for b in T.unroll(batches):
            for e in T.unroll(batch):
                i = T.meta_var(T.min((b * batch + e) * threads + tid, count - 1))
                keys[e] = part[1, row, i]
                ranks[e] = part[0, row, i]
            for e in T.unroll(batch):
                take(key, rank, keys[e], ranks[e])

    return take_partials


def argmax_func(spec: ArgmaxSpec, threads: int, merge_threads: int, warp: int) -> Any:
    """Both stages of `spec` as CUDA-scheduled TVMScript (see the module docstring).

    Stage 1: thread t of block (row, c) loads its `per_thread` vectors of the chunk first (16-byte loads
    where the vocabulary is a multiple of 4, so a vector is whole or past the end), then reduces them in
    index order, then the warps reduce with xor shuffles and warp 0 combines the warps' winners through
    shared memory. Stage 2: one block per row reduces the row's partials the same way (take_partials_macro).
    """
    from tvm.script import tirx as T

    vocab, chunk, chunks = spec.vocab, spec.chunk, spec.chunks
    vec = 4 if vocab % 4 == 0 and chunk % (4 * threads) == 0 else 1
    per_thread = chunk // (vec * threads)
    warps, merge_warps = threads // warp, merge_threads // warp
    floor = T.float32(float(np.finfo(np.float32).min))
    base = T.float32(float(RANK_BASE))
    picks = pick_macros(warp)
    take, block_reduce = picks.take, picks.block_reduce
    take_partials = take_partials_macro(chunks, merge_threads, warp)

    @T.prim_func(s_tir=True)
    def argmax(logits_h: T.handle, ids_h: T.handle) -> None:
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        m = T.int32()
        logits = T.match_buffer(logits_h, (m, vocab), LOGITS)
        ids = T.match_buffer(ids_h, (m,), IDS)
        part = T.sblock_alloc_buffer((2, m, chunks), RANK)  # ranks, then keys (take_partials_macro)
        for row in T.thread_binding(m, thread="blockIdx.x"):
            for c in T.thread_binding(chunks, thread="blockIdx.y"):
                for tid in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("part"):
                        T.reads()
                        T.writes()
                        vals = T.sblock_alloc_buffer((per_thread, vec), LOGITS, scope="local")
                        key = T.sblock_alloc_buffer((1,), LOGITS, scope="local")
                        rank = T.sblock_alloc_buffer((1,), RANK, scope="local")
                        shared = T.sblock_alloc_buffer((2, max(warps, 1)), LOGITS, scope="shared")
                        # every load first, so a thread has all of its vectors in flight at once
                        for e in T.unroll(per_thread):
                            first = T.meta_var(c * chunk + (e * threads + tid) * vec)
                            if first < vocab:
                                for v in T.vectorized(vec):
                                    vals[e, v] = logits[row, first + v]
                        key[0] = floor
                        rank[0] = T.float32(NO_RANK)
                        for e in T.unroll(per_thread):
                            for v in T.unroll(vec):
                                index = T.meta_var(c * chunk + (e * threads + tid) * vec + v)
                                if index < vocab:
                                    # -inf is lifted to the lowest float, so a row of -inf yields its first index
                                    take(key, rank, T.max(vals[e, v], floor), T.Cast(RANK, index) - base)
                        block_reduce(key, rank, shared, tid % warp, tid // warp, warps)
                        if tid == 0:
                            part[0, row, c] = rank[0]
                            part[1, row, c] = key[0]
        for row in T.thread_binding(m, thread="blockIdx.x"):
            for tid in T.thread_binding(merge_threads, thread="threadIdx.x"):
                with T.sblock("best"):
                    T.reads()
                    T.writes()
                    key = T.sblock_alloc_buffer((1,), LOGITS, scope="local")
                    rank = T.sblock_alloc_buffer((1,), RANK, scope="local")
                    shared = T.sblock_alloc_buffer((2, max(merge_warps, 1)), LOGITS, scope="shared")
                    key[0] = floor
                    rank[0] = T.float32(NO_RANK)
                    take_partials(key, rank, part, row, tid)
                    block_reduce(key, rank, shared, tid % warp, tid // warp, merge_warps)
                    if tid == 0:
                        ids[row] = T.Cast(IDS, rank[0] + base)

    return argmax.with_attr("dflash.op", Op.ARGMAX.value).with_attr("tirx.is_scheduled", True)


# --------------------------------------------------------------------------------------------- TOPK


@dataclass(frozen=True)
class TopKSpec(KernelSpec):
    """The k largest logits of each row and their ids, descending; equal values keep the lower id first."""

    vocab: int
    k: int
    chunk: int = 0  # 0: default_chunk(vocab)
    name: str = ""

    def __post_init__(self) -> None:
        if self.chunk == 0:
            object.__setattr__(self, "chunk", default_chunk(self.vocab))
        check_chunk("topk", self.vocab, self.chunk)
        if not 0 < self.k <= min(self.vocab, self.chunk):
            raise ScheduleError(
                f"topk: k must be in 1..min(vocab, chunk) = 1..{min(self.vocab, self.chunk)}, found {self.k}"
            )
        if not self.name:
            object.__setattr__(self, "name", f"topk_v{self.vocab}_k{self.k}_c{self.chunk}")

    @property
    def chunks(self) -> int:
        return -(-self.vocab // self.chunk)

    def params(self) -> tuple[Param, ...]:
        out = (ROWS, self.k)
        return (
            Param("logits", LOGITS, (ROWS, self.vocab)),
            Param("values", LOGITS, out, "out"),
            Param("ids", IDS, out, "out"),
        )

    def node(self) -> Node:
        out = (ROWS, self.k)
        return Node.make(Op.TOPK, [TensorType(LOGITS, out), TensorType(IDS, out)], k=self.k)

    def prim_func(self) -> Any:
        from tvm import te, tirx

        v, k, chunk, chunks = self.vocab, self.k, self.chunk, self.chunks
        m = tirx.Var(ROWS, "int32")
        logits = te.placeholder((m, v), LOGITS, name="logits")

        # stage 1: the chunk once as (rank, key) pairs. The padding past the vocabulary gets the lowest key
        # and ranks above every real entry, so it is never among a row's k best (k <= vocab): no condition
        # on the rank, which keeps TVM's region analysis fast.
        def staged_pair(i: Any, c: Any, e: Any) -> tuple[Any, Any]:
            index = c * chunk + e
            key = tirx.if_then_else(index < v, tirx.max(logits[i, index], lowest()), lowest())
            return rank_of(index), key

        staged = te.compute((m, chunks, chunk), staged_pair, name="staged")
        rounds: list[tuple[Any, Any]] = []
        for j in range(k):  # round j: the best pair ranked after round j-1's pick
            eligible = _eligible(f"eligible{j}", staged, rounds[-1] if rounds else None, 2)
            rounds.append(_best(f"round{j}", eligible, 2))
        # flat [m, chunks * k]: a one-axis reduction in stage 2 (two axes made TVM's region analysis slow)
        cand = te.compute((m, chunks * k), lambda i, q: _choose(rounds, q % k, (i, q // k)), name="cand")
        # stage 2: the same k rounds over every chunk's k candidates
        picks: list[tuple[Any, Any]] = []
        for j in range(k):
            eligible = _eligible(f"candidates{j}", cand, picks[-1] if picks else None, 1)
            picks.append(_best(f"pick{j}", eligible, 1))
        ids = te.compute((m, k), lambda i, j: index_of(_choose(picks, j, (i,))[0]), name="ids")
        # guarded gather: an id is out of range only if a row had fewer than k pickable entries (NaN logits)
        values = te.compute(
            (m, k), lambda i, j: tirx.if_then_else(ids[i, j] < v, logits[i, ids[i, j]], lowest()), name="values"
        )
        return with_attrs(te.create_prim_func([logits, values, ids]), self.name, Op.TOPK)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        values, ids = evaluate_node(self.node(), [arrays["logits"]])
        return {"values": values, "ids": ids}

    def tolerance(self, param: str) -> Tolerance:
        return EXACT  # values are copied from the logits, not computed

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        rows = sizes[ROWS]
        return {
            "logits": distinct_rows(rng, rows, self.vocab, self.k + 1),
            "values": np.full((rows, self.k), np.nan, np.float32),
            "ids": np.full((rows, self.k), -7, np.int32),
        }


def _choose(rounds: Sequence[tuple[Any, Any]], j: Any, idx: tuple[Any, ...]) -> tuple[Any, Any]:
    """(rank, key) of round `j` (a TIR expression) at `idx`: a select chain over the rounds' tensors."""
    from tvm import tirx

    rank, key = rounds[-1][0][idx], rounds[-1][1][idx]
    for r in range(len(rounds) - 2, -1, -1):
        rank = tirx.Select(j == r, rounds[r][0][idx], rank)
        key = tirx.Select(j == r, rounds[r][1][idx], key)
    return rank, key


def _eligible(name: str, source: tuple[Any, Any], prev: tuple[Any, Any] | None, lead: int) -> tuple[Any, Any]:
    """`source`'s (rank, key) pairs where they rank after `prev`'s pick (same leading index), else the identity.

    A stage of its own, so the schedule can compute it per element in registers (`_per_thread`).
    """
    from tvm import te, tirx

    def body(*idx: Any) -> tuple[Any, Any]:
        rank, key = source[0][idx], source[1][idx]
        if prev is None:
            return rank, key
        ok = ranked_after(key, rank, prev[1][idx[:lead]], prev[0][idx[:lead]])
        return tirx.Select(ok, rank, NO_RANK), tirx.Select(ok, key, lowest())

    return te.compute(source[0].shape, body, name=name)


def _best(name: str, pairs: tuple[Any, Any], lead: int) -> tuple[Any, Any]:
    """The best pair over the trailing axes (after the first `lead`) of `pairs`."""
    from tvm import te

    shape = pairs[0].shape
    axes = [te.reduce_axis((0, extent), name=f"r{a}") for a, extent in enumerate(shape[lead:])]
    pick = pick_reducer()
    return te.compute(
        tuple(shape[:lead]),
        lambda *idx: pick((pairs[0][(*idx, *axes)], pairs[1][(*idx, *axes)]), axis=axes),
        name=name,
    )


def schedule_topk(spec: TopKSpec, threads: int, merge_threads: int) -> Any:
    from tvm import s_tir

    k = spec.k
    sch = s_tir.Schedule(spec.prim_func())
    sch.compute_inline(sch.get_sblock("staged_v0"))  # ranks are index arithmetic
    for name in ("eligible0", "candidates0"):  # the first round takes every pair: no condition to keep apart
        for n in (0, 1):
            sch.compute_inline(sch.get_sblock(f"{name}_v{n}"))
    # kernel 1: block (row, chunk) stages its chunk's keys in shared memory and runs the k rounds over them
    staged = sch.get_sblock("staged_v1")
    row, chunk, elem = sch.get_loops(staged)
    sch.bind(row, "blockIdx.x")  # rows on x: gridDim.y stops at 65535
    sch.bind(chunk, "blockIdx.y")
    bind_spread(sch, elem, threads)
    sch.set_scope(staged, 0, "shared")
    for j in range(k):
        eligible = [sch.get_sblock(f"eligible{j}_v{n}") for n in (0, 1)] if j else []
        block = sch.get_sblock(f"round{j}")
        for stage in (*eligible, block):
            sch.reverse_compute_at(stage, chunk)
        _, serial = bind_reduction(sch, block, threads)
        _per_thread(sch, eligible, serial)
        sch.set_scope(block, 0, "shared")  # read by every thread of the next round
        sch.set_scope(block, 1, "shared")
    for name in ("cand_v0", "cand_v1"):
        block = sch.get_sblock(name)
        sch.reverse_compute_at(block, chunk)
        bind_spread(sch, sch.get_loops(block)[-1], threads)  # k stores, predicated to the first k threads
    # kernel 2: one block per row, its candidates in shared memory, k rounds, then the k outputs
    ids, values = sch.get_sblock("ids"), sch.get_sblock("values")
    row = sch.get_loops(ids)[0]
    sch.bind(row, "blockIdx.x")
    picks = [sch.get_sblock(f"pick{j}") for j in range(k)]
    candidates = [[sch.get_sblock(f"candidates{j}_v{n}") for n in (0, 1)] if j else [] for j in range(k)]
    for j in reversed(range(k)):  # a stage moves under the row loop after all its consumers
        for stage in (picks[j], *candidates[j]):
            sch.compute_at(stage, row)
    sch.reverse_compute_at(values, row)
    for buffer in ("cand.v0", "cand.v1"):
        readers = [picks[0], *(c for pair in candidates for c in pair)]
        reads = [r.source.name for r in sch.get(readers[0]).reads]
        cache = sch.cache_read(readers[0], reads.index(buffer), "shared", consumer_blocks=readers)
        sch.compute_at(cache, row)
        bind_spread(sch, sch.fuse(*sch.get_loops(cache)[1:]), merge_threads)
    for block, eligible in zip(picks, candidates, strict=True):
        _, serial = bind_reduction(sch, block, merge_threads)
        _per_thread(sch, eligible, serial)
        sch.set_scope(block, 0, "shared")
        sch.set_scope(block, 1, "shared")
    for block in (ids, values):
        bind_spread(sch, sch.get_loops(block)[-1], merge_threads)
    return scheduled(sch)


def _per_thread(sch: Any, stages: Sequence[Any], loop: Any) -> None:
    """Compute elementwise `stages` one element at a time inside a reduction's serial loop (registers).

    Equivalent to inlining them into the reduction, which TVM compiles about twice as slowly.
    """
    for stage in stages:
        sch.compute_at(stage, loop)
        sch.set_scope(stage, 0, "local")


# ------------------------------------------------------------------------------------------- the rule


class ArgmaxRule(FamilyRule):
    """ARGMAX and TOPK nodes over float32 logits with a static vocabulary, or their specs.

    Knobs: `threads` per stage-1 block (a chunk is spread over them) and `merge_threads` per stage-2
    block (one row's partials are spread over them); both multiples of the warp size.
    """

    name = "argmax"
    knob_names = ("threads", "merge_threads")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # A quarter of the block limit: 16 logits per thread per 4096-chunk and several blocks per SM.
        return {"threads": target.max_threads_per_block // 4, "merge_threads": 4 * target.warp_size}

    def spec_of(self, subject: Any) -> KernelSpec | None:
        if isinstance(subject, ArgmaxSpec | TopKSpec):
            return subject
        if not isinstance(subject, OpInstance) or subject.op not in (Op.ARGMAX, Op.TOPK):
            return None
        if len(subject.inputs) != 1:
            return None
        logits = subject.inputs[0]
        if logits.dtype != LOGITS or len(logits.shape) != 2 or not isinstance(logits.shape[1], int):
            return None
        expected = (IDS,) if subject.op is Op.ARGMAX else (LOGITS, IDS)
        if tuple(o.dtype for o in subject.outputs) != expected:
            return None
        vocab = logits.shape[1]
        if subject.op is Op.ARGMAX:
            return ArgmaxSpec(vocab=vocab)
        k = int(subject.attr("k"))
        if not 0 < k <= min(vocab, default_chunk(vocab)):
            return None
        return TopKSpec(vocab=vocab, k=k)

    def schedule(self, spec: Any, target: Target, knobs: Mapping[str, int]) -> Any:
        threads = fit_threads(self.name, target, knobs["threads"], spec.chunk)
        merge = fit_threads(self.name, target, knobs["merge_threads"], spec.chunks * getattr(spec, "k", 1))
        if spec.chunk % threads:
            raise ScheduleError(
                f"{self.name}: chunk {spec.chunk} of {spec.name} is not a multiple of threads={threads}. "
                "Fix: choose a power-of-two thread count that divides the chunk"
            )
        if isinstance(spec, TopKSpec):
            shared = 4 * spec.chunk + 16 * spec.k
            if shared > target.max_static_shared_memory_per_block:
                raise ScheduleError(
                    f"{spec.name} stages {shared} bytes of shared memory per block; {target.name} allows "
                    f"{target.max_static_shared_memory_per_block} static. Fix: a smaller chunk"
                )
            return schedule_topk(spec, threads, merge)
        return argmax_func(spec, threads, merge, target.warp_size)
