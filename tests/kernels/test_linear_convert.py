"""The warpgroup GEMM with e4m3 weights converted into the wgmmas' A fragments in registers (linear_wgmma.py, knob
wgmma_convert 2, the default for e4m3 weights): each thread loads its fragments' bytes from the raw slot and
converts them, the wgmmas read only x from shared memory, and no bf16 tile, second fence or second barrier is
left. CPU side: the plan, the knob's resolution, the raw rows' swizzle, the structure of the generated CUDA,
NVRTC builds without serialised wgmmas and without local memory; numbers on the GPU: bench/linear.py's odd cases
with convert 2 (numpy checks) and the drafter's GPU tests on a build that converts in registers.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from dflash_compiler.dependent_launch import WAIT, kernel_bodies
from dflash_compiler.fp8_convert import E4M3_A_FRAGMENT, E4M3X4_TO_BF16
from dflash_compiler.mbarrier import NAMED_SYNC, WAIT_PARITY
from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_rules import LinearMmaRule
from dflash_compiler.schedules.linear_wgmma import (
    CLUSTER_REDUCE,
    CONVERT_REGISTERS,
    CONVERT_TILE,
    WgmmaPlan,
    raw_chunk,
)
from dflash_compiler.targets import SM90
from dflash_compiler.wgmma import COMMIT, FENCE, mma_name, mma_rk_name

tvm = pytest.importorskip("tvm")

from kernel_harness import FUSED_EPILOGUES, assert_only_weights_before_the_wait, wgmma_kernel  # noqa: E402

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM
from dflash_compiler.nvrtc import compile_cubin  # noqa: E402 - after the TVM skip, as the other kernel tests


def _local_bytes(cubin: bytes, kernel: str, tmp_path) -> tuple[int, int]:
    """(LOCAL, STACK) bytes of `kernel` in `cubin`, by cuobjdump (a dependency of the build box)."""
    import cuda.pathfinder as pf

    tool = pf.find_nvidia_binary_utility("cuobjdump")
    assert tool, "cuobjdump not found: pip install nvidia-cuda-cuobjdump"
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.search(rf"Function {kernel}:\s*\n\s*REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    assert found, f"no resource usage of {kernel} in:\n{out}"
    return int(found.group(2)), int(found.group(1))


def test_the_plan_has_no_converted_tile():
    tile = WgmmaPlan(3, 128, 5, 1, 1, 2, 1)
    registers = WgmmaPlan(3, 128, 5, 1, 1, 2, 1, convert=CONVERT_REGISTERS)
    assert tile.converted_bytes() == 2 * 192 * 128 and registers.converted_bytes() == 0
    assert registers.shared_bytes() == tile.shared_bytes() - tile.converted_bytes() == 5 * (192 * 64 + 128 * 128)
    assert registers.registers and not tile.registers
    assert not WgmmaPlan(3, 128, 5, 1, 1, 2, 2, convert=CONVERT_REGISTERS).registers  # bf16: nothing to convert
    assert registers.knobs()["convert"] == CONVERT_REGISTERS


def test_bad_convert_is_refused_and_bf16_weights_report_the_tile():
    with pytest.raises(ScheduleError, match=r"wgmma_convert=3: expected 1 .* or 2"):
        LinearMmaRule().apply(LinearSpec("matmul_fp8", 4096, 4096, FP8), SM90, {"wgmma_convert": 3})
    # one rule's knobs serve the bf16 linears of a mixed-precision build too: nothing changes for them
    spec = LinearSpec("matmul", 4096, 4096)
    kernel = LinearMmaRule().apply(spec, SM90, {"wgmma_convert": CONVERT_REGISTERS})
    default = LinearMmaRule().apply(spec, SM90)
    assert kernel.knobs == default.knobs and kernel.knobs["wgmma_convert"] == CONVERT_TILE
    sources = [lower_to_cuda(tvm.IRModule({k.name: k.func}), SM90).source for k in (kernel, default)]
    assert sources[0] == sources[1]
    # e4m3 weights convert into registers unless the knob says otherwise
    assert (
        LinearMmaRule().apply(LinearSpec("matmul_fp8", 4096, 4096, FP8), SM90).knobs["wgmma_convert"]
        == CONVERT_REGISTERS
    )


def test_tiles_taller_than_128_rows_convert_into_the_shared_tile_by_default():
    """A 256-row x tile's accumulators take 128 registers a thread: by default its e4m3 weights convert into the
    shared tile, and the producer-role GEMM of that shape builds (with register fragments ptxas serialised its
    wgmmas, C7512, which NVRTC's check refuses); the knob still asks for registers."""
    spec = LinearSpec("matmul_fp8", 200, 256, FP8, name="r_tall")
    tall = {"wgmma_warpgroups": 2, "wgmma_block_m": 256, "wgmma_stages": 3, "wgmma_k_splits": 2, "wgmma_roles": 2}
    kernel = LinearMmaRule().apply(spec, SM90, {**tall, "mid_rows": 0})
    assert kernel.knobs["wgmma_convert"] == CONVERT_TILE
    assert compile_cubin(lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90).source, SM90.arch)
    asked = LinearMmaRule().apply(spec, SM90, {**tall, "mid_rows": 0, "wgmma_convert": CONVERT_REGISTERS})
    assert asked.knobs["wgmma_convert"] == CONVERT_REGISTERS
    # 128-row tiles, as the default GEMMs take, keep the registers
    shorter = LinearMmaRule().apply(spec, SM90, {**tall, "wgmma_block_m": 128, "mid_rows": 0})
    assert shorter.knobs["wgmma_convert"] == CONVERT_REGISTERS


