"""Warpgroup-MMA block attention (sm_90a): which specs the rule takes (the rest go to the mma.sync rule),
that its staged tiles are the layouts its wgmma descriptors describe, the kernel table (the mma kernel's
workspaces and merge), the dependent-launch protocol and an NVRTC build whose wgmmas ptxas keeps async.

The kernel cannot run on the CPU; its numbers are checked on the GPU against numpy through a check bundle
(`python bench/attention.py -o DIR --rule block_attention_wgmma`, then `python bench/kernels.py run DIR`),
which covers every mask, head dims 64 and 128, ragged rows, long and short sequences.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_compiler.dependent_launch import kernel_bodies
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules import RULES, apply_rules
from dflash_compiler.schedules.attention import BlockAttentionSpec
from dflash_compiler.schedules.attention_merge import MERGE_WIDTHS, merge_blocking
from dflash_compiler.schedules.attention_wgmma import (
    ATOM,
    TILE,
    AttentionWgmmaRule,
    WgmmaAttentionPlan,
    fit_wgmma_attention,
    tile_offset,
    wgmma_attention_fits,
)
from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.targets import SM90, SM120, SM121

tvm = pytest.importorskip("tvm")

from kernel_harness import (  # noqa: E402
    DFLASH2_SWA,
    DSPARK,
    QWEN3_8B,
    SMALL,
    assert_only_prefetches_before_the_wait,
    assert_split_grid_is_the_used_spans,
    assert_split_waits_and_merge_triggers,
)

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM

WIDE_GROUP = BlockAttentionSpec(block=16, heads=40, kv_heads=8, head_dim=128, causal=False)  # 80 rows


@pytest.mark.parametrize(
    ("spec", "target", "rule"),
    [
        (QWEN3_8B, SM90, "block_attention_wgmma"),
        (DSPARK, SM90, "block_attention_wgmma"),
        (SMALL, SM90, "block_attention_wgmma"),
        (WIDE_GROUP, SM90, "block_attention_mma"),  # more query rows than one warpgroup's 64
        (BlockAttentionSpec(block=16, heads=32, kv_heads=8, head_dim=96, causal=False), SM90, "block_attention_mma"),
        (QWEN3_8B, SM120, "block_attention_mma"),  # no wgmma on sm_12x
        (QWEN3_8B, SM121, "block_attention_mma"),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_rule_takes_what_one_warpgroup_holds(spec, target, rule):
    """Targets with wgmma, at most 64 query rows per kv head, head dims of whole 64-wide atoms up to 128."""
    assert apply_rules(RULES, spec, target).rule == rule
    assert wgmma_attention_fits(spec, target) == (rule == "block_attention_wgmma")


def _canonical(n: int, k: int, lbo: int, sbo: int) -> int:
    """Byte address of element (n, k) of an N-major 128-byte-swizzled wgmma operand (bf16), as the PTX ISA's
    canonical layout ((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO)) in elements, then Swizzle<3, 4, 3> on the
    byte address (bits 7-9 xor-ed into bits 4-6), from a 1024-byte aligned base."""
    address = (n % 64) * 2 + (n // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
    return address ^ ((address >> 3) & 0x70)


def _canonical_k_major(row: int, k: int, sbo: int) -> int:
    """Byte address of element (row, k) of a K-major 128-byte-swizzled operand whose k lies in one atom."""
    address = k * 2 + (row % 8) * 128 + (row // 8) * sbo
    return address ^ ((address >> 3) & 0x70)


@pytest.mark.parametrize("dim", [64, 128])
def test_tiles_are_the_layouts_the_descriptors_describe(dim):
    """One staging layout serves both products: read K-major (Q and K, rows = query rows or keys, k = head
    dim within an atom, 8-row groups 1024 bytes apart) and read N-major (V: a row per key = k, head dim = N,
    64-column blocks one tile apart, the leading byte offset the kernel passes, 8-key groups 1024 apart)."""
    for row in range(64):
        for d in range(dim):
            staged = (tile_offset(row, d // 8) + d % 8) * 2
            assert staged == _canonical(d, row, lbo=TILE * 2, sbo=1024)
            atom, within = divmod(d, ATOM)
            assert staged == atom * TILE * 2 + _canonical_k_major(row, within, sbo=1024)
    # every 16-byte chunk of a tile is written once
    chunks = {tile_offset(row, v) for row in range(64) for v in range(dim // 8)}
    assert len(chunks) == 64 * dim // 8 and max(chunks) < dim // ATOM * TILE


def test_plans_and_knobs():
    knobs = AttentionWgmmaRule().default_knobs(SM90)
    assert knobs == {
        "splits": 16, "slots": 2 * SM90.sm_count, "prefetch": 2, "stages": 3, "cluster": 0, "early": 0, "trigger": 0,
        "l2_ahead": 0,
    }  # fmt: skip
    assert fit_wgmma_attention(QWEN3_8B, SM90, 16, cluster=16).cluster_counts == (2, 4, 8, 16)
    assert fit_wgmma_attention(QWEN3_8B, SM90, 8, cluster=4).cluster_counts == (2, 4)
    assert fit_wgmma_attention(QWEN3_8B, SM90, 16).cluster_counts == ()
    # the merge's f32 tile (outputs, (max, sum), pad) lies over the Q tile and the ring
    assert WgmmaAttentionPlan.cluster_shared_bytes(QWEN3_8B) == 64 * 136 * 4 <= plan_bytes(QWEN3_8B, 2)
    plan = fit_wgmma_attention(QWEN3_8B, SM90, 16)
    # the Q tile and three slots of a group's K and V: two blocks share an H200 SM
    assert plan.shared_bytes(QWEN3_8B) == 7 * 16384 and 2 * (plan.shared_bytes(QWEN3_8B) + 1024) <= 233472
    assert WgmmaAttentionPlan(1, stages=2).shared_bytes(SMALL) == 5 * 8192
    for bad, match in (
        ({"stages": 1}, "stages=1"),
        ({"stages": 7}, "fewer stages"),
        ({"splits": 0}, "splits=0"),
        ({"slots": -1}, "slots=-1"),
        ({"prefetch": 17}, "prefetch=17"),
        ({"cluster": 3}, "cluster=3: expected 0 .* or a power of two"),
        ({"cluster": 32}, "cluster=32"),
        ({"cluster": 1}, "cluster=1"),
        ({"early": 2}, "early=2: expected 0 .* or 1"),
        ({"trigger": 2}, "trigger=2: expected 0 .* or 1"),
        ({"l2_ahead": 17}, "l2_ahead=17: expected 0 .* to 16"),
        ({"l2_ahead": -1}, "l2_ahead=-1"),
        ({"splits": 8, "cluster": 16}, r"min\(splits=8, 16\)"),
        ({"key_warps": 2}, "key_warps"),  # the mma rule's knob: not this rule's
    ):
        with pytest.raises(ScheduleError, match=match):
            AttentionWgmmaRule().apply(QWEN3_8B, SM90, bad)
    assert AttentionWgmmaRule().apply(QWEN3_8B, SM121) is None


def plan_bytes(spec: BlockAttentionSpec, stages: int) -> int:
    return WgmmaAttentionPlan(16, stages=stages).shared_bytes(spec)


@pytest.fixture(scope="module")
def lowered():
    kernels = [AttentionWgmmaRule().apply(s, SM90) for s in (QWEN3_8B, DFLASH2_SWA, DSPARK, SMALL)]
    for knobs in (
        {"stages": 2, "prefetch": 0},
        {"stages": 4},
        {"early": 1},
        {"early": 1, "prefetch": 0},
        {"trigger": 1},
        {"trigger": 1, "stages": 2},
        {"splits": 20},  # one merge pass of 20 beside the narrow ones
        {"l2_ahead": 2},
        {"l2_ahead": 1, "stages": 2},
    ):
        other = AttentionWgmmaRule().apply(QWEN3_8B, SM90, knobs)
        name = other.name + "".join(f"_{k}{v}" for k, v in knobs.items())
        kernels.append(replace(other, name=name, func=other.func.with_attr("global_symbol", name)))
    return kernels, lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), SM90)


def test_kernel_table(lowered):
    """Split and merge kernels with the mma kernel's workspaces; one warpgroup per (split, kv head,
    sequence), the Q tile and the ring in dynamic shared memory; the split waits first (after its L2
    prefetches) and lets its dependents in only with `trigger`."""
    kernels, cuda = lowered
    for kernel in kernels:
        spec, knobs = kernel.spec, kernel.knobs
        func = cuda.functions[kernel.name]
        assert [(w.name, w.dtype) for w in func.workspaces] == [("part_o", "float32"), ("part_ml", "float32")]
        env = {"nb": 3, "m": 3 * spec.block, "maxp": 7, "pages": 21}
        rows, splits = spec.block * spec.group, knobs["splits"]
        sizes = [int(np.prod([evaluate(d, env) for d in w.shape])) for w in func.workspaces]
        assert sizes == [3 * spec.kv_heads * splits * rows * spec.head_dim, 3 * spec.kv_heads * splits * rows * 2]
        split, merge = func.kernels
        _, block, smem = split.launch_dims(env)
        plan = fit_wgmma_attention(spec, SM90, splits, stages=knobs["stages"])
        assert block == (32, 4, 1) and smem == plan.shared_bytes(spec)
        assert_split_grid_is_the_used_spans(split, spec, splits, knobs["slots"], env)
        grid, block, _ = merge.launch_dims(env)
        per_block, threads = merge_blocking(spec)
        assert grid == (spec.heads // per_block, spec.block, 3) and block == (threads, 1, 1)
        early = knobs["prefetch"] > 0 or knobs["early"] == 1  # host-written lengths and tables before the wait
        assert_split_waits_and_merge_triggers(cuda.source, split.name, merge.name, early, bool(knobs["trigger"]))


def test_the_merge_moves_a_split_in_one_load_of_each_workspace(lowered):
    """Per split a merge thread loads its four outputs in one 16-byte load and the (max, sum) in one 8-byte load
    (every stride of the workspaces is a constant multiple of the vector), and it stores its four bf16 outputs
    in one 8-byte store: a pass of w splits is w loads of each, for the narrow passes of 4, 8 and 16 splits below
    the split count and the pass of every split (20 splits: one pass of 20, not two of 16)."""
    kernels, cuda = lowered
    assert {kernel.knobs["splits"] for kernel in kernels} == {16, 20}
    for kernel in kernels:
        _, merge = cuda.functions[kernel.name].kernels
        body = cuda.source[slice(*kernel_bodies(cuda.source)[merge.name])]
        widths = sum(w for w in MERGE_WIDTHS if w < kernel.knobs["splits"]) + kernel.knobs["splits"]
        assert body.count("*(float4*)(part_o_ptr + ") == widths, kernel.name
        assert body.count("*(float2*)(part_ml_ptr + ") == widths, kernel.name
        assert "part_o_ptr[" not in body and "part_ml_ptr[" not in body
        assert body.count("*(nv_bfloat164*)(out_ptr + ") == 1 and "out_ptr[" not in body


def test_both_products_are_warpgroup_mmas(lowered):
    """S = Q·Kᵀ is m64n64k16 with both operands in shared memory, O += P·V is m64n{head_dim}k16 with P from
    registers and V read N-major (imm-trans-b 1) with its column blocks one tile apart; no warp multiplies
    with mma.sync or reads a K/V fragment itself; the K/V copies are cp.async, waited for by group."""
    from dflash_compiler.dependent_launch import kernel_bodies
    from dflash_compiler.wgmma import mma_name, mma_rs_name

    kernels, cuda = lowered
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    for kernel in kernels:
        split = bodies[cuda.functions[kernel.name].kernels[0].name]
        dim = kernel.spec.head_dim
        assert split.count(f"{mma_name(64)}(") == dim // 16, kernel.name
        assert split.count(f"{mma_rs_name(dim)}(") == 4 and f", {TILE * 2});" in split, kernel.name
        assert "mma.sync" not in split and "cp_async" in split
        assert f"cp_async_wait_group_async_wait_group_{kernel.knobs['stages'] - 2}()" in split, kernel.name
    assert "m64n128k16.f32.bf16.bf16 {%0" in cuda.source and "}, %68, p, 1, 1, 1;" in cuda.source


def test_early_locates_before_the_wait_and_copies_right_after_it(lowered):
    """With `early` 1 the split reads the length, positions and its first group's page-table entries before its
    wait (host-written, as the prefetches read them) and, after it, nothing of them before its first copies:
    Q's rows go by cp.async and the first group's K/V follow at once. With 0 the length and the span are
    read again after the wait and Q's rows pass through registers."""
    import re

    from dflash_compiler.dependent_launch import WAIT, kernel_bodies

    kernels, cuda = lowered
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    assert sum(kernel.knobs["early"] for kernel in kernels) == 2
    for kernel in kernels:
        split = bodies[cuda.functions[kernel.name].kernels[0].name]
        before, after = split.split(f"{WAIT}();", 1)
        q_reads = len(re.findall(r"\bq_ptr\b", after))
        q_copies = len(re.findall(r"cp_async\w*\(tvm_builtin_cuda_cvta_generic_to_shared\([^;]*\(&\(q_ptr\[", after))
        if kernel.knobs["early"]:
            assert "cache_lens_ptr[" in before and "block_table_ptr[" in before and "cache_lens_ptr[" not in after
            first_copy = after.index("cp_async")
            assert "block_table_ptr[" not in after[:first_copy] and "blk_positions_ptr[" not in after[:first_copy]
            assert q_reads == q_copies > 0, kernel.name
        else:
            assert "cache_lens_ptr[" in after and q_copies == 0 < q_reads, kernel.name
        assert_only_prefetches_before_the_wait(cuda.source, cuda.functions[kernel.name].kernels[0].name)


