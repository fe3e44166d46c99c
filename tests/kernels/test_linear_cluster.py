"""The warpgroup GEMM's k splits added in a thread block cluster (`wgmma_k_reduce` 2, linear_wgmma.py's
`cluster_store_macro`): the plan's limits and shared memory, the kernel table (one launch, no workspace, the
cluster shape), the generated reduction and NVRTC builds. The kernels against numpy on the GPU:
bench/linear.py --gemm (its odd-shape cases include clusters of 2, 4 and 8 blocks).
"""

from __future__ import annotations

import re

import pytest

from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_plans import fit_wgmma_plan
from dflash_compiler.schedules.linear_rules import LinearMmaRule
from dflash_compiler.schedules.linear_wgmma import CLUSTER_PAD, CLUSTER_REDUCE, KERNEL_REDUCE, WgmmaPlan
from dflash_compiler.targets import SM90

tvm = pytest.importorskip("tvm")

from kernel_harness import WGMMA_PLAN, assert_nvrtc_builds  # noqa: E402 - TVM

from dflash_compiler.cluster import ADD4, DIMS, SYNC  # noqa: E402
from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM
from dflash_compiler.dependent_launch import kernel_bodies  # noqa: E402

KNOBS = {**WGMMA_PLAN, "k_reduce": 2}


def test_plan_caps_the_splits_at_a_portable_cluster_and_sizes_the_tile():
    spec = LinearSpec("matmul", 4096, 1024)  # 16 atoms
    plan = fit_wgmma_plan(spec, SM90, {**KNOBS, "k_splits": 16})
    assert plan.k_splits == 8 and plan.cluster  # a cluster holds at most 8 blocks
    assert fit_wgmma_plan(spec, SM90, {**KNOBS, "k_splits": 16, "k_reduce": KERNEL_REDUCE}).k_splits == 16
    # the f32 tile of partial sums lies over the slots; the block asks for the larger of the two
    assert plan.reduce_bytes() == 128 * (64 + CLUSTER_PAD) * 4
    ring = plan.stages * plan.stage_bytes()
    assert plan.shared_bytes() == max(ring, plan.reduce_bytes())
    wide = WgmmaPlan(2, 256, 2, 1, 4, k_reduce=CLUSTER_REDUCE)  # a 256-row tile outgrows two slots
    assert wide.shared_bytes() == wide.reduce_bytes() > 2 * wide.stage_bytes()
    # one split has nothing to add: reported as the merge-kernel plan, which it is
    single = fit_wgmma_plan(spec, SM90, {**KNOBS, "k_splits": 1})
    assert single.k_reduce == KERNEL_REDUCE and not single.cluster and single.reduce_bytes() == 0
    with pytest.raises(ScheduleError, match="wgmma_k_reduce=4"):
        fit_wgmma_plan(spec, SM90, {**KNOBS, "k_reduce": 4})
    # four warpgroups by 256 rows of x: a 264 KiB f32 tile, whatever the slots
    with pytest.raises(ScheduleError, match=r"cluster's f32 tile .* Fix: lower wgmma_block_m"):
        fit_wgmma_plan(spec, SM90, {**KNOBS, "warpgroups": 4, "block_m": 256, "stages": 2})


def _lowered(spec: LinearSpec, knobs: dict[str, int]):
    kernel = LinearMmaRule().apply(spec, SM90, {**knobs, "mid_rows": 0})  # every call above 32 rows clustered
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    return kernel, cuda, cuda.functions[kernel.name]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_kernel_table_has_one_clustered_launch_and_no_workspace(fp8):
    spec = LinearSpec("matmul_fp8" if fp8 else "matmul", 6144, 4096, weight_dtype=FP8 if fp8 else "bfloat16")
    _, plain, plain_func = _lowered(spec, {})
    kernel, cuda, func = _lowered(spec, {"wgmma_k_reduce": CLUSTER_REDUCE})
    splits = kernel.knobs["wgmma_k_splits"]
    assert splits > 1 and kernel.knobs["wgmma_k_reduce"] == CLUSTER_REDUCE
    # the same GEMM through a merge kernel: a workspace of partial sums and a second launch
    assert len(plain_func.launches({"m": 128})) == 2 and plain_func.workspaces
    assert DIMS not in plain.source and "__cluster_dims__" not in plain.source
    assert func.workspaces == ()
    (gemm,) = func.launches({"m": 128})
    grid, _, smem = gemm.launch_dims({"m": 128})
    assert gemm.cluster == (1, 1, splits) and grid[2] == splits
    assert smem >= 128 * (kernel.knobs["wgmma_warpgroups"] * 64 + CLUSTER_PAD) * 4
    (few,) = func.launches({"m": 16})
    assert few.cluster == (1, 1, 1)  # the kernel for few rows never splits across blocks
    signature = f"__cluster_dims__(1, 1, {splits}) {gemm.name}("
    assert cuda.source.count(signature) == 2 and cuda.source.count("__cluster_dims__") == 2
    start, end = kernel_bodies(cuda.source)[gemm.name]
    body = cuda.source[start:end]
    # the tile goes into shared memory behind a block barrier, then two cluster barriers around the remote reads
    syncs = [m.start() for m in re.finditer(rf"\b{SYNC}\(\);", body)]
    adds = [m.start() for m in re.finditer(rf"\b{ADD4}\(", body)]
    assert len(syncs) == 2 and adds and syncs[0] < min(adds) and max(adds) < syncs[1]
    assert body.rfind("__syncthreads();", 0, syncs[0]) > body.rfind("cp_async_wait_all", 0, syncs[0]) > 0
    # every remote load names one rank, all of them in rank order per output: the sum does not depend on timing
    ranks = [int(r) for r in re.findall(rf"\b{ADD4}\(.*, (\d+)\);", body)]
    assert ranks == list(range(splits)) * (len(ranks) // splits)
    assert "part" not in body  # no partial sums through global memory


@pytest.mark.parametrize(
    ("op", "n", "k", "wdtype", "variant"),
    [
        ("matmul", 6144, 4096, "bfloat16", (2, 128, 3, 1, 4, 1)),
        ("matmul_fp8", 4096, 12288, FP8, (1, 128, 4, 1, 8, 2)),
        ("lm_head", 384, 512, FP8, (1, 40, 3, 1, 4, 2)),  # ragged n, 40-row x tiles, FP8 scales
        ("matmul", 200, 256, "bfloat16", (2, 256, 2, 1, 4, 1)),  # a tile larger than the slots
    ],
)
def test_compiles_for_sm90a(op, n, k, wdtype, variant):
    pytest.importorskip("cuda.bindings")
    names = ("warpgroups", "block_m", "stages", "k_atoms", "k_splits", "mma_groups")
    knobs = {f"wgmma_{name}": v for name, v in zip(names, variant, strict=True)}
    kernel, cuda, func = _lowered(LinearSpec(op, n, k, weight_dtype=wdtype), {**knobs, "wgmma_k_reduce": 2})
    assert func.launches({"m": 300})[0].cluster == (1, 1, kernel.knobs["wgmma_k_splits"])
    assert_nvrtc_builds(cuda, "sm_90a")
