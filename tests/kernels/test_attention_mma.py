"""Tensor-core block attention: which specs the rule takes (and leaves to the SIMT kernel), the kernel table
TVM produces (the same workspaces and merge as the SIMT kernel), and NVRTC builds for all three targets
with code for each SM and registers that fit.

The mma kernel cannot run on the CPU; its numbers are checked on the GPU against numpy through a check
bundle (`python bench/attention.py -o DIR`, then `pytest tests/gpu/test_kernels.py --kernel-bundle DIR`),
which covers every mask, head dims 64 and 128, ragged warps, long and short sequences.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules import RULES, apply_rules
from dflash_compiler.schedules.attention import BlockAttentionSpec
from dflash_compiler.schedules.attention_merge import merge_blocking
from dflash_compiler.schedules.attention_mma import (
    AttentionMmaRule,
    MmaAttentionPlan,
    fit_mma_attention,
    mma_attention_fits,
    staged_chunk,
    staged_pitch,
)
from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.targets import SM90, SM120, SM121

tvm = pytest.importorskip("tvm")

from kernel_harness import (  # noqa: E402
    DFLASH2_SWA,
    DSPARK,
    QWEN3_8B,
    SMALL,
    assert_split_grid_is_the_used_spans,
    assert_split_waits_and_merge_triggers,
)

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        (QWEN3_8B, "block_attention_mma"),
        (DSPARK, "block_attention_mma"),
        (SMALL, "block_attention_mma"),
        (BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=True, window=12), "block_attention"),
        (BlockAttentionSpec(block=6, heads=4, kv_heads=4, head_dim=12, causal=False), "block_attention"),
        (BlockAttentionSpec(block=16, heads=16, kv_heads=4, head_dim=256, causal=False), "block_attention"),
        (BlockAttentionSpec(block=16, heads=48, kv_heads=4, head_dim=128, causal=False), "block_attention"),
    ],
    ids=lambda x: x.name if isinstance(x, BlockAttentionSpec) else x,
)
def test_rule_takes_what_it_can_tile(spec, rule):
    """head_dim a multiple of 32 up to 128 and a group that fits the staged chunks go to tensor cores; the
    SIMT kernel (correct for any shape) takes the rest. (On a target with wgmma the warpgroup rule comes
    first: test_attention_wgmma.py.)"""
    assert apply_rules(RULES, spec, SM90.model_copy(update={"wgmma": False})).rule == rule


def test_fit_rules():
    assert not mma_attention_fits(QWEN3_8B, SM90.model_copy(update={"bf16_mma": False}))
    # 192 query rows per kv head: 12 warps stage 12 chunks, 104 KB of shared memory
    assert not mma_attention_fits(BlockAttentionSpec(16, 48, 4, 128, False), SM90)
    plan = fit_mma_attention(DSPARK, SM90, 16)
    assert plan == MmaAttentionPlan(warps=2, splits=16)
    assert plan.shared_bytes(DSPARK) == 2 * 2 * 16 * 128 * 2  # K and V of 2 chunks, unpadded (swizzled) rows
    assert fit_mma_attention(DSPARK, SM90, 8, 4, 2, 96) == MmaAttentionPlan(2, 8, 4, 2, 96)
    for knobs, match in (
        ({"splits": 0}, "splits=0"),
        ({"qk_chains": 3}, "qk_chains=3"),  # 8 k steps of head_dim 128: 1, 2 or 4 chains
        ({"tile_chunks": 3}, "tile_chunks=3"),  # 4 warps stage 4 chunks a group
        ({"slots": -1}, "slots=-1"),
        ({"key_warps": 3}, "key_warps=3"),  # 2 tiles a group (4 chunks, 2 per step)
        ({"chunk": 32}, "unknown knob"),
    ):
        with pytest.raises(ScheduleError, match=match):
            AttentionMmaRule().apply(QWEN3_8B, SM90, knobs)
    with pytest.raises(ScheduleError, match="tile_chunks=4"):
        AttentionMmaRule().apply(DSPARK, SM90, {"tile_chunks": 4})  # 28 rows: 2 warps, 2 chunks a group
    # the default step takes 2 chunks where the warps (chunks per group) allow: 4, 2, then 1 warp
    assert [AttentionMmaRule().apply(s, SM90).knobs["tile_chunks"] for s in (QWEN3_8B, DSPARK, SMALL)] == [2, 2, 1]
    # two warps per row tile take turns over a group's tiles: DSpark's group of 2 chunks has one tile of 2
    with pytest.raises(ScheduleError, match="key_warps=2"):
        AttentionMmaRule().apply(DSPARK, SM90, {"key_warps": 2})
    assert AttentionMmaRule().apply(DSPARK, SM90, {"key_warps": 2, "tile_chunks": 1}).knobs["key_warps"] == 2
    assert fit_mma_attention(QWEN3_8B, SM90, 16, 2, 2, 0, 2).threads == 256
    # the ring: 2 or more group slots of 32 KiB, within the block's opt-in shared memory (99 KiB on sm_12x)
    for knobs, target, match in (
        ({"stages": 1}, SM90, "stages=1"),
        ({"stages": 8}, SM90, "262144 bytes"),
        ({"stages": 4}, SM121, "131072 bytes"),
    ):
        with pytest.raises(ScheduleError, match=match):
            AttentionMmaRule().apply(QWEN3_8B, target, knobs)
    assert fit_mma_attention(QWEN3_8B, SM121, 4, 2, 2, 0, 1, 3).shared_bytes(QWEN3_8B) == 3 * 32768
    with pytest.raises(ScheduleError, match="256 threads, expected at most 128"):
        fit_mma_attention(QWEN3_8B, SM90.model_copy(update={"max_threads_per_block": 128}), 16, 2, 2, 0, 2)
    knobs = AttentionMmaRule().default_knobs(SM121)
    assert knobs["splits"] == 4  # 48 SMs: 8 kv heads x 4 blocks
    assert knobs["slots"] == 4 * SM121.sm_count and knobs["qk_chains"] == 2


@pytest.fixture(scope="module")
def lowered():
    out = {}
    for target in (SM90, SM120, SM121):
        kernels = [AttentionMmaRule().apply(s, target) for s in (QWEN3_8B, DFLASH2_SWA, DSPARK, SMALL)]
        # two warps per row tile (their combine through the staging memory); K/V copied into a ring of 2
        # group slots (cp.async, dynamic shared memory), with the combine over the ring
        for knobs in ({"key_warps": 2}, {"stages": 2}, {"stages": 2, "key_warps": 2}):
            other = AttentionMmaRule().apply(QWEN3_8B, target, knobs)
            name = other.name + "".join(f"_{k}{v}" for k, v in knobs.items())
            kernels.append(replace(other, name=name, func=other.func.with_attr("global_symbol", name)))
        out[target.name] = (kernels, lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target))
    return out


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_kernel_table(lowered, target):
    kernels, cuda = lowered[target.name]
    for kernel in kernels:
        spec, splits = kernel.spec, kernel.knobs["splits"]
        warps = -(-spec.block * spec.group // 16)
        func = cuda.functions[kernel.name]
        assert [k.name for k in func.kernels] == [f"{kernel.name}_kernel", f"{kernel.name}_kernel_1"]
        # the SIMT kernel's workspaces: the merge kernel is shared
        assert [(w.name, w.dtype) for w in func.workspaces] == [("part_o", "float32"), ("part_ml", "float32")]
        env = {"nb": 3, "m": 3 * spec.block, "maxp": 7, "pages": 21}
        rows = spec.block * spec.group
        sizes = [int(np.prod([evaluate(d, env) for d in w.shape])) for w in func.workspaces]
        assert sizes == [3 * spec.kv_heads * splits * rows * spec.head_dim, 3 * spec.kv_heads * splits * rows * 2]
        split, merge = func.kernels
        _, block, smem = split.launch_dims(env)
        assert block == (32, warps * kernel.knobs["key_warps"], 1)
        assert_split_grid_is_the_used_spans(split, spec, splits, kernel.knobs["slots"], env)
        plan = fit_mma_attention(spec, target, splits, key_warps=kernel.knobs["key_warps"],
                                 stages=kernel.knobs["stages"])  # fmt: skip
        # the staged chunks: static, or the ring in dynamic shared memory
        assert smem == (plan.shared_bytes(spec) if plan.stages else 0)
        grid, block, _ = merge.launch_dims(env)
        per_block, threads = merge_blocking(spec)
        assert grid == (spec.heads // per_block, spec.block, 3) and block == (threads, 1, 1)
        assert_split_waits_and_merge_triggers(cuda.source, split.name, merge.name, kernel.knobs["prefetch"] > 0)
    assert cuda.source.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 2 * len(kernels)
    assert "__shfl_xor_sync" in cuda.source


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_softmax_weights_take_one_ex2(lowered, target):
    """The split kernels' exponentials are the prelude's single `ex2.approx.ftz` (fast_exp2.py), not CUDA's
    exp2f with its subnormal range fix; the scale by 1/sqrt(d)·log2(e) happens in the exponent's FFMA."""
    from dflash_compiler.dependent_launch import kernel_bodies
    from dflash_compiler.fast_exp2 import EXP2

    kernels, cuda = lowered[target.name]
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    assert f"float {EXP2}(float x)" in cuda.source and "ex2.approx.ftz.f32" in cuda.source
    for kernel in kernels:
        split = bodies[cuda.functions[kernel.name].kernels[0].name]
        assert f"{EXP2}(" in split and "exp2f(" not in split, kernel.name


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_nvrtc_builds_for_each_sm(lowered, target):
    from dflash_compiler.cubin import cubin_arch, kernel_names, static_shared_bytes
    from dflash_compiler.nvrtc import compile_cubin

    kernels, cuda = lowered[target.name]
    cubin = compile_cubin(cuda.source, target.arch)
    assert cubin_arch(cubin) == target.arch
    assert set(kernel_names(cubin)) == set(cuda.kernel_names())
    shared = static_shared_bytes(cubin)
    for kernel in kernels:
        knobs = kernel.knobs
        plan = fit_mma_attention(
            kernel.spec, target, knobs["splits"], key_warps=knobs["key_warps"], stages=knobs["stages"]
        )
        # TVM trims the last row's padding; the section may add the block's reserved bytes
        static = plan.shared_bytes(kernel.spec) if not plan.stages else 0
        assert static - 64 <= shared[f"{kernel.name}_kernel"] <= static + 1024
        assert shared[f"{kernel.name}_kernel"] <= target.max_static_shared_memory_per_block