def test_trigger_lets_the_merge_in_once_per_block_after_its_last_copies(lowered):
    """With `trigger` 1 every split block calls the trigger exactly once, whatever its group count: after its
    prologue when that issued every copy, else in the loop right after the commit of the last group's copies.
    The guards are read out of the generated CUDA and evaluated for 0-12 groups."""
    import re

    from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, WAIT, kernel_bodies

    kernels, cuda = lowered
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    triggered = [k for k in kernels if k.knobs["trigger"]]
    assert len(triggered) == 2
    for kernel in triggered:
        split = bodies[cuda.functions[kernel.name].kernels[0].name]
        guards = re.findall(r"if \(([^{]*)\) \{\n\s*" + LAUNCH_DEPENDENTS + r"\(\);", split)
        assert len(guards) == split.count(f"{LAUNCH_DEPENDENTS}();") == 2, kernel.name
        prologue, in_loop = (g.replace("span_ptr[3]", "groups") for g in guards)
        loop = split.index("for (int grp = 0; grp < span_ptr[3]; ++grp)")
        assert split.index(WAIT) < split.index(LAUNCH_DEPENDENTS) < loop < split.rindex(LAUNCH_DEPENDENTS)
        commit = "tvm_builtin_ptx_cp_async_commit_group_async_commit_group();"
        assert split[: split.rindex(LAUNCH_DEPENDENTS)].rstrip().endswith(f"{commit}\n    if ({guards[1]}) {{")
        for groups in range(13):
            calls = eval(prologue, {"groups": groups}) + sum(
                eval(in_loop, {"groups": groups, "grp": grp}) for grp in range(groups)
            )
            assert calls == 1, (kernel.name, groups, prologue, in_loop)