@pytest.mark.parametrize("row0", [0, 16, 48, 112])
def test_a_fragment_load_reads_eight_distinct_bank_groups(row0):
    """The eight rows g (and g + 8) that one fragment load reads of chunk kk sit at 64 · row + 16 · position
    bytes of their slot: eight distinct 16-byte groups of the 128 bytes of banks. And each row's chunks are a
    permutation, so the copies fill the whole row."""
    for kk in range(4):
        for half in (0, 8):
            rows = [row0 + half + g for g in range(8)]
            groups = {(64 * r + 16 * raw_chunk(kk, r)) % 128 // 16 for r in rows}
            assert len(groups) == 8, (kk, half, groups)
    for r in range(row0, row0 + 16):
        assert sorted(raw_chunk(c, r) for c in range(4)) == [0, 1, 2, 3]


CASES = [
    # three warpgroups, one group in flight: the k loop runs pairs of slots, each with its own fragment set
    (LinearSpec("matmul_fp8", 24576, 4096, FP8, name="r_gate_up"), WgmmaPlan(3, 128, 5, 1, 1, 2, 1, convert=2)),
    # each slot's wgmmas waited for: one fragment set, one slot per iteration; k splits through a merge
    (LinearSpec("matmul_fp8", 4096, 4096, FP8, name="r_o"), WgmmaPlan(1, 128, 4, 1, 4, 1, 1, convert=2)),
    # three slots a split with two groups in flight (the pair's second half guarded), 40-row x tiles, ragged n
    (LinearSpec("matmul_fp8", 200, 192, FP8, name="r_odd"), WgmmaPlan(1, 40, 3, 1, 1, 2, 1, convert=2)),
    # two atoms a slot, 64-row x tiles
    (LinearSpec("matmul_fp8", 200, 256, FP8, name="r_atoms"), WgmmaPlan(2, 64, 3, 2, 1, 2, 1, convert=2)),
    # 256-row x tiles: 128 accumulators beside the fragments
    (LinearSpec("matmul_fp8", 4096, 4096, FP8, name="r_256"), WgmmaPlan(1, 256, 3, 1, 2, 2, 1, convert=2)),
    # a producer warpgroup, one and two groups in flight
    (LinearSpec("matmul_fp8", 6144, 4096, FP8, name="r_p2"), WgmmaPlan(1, 128, 4, 1, 2, 2, 1, roles=2, convert=2)),
    (LinearSpec("matmul_fp8", 4096, 4096, FP8, name="r_p1"), WgmmaPlan(2, 128, 3, 1, 4, 1, 1, roles=2, convert=2)),
    # the k splits added in a cluster
    (
        LinearSpec("matmul_fp8", 6144, 4096, FP8, name="r_cluster"),
        WgmmaPlan(2, 128, 4, 1, 4, 2, 1, k_reduce=CLUSTER_REDUCE, convert=2),
    ),
]


@pytest.mark.parametrize(("spec", "plan"), CASES, ids=[spec.name for spec, _ in CASES])
def test_each_thread_converts_its_own_fragments_and_the_wgmmas_read_them_from_registers(spec, plan, tmp_path):
    kernel = wgmma_kernel(spec, plan)
    assert plan.registers
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    gemm = cuda.functions[kernel.name].kernels[1]
    assert int(gemm.dynamic_smem) == plan.shared_bytes()
    body = cuda.source[slice(*kernel_bodies(cuda.source)[gemm.name])]
    per_split = spec.k // plan.slot_k // plan.k_splits
    unroll = plan.mma_groups  # slots per iteration of the k loop
    mma = mma_rk_name(plan.block_m)

    # no bf16 tile: nothing converted into shared memory, no wgmma reading A from there
    assert E4M3X4_TO_BF16 not in body and f"{mma_name(plan.block_m)}(" not in body
    # every wgmma takes the fragments that one helper call wrote, and a slot's fragments are one set of
    # registers per group in flight (af elements 8 apiece)
    fragments = re.findall(rf"{E4M3_A_FRAGMENT}\(\(&\(af_ptr\[(\d+)\]\)\)", body)
    wgmmas = re.findall(rf"{mma}\(\(&\(acc_ptr\[0\]\)\), \(&\(af_ptr\[(\d+)\]\)\)", body)
    sets = {8 * i for i in range(unroll * plan.k_atoms * 4)}
    assert set(fragments) == set(wgmmas) and {int(i) for i in fragments} == sets
    assert len(fragments) == len(wgmmas) and len(fragments) % (plan.k_atoms * 4) == 0
    # the fragment array holds every set whole: each call writes 8 bf16 from its offset, so an array sized by
    # the offsets alone (TVM sizes local buffers by what it sees accessed) would be overrun
    assert f"nv_bfloat16 af_ptr[{8 * len(sets)}];" in body

    pairs = per_split // unroll  # an odd last slot follows the loop
    # a loop of one iteration is no loop (TVM unrolls it): then the steps follow the first slots' copies
    loop = body[body.index("for (int kt = 0;" if pairs > 1 else f"{WAIT}();") :]
    assert (f"for (int kt = 0; kt < {pairs}; ++kt) {{" in body) == (pairs > 1)
    # within a step: the slot is there (block barrier, or its full barrier), then the fragments, the fence that
    # orders their registers before the wgmmas, the wgmmas and their commit
    ready = "__syncthreads();" if not plan.producer else f"{WAIT_PARITY}("
    step = loop[loop.index(ready) :]
    first_fragment = step.index(f"{E4M3_A_FRAGMENT}(")
    assert first_fragment < step.index(f"{FENCE}();") < step.index(f"{mma}(") < step.index(f"{COMMIT}();")
    if plan.producer:
        consumer = body.split("\n  } else {\n", 1)[1]
        assert NAMED_SYNC not in consumer and "__syncthreads" not in consumer.split("\n  }\n")[0]
    else:  # one block barrier per slot (the tile conversion needs a second one)
        steps = loop[: loop.index(f"{mma}(") + 1]
        assert loop.count("__syncthreads();") >= unroll and steps.count("__syncthreads();") == 1
    assert_only_weights_before_the_wait(cuda.source, gemm.name)

    cubin = compile_cubin(cuda.source, SM90.arch)  # raises where ptxas serialised the wgmmas
    assert _local_bytes(cubin, gemm.name, tmp_path) == (0, 0)  # the fragments live in registers


def test_the_tile_conversion_keeps_two_barriers_per_slot():
    """The FP8 GEMM converting into a shared tile (wgmma_convert 1): its k loop meets a second block barrier per
    slot, which the registers variant drops (the other test counts one)."""
    spec, plan = CASES[1]
    kernel = wgmma_kernel(spec, WgmmaPlan(**{**vars(plan), "convert": CONVERT_TILE}))
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    body = cuda.source[slice(*kernel_bodies(cuda.source)[cuda.functions[kernel.name].kernels[1].name])]
    loop = body[body.index("for (int kt = 0;") :]
    assert loop[: loop.index(f"{mma_name(plan.block_m)}(")].count("__syncthreads();") == 2
    assert E4M3_A_FRAGMENT + "(" not in body


def test_the_mid_gemm_converts_where_the_wide_one_does():
    """wgmma_convert serves both warpgroup GEMMs: by default the one of the calls up to mid_rows rows reads its
    fragments from registers too."""
    spec = LinearSpec("matmul_fp8", 4096, 4096, FP8, name="r_mid")
    kernel = LinearMmaRule().apply(spec, SM90, {"mid_rows": 64})
    assert kernel.knobs["wgmma_convert"] == CONVERT_REGISTERS
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    bodies = [cuda.source[slice(*span)] for span in kernel_bodies(cuda.source).values()]
    assert sum(f"{mma_rk_name(64)}(" in body for body in bodies) == 1  # the mid GEMM's 64-row tiles
    assert sum(f"{mma_rk_name(128)}(" in body for body in bodies) == 1
    assert not any(E4M3X4_TO_BF16 in body and "wgmma" in body for body in bodies)
    assert compile_cubin(cuda.source, SM90.arch)


@FUSED_EPILOGUES
def test_the_fused_epilogues_take_register_fragments(rule, spec):
    """The argmax and silu epilogues are the accumulators' alone: converting in registers changes only the k loop
    (bf16 weights report the tile and keep their code)."""
    kernel = rule.apply(spec, SM90, {"wgmma_convert": CONVERT_REGISTERS, "mid_rows": 0})
    assert kernel.knobs["wgmma_convert"] == (CONVERT_REGISTERS if spec.fp8 else CONVERT_TILE)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    assert (f"{E4M3_A_FRAGMENT}((&(af_ptr[" in cuda.source) == spec.fp8
    assert compile_cubin(cuda.source, SM90.arch)
