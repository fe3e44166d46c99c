"""The warpgroup GEMM with a producer warpgroup (linear_wgmma.py, knob wgmma_roles 2): one more warpgroup copies
every slot and marks it full on its mbarrier; the multiplying warpgroups wait for that, multiply and mark it free,
and no block barrier sits in the k loop. CPU side: the plan, the refused knobs, the structure of the
generated CUDA (barrier counts and phases, the order of waits, fences and arrivals) and NVRTC builds;
numbers on the GPU: bench/linear.py's odd cases with roles 2 (numpy checks) and the drafter's GPU tests.
"""

from __future__ import annotations

import re

import pytest

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, WAIT, kernel_bodies
from dflash_compiler.fp8_convert import E4M3X4_TO_BF16
from dflash_compiler.mbarrier import ARRIVE, BARRIER_BYTES, INIT, NAMED_SYNC, WAIT_PARITY
from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_rules import LinearMmaRule
from dflash_compiler.schedules.linear_wgmma import PRODUCER_ROLES, SHARED_ROLES, WgmmaPlan
from dflash_compiler.targets import SM90
from dflash_compiler.wgmma import FENCE as WGMMA_FENCE
from dflash_compiler.wgmma import FENCE_ASYNC_SHARED, WAIT_PRIOR, mma_name, wait_name

tvm = pytest.importorskip("tvm")

from kernel_harness import FUSED_EPILOGUES, assert_only_weights_before_the_wait, wgmma_kernel  # noqa: E402

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM


def test_the_plan_counts_the_producer_warp_and_the_barriers():
    shared = WgmmaPlan(2, 128, 4, 1, 1)
    producer = WgmmaPlan(2, 128, 4, 1, 1, roles=PRODUCER_ROLES)
    assert (shared.block_warps, producer.block_warps) == (8, 12)
    assert producer.threads == shared.threads == 256  # the multiplying threads: accumulators and epilogue
    assert producer.shared_bytes() == shared.shared_bytes() + 2 * 4 * BARRIER_BYTES
    assert not shared.producer and producer.producer


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"wgmma_roles": 3}, "wgmma_roles=3: expected 1 .* or 2"),
        ({"wgmma_roles": PRODUCER_ROLES, "wgmma_k_reduce": 2, "wgmma_k_splits": 4}, "Fix: wgmma_k_reduce 1"),
        ({"wgmma_roles": PRODUCER_ROLES, "wgmma_warpgroups": 8}, "at most 7 warpgroups .* beside the producer"),
    ],
)
def test_bad_producer_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearMmaRule().apply(LinearSpec("matmul", 4096, 4096), SM90, knobs)


CASES = [
    # bf16, each slot's wgmmas waited for: the slot is freed right after
    (LinearSpec("matmul", 6144, 4096, name="p_qkv"), WgmmaPlan(2, 128, 4, 1, 4, roles=PRODUCER_ROLES)),
    # one group in flight: a slot is freed once the next one's wgmmas are issued and its own completed
    (LinearSpec("matmul", 24576, 4096, name="p_gate_up"), WgmmaPlan(3, 128, 5, 1, 1, 2, roles=PRODUCER_ROLES)),
    # e4m3: each warpgroup converts its own 64 weight rows, frees the raw slot, then meets its own warps
    (LinearSpec("matmul_fp8", 6144, 4096, FP8, name="p_qkv_fp8"), WgmmaPlan(1, 128, 4, 1, 2, 2, 1, roles=2)),
    (LinearSpec("matmul_fp8", 4096, 4096, FP8, name="p_o_fp8"), WgmmaPlan(2, 128, 3, 1, 4, 1, 1, roles=2)),
    # a split of fewer slots than the ring holds, ragged n, two atoms a slot
    (LinearSpec("matmul", 200, 256, name="p_tiny"), WgmmaPlan(1, 64, 4, 2, 2, 1, roles=PRODUCER_ROLES)),
]