def test_l2_ahead_prefetches_each_later_group_once_from_entries_read_a_group_before(lowered):
    """With `l2_ahead` f each loop step, after the copies of group grp + ahead, prefetches into L2 the cached K/V
    lines of group grp + ahead + f (ahead = stages - 1), through page-table entries read in the step before (the
    prologue reads the first ones): every group from ahead + f on is prefetched once, by one guarded set of
    prefetches per step. Without it the loop prefetches nothing."""
    import re

    from dflash_compiler.dependent_launch import PREFETCH_L2, WAIT, kernel_bodies

    kernels, cuda = lowered
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    assert sorted(kernel.knobs["l2_ahead"] for kernel in kernels if kernel.knobs["l2_ahead"]) == [1, 2]
    for kernel in kernels:
        split = bodies[cuda.functions[kernel.name].kernels[0].name]
        far, ahead = kernel.knobs["l2_ahead"], kernel.knobs["stages"] - 1
        loop_at = split.index("for (int grp = 0; grp < span_ptr[3]; ++grp)")
        prologue, loop = split[split.index(f"{WAIT}();") : loop_at], split[loop_at:]
        if not far:
            assert PREFETCH_L2 not in loop and "pf_ptr" not in split, kernel.name
            continue
        keys = 64 * (ahead + far)
        # the entries of group ahead + f, read before the loop; in the loop those of the group after
        assert re.search(rf"pf_ptr\[0\] = block_table_ptr\[.*span_ptr\[0\]\) \+ {keys}\)", prologue), kernel.name
        assert re.search(rf"pf_ptr\[0\] = block_table_ptr\[.*span_ptr\[0\]\) \+ {keys + 64}\)", loop), kernel.name
        guards = re.findall(r"if \(\(grp \+ (\d+)\) < span_ptr\[3\]\) \{\n\s*if \(\(\(\(\(\(\(\(grp \* 64\)", loop)
        assert guards == [str(ahead + far)], (kernel.name, guards)
        slots = re.findall(r"int (slot_\d+) = max\(min\(pf_ptr\[\d\]", loop)
        prefetched = re.findall(rf"{PREFETCH_L2}\(\(&\(kv_ptr\[\(+(?:pages \* 16384\) \+ \()?(slot_\d+) \* 16384", loop)
        assert len(prefetched) == 2 * len(slots) > 0 and set(prefetched) == set(slots), kernel.name
        assert all(f"span_ptr[0]) + {keys + 8 * i})" in loop for i in range(len(slots))), kernel.name


