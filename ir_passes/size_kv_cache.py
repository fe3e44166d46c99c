"""size_kv_cache: size the paged KV pool from the build options and record it as a plan.

Precondition: a phase graph lowered from ``ctx.config`` (served at ``options.block_size`` or the config's
block size); its ``kv_cache`` STATE has the type :func:`dflash_compiler.lower.kv_cache_type` gives.

Established invariant: ``graph.meta["kv_cache"]`` is a :class:`KVCachePlan`, identical for both phases
(it depends on the config and the options only); the graph's nodes are unchanged.

Sizing (DESIGN.md "Paged KV cache"): pages of 16 rows, one page holding K and V of every layer, so
``bytes_per_page = L·2·16·Hkv·D·sizeof(bf16)``. A sequence needs ``pages_per_seq = ceil((rows + B + 1) / 16)``
pages, ``rows`` = ``max_seq_len``: the block's B rows are appended (padded mode) before the rollback, and
the anchor sits one past the context. The pool is ``pages_per_seq · max_batch + 1`` pages (page 0 is the
scratch page padded rows write into), or as many pages as ``kv_budget_bytes`` holds. A pool of more than
2^31 elements is refused: the cache kernels address it with 32-bit offsets (Qwen3-8B-DFlash at max_seq_len
8192: up to 25 sequences).

With ``sliding_window_only``, a sliding layer keeps its last ``W`` rows. Pages are shared by all layers
(one page index covers every layer), so a sequence needs fewer pages only when every layer slides; then
``rows`` = the largest window and one more page is added, because a window starts anywhere in a page.
"""

from __future__ import annotations

import math

from dflash_compiler.config import DrafterConfig
from dflash_compiler.errors import Problem
from dflash_compiler.ir.graph import Graph
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.lower import PAGE_SIZE, kv_cache_type
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import KVCachePlan, LayerRetention, PlanError, SizedBy, dtype_bytes

# the cache kernels (kv_write, the attention kernels) index the pool with int32 element offsets
MAX_CACHE_ELEMENTS = 2**31


def serving_block_size(config: DrafterConfig, options: BuildOptions) -> int:
    """The block the runtime proposes with: the option overrides the config (a serving choice)."""
    return options.block_size or config.block_size


def bytes_per_page(config: DrafterConfig) -> int:
    """K and V of one page in every layer, from the cache type lowering declares (``pages`` = 1)."""
    kv = kv_cache_type(config)
    return math.prod(1 if d == "pages" else int(d) for d in kv.shape) * dtype_bytes(kv.dtype)


def retention(config: DrafterConfig, options: BuildOptions) -> tuple[LayerRetention, ...]:
    """Per layer: a window when ``sliding_window_only`` lets a sliding layer drop older rows, else full."""
    return tuple(
        LayerRetention(layer=i, window=layer.window if options.sliding_window_only else None)
        for i, layer in enumerate(config.layers)
    )


