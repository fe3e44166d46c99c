"""Calls of gemm_rows + 1 to mid_rows rows on their own warpgroup GEMM (LinearMmaRule knob mid_rows): x tiles
that tall instead of the 128-row tile, whose other half would be padding. CPU side: the host code's choice
of kernel per row count, the workspaces, the knobs reported and refused, the shape defaults and NVRTC
builds; numbers on the GPU: bench/linear.py --gemm --mid-rows (numpy checks) and bench/kernels.py at nb = 4.
"""

from __future__ import annotations

import pytest

from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_plans import MID_KNOBS, mid_defaults
from dflash_compiler.schedules.linear_rules import LinearMmaRule
from dflash_compiler.schedules.linear_wgmma import WGMMA_KNOBS
from dflash_compiler.targets import SM90, SM120

tvm = pytest.importorskip("tvm")

from kernel_harness import FUSED_EPILOGUES  # noqa: E402 - TVM

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM


def _table(rule, spec, knobs):
    kernel = rule.apply(spec, SM90, knobs)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    return kernel, cuda, cuda.functions[kernel.name]


@pytest.mark.parametrize(
    ("spec", "splits"),
    [(LinearSpec("matmul", 6144, 4096), 4), (LinearSpec("matmul_fp8", 4096, 12288, FP8), 6)],
    ids=["qkv", "down-fp8"],
)
def test_calls_up_to_mid_rows_take_the_mid_gemm(spec, splits):
    """1-32 rows: the few-rows kernel; 33-64: the mid GEMM (64-row x tiles, one warpgroup, its k splits
    merged by its own kernel through its own workspace); 65 and up: the 128-row GEMM, as without the knob."""
    # the calls above 64 rows on the 128-row GEMM alone (qkv's 65-128 have a GEMM of their own: test_linear_tall.py)
    kernel, _, func = _table(LinearMmaRule(), spec, {"mid_rows": 64, "tall_rows": 0})
    assert {key: kernel.knobs[key] for key in ("mid_rows", *(f"mid_{name}" for name in MID_KNOBS))} == {
        "mid_rows": 64,
        "mid_warpgroups": 1,
        "mid_stages": 4,
        "mid_k_splits": splits,
        "mid_mma_groups": 2 if spec.fp8 else 1,
    }
    plain = _table(LinearMmaRule(), spec, {"mid_rows": 0})[2]
    few, mid, mid_merge, large, large_merge = func.kernels
    assert func.launches({"m": 16}) == [few] and func.launches({"m": 32}) == [few]
    for m in (33, 64):
        assert func.launches({"m": m}) == [mid, mid_merge]
    for m in (65, 128, 512):
        assert func.launches({"m": m}) == [large, large_merge]
    assert mid.grid == ("((m + 63) // 64)", str(-(-spec.n // 64)), str(splits))
    assert mid.block == ("32", "4", "1")
    # the 128-row GEMM is the one without the knob, launched on the same calls above 64 rows
    assert (large.grid, large.block, large.dynamic_smem) == (plain.kernels[1].grid, plain.kernels[1].block,
                                                             plain.kernels[1].dynamic_smem)  # fmt: skip
    assert plain.launches({"m": 33}) == list(plain.kernels[1:])
    sizes = {w.name: w.shape for w in func.workspaces}
    assert set(sizes) == {"mid_part", "part"}
    from dflash_compiler.runtime.expr import evaluate

    assert evaluate(sizes["mid_part"][0], {"m": 64}) == splits * 64 * spec.n


@FUSED_EPILOGUES
def test_the_fused_epilogues_have_a_mid_gemm_of_whole_sums(rule, spec):
    """lm_head_argmax and matmul_silu take whole sums: the mid GEMM has no k split; the argmax one picks per
    block into a workspace of its own, merged by its own kernel."""
    kernel, cuda, func = _table(rule, spec, {"mid_rows": 64})
    assert kernel.knobs["mid_k_splits"] == 1
    kernels = func.launches({"m": 64})
    assert kernels[0].grid[0] == "((m + 63) // 64)" and len(kernels) == 1 + spec.picks
    assert func.launches({"m": 65})[0].grid[0] == "((m + 127) // 128)"
    with pytest.raises(ScheduleError, match="Fix: mid_k_splits 1"):
        rule.apply(spec, SM90, {"mid_rows": 64, "mid_k_splits": 2})
    from dflash_compiler.nvrtc import compile_cubin

    assert compile_cubin(cuda.source, SM90.arch)


def test_mid_defaults_fill_the_sms():
    """One warpgroup of four slots; k splits that fill the block slots for narrow weights, none for wide
    ones; one slot's wgmmas in flight for FP8."""
    assert mid_defaults(LinearSpec("matmul", 6144, 4096), SM90, 64) == {
        "warpgroups": 1,
        "stages": 4,
        "k_splits": 4,
        "mma_groups": 1,
    }
    assert mid_defaults(LinearSpec("matmul", 24576, 4096), SM90, 64)["k_splits"] == 1
    assert mid_defaults(LinearSpec("matmul_fp8", 6144, 4096, FP8), SM90, 64)["mma_groups"] == 2


@pytest.mark.parametrize(
    ("target", "knobs", "message"),
    [
        (SM120, {"mid_rows": 64}, "beside the warpgroup GEMM. Fix: mid_rows 0"),
        (SM90, {"mid_rows": 60}, "a multiple of 8 above gemm_rows"),
        (SM90, {"mid_rows": 32}, "a multiple of 8 above gemm_rows"),
        (SM90, {"mid_rows": 264}, "at most 256"),
        (SM90, {"mid_rows": 64, "gemm_wgmma": 0}, "Fix: mid_rows 0, or gemm_wgmma 1"),
        (SM90, {"mid_rows": 0, "mid_stages": 3}, "mid_stages .* mid_rows is 0. Fix: drop them, or set mid_rows"),
        (SM90, {"mid_rows": 64, "mid_stages": 1}, "stages >= 2"),
    ],
)
def test_bad_mid_knobs_are_refused(target, knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearMmaRule().apply(LinearSpec("matmul", 6144, 4096), target, knobs)


def test_the_mid_gemm_is_the_default_where_the_warpgroup_gemm_is():
    """sm_90 takes MID_ROWS (the knobs of test_calls_up_to_mid_rows_take_the_mid_gemm); mid_rows 0 keeps
    every call above gemm_rows on the 128-row GEMM and reports no mid knob; sm_120 has no warpgroup GEMM."""
    spec = LinearSpec("matmul", 6144, 4096)
    assert LinearMmaRule().apply(spec, SM90).knobs == LinearMmaRule().apply(spec, SM90, {"mid_rows": 64}).knobs
    kernel, _, func = _table(LinearMmaRule(), spec, {"mid_rows": 0})
    assert not [key for key in kernel.knobs if key.startswith("mid_")]
    assert len(func.kernels) == 3 and {w.name for w in func.workspaces} == {"part"}
    assert all(f"wgmma_{name}" in kernel.knobs for name in WGMMA_KNOBS)
    assert not [key for key in LinearMmaRule().apply(spec, SM120).knobs if key.startswith("mid_")]