def _wavefronts(addresses):
    """Shared-memory wavefronts of one quarter warp's 16-byte accesses (byte addresses): the most distinct
    16-byte chunks that fall in one of the 8 bank groups (a chunk read twice is one broadcast)."""
    groups: dict[int, set[int]] = {}
    for a in addresses:
        groups.setdefault(a // 16 % 8, set()).add(a // 16)
    return max(len(chunks) for chunks in groups.values())


def _fragment_reads(dim, slot):
    """Each quarter warp's 16-byte reads of one tile's B fragments, as the kernel indexes them: Q·Kᵀ reads
    chunk 4·st + tq of row 8·nt + gq; P·V reads chunk gq·dim/64 + cv of row 8·(kk // 2) + 2·tq + kk % 2.
    `slot(row, chunk)` is the byte address of a chunk."""
    for q in range(4):
        lanes = [(lane // 4, lane % 4) for lane in range(8 * q, 8 * q + 8)]
        for nt in range(2):
            for st in range(dim // 32):
                yield "k", [slot(nt * 8 + gq, st * 4 + tq) for gq, tq in lanes]
        for kk in range(4):
            for cv in range(dim // 64):
                yield "v", [slot(kk // 2 * 8 + tq * 2 + kk % 2, gq * (dim // 64) + cv) for gq, tq in lanes]


@pytest.mark.parametrize("dim", [64, 128])
def test_staged_rows_are_read_in_one_wavefront(dim):
    """The swizzled staging (`staged_chunk`) serves every quarter warp's fragment read in one wavefront; rows
    padded by 16 bytes (the layout of head dims 32 and 96) would take two for P·V or Q·Kᵀ. Each row's chunks
    stay a permutation within groups of 8, so a quarter warp staging 8 consecutive chunks writes 8 groups."""
    pitch = staged_pitch(dim)
    assert pitch == dim
    swizzled, padded = {"k": 0, "v": 0}, {"k": 0, "v": 0}
    for kind, a in _fragment_reads(dim, lambda r, c: r * pitch * 2 + staged_chunk(r, c, dim) * 16):
        swizzled[kind] = max(swizzled[kind], _wavefronts(a))
    for kind, a in _fragment_reads(dim, lambda r, c: r * (dim + 8) * 2 + c * 16):
        padded[kind] = max(padded[kind], _wavefronts(a))
    assert swizzled == {"k": 1, "v": 1}
    assert max(padded.values()) == 2
    for row in range(64):
        for base in range(0, dim // 8, 8):
            assert sorted(staged_chunk(row, base + c, dim) for c in range(8)) == list(range(base, base + 8))
    assert staged_pitch(96) == 104 and staged_chunk(5, 3, 96) == 3


def test_cached_kv_is_prefetched_before_the_wait():
    """The default split kernel prefetches its first two groups' cached K/V lines into L2 before it waits
    for its inputs: per lane and group, one prefetch per 16-byte vector that starts a 128-byte line, for K
    and V (fetch_chunk's loads, as lines); prefetch=0 leaves the wait first, and the knob is bounded."""
    from dflash_compiler.dependent_launch import PREFETCH_L2, WAIT, kernel_bodies

    kernels = [AttentionMmaRule().apply(QWEN3_8B, SM90, knobs) for knobs in ({}, {"prefetch": 0})]
    kernels[1] = replace(kernels[1], name="off", func=kernels[1].func.with_attr("global_symbol", "off"))
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), SM90)
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    early = [bodies[cuda.functions[k.name].kernels[0].name].split(f"{WAIT}();")[0] for k in kernels]
    assert kernels[0].knobs["prefetch"] == 2
    # 2 groups x 8 vectors a lane fetches per chunk x (K, V); a lane prefetches where its vector starts a line
    assert early[0].count(f"{PREFETCH_L2}(") == 2 * 8 * 2 and "% 8) == 0" in early[0]
    assert PREFETCH_L2 not in early[1] and "kv_ptr" not in early[1]
    with pytest.raises(ScheduleError, match="prefetch=17"):
        AttentionMmaRule().apply(QWEN3_8B, SM90, {"prefetch": 17})
