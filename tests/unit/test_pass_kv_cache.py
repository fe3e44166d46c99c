"""size_kv_cache: the pool sized by max_batch or a byte budget, refusals, sliding-window retention.

Expected numbers are written out from the formulas in DESIGN.md ("Paged KV cache") and DFLASH.md §2
(KV per token = L·2·Hkv·D·2 bytes), not computed with the pass's helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_compiler.config import load_drafter_config
from dflash_compiler.ir import dump
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.ir_passes.size_kv_cache import size_kv_cache
from dflash_compiler.lower import lower
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import KVCachePlan, PlanError, SizedBy
from dflash_compiler.runtime.pages import PageAllocator

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QWEN3_8B = "qwen3-8b-dflash-b16"
PAGE_8B = 5 * 2 * 16 * 8 * 128 * 2  # L · (K, V) · 16 rows · Hkv · D · bf16 = 327680


def plans(example: str, **options) -> list[KVCachePlan]:
    cfg = load_drafter_config(EXAMPLES / example)
    ctx = PassContext(cfg, BuildOptions(**options))
    out = []
    for graph in lower(cfg).phases.values():
        sized = size_kv_cache(graph, ctx)
        assert dump(sized).split("meta ")[0] == dump(graph), "size_kv_cache must not change nodes"
        assert "kv_cache" not in graph.meta, "size_kv_cache must not mutate its input"
        out.append(sized.meta["kv_cache"])
    return out


def plan(example: str, **options) -> KVCachePlan:
    append, propose = plans(example, **options)
    assert append == propose, "both phases must get the same plan"
    return propose


def test_qwen3_8b_sized_by_max_batch() -> None:
    p = plan(QWEN3_8B, max_seq_len=4096, max_batch=8)
    assert p.page_size == 16 and p.block_size == 16
    assert p.pages_per_seq == 258  # ceil((4096 + 16 + 1) / 16)
    assert p.num_pages == 8 * 258 + 1  # + the scratch page 0
    assert p.bytes_per_page == PAGE_8B == 327680
    assert p.total_bytes == (8 * 258 + 1) * 327680
    assert p.sized_by is SizedBy.MAX_BATCH and p.budget_bytes is None
    assert p.sequences_at_full_length == 8
    assert p.retention == tuple(p.retention) and all(r.window is None for r in p.retention)
    assert p.summary() == "kv 2065 pages x 327680 B = 645.3 MiB (258 pages/seq, 8 full sequences, sized by max_batch)"


def test_qwen3_8b_pool_admits_max_batch_sequences_in_the_runtime_allocator() -> None:
    p = plan(QWEN3_8B, max_seq_len=4096, max_batch=8)
    pages = PageAllocator(p.num_pages, p.page_size, p.max_seq_len)
    for seq in range(p.max_batch):
        pages.create(seq)
    pages.reserve({seq: p.max_seq_len for seq in range(p.max_batch)})
    assert pages.free_pages == p.num_pages - 1 - 8 * 256


def test_block_size_option_overrides_the_config() -> None:
    p = plan(QWEN3_8B, max_seq_len=4096, max_batch=2, block_size=4)
    assert p.block_size == 4 and p.pages_per_seq == 257  # ceil((4096 + 4 + 1) / 16)
    assert p.num_pages == 2 * 257 + 1


def test_budget_sizing_takes_as_many_pages_as_fit() -> None:
    budget = 1000 * PAGE_8B + PAGE_8B - 1  # one byte short of 1001 pages
    p = plan(QWEN3_8B, max_seq_len=4096, max_batch=8, kv_budget_bytes=budget)
    assert p.num_pages == 1000 and p.total_bytes == 1000 * PAGE_8B <= budget
    assert p.sized_by is SizedBy.BUDGET and p.budget_bytes == budget
    assert p.pages_per_seq == 258 and p.sequences_at_full_length == 999 // 258 == 3


def test_budget_of_exactly_one_sequence_plus_scratch_is_enough() -> None:
    p = plan(QWEN3_8B, max_seq_len=4096, kv_budget_bytes=259 * PAGE_8B)
    assert p.num_pages == 259 and p.sequences_at_full_length == 1


def test_too_small_budget_says_how_many_bytes_are_needed() -> None:
    with pytest.raises(PlanError) as info:
        plan(QWEN3_8B, max_seq_len=4096, kv_budget_bytes=259 * PAGE_8B - 1)
    text = str(info.value)
    assert "kv_budget_bytes" in text
    assert f"{259 * PAGE_8B - 1} bytes (258 pages of {PAGE_8B} bytes)" in text  # what was found
    assert f"at least {259 * PAGE_8B} bytes" in text  # what is needed: 258 pages + the scratch page
    assert "max_seq_len" in text  # how to fix it otherwise


def test_pool_past_int32_offsets_is_refused() -> None:
    """The cache kernels address the pool with 32-bit element offsets: Qwen3-8B-DFlash's page holds
    5 · 2 · 16 · 8 · 128 = 163840 elements, so 2^31 of them are 13107 pages, 25 sequences of 514 pages
    (max_seq_len 8192) beside the scratch page."""
    assert plan(QWEN3_8B, max_seq_len=8192, max_batch=25).num_pages == 25 * 514 + 1 <= 13107
    with pytest.raises(PlanError) as info:
        plan(QWEN3_8B, max_seq_len=8192, max_batch=26)
    text = str(info.value)
    assert "BuildOptions.max_batch" in text and "a pool of 13365 pages" in text  # what was found
    assert "at most 13107 pages (2147483648 elements)" in text and "32-bit" in text  # what is expected, and why
    assert "lower max_batch to at most 25" in text and f"kv_budget_bytes of at most {13107 * PAGE_8B}" in text
    # a budget sizes the pool instead: the same limit, named by its option
    assert plan(QWEN3_8B, max_seq_len=8192, kv_budget_bytes=13107 * PAGE_8B).num_pages == 13107
    with pytest.raises(PlanError, match=r"kv_budget_bytes.*a pool of 13108 pages.*lower kv_budget_bytes"):
        plan(QWEN3_8B, max_seq_len=8192, kv_budget_bytes=13108 * PAGE_8B)
    # one sequence too long for the pool on its own
    with pytest.raises(PlanError, match="lower max_seq_len: one sequence of 2200000 rows"):
        plan(QWEN3_8B, max_seq_len=2_200_000, max_batch=1)


def test_sliding_window_retention_when_every_layer_slides() -> None:
    # tiny-dflash2: 2 layers, both sliding with W = 10, block 8, Hkv 2, D 16
    p = plan("tiny-dflash2", max_seq_len=4096, max_batch=4, sliding_window_only=True)
    assert [(r.layer, r.window) for r in p.retention] == [(0, 10), (1, 10)]
    assert p.retained_rows == 10
    assert p.pages_per_seq == 3  # ceil((10 + 8 + 1) / 16) + 1 page for a window that starts mid-page
    assert p.num_pages == 4 * 3 + 1
    assert p.bytes_per_page == 2 * 2 * 16 * 2 * 16 * 2


def test_sliding_windows_are_kept_only_with_the_option() -> None:
    p = plan("tiny-dflash2", max_seq_len=4096, max_batch=4)
    assert all(r.window is None for r in p.retention) and p.retained_rows == 4096
    assert p.pages_per_seq == 257  # ceil((4096 + 8 + 1) / 16)


def test_mixed_layers_keep_full_pages() -> None:
    # tiny-dflash: [sliding 12, sliding 12, full]; pages are shared across layers, so the full layer decides
    p = plan("tiny-dflash", max_seq_len=1000, max_batch=2, sliding_window_only=True)
    assert [r.render() for r in p.retention] == ["window 12", "window 12", "full"]
    assert p.retained_rows == 1000 and p.pages_per_seq == 64  # ceil((1000 + 8 + 1) / 16) = ceil(63.06)


def test_window_wider_than_the_sequence_keeps_the_full_formula() -> None:
    p = plan("tiny-dflash2", max_seq_len=8, max_batch=1, sliding_window_only=True)
    assert p.pages_per_seq == 2 and p.retained_rows == 8  # ceil((8 + 8 + 1) / 16) < the windowed 3


def test_graph_from_another_config_is_refused() -> None:
    small = load_drafter_config(EXAMPLES / "tiny-dflash")
    other = load_drafter_config(EXAMPLES / "tiny-dflash2")
    with pytest.raises(PlanError, match="kv_cache"):
        size_kv_cache(lower(small).propose, PassContext(other, BuildOptions()))
