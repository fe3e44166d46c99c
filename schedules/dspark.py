"""DSpark's own ops: MARKOV_WALK (greedy walk with the Markov bias) and CONFIDENCE (acceptance probability).

MARKOV_WALK (`_markov_walk` in the interpreter, DFLASH.md §4): for each sequence `s`, from
`prev = anchors[s]`, for each draft row `r = s*gamma + i` (`gamma = block - 1`):
`prev = argmax_v(logits[r, v] + w2[v] . w1[prev])` (lowest id on ties), `tokens[r] = prev`.
Every step is a full-vocabulary GEMV (`w2` is `[vocab, rank]`) followed by an argmax, and only the
steps are sequential, so each step is one kernel over (sequence, vocabulary chunk) blocks: the block
loads `w1[prev]` into shared memory; each thread takes vocabulary rows of the chunk in turn, computes
the row's bias in registers (a rank-long dot product), adds the logit and keeps its best (id, score)
(the argmax.py pair); a cross-thread reduction gives the chunk's best. The next step's kernel starts by
reducing the previous step's partials of its sequence to the previous token (every block of the
sequence does this small reduction itself), and a last kernel reduces every step's partials into the
output tokens (step -> threadIdx.y). `gamma + 1` kernels in all; the partials of each step stay in
workspaces. Sequences are the fastest grid axis, so the blocks reading the same chunk of `w2` run
together and share it through L2.

CONFIDENCE (`_confidence`): `sigmoid(hidden[r] . proj_w[0, :H] + w1[prev_r] . proj_w[0, H:] + proj_b[0])`
with `prev_r` the anchor for a sequence's first row and the previous draft token otherwise (the
Markov part only `with_markov`). One block per row, both dot products as cross-thread sums.

Variables: `m` (draft rows) and `nb` (sequences); the launch plan must bind `m = nb * (block - 1)`.
`sample()` draws coarse Markov weights whose bias sums are exact in f32 in any order, so the walk's
scores are bit-identical to numpy's and the walk agrees exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .argmax import (
    IDS,
    LOGITS,
    bind_reduction,
    check_chunk,
    chunk_partials,
    coarse_bf16,
    default_chunk,
    fit_threads,
    index_of,
    merge_partials,
    scheduled,
    with_attrs,
)
from .base import FamilyRule, KernelSpec, OpInstance, Param, ScheduleError

ROWS = "m"  # draft rows, nb*(blk-1); the launch plan binds it
SEQS = "nb"  # sequences; the launch plan binds it with m = nb*(blk-1)
BF16 = "bfloat16"
MARKOV_CHUNK = 1024  # vocabulary rows per block and step: 151936 -> 149 blocks per sequence


def _previous(tokens: Any, anchors: Any, g: int) -> Any:
    """prev(r): the anchor for a sequence's first draft row, else the draft token before it."""
    from tvm import tirx

    def prev(r: Any) -> Any:
        # if_then_else is lazy: tokens[r - 1] is never read at r = 0
        return tirx.if_then_else(r % g == 0, anchors[r // g], tokens[r - 1])

    return prev


# -------------------------------------------------------------------------------------- MARKOV_WALK


@dataclass(frozen=True)
class MarkovWalkSpec(KernelSpec):
    """The greedy DSpark walk over `m = nb*(block-1)` rows of float32 logits with a rank-`rank` Markov head."""

    vocab: int
    rank: int
    block: int
    chunk: int = 0  # 0: default_chunk(vocab, MARKOV_CHUNK)
    name: str = ""

    def __post_init__(self) -> None:
        if self.chunk == 0:
            object.__setattr__(self, "chunk", default_chunk(self.vocab, MARKOV_CHUNK))
        check_chunk("markov_walk", self.vocab, self.chunk)
        if self.rank <= 0 or self.block < 2:
            raise ScheduleError(f"markov_walk: rank must be positive and block >= 2, found {self.rank}, {self.block}")
        if not self.name:
            tag = f"v{self.vocab}_r{self.rank}_b{self.block}_c{self.chunk}"
            object.__setattr__(self, "name", f"markov_walk_{tag}")

    @property
    def gamma(self) -> int:
        return self.block - 1

    @property
    def chunks(self) -> int:
        return -(-self.vocab // self.chunk)

    def params(self) -> tuple[Param, ...]:
        weights = (self.vocab, self.rank)
        return (
            Param("logits", LOGITS, (ROWS, self.vocab)),
            Param("anchors", IDS, (SEQS,)),
            Param("w1", BF16, weights),
            Param("w2", BF16, weights),
            Param("tokens", IDS, (ROWS,), "out"),
        )

    def node(self) -> Node:
        return Node.make(Op.MARKOV_WALK, [TensorType(IDS, (ROWS,))], block=self.block)

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """The logits once and `w2` once per step (sequences share it through L2), plus the tokens."""
        return sizes[ROWS] * (self.vocab * 4 + 4) + self.gamma * self.vocab * self.rank * 2

    def prim_func(self) -> Any:
        from tvm import te, tirx

        g, r, v = self.gamma, self.rank, self.vocab
        m, nb = tirx.Var(ROWS, "int32"), tirx.Var(SEQS, "int32")
        logits = te.placeholder((m, v), LOGITS, name="logits")
        anchors = te.placeholder((nb,), IDS, name="anchors")
        w1 = te.placeholder((v, r), BF16, name="w1")
        w2 = te.placeholder((v, r), BF16, name="w2")
        parts: list[tuple[Any, Any]] = []
        for i in range(g):
            if parts:  # the previous token, from the previous step's partials
                best = merge_partials(f"prev{i}", (nb,), parts[-1], self.chunks)
                prev = te.compute((nb,), _token(best), name=f"prev{i}_id")
            else:
                prev = anchors
            embed = te.compute((nb, r), _embed(w1, prev), name=f"embed{i}")
            j = te.reduce_axis((0, r), name="j")
            # over the padded vocabulary (whole chunks); padding rows repeat the last row and are never picked
            bias = te.compute((nb, self.chunks * self.chunk), _bias(w2, embed, j, v), name=f"bias{i}")
            parts.append(chunk_partials(f"part{i}", (nb,), v, self.chunk, _score(logits, bias, g, i)))
        # every step's token at once, walk[s, i], from all steps' partials (one block, so the last kernel's
        # loops are its own)
        walk_parts = te.compute((nb, g, self.chunks), _blend(parts), name="walk_parts")
        walk = merge_partials("walk", (nb, g), (walk_parts[0], walk_parts[1]), self.chunks)
        tokens = te.compute((m,), lambda row: index_of(walk[0][row // g, row % g]), name="tokens")
        return with_attrs(te.create_prim_func([logits, anchors, w1, w2, tokens]), self.name, Op.MARKOV_WALK)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        (tokens,) = evaluate_node(self.node(), [arrays[n] for n in ("logits", "anchors", "w1", "w2")])
        return {"tokens": tokens}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        rows, seqs = sizes[ROWS], sizes[SEQS]
        if rows != seqs * self.gamma:
            raise ScheduleError(f"{self.name}: m must be nb * {self.gamma}, found m={rows}, nb={seqs}")
        return {
            "logits": (2 * rng.standard_normal((rows, self.vocab))).astype(np.float32),
            "anchors": rng.integers(0, self.vocab, seqs, dtype=np.int32),
            "w1": coarse_bf16(rng, (self.vocab, self.rank), span=4),
            "w2": coarse_bf16(rng, (self.vocab, self.rank), span=4),
            "tokens": np.full(rows, -7, np.int32),
        }


def _blend(parts: list[tuple[Any, Any]]) -> Any:
    """walk_parts[s, i, c] = parts[i][s, c]: a select chain over the steps' partials."""
    from tvm import tirx

    def body(s: Any, i: Any, c: Any) -> tuple[Any, Any]:
        rank, key = parts[-1][0][s, c], parts[-1][1][s, c]
        for n in range(len(parts) - 2, -1, -1):
            rank = tirx.Select(i == n, parts[n][0][s, c], rank)
            key = tirx.Select(i == n, parts[n][1][s, c], key)
        return rank, key

    return body


def _token(best: tuple[Any, Any]) -> Any:
    return lambda s: index_of(best[0][s])


def _embed(w1: Any, prev: Any) -> Any:
    return lambda s, j: w1[prev[s], j].astype("float32")


def _bias(w2: Any, embed: Any, j: Any, vocab: int) -> Any:
    from tvm import te, tirx

    return lambda s, k: te.sum(w2[tirx.min(k, vocab - 1), j].astype("float32") * embed[s, j], axis=j)


def _score(logits: Any, bias: Any, g: int, i: int) -> Any:
    # the interpreter's `logits[r] + w2 @ w1[prev]`: the bias is summed first, then added once
    return lambda s, k: logits[s * g + i, k] + bias[s, k]


def markov_layout(rank: int, threads: int, warp: int) -> tuple[int, int, int]:
    """(lanes, vector, rows at once): the threads of a block as `threads // lanes` rows of `lanes` lanes.

    One vocabulary row of `w2` is read by `lanes` lanes with `vector`-element (up to 16-byte) loads, so a
    warp reads whole rows contiguously; the widest vector and the most lanes (up to a warp) that tile
    the rank exactly.
    """
    vector = next(v for v in (8, 4, 2, 1) if rank % v == 0)
    lanes = warp
    while lanes > 1 and rank % (lanes * vector):
        lanes //= 2
    return lanes, vector, threads // lanes


def schedule_markov_walk(spec: MarkovWalkSpec, threads: int, merge_threads: int, warp: int) -> Any:
    from tvm import s_tir

    g = spec.gamma
    lanes, vector, rows = markov_layout(spec.rank, threads, warp)
    sch = s_tir.Schedule(spec.prim_func())

    def over_threads(loop: Any) -> Any:
        """Spread a loop over the block's (rows x lanes) threads, threads outermost; returns the serial rest."""
        serial, ty, tx = sch.split(loop, [None, rows, lanes])
        sch.reorder(ty, tx, serial)
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        return serial

    for i in range(g):
        part = sch.get_sblock(f"part{i}")
        seq, chunk, elem = sch.get_loops(part)
        sch.bind(seq, "blockIdx.x")  # sequences fastest: the blocks of one w2 chunk run together
        sch.bind(chunk, "blockIdx.y")
        over_threads(elem)  # the chunk's argmax: coalesced logits, a cross-thread reduction
        # the chunk's bias in shared memory: `lanes` lanes per vocabulary row, a cross-lane sum per row
        bias, embed = sch.get_sblock(f"bias{i}"), sch.get_sblock(f"embed{i}")
        sch.compute_at(bias, chunk)
        sch.set_scope(bias, 0, "shared")
        row, col = sch.get_loops(bias)[-2:]
        row_serial, row_thread = sch.split(row, [None, rows])
        col_serial, lane, vec = sch.split(col, [None, lanes, vector])
        sch.reorder(row_thread, row_serial, lane, col_serial, vec)
        sch.bind(row_thread, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        reads = [r.source.name for r in sch.get(bias).reads]
        weights = sch.cache_read(bias, reads.index("w2"), "local", consumer_blocks=[bias])
        sch.compute_at(weights, col_serial)
        sch.vectorize(sch.get_loops(weights)[-1])  # one 16-byte load per lane
        sch.unroll(vec)
        sch.compute_at(embed, chunk)
        sch.set_scope(embed, 0, "shared")
        over_threads(sch.get_loops(embed)[-1])
        if i:
            # every thread ends up with the previous token in a register (a cross-thread reduction
            # broadcasts its result; with one chunk compute_at leaves no loop and each thread reads it)
            prev, prev_id = sch.get_sblock(f"prev{i}"), sch.get_sblock(f"prev{i}_id")
            sch.compute_at(prev_id, chunk)
            sch.set_scope(prev_id, 0, "local")
            sch.compute_at(prev, chunk)
            if spec.chunks > 1:
                over_threads(sch.get_loops(prev)[-1])
            sch.set_scope(prev, 0, "local")
            sch.set_scope(prev, 1, "local")
    # last kernel: block s reduces every step's partials of sequence s (step -> threadIdx.y) and stores
    # its g tokens
    walk, tokens = sch.get_sblock("walk"), sch.get_sblock("tokens")
    for n in (0, 1):
        sch.compute_inline(sch.get_sblock(f"walk_parts_v{n}"))
    seq, step, _ = sch.get_loops(walk)
    sch.bind(seq, "blockIdx.x")
    sch.bind(step, "threadIdx.y")
    bind_reduction(sch, walk, merge_threads)
    sch.set_scope(walk, 0, "local")  # each thread holds its step's result: no shared memory, no barrier
    sch.set_scope(walk, 1, "local")
    sch.reverse_compute_at(tokens, seq)
    sch.bind(sch.get_loops(tokens)[-1], "threadIdx.y")  # the thread of step i stores token i
    return scheduled(sch)


# --------------------------------------------------------------------------------------- CONFIDENCE


@dataclass(frozen=True)
class ConfidenceSpec(KernelSpec):
    """DSpark's confidence head over `m = nb*(block-1)` draft rows of `hidden` bf16 features."""

    hidden: int
    vocab: int
    rank: int
    block: int
    with_markov: bool
    name: str = ""

    def __post_init__(self) -> None:
        if min(self.hidden, self.vocab, self.rank) <= 0 or self.block < 2:
            raise ScheduleError(
                f"confidence: hidden, vocab and rank must be positive and block >= 2, found {self.hidden}, "
                f"{self.vocab}, {self.rank}, {self.block}"
            )
        if not self.name:
            tag = f"h{self.hidden}_v{self.vocab}_r{self.rank}_b{self.block}"
            object.__setattr__(self, "name", f"confidence_{tag}" + ("_markov" if self.with_markov else ""))

    @property
    def gamma(self) -> int:
        return self.block - 1

    @property
    def features(self) -> int:
        return self.hidden + (self.rank if self.with_markov else 0)

    def params(self) -> tuple[Param, ...]:
        return (
            Param("hidden", BF16, (ROWS, self.hidden)),
            Param("tokens", IDS, (ROWS,)),
            Param("anchors", IDS, (SEQS,)),
            Param("w1", BF16, (self.vocab, self.rank)),
            Param("proj_w", BF16, (1, self.features)),
            Param("proj_b", BF16, (1,)),
            Param("confidence", LOGITS, (ROWS,), "out"),
        )

    def node(self) -> Node:
        return Node.make(Op.CONFIDENCE, [TensorType(LOGITS, (ROWS,))], block=self.block, with_markov=self.with_markov)

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """Per row: its features (the hidden row and, with the Markov part, one w1 row), token and output."""
        return sizes[ROWS] * (self.hidden * 2 + (self.rank * 2 if self.with_markov else 0) + 8) + self.features * 2

    def prim_func(self) -> Any:
        from tvm import te, tirx

        h, r = self.hidden, self.rank
        m, nb = tirx.Var(ROWS, "int32"), tirx.Var(SEQS, "int32")
        hidden = te.placeholder((m, h), BF16, name="hidden")
        tokens = te.placeholder((m,), IDS, name="tokens")
        anchors = te.placeholder((nb,), IDS, name="anchors")
        w1 = te.placeholder((self.vocab, r), BF16, name="w1")
        proj_w = te.placeholder((1, self.features), BF16, name="proj_w")
        proj_b = te.placeholder((1,), BF16, name="proj_b")

        def f32(value: Any) -> Any:
            return value.astype("float32")

        f = te.reduce_axis((0, h), name="f")
        logit = te.compute((m,), lambda row: te.sum(f32(hidden[row, f]) * f32(proj_w[0, f]), axis=f), name="dot")
        if self.with_markov:
            prev = _previous(tokens, anchors, self.gamma)
            j = te.reduce_axis((0, r), name="j")
            markov = te.compute(
                (m,), lambda row: te.sum(f32(w1[prev(row), j]) * f32(proj_w[0, h + j]), axis=j), name="markov"
            )

            def total(row: Any) -> Any:
                return logit[row] + markov[row] + f32(proj_b[0])
        else:

            def total(row: Any) -> Any:
                return logit[row] + f32(proj_b[0])

        # the interpreter's 1 / (1 + exp(-logit)), in f32
        one = tirx.const(1.0, "float32")
        out = te.compute((m,), lambda row: one / (one + te.exp(-total(row))), name="confidence")
        func = te.create_prim_func([hidden, tokens, anchors, w1, proj_w, proj_b, out])
        return with_attrs(func, self.name, Op.CONFIDENCE)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        names = ("hidden", "tokens", "anchors", "w1", "proj_w", "proj_b")
        (confidence,) = evaluate_node(self.node(), [arrays[n] for n in names])
        return {"confidence": confidence}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        import ml_dtypes

        rows, seqs, bf16 = sizes[ROWS], sizes[SEQS], ml_dtypes.bfloat16
        if rows != seqs * self.gamma:
            raise ScheduleError(f"{self.name}: m must be nb * {self.gamma}, found m={rows}, nb={seqs}")
        scale = 1.0 / np.sqrt(self.features)
        return {
            "hidden": rng.standard_normal((rows, self.hidden)).astype(bf16),
            "tokens": rng.integers(0, self.vocab, rows, dtype=np.int32),
            "anchors": rng.integers(0, self.vocab, seqs, dtype=np.int32),
            "w1": rng.standard_normal((self.vocab, self.rank)).astype(bf16),
            "proj_w": (2 * scale * rng.standard_normal((1, self.features))).astype(bf16),
            "proj_b": (0.5 * rng.standard_normal(1)).astype(bf16),
            "confidence": np.full(rows, np.nan, np.float32),
        }


def schedule_confidence(spec: ConfidenceSpec, threads: int) -> Any:
    """One block per row; each dot product a cross-thread sum over `threads` threads."""
    from tvm import s_tir

    sch = s_tir.Schedule(spec.prim_func())
    out = sch.get_sblock("confidence")
    (row,) = sch.get_loops(out)
    sch.bind(row, "blockIdx.x")
    for name in ("markov", "dot") if spec.with_markov else ("dot",):
        block = sch.get_sblock(name)
        sch.compute_at(block, row)  # from the consumer: both sums read inputs only
        bind_reduction(sch, block, threads)
        sch.set_scope(block, 0, "local")
    return scheduled(sch)


# ------------------------------------------------------------------------------------------- the rule


class DSparkRule(FamilyRule):
    """MARKOV_WALK (f32 logits, bf16 Markov weights) and CONFIDENCE (bf16 features) nodes, or their specs.

    Knobs: `threads` per block (markov: one vocabulary chunk's rows and its argmax; confidence: one
    row's dot products) and `merge_threads` (markov: the per-step reductions of the chunk partials).
    """

    name = "dspark"
    knob_names = ("threads", "merge_threads")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # A quarter of the block limit: 4 vocabulary rows per thread per 1024-chunk, several blocks per SM.
        return {"threads": target.max_threads_per_block // 4, "merge_threads": 4 * target.warp_size}

    def spec_of(self, subject: Any) -> KernelSpec | None:
        if isinstance(subject, MarkovWalkSpec | ConfidenceSpec):
            return subject
        if not isinstance(subject, OpInstance):
            return None
        if subject.op is Op.MARKOV_WALK:
            return _markov_spec(subject)
        if subject.op is Op.CONFIDENCE:
            return _confidence_spec(subject)
        return None

    def schedule(self, spec: Any, target: Target, knobs: Mapping[str, int]) -> Any:
        if isinstance(spec, ConfidenceSpec):
            return schedule_confidence(spec, fit_threads(self.name, target, knobs["threads"], spec.hidden))
        threads = fit_threads(self.name, target, knobs["threads"], spec.chunk)
        merge = fit_threads(self.name, target, knobs["merge_threads"], spec.chunks)
        # the last kernel runs the g steps side by side (threadIdx.y): g * merge threads per block
        room = target.max_threads_per_block // spec.gamma // target.warp_size * target.warp_size
        if room == 0:
            raise ScheduleError(
                f"{spec.name}: {spec.gamma} steps of one warp each exceed {target.max_threads_per_block} threads "
                f"per block on {target.name}. Fix: a block size of at most "
                f"{target.max_threads_per_block // target.warp_size + 1}"
            )
        merge = min(merge, room)
        if spec.chunk % threads:
            raise ScheduleError(
                f"{self.name}: chunk {spec.chunk} of {spec.name} is not a multiple of threads={threads}. "
                "Fix: choose a power-of-two thread count that divides the chunk"
            )
        shared = 4 * (spec.chunk + spec.rank) + 16
        if shared > target.max_static_shared_memory_per_block:
            raise ScheduleError(
                f"{spec.name} keeps {shared} bytes in shared memory per block; {target.name} allows "
                f"{target.max_static_shared_memory_per_block} static. Fix: a smaller chunk"
            )
        return schedule_markov_walk(spec, threads, merge, target.warp_size)


def _static(*dims: Any) -> bool:
    return all(isinstance(d, int) for d in dims)


def _markov_spec(op: OpInstance) -> MarkovWalkSpec | None:
    if len(op.inputs) != 4:
        return None
    logits, _, w1, w2 = op.inputs
    if tuple(t.dtype for t in op.inputs) != (LOGITS, IDS, BF16, BF16) or op.outputs[0].dtype != IDS:
        return None
    if not _static(logits.shape[-1], *w1.shape, *w2.shape) or w1.shape != w2.shape:
        return None
    if w1.shape[0] != logits.shape[-1]:
        return None
    try:
        return MarkovWalkSpec(vocab=w1.shape[0], rank=w1.shape[1], block=int(op.attr("block")))
    except (ScheduleError, KeyError):
        return None


def _confidence_spec(op: OpInstance) -> ConfidenceSpec | None:
    if len(op.inputs) != 6:
        return None
    hidden, _, _, w1, proj_w, _ = op.inputs
    dtypes = (BF16, IDS, IDS, BF16, BF16, BF16)
    if tuple(t.dtype for t in op.inputs) != dtypes or op.outputs[0].dtype != LOGITS:
        return None
    if not _static(hidden.shape[-1], *w1.shape, *proj_w.shape):
        return None
    try:
        spec = ConfidenceSpec(
            hidden=hidden.shape[-1],
            vocab=w1.shape[0],
            rank=w1.shape[1],
            block=int(op.attr("block")),
            with_markov=bool(op.attr("with_markov")),
        )
    except (ScheduleError, KeyError):
        return None
    return spec if proj_w.shape == (1, spec.features) else None
