"""The warpgroup GEMM's k splits added by each tile's last block to finish (`wgmma_k_reduce` 3, linear_wgmma.py's
`last_store_macro`): the plan, the kernel table (no merge launch, the workspace's plane of counts), the order
of the generated count and sum, and NVRTC builds. The kernels against numpy on the GPU: bench/linear.py --gemm
(its odd-shape cases include k_reduce 3) and bench/kernels.py with the knob.
"""

from __future__ import annotations

import re

import pytest

from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_plans import fit_wgmma_plan
from dflash_compiler.schedules.linear_rules import LinearMmaRule
from dflash_compiler.schedules.linear_wgmma import KERNEL_REDUCE, LAST_REDUCE, PRODUCER_ROLES
from dflash_compiler.targets import SM90

tvm = pytest.importorskip("tvm")

from kernel_harness import WGMMA_PLAN, assert_nvrtc_builds  # noqa: E402 - TVM

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM
from dflash_compiler.dependent_launch import kernel_bodies  # noqa: E402

KNOBS = {**WGMMA_PLAN, "k_reduce": LAST_REDUCE}


def test_plan_reports_the_last_block_sum_and_refuses_a_producer():
    spec = LinearSpec("matmul", 4096, 1024)  # 16 atoms
    plan = fit_wgmma_plan(spec, SM90, KNOBS)
    assert plan.last and not plan.cluster and plan.k_splits == 4 and plan.reduce_bytes() == 0
    assert plan.shared_bytes() == plan.stages * plan.stage_bytes()  # the flag lies over the slots
    # one split has nothing to add: reported as the merge-kernel plan, which needs no merge either
    single = fit_wgmma_plan(spec, SM90, {**KNOBS, "k_splits": 1})
    assert single.k_reduce == KERNEL_REDUCE and not single.last
    with pytest.raises(ScheduleError, match=r"wgmma_roles=2, wgmma_k_reduce=3.*Fix: wgmma_k_reduce 1"):
        fit_wgmma_plan(spec, SM90, {**KNOBS, "roles": PRODUCER_ROLES})
    with pytest.raises(ScheduleError, match=r"wgmma_k_reduce=4: expected 1 .* or 3"):
        fit_wgmma_plan(spec, SM90, {**KNOBS, "k_reduce": 4})


def _lowered(spec: LinearSpec, knobs: dict[str, int]):
    kernel = LinearMmaRule().apply(spec, SM90, knobs)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    return kernel, cuda, cuda.functions[kernel.name]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_split_gemms_launch_no_merge_and_count_in_the_workspace(fp8):
    """o_proj's GEMMs of 33-64 and 65-128 rows split k four ways: with the knob each is one launch whose
    workspace holds the splits' partial sums and, past them, a plane for the tiles' counts."""
    spec = LinearSpec("matmul_fp8" if fp8 else "matmul", 4096, 4096, weight_dtype=FP8 if fp8 else "bfloat16")
    plain, _, plain_func = _lowered(spec, {})
    kernel, _, func = _lowered(spec, {"wgmma_k_reduce": LAST_REDUCE})
    assert kernel.knobs["wgmma_k_reduce"] == LAST_REDUCE and plain.knobs["wgmma_k_reduce"] == KERNEL_REDUCE
    for m, tier in ((64, "mid_"), (128, "wgmma_")):
        splits = kernel.knobs[f"{tier}k_splits"]
        assert splits > 1
        assert len(plain_func.launches({"m": m})) == 2  # the GEMM and its merge kernel
        (gemm,) = func.launches({"m": m})
        grid, _, _ = gemm.launch_dims({"m": m})
        assert grid[2] == splits
        (ws,) = [w for w in func.workspaces if w.name == ("mid_part" if tier == "mid_" else "part")]
        elements = evaluate(" * ".join(f"({d})" for d in ws.shape), {"m": m})
        assert ws.dtype == "float32" and elements == m * (splits + 1) * spec.n
    assert len(func.launches({"m": 16})) == 1  # the few-rows kernel never splits k


def test_generated_code_counts_after_the_stores_and_sums_after_the_count():
    """The partial sums are stored and fenced before the block barrier that precedes the count; one thread
    counts the block with an atomic add on the plane past the splits and resets a full count; the block that
    was last fences again and reads every split's sums, vectors of four, then stores y."""
    spec = LinearSpec("matmul", 4096, 4096)
    kernel, cuda, func = _lowered(spec, {"wgmma_k_reduce": LAST_REDUCE, "mid_rows": 0})
    splits = kernel.knobs["wgmma_k_splits"]
    (gemm,) = func.launches({"m": 128})
    start, end = kernel_bodies(cuda.source)[gemm.name]
    body = cuda.source[start:end]
    stores = [m.start() for m in re.finditer(r"part_ptr\[[^\]]*\] = acc_ptr", body)]
    fences = [m.start() for m in re.finditer(r"__threadfence\(\);", body)]
    (add,) = [m.start() for m in re.finditer(r"atomicAdd\(", body)]
    assert stores and len(fences) == 2
    assert max(stores) < fences[0] < body.index("__syncthreads();", fences[0]) < add < fences[1]
    # the count sits in the plane past the splits: row bm's offset splits * n
    count = re.search(r"atomicAdd\(\(&\(part_ptr\[(.*)\]\)\), ", body).group(1)
    assert f"+ {splits * spec.n})" in count
    found = re.escape(f"/*{splits - 1:.6e}*/")  # the block found splits - 1 counted before it
    assert re.search(rf"if \(before_ptr\[0\] == \S+{found}\)", body)
    assert re.search(r"part_ptr\[.*\] = 0x0p\+0f", body[add : fences[1]])  # the last block resets the count
    loads = re.findall(r"float4 v_\w* = \*\(float4\*\)\(part_ptr \+", body[fences[1] :])
    assert len(loads) >= splits and "y_ptr" in body[fences[1] :]


@pytest.mark.parametrize(
    ("op", "n", "k", "wdtype", "variant"),
    [
        ("matmul", 4096, 4096, "bfloat16", (1, 128, 4, 1, 4, 1)),
        ("matmul_fp8", 4096, 12288, FP8, (1, 128, 4, 1, 8, 2)),
        ("lm_head", 384, 512, FP8, (1, 40, 3, 1, 4, 2)),  # ragged n, 40-row x tiles, FP8 scales
        ("matmul_fp8", 202, 256, FP8, (2, 64, 3, 1, 2, 2)),  # n not a multiple of 4: scalar sums
    ],
)
def test_compiles_for_sm90a(op, n, k, wdtype, variant):
    pytest.importorskip("cuda.bindings")
    names = ("warpgroups", "block_m", "stages", "k_atoms", "k_splits", "mma_groups")
    knobs = {f"wgmma_{name}": v for name, v in zip(names, variant, strict=True)}
    kernel, cuda, func = _lowered(LinearSpec(op, n, k, weight_dtype=wdtype), {**knobs, "wgmma_k_reduce": 3})
    assert kernel.knobs["wgmma_k_reduce"] == LAST_REDUCE
    assert len(func.launches({"m": 300})) == 1
    assert_nvrtc_builds(cuda, "sm_90a")
