"""Calls of mid_rows + 1 to tall_rows rows on a third warpgroup GEMM (LinearMmaRule knob tall_rows): for
weights whose 128-row GEMM is one block of three or more warpgroups an SM with k splits (qkv), 64-row x tiles
of one warpgroup, three blocks an SM. CPU side: which weights take it by default, the host code's choice of
kernel per row count, the workspaces, the knobs reported and refused, and an NVRTC build; numbers on the GPU:
bench/kernels.py at nb = 8 (numpy checks) and bench/propose.py at nb = 4, 8 and 16.
"""

from __future__ import annotations

import pytest

from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.base import ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_plans import TALL_KNOBS, tall_defaults, tall_wanted
from dflash_compiler.schedules.linear_rules import LinearMmaRule
from dflash_compiler.targets import SM90, SM120

tvm = pytest.importorskip("tvm")

from kernel_harness import FUSED_EPILOGUES  # noqa: E402 - TVM

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM

QKV = LinearSpec("matmul", 6144, 4096)


def _table(rule, spec, knobs=None):
    kernel = rule.apply(spec, SM90, knobs)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    return kernel, cuda, cuda.functions[kernel.name]


def test_qkv_calls_of_65_to_128_rows_take_the_tall_gemm():
    """1-32 rows: the few-rows kernel; 33-64: the mid GEMM; 65-128: the tall GEMM (96 weight tiles of 64 rows
    by two 64-row x tiles at 128 rows, split 2 ways, merged by its own kernel through its own workspace);
    129 and up: the 128-row GEMM."""
    from dflash_compiler.nvrtc import compile_cubin

    kernel, cuda, func = _table(LinearMmaRule(), QKV)
    assert {key: kernel.knobs[key] for key in ("tall_rows", *(f"tall_{name}" for name in TALL_KNOBS))} == {
        "tall_rows": 128,
        "tall_block_m": 64,
        "tall_warpgroups": 1,
        "tall_stages": 4,
        "tall_k_splits": 2,
        "tall_mma_groups": 1,
    }
    few, mid, mid_merge, tall, tall_merge, large, large_merge = func.kernels
    assert func.launches({"m": 32}) == [few] and func.launches({"m": 64}) == [mid, mid_merge]
    for m in (65, 100, 128):
        assert func.launches({"m": m}) == [tall, tall_merge]
    for m in (129, 512):
        assert func.launches({"m": m}) == [large, large_merge]
    assert [evaluate(d, {"m": 100}) for d in tall.grid] == [2, 96, 2] and tall.block == ("32", "4", "1")
    assert [evaluate(d, {"m": 200}) for d in large.grid] == [2, 32, 4]
    sizes = {w.name: w.shape for w in func.workspaces}
    assert set(sizes) == {"mid_part", "tall_part", "part"}
    assert evaluate(sizes["tall_part"][0], {"m": 128}) == 2 * 128 * QKV.n
    assert compile_cubin(cuda.source, SM90.arch)


@pytest.mark.parametrize(
    "spec",
    [
        LinearSpec("matmul", 4096, 4096),  # o_proj: one warpgroup at 128 rows already
        LinearSpec("matmul", 4096, 12288),  # down
        LinearSpec("matmul_fp8", 6144, 4096, FP8),  # e4m3 qkv: slower with such tiles
    ],
    ids=["o_proj", "down", "qkv-fp8"],
)
def test_other_weights_keep_two_gemms_above_gemm_rows(spec):
    assert not tall_wanted(spec, SM90)
    kernel, _, func = _table(LinearMmaRule(), spec)
    assert not [key for key in kernel.knobs if key.startswith("tall_")]
    assert {w.name for w in func.workspaces} == {"mid_part", "part"}
    assert evaluate(func.launches({"m": 128})[0].grid[0], {"m": 128}) == 1  # one 128-row x tile


def test_the_tall_gemm_is_wanted_where_the_128_row_gemm_is_one_large_block_an_sm():
    """qkv's 128-row GEMM is one block of three warpgroups an SM split 4 ways; its tall GEMM's splits fill
    three blocks an SM at 128 rows; sm_120 has no warpgroup GEMM; fused epilogues keep theirs."""
    assert tall_wanted(QKV, SM90) and not tall_wanted(QKV, SM120)
    assert not tall_wanted(LinearSpec("matmul_silu", 24576, 4096), SM90)
    assert tall_defaults(QKV, SM90, 128, 64) == {
        "block_m": 64, "warpgroups": 1, "stages": 4, "k_splits": 2, "mma_groups": 1,
    }  # fmt: skip
    assert not [key for key in LinearMmaRule().apply(QKV, SM120).knobs if key.startswith("tall_")]


@FUSED_EPILOGUES
def test_the_fused_epilogues_take_a_tall_gemm_only_of_whole_sums(rule, spec):
    kernel = rule.apply(spec, SM90)
    assert not [key for key in kernel.knobs if key.startswith("tall_")]
    kernel, _, func = _table(rule, spec, {"tall_rows": 128})
    assert kernel.knobs["tall_k_splits"] == 1 and evaluate(func.launches({"m": 128})[0].grid[0], {"m": 128}) == 2
    with pytest.raises(ScheduleError, match="Fix: tall_k_splits 1"):
        rule.apply(spec, SM90, {"tall_rows": 128, "tall_k_splits": 2})


@pytest.mark.parametrize(
    ("target", "knobs", "message"),
    [
        (SM120, {"tall_rows": 128}, "beside the warpgroup GEMM. Fix: tall_rows 0"),
        (SM90, {"tall_rows": 120, "tall_block_m": 60}, "multiples of 8"),
        (SM90, {"tall_rows": 64}, "tall_rows above 64"),
        (SM90, {"mid_rows": 0, "tall_rows": 32}, "tall_rows above 32"),
        (SM90, {"tall_rows": 264}, "at most 256"),
        (SM90, {"tall_rows": 96, "tall_block_m": 128}, "taller than the tall_rows=96 rows"),
        (SM90, {"tall_rows": 0, "tall_stages": 3}, "tall_stages .* tall_rows is 0. Fix: drop them, or set tall_rows"),
        (SM90, {"tall_rows": 128, "tall_stages": 1}, "stages >= 2"),
    ],
)
def test_bad_tall_knobs_are_refused(target, knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearMmaRule().apply(QKV, target, knobs)
