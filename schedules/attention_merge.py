"""The two-kernel skeleton every block-attention rule builds on (`attention.py`'s SIMT kernel,
`attention_mma.py`'s and `attention_wgmma.py`'s): the spans a batch's splits cover, the merge kernel that
adds the splits' partial results with their log-sum-exp weights, and the PrimFunc holding both kernels, its
parameters and the workspaces between them. A rule supplies the split kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, LOAD_BEFORE_WAIT, WAIT

if TYPE_CHECKING:
    from .attention import BlockAttentionSpec

DTYPE = "bfloat16"
NEG = -3.0e38  # "no score yet": finite, so exp2(NEG - max) is 0 and max(NEG, x) is x, never NaN
MERGE_ELEMENTS = 4  # outputs per thread of the merge kernel (merge_macro says why four)
MERGE_WIDTHS = (4, 8, 16)  # the merge's narrower passes, for batches that use that few splits (merge_macro)
MERGE_PASS = 24  # the most splits one pass of the merge loads at once (merge_macro)


def span_count(spec: BlockAttentionSpec, splits: int, slots: int, nb: Any) -> Any:
    """The spans each (sequence, kv head) of a batch of `nb` sequences is cut into: `splits`, or with `slots`
    > 0 `slots // (nb · kv_heads)` clamped to [1, splits] (`split_span_macro`). It is also the split kernels'
    grid along the splits: a block past it would only exit, and at nb = 8 on the H200 (4 of 16 splits used)
    the 768 such blocks of a layer went through the SMs mixed in with the 256 used ones (Nsight Compute: SMs
    active 70 % of the kernel's cycles)."""
    from tvm.script import tirx as T

    return splits if slots <= 0 else T.max(1, T.min(splits, slots // (nb * spec.kv_heads)))


def split_span_macro(spec: BlockAttentionSpec, splits: int, chunk: int, slots: int = 0, early: bool = False) -> Any:
    """`split_span(span, s, n, blk_positions, nb)`: span[0] = the first key any query of sequence s can see
    (a window hides older cached rows), span[1] = keys per split: the rest of the keys in equal spans,
    multiples of `chunk`. The split kernels and the merge must agree on it.

    With `slots` > 0 (the grid, in blocks, a batch aims at) a batch of `nb` sequences cuts each (sequence,
    kv head) into only `slots // (nb · kv_heads)` spans (at least 1, at most `splits`): a larger batch keeps
    about the same grid and writes and merges fewer partial rows instead of more; the split kernels launch
    only those spans (`span_count`).

    `early`: a kernel calls it before its wait for inputs, so the positions are read with relaxed loads,
    which stay above the wait in the machine code (dependent_launch.py)."""
    from tvm.script import tirx as T

    blk, window = spec.block, spec.window

    @T.macro
    def first_visible(span: Any, s: Any, n: Any, blk_positions: Any) -> None:
        span[0] = blk_positions[s * blk]
        for i in T.serial(1, blk):
            span[0] = T.min(span[0], blk_positions[s * blk + i])
        span[0] = T.max(0, T.min(n, span[0] - window + 1))

    @T.macro
    def first_visible_early(span: Any, s: Any, n: Any, blk_positions: Any) -> None:
        pos = T.sblock_alloc_buffer((blk,), "int32", scope="local")
        for i in T.unroll(blk):
            T.evaluate(T.call_extern(
                "void", LOAD_BEFORE_WAIT, pos.access_ptr("w", offset=i, extent=1),
                T.address_of(blk_positions[s * blk + i]), 4,
            ))  # fmt: skip
        span[0] = pos[0]
        for i in T.unroll(1, blk):
            span[0] = T.min(span[0], pos[i])
        span[0] = T.max(0, T.min(n, span[0] - window + 1))

    visible = first_visible_early if early else first_visible

    @T.macro
    def split_span(span: Any, s: Any, n: Any, blk_positions: Any, nb: Any) -> None:
        span[0] = 0
        if window is not None:
            visible(span, s, n, blk_positions)
        span[1] = T.ceildiv(T.ceildiv(n + blk - span[0], span_count(spec, splits, slots, nb)), chunk) * chunk

    return split_span


def merge_blocking(spec: BlockAttentionSpec) -> tuple[int, int]:
    """(heads per thread block, threads) of the merge kernel: one thread per MERGE_ELEMENTS outputs of a
    head's row, about 128 threads per block."""
    vecs = spec.head_dim // MERGE_ELEMENTS
    per_block = max(h for h in range(1, spec.heads + 1) if spec.heads % h == 0 and h * vecs <= max(128, vecs))
    return per_block, per_block * vecs


def merge_macro(spec: BlockAttentionSpec, splits: int, chunk: int, device: bool, slots: int = 0) -> Any:
    """`merge(part_o, part_ml, cache_lens, blk_positions, out, nb)`: the second kernel, merging the splits'
    unnormalised outputs `part_o[nb, kv_heads, splits, rows, dim]` with their log-sum-exp weights from
    `part_ml[..., (max, sum)]` (base 2) and writing bf16 `out`.

    One thread per MERGE_ELEMENTS outputs of a (block row, head): a thread block covers a few heads of one
    block row, so a step of one sequence has hundreds of blocks. One output per thread (four times the
    threads, each repeating the splits' (max, sum) loads and exp2) took 6.9 against 8.1 µs for one sequence
    on an H200 but 29.4 against 22.8 µs per layer for 16 sequences.

    The splits go in passes of up to MERGE_PASS: a pass first loads every split's (max, sum) and outputs into
    registers, unconditionally, splits past the used ones reading the last used one again (a cache hit; a
    batch that uses a quarter of the splits would otherwise read four times the partial sums from DRAM), and
    only then applies the guard "this split saw keys" to the values, as selects. Loads behind a per-split
    branch went out one split at a time, a round trip each: 11.3 µs for one sequence of 4096 keys on an
    H200 (Nsight Compute), 8.1 µs now. A batch that uses at most 4, 8 or 16 of the splits (where there are
    more) takes one pass of the narrowest of those widths that holds them instead (a runtime branch to a copy
    of the pass), so it does not load and weigh the clamped duplicates of the wide pass. Up to MERGE_PASS
    splits are one pass (its loads take 6 · MERGE_PASS registers), not passes of 16 and a ragged one, whose
    maxima are loaded and folded before the sums, a round trip more.

    A merge of one pass locates its spans from the host-written lengths and positions
    before the wait for inputs, and its pass asks for every split's (max, sum) and outputs before it uses any.
    With the spans located after the wait and the pass split into the max's loads, then the weighted sums'
    loads, it waited for three round trips one after the other (sm_90 SASS: the length's load, the maxima's,
    then the outputs' behind the first exp2); then the 4- and 8-wide passes waited for one, and in the 16-wide
    one, still of 4-byte loads, ptxas issued the last 28 of its 96 loads after the first exp2 (96 registers),
    so it waited for two (the vector loads below came after that reading of the SASS).

    A split's four outputs of a thread are one 16-byte load and its (max, sum) one 8-byte load, and the four
    bf16 outputs one 8-byte store (every stride of the workspaces is a constant multiple of the vector). Four
    4-byte loads and two 4-byte loads before → this, on an H100 (bench/propose.py, both builds in one run, µs the
    five merges add, timeline): 19.6 → 19.3 at nb = 1 and 21.9 → 19.9 at nb = 8 (bf16), 17.1 → 16.3 and 21.4 →
    20.3 (FP8); the step moved within its noise (bf16 1.257 / 1.751 → 1.271 / 1.752 ms at nb = 1 / 8): the
    merge waits on its round trips, not on how many loads it issues."""
    from tvm.script import tirx as T

    blk, heads, dim, group = spec.block, spec.heads, spec.head_dim, spec.group
    vecs, per = dim // MERGE_ELEMENTS, MERGE_ELEMENTS
    per_block, mt = merge_blocking(spec)
    unroll = min(splits, MERGE_PASS)
    passes = -(-splits // unroll)
    local = "local" if device else "global"
    split_span = split_span_macro(spec, splits, chunk, slots, early=device)

    def grid(n: Any, tag: str) -> Any:
        return T.thread_binding(n, thread=tag) if device else T.serial(n)

    def lanes(n: int) -> Any:
        return T.thread_binding(n, thread="threadIdx.x") if device else T.serial(n)

    def passes_macros(width: int) -> tuple[Any, Any, Any]:
        """(load, fold_max, weigh) of one pass of `width` splits from split `first`: `load` asks for every
        split's (max, sum) and outputs, the splits past used[0] re-reading the last used one; `fold_max` takes
        the used splits' maxima into the running max mstat[t, 0]; `weigh` adds their sums and outputs, with
        weights 2^(max - mstat[t, 0]), into mstat[t, 1] and macc, the unused ones weighing nothing."""

        @T.macro
        def load(part_o, part_ml, ml, po, used, s, kvh, r, d0, t, first):
            for u in T.unroll(width):
                sp = T.meta_var(T.min(first + u, used[0] - 1))
                # one 8-byte and one 16-byte load: every stride of the workspaces is a constant multiple of
                # the vector, so the addresses are aligned
                for j in T.vectorized(2):
                    ml[t, u, j] = part_ml[s, kvh, sp, r, j]
                for x in T.vectorized(per):
                    po[t, u, x] = part_o[s, kvh, sp, r, d0 + x]

        @T.macro
        def weigh(ml, po, mstat, macc, used, t, first):
            for u in T.unroll(width):
                # an unused split's slot holds anything, NaN included: select, never scale
                ok = T.meta_var(first + u < used[0])
                mstat[t, 2] = T.exp2(T.Select(ok, ml[t, u, 0], T.float32(NEG)) - mstat[t, 0])
                mstat[t, 1] = mstat[t, 1] + T.Select(ok, mstat[t, 2] * ml[t, u, 1], T.float32(0))
                for x in T.unroll(per):
                    macc[t, x] = macc[t, x] + T.Select(ok, mstat[t, 2] * po[t, u, x], T.float32(0))

        @T.macro
        def fold_max(ml, mstat, used, t, first):
            for u in T.unroll(width):
                mstat[t, 0] = T.max(mstat[t, 0], T.Select(first + u < used[0], ml[t, u, 0], T.float32(NEG)))

        return load, fold_max, weigh

    def combine_macro(width: int, rounds: int) -> Any:
        """Splits [0, width · rounds) in `rounds` passes of `width`: the running max first, then the weighted
        sums of (sum, outputs). A single pass asks for every (max, sum) and output before it uses any; more
        load the maxima for the max first, then each pass again for its sums."""
        load, fold_max, weigh = passes_macros(width)

        @T.macro
        def clear_sums(mstat, macc, t):
            mstat[t, 1] = T.float32(0)
            for x in T.unroll(per):
                macc[t, x] = T.float32(0)

        @T.macro
        def one_pass(part_o, part_ml, ml, po, mstat, macc, used, s, kvh, r, d0, t):
            load(part_o, part_ml, ml, po, used, s, kvh, r, d0, t, 0)
            mstat[t, 0] = T.float32(NEG)
            fold_max(ml, mstat, used, t, 0)
            clear_sums(mstat, macc, t)
            weigh(ml, po, mstat, macc, used, t, 0)

        @T.macro
        def combine(part_o, part_ml, ml, po, mstat, macc, used, s, kvh, r, d0, t):
            mstat[t, 0] = T.float32(NEG)
            for sp0 in T.serial(rounds):
                for u in T.unroll(width):
                    ml[t, u, 0] = part_ml[s, kvh, T.min(sp0 * width + u, used[0] - 1), r, 0]
                fold_max(ml, mstat, used, t, sp0 * width)
            clear_sums(mstat, macc, t)
            for sp0 in T.serial(rounds):
                load(part_o, part_ml, ml, po, used, s, kvh, r, d0, t, sp0 * width)
                weigh(ml, po, mstat, macc, used, t, sp0 * width)

        return one_pass if rounds == 1 else combine

    def dispatch_macro(widths: list[int]) -> Any:
        """The narrowest pass of `widths` (ascending) that holds the splits a batch uses, else every split."""
        if not widths:
            return combine_macro(unroll, passes)
        width, wider = widths[0], dispatch_macro(widths[1:])
        narrow = combine_macro(width, 1)

        @T.macro
        def dispatch(part_o, part_ml, ml, po, mstat, macc, used, s, kvh, r, d0, t):
            if used[0] <= width:
                narrow(part_o, part_ml, ml, po, mstat, macc, used, s, kvh, r, d0, t)
            else:
                wider(part_o, part_ml, ml, po, mstat, macc, used, s, kvh, r, d0, t)

        return dispatch

    # a batch that uses few of the splits (`slots`) takes the narrowest pass that holds them
    combine = dispatch_macro(sorted(w for w in MERGE_WIDTHS if w < unroll))

    @T.macro
    def merge(part_o: Any, part_ml: Any, cache_lens: Any, blk_positions: Any, out: Any, nb: Any) -> None:
        for s in grid(nb, "blockIdx.z"):
            for i in grid(blk, "blockIdx.y"):
                for hb in grid(heads // per_block, "blockIdx.x"):
                    with T.sblock("merge"):
                        T.reads()
                        T.writes()
                        used = T.sblock_alloc_buffer((2,), "int32", scope=local)
                        lens = T.sblock_alloc_buffer((1,), "int32", scope=local)
                        mstat = T.sblock_alloc_buffer((mt, 3), "float32", scope=local)  # max, sum, weight
                        macc = T.sblock_alloc_buffer((mt, per), "float32", scope=local)
                        # one pass's loads: (max, sum) and the thread's outputs of every split of the pass
                        ml = T.sblock_alloc_buffer((mt, unroll, 2), "float32", scope=local)
                        po = T.sblock_alloc_buffer((mt, unroll, per), "float32", scope=local)
                        # only the first ceil(keys / span) splits saw keys; the lengths and positions are
                        # the host's (no kernel of the step writes them), so this is done before the wait,
                        # with relaxed loads, which stay there in the machine code (dependent_launch.py)
                        if device:
                            T.evaluate(T.call_extern(
                                "void", LOAD_BEFORE_WAIT, lens.access_ptr("w", extent=1), T.address_of(cache_lens[s]), 4
                            ))  # fmt: skip
                        else:
                            lens[0] = cache_lens[s]
                        split_span(used, s, lens[0], blk_positions, nb)
                        used[0] = T.ceildiv(lens[0] + blk - used[0], used[1])
                        if device:  # then the split kernel's partial results, and the next grid may come in
                            T.evaluate(T.call_extern("void", WAIT))
                            T.evaluate(T.call_extern("void", LAUNCH_DEPENDENTS))
                        for t in lanes(mt):
                            hd = T.meta_var(hb * per_block + t // vecs)
                            kvh = T.meta_var(hd // group)
                            r = T.meta_var(i * group + hd % group)
                            d0 = T.meta_var(t % vecs * per)
                            combine(part_o, part_ml, ml, po, mstat, macc, used, s, kvh, r, d0, t)
                            mstat[t, 2] = T.if_then_else(
                                mstat[t, 1] > T.float32(0), T.float32(1) / mstat[t, 1], T.float32(0)
                            )
                            for x in T.vectorized(per):
                                out[s * blk + i, hd * dim + d0 + x] = T.Cast(DTYPE, macc[t, x] * mstat[t, 2])

    return merge


def attention_prim_func(
    spec: BlockAttentionSpec,
    splits: int,
    chunk: int,
    device: bool,
    split: Any,
    slots: int = 0,
    clustered: Mapping[int, Any] | None = None,
) -> Any:
    """The block-attention PrimFunc both kernels share: the parameters, the host workspaces between the two
    kernels (unnormalised outputs and (max, sum) per split), the split kernel `split(q, k, v, kv, block_table,
    cache_lens, blk_positions, part_o, part_ml, nb)` and the merge kernel. The splits' spans are cut in
    multiples of `chunk` keys, `slots` as `split_span_macro` says.

    `clustered` maps span counts c to kernels `kernel(q, k, v, kv, block_table, cache_lens, blk_positions,
    out, nb)` whose c spans of a (sequence, kv head) are one thread block cluster that merges them itself: a
    batch whose `span_count` is c launches that kernel alone, no workspace, no merge kernel."""
    from tvm.script import tirx as T

    heads, hkv, dim, page = spec.heads, spec.kv_heads, spec.head_dim, spec.page_size
    rows = spec.block * spec.group
    merge = merge_macro(spec, splits, chunk, device, slots)

    @T.macro
    def two_kernels(q, k, v, kv, block_table, cache_lens, blk_positions, out, nb):
        part_o = T.sblock_alloc_buffer((nb, hkv, splits, rows, dim), "float32")
        part_ml = T.sblock_alloc_buffer((nb, hkv, splits, rows, 2), "float32")
        split(q, k, v, kv, block_table, cache_lens, blk_positions, part_o, part_ml, nb)
        merge(part_o, part_ml, cache_lens, blk_positions, out, nb)

    def pick_macro(counts: list[int]) -> Any:
        # the kernel of the first span count that is the batch's, else the next ones', else the two kernels
        if not counts:
            return two_kernels
        count, rest = counts[0], pick_macro(counts[1:])
        kernel = (clustered or {})[count]

        @T.macro
        def pick(q, k, v, kv, block_table, cache_lens, blk_positions, out, nb):
            if span_count(spec, splits, slots, nb) == count:
                kernel(q, k, v, kv, block_table, cache_lens, blk_positions, out, nb)
            else:
                rest(q, k, v, kv, block_table, cache_lens, blk_positions, out, nb)

        return pick

    body = pick_macro(sorted(clustered or {}, reverse=True))

    @T.prim_func(s_tir=True)
    def attention(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        kv_h: T.handle,
        table_h: T.handle,
        lens_h: T.handle,
        pos_h: T.handle,
        out_h: T.handle,
    ) -> None:
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        m = T.int32()
        pages = T.int32()
        nb = T.int32()
        maxp = T.int32()
        q = T.match_buffer(q_h, (m, heads * dim), DTYPE)
        k = T.match_buffer(k_h, (m, hkv * dim), DTYPE)
        v = T.match_buffer(v_h, (m, hkv * dim), DTYPE)
        kv = T.match_buffer(kv_h, (2, pages, page, hkv, dim), DTYPE)
        block_table = T.match_buffer(table_h, (nb, maxp), "int32")
        cache_lens = T.match_buffer(lens_h, (nb,), "int32")
        blk_positions = T.match_buffer(pos_h, (m,), "int32")
        out = T.match_buffer(out_h, (m, heads * dim), DTYPE)
        body(q, k, v, kv, block_table, cache_lens, blk_positions, out, nb)

    return attention