def pages_for(rows: int, block: int) -> int:
    """Pages one sequence of ``rows`` context rows needs while it proposes and appends a block."""
    return -(-(rows + block + 1) // PAGE_SIZE)


def _retained_pages(layers: tuple[LayerRetention, ...], max_seq_len: int, block: int) -> tuple[int, int]:
    """(rows a sequence keeps, its pages): the largest window if every layer slides, else max_seq_len."""
    full = pages_for(max_seq_len, block)
    windows = [layer.window for layer in layers]
    if not windows or any(w is None for w in windows):
        return max_seq_len, full
    widest = max(w for w in windows if w is not None)
    windowed = pages_for(widest, block) + 1
    return (widest, windowed) if windowed < full else (max_seq_len, full)


def _budget_pages(budget: int, page_bytes: int, per_seq: int, options: BuildOptions) -> int:
    """Pages that fit in ``budget``; refuses a budget below one sequence at its longest plus the scratch page."""
    pages = budget // page_bytes
    need = (per_seq + 1) * page_bytes
    if pages < per_seq + 1:
        raise PlanError(
            "KV cache sizing",
            [
                Problem(
                    "BuildOptions.kv_budget_bytes",
                    f"{budget} bytes ({pages} pages of {page_bytes} bytes)",
                    f"at least {need} bytes: one sequence's {per_seq} pages (max_seq_len {options.max_seq_len}) "
                    "plus the scratch page",
                    f"raise kv_budget_bytes to {need} or more, or lower max_seq_len",
                )
            ],
        )
    return pages


def _check_offsets(num_pages: int, page_bytes: int, per_seq: int, config: DrafterConfig, options: BuildOptions) -> None:
    """Refuses a pool the cache kernels cannot address: they index the whole pool (every layer's K and V of
    every page) with 32-bit element offsets, so it must hold at most 2^31 elements."""
    per_page = page_bytes // dtype_bytes(kv_cache_type(config).dtype)
    most = MAX_CACHE_ELEMENTS // per_page
    if num_pages <= most:
        return
    fits = (most - 1) // per_seq  # full-length sequences beside the scratch page
    if options.kv_budget_bytes is not None:
        where, fix = "BuildOptions.kv_budget_bytes", f"lower kv_budget_bytes to at most {most * page_bytes}"
    else:
        where = "BuildOptions.max_batch"
        fix = (
            f"lower max_batch to at most {fits} or lower max_seq_len, or size the pool with kv_budget_bytes of at "
            f"most {most * page_bytes}"
            if fits
            else f"lower max_seq_len: one sequence of {options.max_seq_len} rows does not fit beside the scratch page"
        )
    raise PlanError(
        "KV cache sizing",
        [
            Problem(
                where,
                f"a pool of {num_pages} pages ({num_pages * per_page} cache elements, {num_pages * page_bytes} bytes)",
                f"at most {most} pages ({MAX_CACHE_ELEMENTS} elements): the cache kernels address the pool with "
                "32-bit element offsets",
                fix,
            )
        ],
    )


def make_kv_plan(config: DrafterConfig, options: BuildOptions) -> KVCachePlan:
    """The pool the runtime allocates for ``config`` served with ``options``."""
    block = serving_block_size(config, options)
    layers = retention(config, options)
    rows, per_seq = _retained_pages(layers, options.max_seq_len, block)
    page_bytes = bytes_per_page(config)
    if options.kv_budget_bytes is not None:
        num_pages, sized_by = _budget_pages(options.kv_budget_bytes, page_bytes, per_seq, options), SizedBy.BUDGET
    else:
        num_pages, sized_by = per_seq * options.max_batch + 1, SizedBy.MAX_BATCH
    _check_offsets(num_pages, page_bytes, per_seq, config, options)
    return KVCachePlan(
        page_size=PAGE_SIZE,
        block_size=block,
        max_batch=options.max_batch,
        max_seq_len=options.max_seq_len,
        retention=layers,
        retained_rows=rows,
        pages_per_seq=per_seq,
        num_pages=num_pages,
        bytes_per_page=page_bytes,
        total_bytes=num_pages * page_bytes,
        sized_by=sized_by,
        budget_bytes=options.kv_budget_bytes,
    )


def _check_cache_type(graph: Graph, config: DrafterConfig) -> None:
    """The plan's page size and bytes follow the config; a graph lowered from another config is refused."""
    expected = kv_cache_type(config)
    if "kv_cache" in graph and graph.node("kv_cache").type != expected:
        raise PlanError(
            "KV cache sizing",
            [
                Problem(
                    f"{graph.name}: %kv_cache",
                    graph.node("kv_cache").type.render(),
                    f"{expected.render()} (the cache type of the config being built)",
                    "size the cache of a graph lowered from the same config",
                )
            ],
        )


def size_kv_cache(graph: Graph, ctx: PassContext) -> Graph:
    """Record ``graph.meta["kv_cache"]`` (see the module docstring); nodes are unchanged."""
    _check_cache_type(graph, ctx.config)
    out = graph.copy()
    out.meta["kv_cache"] = make_kv_plan(ctx.config, ctx.options)
    return out