def test_nvrtc_keeps_the_warpgroup_mmas_async(lowered):
    """sm_90a code for every kernel; compile_cubin refuses a cubin whose wgmmas ptxas serialised."""
    from dflash_compiler.cubin import cubin_arch, kernel_names
    from dflash_compiler.nvrtc import compile_cubin

    _, cuda = lowered
    cubin = compile_cubin(cuda.source, SM90.arch)
    assert cubin_arch(cubin) == SM90.arch
    assert set(kernel_names(cubin)) == set(cuda.kernel_names())


@pytest.fixture(scope="module")
def clustered():
    """Cluster-16 kernels of the Qwen3 drafter, a sliding window and DSpark's 28 query rows."""
    kernels = [AttentionWgmmaRule().apply(s, SM90, {"cluster": 16}) for s in (QWEN3_8B, DFLASH2_SWA, DSPARK)]
    return kernels, lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), SM90)


def test_batches_of_2_to_16_spans_launch_one_cluster_kernel(clustered):
    """A batch whose span count is 2, 4, 8 or 16 launches that many blocks per (kv head, sequence) as one
    cluster and nothing else (no workspace is read, no merge kernel); any other count launches the split and
    merge kernels. H100/H200: 264 slots, 8 kv heads, so 33 // nb spans up to 16."""
    kernels, cuda = clustered
    for kernel in kernels:
        spec, func = kernel.spec, cuda.functions[kernel.name]
        assert [w.name for w in func.workspaces] == ["part_o", "part_ml"]
        *cluster_kernels, split, merge = func.kernels
        assert [k.cluster for k in cluster_kernels] == [(16, 1, 1), (8, 1, 1), (4, 1, 1), (2, 1, 1)]
        assert split.cluster == merge.cluster == (1, 1, 1)
        plan = fit_wgmma_attention(spec, SM90, 16, cluster=16)
        for nb, count in ((1, 16), (2, 16), (3, 0), (4, 8), (5, 0), (8, 4), (11, 0), (16, 2), (40, 0)):
            env = {"nb": nb, "m": nb * spec.block, "maxp": 7, "pages": 21}
            used = max(1, min(16, 2 * SM90.sm_count // (nb * spec.kv_heads)))
            launched = func.launches(env)
            if count:
                assert used == count and len(launched) == 1, (nb, launched)
                (one,) = launched
                grid, block, smem = one.launch_dims(env)
                assert one.cluster == (count, 1, 1) and grid == (count, spec.kv_heads, nb), (nb, grid)
                assert block == (32, 4, 1) and smem == plan.shared_bytes(spec)
            else:
                assert [k.name for k in launched] == [split.name, merge.name], nb
                assert split.launch_dims(env)[0] == (used, spec.kv_heads, nb)


def test_a_cluster_merges_its_spans_in_shared_memory(clustered):
    """Each cluster kernel waits before it reads (after its L2 prefetches), lets the next grid in once its
    keys are done, puts its rows into the f32 tile behind a block barrier, meets the cluster, reads each
    span's (max, sum) and outputs with one 16-byte remote load per span, stores bf16 `out`, and meets the
    cluster again before it exits; it writes no workspace."""
    from dflash_compiler.cluster import LOAD4, SYNC
    from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, kernel_bodies

    kernels, cuda = clustered
    bodies = {name: cuda.source[slice(*span)] for name, span in kernel_bodies(cuda.source).items()}
    for kernel in kernels:
        rows = kernel.spec.block * kernel.spec.group
        for launch in cuda.functions[kernel.name].kernels[:4]:
            count, body = launch.cluster[0], bodies[launch.name]
            assert_only_prefetches_before_the_wait(cuda.source, launch.name)
            assert "part_o" not in body and "part_ml" not in body and "out_ptr[" in body
            trigger, barrier = body.index(f"{LAUNCH_DEPENDENTS}();"), body.index("__syncthreads();", body.index(
                f"{LAUNCH_DEPENDENTS}();"))  # fmt: skip
            first, last = body.index(f"{SYNC}();"), body.rindex(f"{SYNC}();")
            assert body.count(f"{SYNC}();") == 2 and trigger < barrier < first < last
            loads = body[first:last].count(f"{LOAD4}(")
            rows_per = -(-rows // count)
            rounds = -(-rows_per * kernel.spec.head_dim // 4 // 128)
            assert loads == 2 * count * rounds, (launch.name, loads)
            assert body.rindex("out_ptr[") < last