@pytest.mark.parametrize(("spec", "plan"), CASES, ids=[spec.name for spec, _ in CASES])
def test_a_producer_warp_fills_the_slots_and_the_warpgroups_wait_for_them(spec, plan):
    kernel = wgmma_kernel(spec, plan)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    gemm = cuda.functions[kernel.name].kernels[1]
    assert gemm.block == ("32", str(plan.n_warps + 4), "1")
    assert int(gemm.dynamic_smem) == plan.shared_bytes()
    body = cuda.source[slice(*kernel_bodies(cuda.source)[gemm.name])]
    stages, groups = plan.stages, plan.mma_groups
    per_split = spec.k // plan.slot_k // plan.k_splits

    # one thread sets up a full barrier (the producer's 128 arrivals) and a free one (every multiplying
    # thread's) per slot, before the block's only barrier
    inits = re.findall(rf"{INIT}\(\(&\(\(\(uint64_t\*\)smem_ptr\)\[(\d+)\]\)\), (\d+)\);", body)
    assert sorted(int(count) for _, count in inits) == [128] * stages + [plan.threads] * stages
    assert len({int(index) for index, _ in inits}) == 2 * stages
    assert min(int(index) for index, _ in inits) * BARRIER_BYTES == plan.shared_bytes() - 2 * stages * BARRIER_BYTES
    assert body.count("__syncthreads()") == 1 and body.index(f"{INIT}(") < body.index("__syncthreads()")

    # the two roles' branches: the producer's, then (at the block's indentation) the warpgroups'
    producer, consumer = body.split(f"if ({plan.n_warps} <= ((int)threadIdx.y)) {{", 1)[1].split("\n  } else {\n", 1)
    # the producer: the first slots' weight before the wait for x's writer, then per slot: its copies landed
    # (wait_group), visible to the async proxy, full; the ring slot of slot c - groups refilled once free
    assert producer.index("w_ptr[") < producer.index(f"{WAIT}();") < producer.index("x_ptr[")
    assert body.count(f"{WAIT}();") == 1 and WAIT not in consumer
    # a split of one slot has no loop (TVM unrolls a loop of one step)
    loop = producer[producer.index("for (int c = 0;" if per_split > 1 else f"{WAIT}();") :]
    landed = loop.index(f"cp_async_wait_group_async_wait_group_{stages - groups - 1}()")
    assert landed < loop.index(f"{FENCE_ASYNC_SHARED}();") < loop.index(f"{ARRIVE}(")
    refills = per_split - stages
    assert (f"{WAIT_PARITY}(" in loop) == (refills > 0)
    if refills > 0:
        assert loop.index(f"{ARRIVE}(") < loop.index(f"{WAIT_PARITY}(") < loop.index("w_ptr[")
        assert f"if ({groups} <= c) {{" in loop and f"if (c < {per_split - stages + groups}) {{" in loop
    assert loop.count(f"{LAUNCH_DEPENDENTS}();") == 1
    if per_split > 1:
        trigger = re.search(rf"if \(c == (\d+)\) \{{\s*{LAUNCH_DEPENDENTS}\(\);", loop)
        assert trigger and int(trigger.group(1)) == max(per_split - 1 - stages + groups, 0)

    # the multiplying warpgroups: wait for the slot's phase, multiply, free it; never a copy or a block barrier
    assert "cp_async" not in consumer and "__syncthreads" not in consumer.split("\n  }\n")[0]
    mma, wait = f"{mma_name(plan.block_m)}(", f"{wait_name(plan.block_m)}("
    full_wait = consumer.index(f"{WAIT_PARITY}(")
    assert full_wait < consumer.index(f"{WGMMA_FENCE}();") < consumer.index(mma)
    free = consumer.index(f"{ARRIVE}(")
    if plan.fp8:
        converts = -(-64 * 4 * plan.k_atoms // 128) * 4  # a warpgroup's 64 rows of 16-byte e4m3 chunks, 4 values a call
        assert consumer.count(f"{E4M3X4_TO_BF16}(") == converts
        # the warpgroup's own named barrier (id 2 + warpgroup) of its 128 threads: once every warp is past the
        # wgmmas that last read the tile, and once the tile is converted and visible to the async proxy
        named = list(re.finditer(rf"{NAMED_SYNC}\((2|\(\(\(\(int\)threadIdx.y\) >> 2\) \+ 2\)), 128\);", consumer))
        assert len(named) == 2 and all((m.group(1) == "2") == (plan.warpgroups == 1) for m in named)
        before, after = (m.start() for m in named)
        convert = consumer.index(f"{E4M3X4_TO_BF16}(")
        assert full_wait < before < convert < consumer.index(FENCE_ASYNC_SHARED) < after < consumer.index(mma)
    # the slot holds x rows its wgmmas read: freed only once they completed
    if groups == 1:
        assert consumer.index(mma) < consumer.index(wait) < free
    else:
        assert consumer.index(mma) < consumer.index(f"{WAIT_PRIOR}();") < free
        assert "if (0 < kt) {" in consumer  # the first slot is freed after the second's wgmmas are issued
    assert_only_weights_before_the_wait(cuda.source, gemm.name)

    from dflash_compiler.cubin import cubin_arch
    from dflash_compiler.nvrtc import compile_cubin

    assert cubin_arch(compile_cubin(cuda.source, SM90.arch)) == "sm_90a"


@FUSED_EPILOGUES
def test_the_fused_epilogues_run_beside_a_producer_warp(rule, spec):
    """The argmax epilogue meets at block barriers: the producer warpgroup takes part in them and writes nothing;
    the silu store is the multiplying warps' alone."""
    knobs = {"wgmma_roles": PRODUCER_ROLES, "wgmma_warpgroups": 2, "wgmma_stages": 4, "mid_rows": 0}
    kernel = rule.apply(spec, SM90, knobs)
    assert kernel.knobs["wgmma_roles"] == PRODUCER_ROLES
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    gemm = next(k for k in cuda.functions[kernel.name].kernels if k.block == ("32", "12", "1"))
    body = cuda.source[slice(*kernel_bodies(cuda.source)[gemm.name])]
    after = body[body.rindex(f"{ARRIVE}(") :]  # past the k loops
    if spec.picks:
        # both block barriers for all nine warps; the slot writes and the final picks the warpgroups' only
        first, second = (m.start() for m in re.finditer(r"__syncthreads\(\);", after))
        assert after.count("__syncthreads()") == 2
        assert "if ((((int)threadIdx.y) < 8) && " in after[first:second] and "((int)threadIdx.y) < 8)" in after[second:]
        assert "part_ptr[" in after[second:] and not re.search(r"\by_ptr\[", body)  # no logits stored
    else:
        assert "__syncthreads" not in after and "if (((int)threadIdx.y) < 8) {" in after
    from dflash_compiler.nvrtc import compile_cubin

    assert compile_cubin(cuda.source, SM90.arch)


def test_shared_roles_have_no_producer():
    """With roles 1 every warp copies and multiplies, behind block barriers: no mbarrier in the source."""
    spec = LinearSpec("matmul", 4096, 4096)
    kernel = LinearMmaRule().apply(spec, SM90, {"wgmma_roles": SHARED_ROLES, "mid_rows": 0})
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    body = cuda.source[slice(*kernel_bodies(cuda.source)[cuda.functions[kernel.name].kernels[1].name])]
    assert f"{INIT}(" not in body and f"{WAIT_PARITY}(" not in body
