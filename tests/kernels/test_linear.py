"""Linear family (matmul, matmul_fp8, lm_head): the TE computation built for llvm matches the graph's numpy
semantics; the rules recognise the drafter's nodes; both schedules lower for every target and the
tensor-core kernel compiles with NVRTC, in GEMV mode and in GEMM mode (x through shared memory) for every
arch. Numbers on the GPU: bench/linear.py (H200 table in the report).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, PREFETCH_L2, WAIT, kernel_bodies
from dflash_compiler.fp8_convert import E4M3_A_FRAGMENT, E4M3X4_TO_BF16
from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.linear import BF16, F32, FP8, LinearSpec, random_weight, spec_of
from dflash_compiler.schedules.linear_mma import mma_gemv_func
from dflash_compiler.schedules.linear_plans import (
    FEW_ROWS_KNOBS,
    _register_estimate,
    few_rows_wgmma_plan,
    fit_mma_plan,
    fit_tiled_plan,
    fit_wgmma_plan,
    small_tiled_plan,
)
from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearGemvRule, LinearMmaRule, LinearSiluRule
from dflash_compiler.schedules.linear_wgmma import CONVERT_REGISTERS, CONVERT_TILE, WGMMA_KNOBS, WgmmaPlan
from dflash_compiler.targets import SM90, SM120, SM121
from dflash_compiler.wgmma import COMMIT as WGMMA_COMMIT
from dflash_compiler.wgmma import FENCE as WGMMA_FENCE
from dflash_compiler.wgmma import (
    FENCE_ASYNC_SHARED,
    REQUIRE_ALIGNED,
    WAIT_PRIOR,
    mma_function,
    mma_name,
    mma_rk_function,
    mma_rk_name,
    mma_rs_function,
    mma_rs_name,
    needed_prelude,
    wait_name,
)

tvm = pytest.importorskip("tvm")
ml_dtypes = pytest.importorskip("ml_dtypes")

from kernel_harness import assert_only_weights_before_the_wait, assert_spec_matches_numpy  # noqa: E402 - TVM

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM

MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


# ------------------------------------------------------------------------------- numerics (llvm vs numpy)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (LinearSpec("matmul", 64, 64), 1),
        (LinearSpec("matmul", 192, 64), 7),
        (LinearSpec("matmul", 8, 100), 5),  # tiny-dflash2 selector width; k not a multiple of 32
        (LinearSpec("matmul", 13, 1001), 3),
        (LinearSpec("matmul", 16, 32, out_dtype=F32), 2),
        (LinearSpec("matmul_fp8", 72, 128, FP8), 9),
        (LinearSpec("matmul_fp8", 33, 96, FP8), 4),
        (LinearSpec("lm_head", 384, 64), 16),
        (LinearSpec("lm_head", 512, 64, FP8), 2),
    ],
    ids=lambda v: v.name if isinstance(v, LinearSpec) else str(v),
)
def test_spec_matches_numpy(spec, rows):
    assert [p.name for p in spec.params()] == [p.name for p in spec.prim_func().params]
    assert spec.variables() == ("m",)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=spec.n + rows)


def test_spec_params_follow_the_node():
    fp8 = LinearSpec("matmul_fp8", 4096, 12288, FP8)
    assert [(p.name, p.dtype, p.shape, p.role) for p in fp8.params()] == [
        ("x", BF16, ("m", 12288), "in"),
        ("w", FP8, (4096, 12288), "in"),
        ("scale", F32, (4096,), "in"),
        ("y", BF16, ("m", 4096), "out"),
    ]
    head = LinearSpec("lm_head", 151936, 4096)
    assert head.name == "lm_head_n151936_k4096" and head.out_dtype == F32
    assert LinearSpec("lm_head", 151936, 4096, FP8).name == "lm_head_fp8_n151936_k4096"
    assert LinearSpec("matmul", 16, 32, out_dtype=F32).name == "matmul_n16_k32_f32"
    assert head.bytes_moved({"m": 16}) == 151936 * 4096 * 2 + 16 * 4096 * 2 + 16 * 151936 * 4
    assert fp8.bytes_moved({"m": 1}) == 4096 * 12288 + 4 * 4096 + 12288 * 2 + 4096 * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"op": "rmsnorm", "n": 8, "k": 8}, "is not one of"),
        ({"op": "matmul", "n": 0, "k": 8}, "must be positive"),
        ({"op": "matmul", "n": 8, "k": 8, "weight_dtype": FP8}, "takes a bfloat16 weight"),
        ({"op": "matmul_fp8", "n": 8, "k": 8}, "takes a float8_e4m3fn weight"),
        ({"op": "matmul", "n": 8, "k": 8, "out_dtype": "float16"}, "bfloat16 or float32"),
        ({"op": "lm_head", "n": 600000, "k": 4096}, "int32"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearSpec(**kwargs)


def test_random_weights_are_finite_and_varied():
    rng = np.random.default_rng(0)
    for dtype in (BF16, FP8):
        w = random_weight(rng, (64, 256), dtype).astype(np.float32)
        assert np.all(np.isfinite(w)) and np.std(w) > 0
        assert len(np.unique(w)) > 50


# ------------------------------------------------------------------------------------ the rules' subjects


def _instance(op: Op, n: int | str = 6144, k: int | str = 4096, w_dtype: str = BF16, x_dtype: str = BF16,
              out_dtype: str = BF16, scale: str | None = None, rows: str = "nb*blk") -> OpInstance:  # fmt: skip
    inputs = [TensorType(x_dtype, (rows, k)), TensorType(w_dtype, (n, k))]
    if scale is not None:
        inputs.append(TensorType(scale, (n,)))
    return OpInstance("l0.qkv", Node.make(op, [TensorType(out_dtype, (rows, n))]), tuple(inputs))


def test_rules_recognise_the_drafter_linears():
    cases = [
        (_instance(Op.MATMUL), "matmul_n6144_k4096"),
        (_instance(Op.MATMUL, 4096, 20480, rows="ctx"), "matmul_n4096_k20480"),
        (_instance(Op.MATMUL_FP8, 24576, 4096, FP8, scale=F32), "matmul_fp8_n24576_k4096"),
        (_instance(Op.LM_HEAD, 151936, 4096, out_dtype=F32, rows="nb*(blk-1)"), "lm_head_n151936_k4096"),
        (_instance(Op.LM_HEAD, 151936, 4096, FP8, out_dtype=F32, scale=F32), "lm_head_fp8_n151936_k4096"),
    ]
    for subject, name in cases:
        spec = spec_of(subject)
        assert spec is not None and spec.name == name
        assert LinearMmaRule().spec_of(subject) == spec == LinearGemvRule().spec_of(subject)


@pytest.mark.parametrize(
    "subject",
    [
        OpInstance("n", Node.make(Op.RMSNORM, [TensorType(BF16, ("m", 64))], eps=1e-6), (TensorType(BF16, ("m", 64)),)),
        _instance(Op.MATMUL, x_dtype=F32),
        _instance(Op.MATMUL, w_dtype="float16"),
        _instance(Op.MATMUL, k="h"),
        _instance(Op.MATMUL, w_dtype=FP8),  # an e4m3 weight without its scales
        _instance(Op.MATMUL_FP8, w_dtype=FP8, scale=BF16),
        _instance(Op.MATMUL_FP8, w_dtype=BF16, scale=F32),
        _instance(Op.MATMUL, out_dtype="float16"),
        "matmul",
        None,
    ],
    ids=[
        "rmsnorm",
        "f32-x",
        "f16-w",
        "symbolic-k",
        "fp8-no-scale",
        "bf16-scale",
        "bf16-w-fp8-op",
        "f16-out",
        "string",
        "none",
    ],
)
def test_rules_decline_other_work(subject):
    assert LinearMmaRule().apply(subject, SM90) is None
    assert LinearGemvRule().apply(subject, SM90) is None


def test_mma_rule_leaves_odd_k_and_targets_without_bf16_mma_to_the_fallback():
    assert LinearMmaRule().apply(LinearSpec("matmul", 8, 100), SM90) is None
    assert LinearMmaRule().apply(LinearSpec("matmul_fp8", 192, 96, FP8), SM90) is None  # FP8 steps are 64 wide
    no_mma = SM90.model_copy(update={"bf16_mma": False})
    assert LinearMmaRule().apply(LinearSpec("matmul", 64, 64), no_mma) is None
    assert LinearGemvRule().apply(LinearSpec("matmul", 64, 64), no_mma) is not None


# -------------------------------------------------------------------------------- knobs and launch shapes


def _gemv_knobs(kernel):
    """The knobs of the GEMV-mode kernel and gemm_rows (without the GEMMs' gemm_*, wgmma_*, mid_*, tall_*,
    gemv_tiled_* and gemv_wgmma)."""
    return {
        k: v
        for k, v in kernel.knobs.items()
        if not k.startswith(("gemm_", "gemv_tiled_", "gemv_wgmma", "wgmma_", "mid_", "tall_")) or k == "gemm_rows"
    }


def _lower(kernel, target=SM90):
    """The CUDA module and the kernel's first launch (GEMV mode where gemm_rows adds a GEMM-mode one)."""
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
    launches = cuda.functions[kernel.name].kernels
    # GEMV mode alone, or with the tiled GEMM above gemm_rows (and its merge kernel for k splits), and on
    # sm_90 the 64-row one below mid_rows and, for qkv-like weights, the one below tall_rows (and their merges)
    splits = kernel.knobs.get("gemm_k_splits", kernel.knobs.get("wgmma_k_splits"))
    mid = 1 + (kernel.knobs["mid_k_splits"] > 1) if kernel.knobs.get("mid_rows") else 0
    tall = 1 + (kernel.knobs["tall_k_splits"] > 1) if kernel.knobs.get("tall_rows") else 0
    assert len(launches) == (1 if not kernel.knobs.get("gemm_rows") else 2 + (splits > 1) + mid + tall)
    assert "2147483647" not in cuda.source  # no local buffer sized by the symbolic m
    return cuda, launches[0]


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
def test_mma_kernel_lowers_with_a_sane_launch(target):
    kernel = LinearMmaRule().apply(LinearSpec("matmul", 6144, 4096), target, {"gemv_tiled_stages": 0})
    assert kernel is not None and kernel.rule == "linear_mma"
    assert (kernel.knobs["gemv_tiled_stages"], kernel.knobs["gemv_tiled_k_steps"]) == (0, 0)  # GEMV mode
    assert _gemv_knobs(kernel) == {
        "warps": 4,
        "row_tiles": 1,
        "unroll": 2 if target is SM90 else 4,  # narrow with k = 4096 on 132 SMs, wide on 48 (gemv_defaults)
        "m_tile": 16,
        "stages": 2,
        "x_stages": 0,
        "n_warps": 1,
        "gemm_rows": 32,
    }
    assert kernel.func.attrs["tirx.is_scheduled"] and "tirx.is_scheduled" not in kernel.reference.attrs
    cuda, launch = _lower(kernel, target)
    assert launch.grid == ("384", "1", "1")  # one block per 16 weight rows; m is a loop inside the block
    assert launch.block == ("32", "4", "1")  # a warp per k range
    assert launch.dynamic_smem == "0"
    assert MMA_BF16 in cuda.source
    assert {p.source for p in launch.params if p.kind == "ptr"} == {"x", "w", "y"}
    assert {p.source for p in launch.params if p.kind == "scalar"} <= {"m", "((m - 1))"}
    # under a dependent launch only weights may be touched before the wait: x and y come from other kernels
    start, end = kernel_bodies(cuda.source)[launch.name]
    body = cuda.source[start:end]
    wait = body.index(f"{WAIT}();")
    assert body.index(f"{PREFETCH_L2}(") < wait < min(body.index("(x_ptr + "), body.index("y_ptr["))
    assert_only_weights_before_the_wait(cuda.source, launch.name)
    # the next grid comes in once the last pass has multiplied its weight, for the reduction and stores
    assert body.count(f"{LAUNCH_DEPENDENTS}();") == 1
    assert body.rindex(MMA_BF16) < body.index(f"{LAUNCH_DEPENDENTS}();") < body.index("y_ptr[")


def test_fp8_kernel_has_its_own_defaults_and_scales():
    """GEMV mode's FP8 defaults (by default the calls of few rows take the small tiled kernel instead:
    test_few_rows_go_to_a_small_tiled_kernel)."""
    kernel = LinearMmaRule().apply(LinearSpec("lm_head", 151936, 4096, FP8), SM121, {"gemv_tiled_stages": 0})
    assert kernel is not None
    assert _gemv_knobs(kernel) == {
        "warps": 4,
        "row_tiles": 2,  # a wide FP8 weight: one x fragment per 32 weight rows
        "unroll": 2,
        "m_tile": 16,
        "stages": 1,
        "x_stages": 0,
        "n_warps": 1,
        "gemm_rows": 32,
    }
    cuda, launch = _lower(kernel, SM121)
    assert launch.grid == ("4748", "1", "1") and launch.block == ("32", "4", "1")
    assert {p.source for p in launch.params if p.kind == "ptr"} == {"x", "w", "scale", "y"}
    assert MMA_BF16 in cuda.source and "__nv_fp8_e4m3" in cuda.source


@pytest.mark.parametrize(
    ("spec", "target", "chosen"),
    [
        (LinearSpec("lm_head", 151936, 4096, FP8), SM90, {"warps": 4, "row_tiles": 2, "unroll": 2, "stages": 1}),
        (LinearSpec("matmul_fp8", 24576, 4096, FP8), SM90, {"warps": 4, "row_tiles": 2, "unroll": 2, "stages": 1}),
        (LinearSpec("matmul_fp8", 6144, 4096, FP8), SM90, {"warps": 4, "row_tiles": 1, "unroll": 2, "stages": 2}),
        (LinearSpec("matmul_fp8", 6144, 4096, FP8), SM121, {"warps": 4, "row_tiles": 2, "unroll": 2, "stages": 1}),
        (LinearSpec("matmul_fp8", 4096, 12288, FP8), SM90, {"warps": 8, "row_tiles": 1, "unroll": 4, "stages": 1}),
        (LinearSpec("matmul", 10240, 4096), SM90, {"warps": 4, "row_tiles": 1, "unroll": 2, "stages": 2}),
        (LinearSpec("matmul", 24576, 4096), SM90, {"warps": 4, "row_tiles": 1, "unroll": 4, "stages": 2}),
        (LinearSpec("matmul", 4096, 12288), SM90, {"warps": 4, "row_tiles": 1, "unroll": 4, "stages": 2}),
    ],
    ids=["lm_head-fp8", "gate_up-fp8", "qkv-fp8", "qkv-fp8-gb10", "down-fp8", "ctx_kv", "gate_up", "down"],
)
def test_gemv_defaults_follow_the_weight_shape(spec, target, chosen):
    """Wide means n / 32 >= 4 blocks per SM (16896 rows on the H200's 132 SMs, 6144 on GB10's 48)."""
    kernel = LinearMmaRule().apply(spec, target)
    assert {k: kernel.knobs[k] for k in chosen} == chosen
    assert LinearMmaRule().apply(spec, target, {"row_tiles": 1, "warps": 2}).knobs["warps"] == 2  # knobs win


@pytest.mark.parametrize(
    ("spec", "knobs", "used", "grid"),
    [
        # 2 k steps of 32: warps and unroll shrink to divisors of the steps
        (LinearSpec("matmul", 64, 64), {}, {"warps": 2, "unroll": 1}, "4"),
        # n = 8: one ragged block of 16 rows (rows past n read a clamped row, never stored)
        (LinearSpec("matmul", 8, 64), {"row_tiles": 4}, {"row_tiles": 1, "warps": 2}, "1"),
        (LinearSpec("matmul", 200, 96), {"row_tiles": 2}, {"row_tiles": 2, "warps": 3}, "7"),
        (LinearSpec("matmul", 4096, 12288), {"warps": 8, "m_tile": 32, "stages": 1}, {"warps": 8, "m_tile": 32}, "256"),
    ],
    ids=["short-k", "n8", "n200", "override"],
)
def test_mma_knobs_fit_the_shape(spec, knobs, used, grid):
    kernel = LinearMmaRule().apply(spec, SM90, {"gemv_tiled_stages": 0, **knobs})
    assert kernel is not None
    assert {k: kernel.knobs[k] for k in used} == used
    _, launch = _lower(kernel)
    assert launch.grid[0] == grid
    assert launch.block == ("32", str(kernel.knobs["warps"]), "1")


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"tiles": 4}, "unknown knob"),
        ({"warps": 0}, "warps=0"),
        ({"warps": 64}, "warps=64"),
        ({"m_tile": 12}, "multiple of 8"),
        ({"stages": 3}, "stages=3"),
        ({"x_stages": 9}, "x_stages=9"),
        ({"x_stages": -1}, "x_stages=-1"),
        ({"n_warps": 0}, "n_warps=0"),
        ({"warps": 8, "n_warps": 8}, "at most 32 warps"),
        ({"x_stages": 1, "n_warps": 2, "m_tile": 64}, "at least 2 slots"),
        ({"x_stages": 2, "n_warps": 4, "m_tile": 16}, "divides m_tile / 8"),
        ({"x_stages": 2, "gemm_rows": 32}, "gemm_rows 0, or x_stages 0"),
        ({"gemm_rows": -1}, "gemm_rows=-1"),
        ({"unroll": 0}, "positive"),
        ({"unroll": 16, "stages": 2, "m_tile": 64}, "registers"),
        ({"x_stages": 2, "m_tile": 256, "unroll": 8}, "registers"),
        ({"warps": 32, "m_tile": 64, "row_tiles": 2}, "shared memory"),
        ({"warps": 4.0}, "must be an int"),
    ],
)
def test_bad_mma_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearMmaRule().apply(LinearSpec("matmul", 4096, 4096), SM90, knobs)


def test_default_knobs_read_capabilities():
    small = SM90.model_copy(update={"max_threads_per_block": 64})
    assert LinearMmaRule().default_knobs(small)["warps"] == 2
    assert LinearGemvRule().default_knobs(SM120)["threads"] == 128


@pytest.mark.parametrize(
    ("spec", "knobs", "used"),
    [
        (LinearSpec("matmul", 8, 100), {}, {"threads": 32, "rows_per_block": 4, "vector_bytes": 8}),
        (LinearSpec("matmul", 13, 1001), {}, {"threads": 128, "rows_per_block": 4, "vector_bytes": 2}),
        (
            LinearSpec("matmul_fp8", 192, 96, FP8),
            {"rows_per_block": 2},
            {"threads": 32, "rows_per_block": 2, "vector_bytes": 16},
        ),
        (LinearSpec("lm_head", 151936, 4096), {"threads": 256}, {"threads": 256, "vector_bytes": 16}),
    ],
    ids=["n8-k100", "k1001", "fp8-k96", "lm_head"],
)
def test_fallback_lowers_any_shape(spec, knobs, used):
    kernel = LinearGemvRule().apply(spec, SM121, knobs)
    assert kernel is not None and kernel.rule == "linear_gemv"
    assert {k: kernel.knobs[k] for k in used} == used
    _, launch = _lower(kernel, SM121)
    rows = kernel.knobs["rows_per_block"]
    assert launch.grid == (str(spec.n), f"((m + {rows - 1}) // {rows})", "1")
    assert launch.block == (str(kernel.knobs["threads"]), "1", "1")


@pytest.mark.parametrize(
    ("knobs", "message"),
    [({"threads": 48}, "multiple of 32"), ({"rows_per_block": 0}, "1 to 64"), ({"vector_bytes": 3}, "1, 2, 4")],
)
def test_bad_fallback_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearGemvRule().apply(LinearSpec("matmul", 64, 64), SM90, knobs)


# ------------------------------------------------------------------------------------ GEMM mode (x_stages)


@pytest.mark.parametrize(
    ("target", "m_tile"), [(SM90, 128), (SM120, 64), (SM121, 64)], ids=["sm_90", "sm_120", "sm_121"]
)
@pytest.mark.parametrize(
    "spec", [LinearSpec("matmul", 6144, 4096), LinearSpec("matmul_fp8", 4096, 12288, FP8)], ids=["bf16", "fp8"]
)
def test_gemm_mode_stages_x_through_shared_memory(spec, target, m_tile):
    kernel = LinearMmaRule().apply(spec, target, {"x_stages": 2})
    assert kernel is not None
    # its own defaults, FP8 too: 4 warps with double-buffered weights, m_tile as the SM's shared memory allows
    assert dict(kernel.knobs) == {
        "warps": 4,
        "row_tiles": 1,
        "unroll": 4,
        "m_tile": m_tile,
        "stages": 2,
        "x_stages": 2,
        "n_warps": 1,
        "gemm_rows": 0,  # one kernel for every m: neither tiled kernel
        "gemv_tiled_stages": 0,
        "gemv_tiled_k_steps": 0,
        "gemv_tiled_k_warps": 0,
        "gemv_tiled_n_tiles": 0,
        "gemv_wgmma": 0,
        "gemv_wgmma_stages": 0,
    }
    plan = fit_mma_plan(spec, target, kernel.knobs)
    cuda, launch = _lower(kernel, target)
    assert launch.grid == (str(spec.n // 16), "1", "1") and launch.block == ("32", "4", "1")
    # the x ring, with the partial sums laid over it, in dynamic shared memory: three blocks fit an SM
    assert int(launch.dynamic_smem) == plan.shared_bytes() == plan.x_ring_bytes() == 2 * m_tile // 8 * 4 * 512
    assert 3 * plan.shared_bytes() <= target.shared_memory_per_sm
    assert plan.shared_bytes() <= target.max_shared_memory_per_block
    start, end = kernel_bodies(cuda.source)[launch.name]
    body = cuda.source[start:end]
    assert MMA_BF16 in cuda.source and "extern __shared__" in body
    # x is read only by async copies into shared memory (one per row group and x vector), and the B
    # fragments are 16-byte loads from there; the k loop has no block barrier (each thread reads back its
    # own copies), only the reduction does
    assert "(x_ptr + " not in body
    assert body.count("x_ptr[") == body.count("cp_async_ca_") > 0
    assert "cp_async_wait_group" in body and "*(uint4*)(xs_ptr + " in body
    assert body.count("__syncthreads()") == 3
    # under a dependent launch the weight prefetch comes before the wait and x only after it
    assert body.index(f"{PREFETCH_L2}(") < body.index(f"{WAIT}();") < body.index("x_ptr[")
    assert_only_weights_before_the_wait(cuda.source, launch.name)


def test_gemm_mode_register_and_shared_memory_estimates():
    """GEMM mode trades the x registers for accumulators, so m_tile 128 fits where GEMV mode cannot."""
    spec = LinearSpec("matmul", 4096, 4096)
    with pytest.raises(ScheduleError, match="registers"):
        LinearMmaRule().apply(spec, SM90, {"m_tile": 128})
    rule = LinearMmaRule()
    plans = {m: fit_mma_plan(spec, SM90, rule.knobs_for(spec, SM90, {"x_stages": 2, "m_tile": m})) for m in (64, 128)}
    assert _register_estimate(plans[128]) - _register_estimate(plans[64]) == 8 * 4 + 8  # accumulators, group predicates
    assert plans[64].shared_bytes() == 32 * 1024 and plans[128].shared_bytes() == 64 * 1024


def test_gemm_mode_shared_memory_is_checked_against_the_opt_in_size():
    spec = LinearSpec("matmul", 4096, 4096)
    knobs = {"x_stages": 2, "m_tile": 256, "unroll": 2}
    assert LinearMmaRule().apply(spec, SM90, knobs).knobs["m_tile"] == 256  # 128 KiB of 227
    with pytest.raises(ScheduleError, match="shared memory"):
        LinearMmaRule().apply(spec, SM120, knobs)  # 128 KiB of 99
    assert LinearMmaRule().apply(spec, SM120, {**knobs, "warps": 2}).knobs["warps"] == 2  # 64 KiB


@pytest.mark.parametrize("target", [SM90, SM121], ids=["sm_90", "sm_121"])
def test_n_warps_share_one_x_tile(target):
    """Warps that split n own their weight rows and copy a share of x each; every x vector read waits for
    a block barrier, and x crosses from L2 once per 16 * n_warps weight rows instead of once per 16."""
    spec = LinearSpec("lm_head", 151936, 4096)
    knobs = {"warps": 1, "n_warps": 8, "x_stages": 3, "m_tile": 128 if target is SM90 else 64}
    kernel = LinearMmaRule().apply(spec, target, knobs)
    assert kernel is not None and kernel.knobs["n_warps"] == 8
    plan = fit_mma_plan(spec, target, kernel.knobs)
    assert plan.block_rows == 128 and plan.threads == 256
    cuda, launch = _lower(kernel, target)
    assert launch.grid == (str(-(-spec.n // 128)), "1", "1") and launch.block == ("32", "8", "1")
    assert int(launch.dynamic_smem) == plan.shared_bytes() <= target.max_shared_memory_per_block
    # ring [3, m_tile / 8, 1 k warp, 32, 16 B] and partial sums [1, m_tile, 128] f32, side by side
    assert plan.shared_bytes() == 3 * knobs["m_tile"] // 8 * 512 + 4 * knobs["m_tile"] * 128
    start, end = kernel_bodies(cuda.source)[launch.name]
    body = cuda.source[start:end]
    # each warp copies m_tile / 8 / 8 row groups per x vector: the 2 vectors ahead, then one per vector of
    # the loop body (2 stages x unroll 4); a barrier per vector of the body, then the reduction's three
    assert body.count("cp_async_ca_") == knobs["m_tile"] // 8 // 8 * (2 + 2 * 4)
    assert body.count("__syncthreads()") == 2 * 4 + 3
    # x_stages 3: one copy stays in flight across each barrier
    assert body.count("cp_async_wait_group_async_wait_group_1()") == 2 * 4


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("spec", "shapes"),
    [
        # bf16, narrow: 64-row blocks, k splits toward three blocks per SM (ceil(396 / 96) -> 4 of 128 k
        # steps); on GB10's 48 SMs qkv counts as wide: two k steps per slot, no split
        (LinearSpec("matmul", 6144, 4096), {"sm_90": (64, 4, 1), "sm_120": (64, 4, 1), "sm_121": (64, 1, 2)}),
        (LinearSpec("matmul", 4096, 12288), {"sm_90": (64, 6, 1), "sm_120": (64, 8, 1), "sm_121": (64, 3, 1)}),
        # FP8: 128-row blocks; narrow weights split k toward two blocks per SM
        (
            LinearSpec("matmul_fp8", 6144, 4096, FP8),
            {"sm_90": (128, 4, 1), "sm_120": (128, 8, 1), "sm_121": (128, 1, 1)},  # wide on GB10
        ),
        (
            LinearSpec("lm_head", 151936, 4096, FP8),
            {"sm_90": (128, 1, 1), "sm_120": (128, 1, 1), "sm_121": (128, 1, 1)},
        ),
        (  # a wide FP8 weight is not split: its merge would cost more than the split brings
            LinearSpec("matmul_fp8", 24576, 4096, FP8),
            {"sm_90": (128, 1, 1), "sm_120": (128, 1, 1), "sm_121": (128, 1, 1)},
        ),
        (LinearSpec("lm_head", 151936, 4096), {"sm_90": (64, 1, 2), "sm_120": (64, 1, 2), "sm_121": (64, 1, 2)}),
        (LinearSpec("matmul", 200, 96), {"sm_90": (64, 3, 1), "sm_120": (64, 3, 1), "sm_121": (64, 3, 1)}),  # 3 k steps
    ],
    ids=["qkv", "down", "qkv-fp8", "lm_head-fp8", "gate_up-fp8", "lm_head", "tiny"],
)
def test_gemv_kernel_hands_many_rows_to_the_tiled_gemm(spec, shapes, target):
    """By default a linear is a GEMV-mode kernel up to gemm_rows rows and the tiled GEMM above (with its
    merge kernel when k is split), picked by the host code per call and recorded as each launch's condition.
    (On sm_90 the GEMM is the warpgroup one by default: test_gemm_on_sm90_is_the_warpgroup_gemm.)"""
    kernel = LinearMmaRule().apply(spec, target, {"gemm_wgmma": 0})
    assert kernel.knobs["gemm_rows"] == 32 and kernel.knobs["x_stages"] == 0
    tiled = {key[5:]: value for key, value in kernel.knobs.items() if key.startswith("gemm_") and key != "gemm_rows"}
    plan = fit_tiled_plan(spec, target, tiled)
    assert (plan.block_n, plan.k_splits, plan.k_steps) == shapes[target.name]
    assert (plan.block_m, plan.threads) == (128, 128)
    # 2 to 4 pipeline slots, as many as let two blocks share the SM
    assert 2 <= plan.stages <= 4 and 2 * plan.shared_bytes() <= target.shared_memory_per_sm

    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
    func = cuda.functions[kernel.name]
    gemv, gemm, *merge = func.kernels
    assert len(merge) == (plan.k_splits > 1)
    for m in (1, 16, 32):
        assert func.launches({"m": m}) == [gemv], m
    for m in (33, 128, 512):
        assert func.launches({"m": m}) == [gemm, *merge], m
    n_blocks = -(-spec.n // plan.block_n)
    assert gemm.grid == ("((m + 127) // 128)", str(n_blocks), str(plan.k_splits))  # m tiles neighbour in order
    assert gemm.block == ("32", "4", "1")
    assert plan.shared_bytes() <= target.max_shared_memory_per_block
    # a split of fewer slots' worth of k than slots: TVM drops the slots and copies that can never happen
    full = spec.k // plan.step_k // plan.k_splits // plan.k_steps >= plan.stages
    assert int(gemm.dynamic_smem) == plan.shared_bytes() or not full
    if merge:
        (ws,) = func.workspaces
        assert ws.dtype == "float32" and [evaluate(d, {"m": 7}) for d in ws.shape] == [7 * plan.k_splits * spec.n]
        # a merge thread adds four neighbouring outputs: one 16-byte load per split (a row's splits a constant
        # stride apart in the [m, splits, n] workspace) and one 8-byte store
        (merging,) = merge
        assert merging.launch_dims({"m": 7})[0] == (-(-7 * spec.n // 4 // 256), 1, 1)
        merged = cuda.source[slice(*kernel_bodies(cuda.source)[merging.name])]
        assert merged.count("*(float4*)(part_ptr + ") == plan.k_splits and "part_ptr[" not in merged
        assert merged.count("*(nv_bfloat164*)(y_ptr + ") == 1
    else:
        assert not func.workspaces
    body = cuda.source[slice(*kernel_bodies(cuda.source)[gemm.name])]
    # both operands arrive by async copies only: one 16-byte copy per chunk of a k step, x's zero-filled
    # past m; per k step one wait (stages - 2 steps stay in flight) and one barrier
    assert "(x_ptr + " not in body and "(w_ptr + " not in body
    per_slot = (plan.block_n + 128 * plan.x_vectors) * 4 * plan.k_steps // plan.threads
    if full:
        assert body.count("cp_async_cg_") == per_slot * plan.stages  # the prologue's stages - 1, the loop's one
        x_copies = 128 * 4 * plan.x_vectors * plan.k_steps // plan.threads
        assert body.count("cp_async_cg_ignore_src") == x_copies * plan.stages
    assert body.count(f"cp_async_wait_group_async_wait_group_{plan.stages - 2}()") == 1
    assert body.count("__syncthreads()") == 1
    # the prologue's weight copies fly before the wait for the grid that writes x, x's after it
    assert body.index("w_ptr[") < body.index(f"{WAIT}();") < body.index("x_ptr[")
    assert_only_weights_before_the_wait(cuda.source, gemm.name)
    assert_triggers_after_its_last_weight_copies(body, spec, plan)
    # a warp's n_tiles x 8 tiles: as many mmas per 16 logical k, over the slot's k steps
    assert body.count(MMA_BF16) == plan.n_tiles * 8 * plan.vector // 4 * plan.k_steps
    # gemm_rows 0: the GEMV-mode kernel alone, for every m
    single = LinearMmaRule().apply(spec, target, {"gemm_rows": 0})
    assert not any(key.startswith("gemm_") and key != "gemm_rows" for key in single.knobs)
    (only,) = lower_to_cuda(tvm.IRModule({single.name: single.func}), target).functions[single.name].kernels
    assert only.when == "1" and only.runs({"m": 512})


def assert_triggers_after_its_last_weight_copies(body: str, spec: LinearSpec, plan) -> None:
    """A tiled kernel lets the next grid in (dependent_launch.py) once, in the k loop's step that issues its
    last weight copies (step per_split - stages, or the first when the prologue issued them all)."""
    import re

    slot_k = plan.slot_k if isinstance(plan, WgmmaPlan) else plan.step_k * plan.k_steps
    per_split = spec.k // slot_k // plan.k_splits
    assert body.count(f"{LAUNCH_DEPENDENTS}();") == 1
    assert body.rindex("commit_group") < body.index(f"{LAUNCH_DEPENDENTS}();")
    lead = plan.lead if isinstance(plan, WgmmaPlan) else plan.stages - 1  # slots copied ahead
    if per_split > 1:  # a loop of one step is no loop: its trigger needs no condition
        trigger = re.search(rf"if \(kt == (\d+)\) \{{\s*{LAUNCH_DEPENDENTS}\(\);", body)
        assert trigger and int(trigger.group(1)) == max(per_split - 1 - lead, 0)


@pytest.mark.parametrize(
    ("spec", "plan"),
    [
        # the shapes whose blocks fill the SMs' block slots most evenly (wgmma_defaults): qkv's 32 tiles of
        # 192 rows split 4 ways (128 blocks), lm_head's 792 tiles (6 waves), o_proj's 64 tiles of 64 rows split
        # 4 ways (two 96 KiB blocks per SM)
        (LinearSpec("matmul", 6144, 4096), WgmmaPlan(3, 128, 4, 1, 4)),
        (LinearSpec("lm_head", 151936, 4096), WgmmaPlan(3, 128, 4, 1, 1)),
        (LinearSpec("matmul", 4096, 4096), WgmmaPlan(1, 128, 4, 1, 4)),
        # ragged n and a split of fewer slots than the pipeline holds
        (LinearSpec("matmul", 200, 128), WgmmaPlan(3, 128, 4, 1, 2)),
        # e4m3 weights converted into one bf16 tile per slot (knob wgmma_convert 1; their default converts into
        # registers, test_linear_convert.py): slots of 64 bytes a row
        # ... with one slot's wgmmas in flight while the next slot is waited for and converted into the other tile
        (LinearSpec("matmul_fp8", 24576, 4096, FP8), WgmmaPlan(3, 128, 5, 1, 1, 2, 1)),
        (LinearSpec("matmul_fp8", 6144, 4096, FP8), WgmmaPlan(1, 128, 4, 1, 2, 2, 1)),
        # the same for bf16 weights, by knob (their default waits for each slot's wgmmas)
        (LinearSpec("matmul", 24576, 4096, name="groups2"), WgmmaPlan(3, 128, 5, 1, 1, 2)),
        (LinearSpec("matmul_fp8", 24576, 4096, FP8, name="groups1_fp8"), WgmmaPlan(3, 128, 4, 1, 1, 1, 1)),
    ],
    ids=["qkv", "lm_head", "o_proj", "tiny", "gate_up-fp8", "qkv-fp8", "groups2", "groups1-fp8"],
)
def test_gemm_on_sm90_is_the_warpgroup_gemm(spec, plan):
    """On sm_90 the calls above gemm_rows rows go to the warpgroup GEMM (linear_wgmma.py): whole operand
    tiles copied into 128-byte-swizzled slots (e4m3 weights unswizzled, then converted into one swizzled
    bf16 tile behind a second barrier), 4 wgmma m64n128k16 per 64-wide k atom of a slot, one commit and one
    wait per slot, and shared-memory writes made visible to the async proxy before each barrier."""
    knobs = {"wgmma_mma_groups": plan.mma_groups, "wgmma_stages": plan.stages} if "groups" in spec.name else {}
    knobs |= {"wgmma_convert": CONVERT_TILE} if spec.fp8 else {}
    # the 128-row GEMM takes every call above gemm_rows without the 64-row one (test_linear_mid.py)
    kernel = LinearMmaRule().apply(spec, SM90, {**knobs, "mid_rows": 0})
    assert kernel.knobs["gemm_wgmma"] == 1
    assert not [key for key in kernel.knobs if key.startswith("gemm_") and key not in ("gemm_rows", "gemm_wgmma")]
    assert fit_wgmma_plan(spec, SM90, {name: kernel.knobs[f"wgmma_{name}"] for name in WGMMA_KNOBS}) == plan

    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    func = cuda.functions[kernel.name]
    gemv, gemm, *merge = func.kernels
    assert len(merge) == (plan.k_splits > 1)
    for m in (1, 32):
        assert func.launches({"m": m}) == [gemv]
    for m in (33, 128, 512):
        assert func.launches({"m": m}) == [gemm, *merge]
    assert gemm.grid == ("((m + 127) // 128)", str(-(-spec.n // plan.block_n)), str(plan.k_splits))
    assert gemm.block == ("32", str(plan.n_warps), "1")
    per_split = spec.k // plan.slot_k // plan.k_splits
    full = per_split >= plan.stages
    assert int(gemm.dynamic_smem) == plan.shared_bytes() or not full
    body = cuda.source[slice(*kernel_bodies(cuda.source)[gemm.name])]
    assert "(x_ptr + " not in body and "(w_ptr + " not in body and "mma.sync" not in body
    # the swizzled tiles' base is checked before the first copy lands there
    assert body.index(f"{REQUIRE_ALIGNED}((&(smem_ptr[0])));") < body.index("cp_async")
    if full:  # the prologue's stages - 1 slots and the loop's one, every thread an equal share
        w_chunks = plan.block_n * 8 * plan.weight_bytes // 2 * plan.k_atoms
        w_rounds, x_rounds = (-(-chunks // plan.threads) for chunks in (w_chunks, plan.block_m * 8 * plan.k_atoms))
        assert body.count("cp_async_cg_") == (w_rounds + x_rounds) * (plan.lead + 1)
        assert body.count("cp_async_cg_ignore_src") == x_rounds * (plan.lead + 1)
    loop = body[body.index("for (int kt = 0;") :] if per_split > 1 else body[body.index(f"{WAIT}();") :]
    wait, fence, barrier = (loop.index(f"cp_async_wait_group_async_wait_group_{plan.lead - 1}()"),
                            loop.index(f"{FENCE_ASYNC_SHARED}();"), loop.index("__syncthreads()"))  # fmt: skip
    assert wait < fence < barrier and loop.count("__syncthreads()") == 1 + plan.fp8
    if plan.fp8:  # each thread converts the chunks it copied, 4 values a call, then all meet again
        converts = -(-plan.block_n * 4 * plan.k_atoms // plan.threads) * 4
        second = loop.index("__syncthreads()", barrier + 1)
        assert loop.count(f"{E4M3X4_TO_BF16}(") == converts and body.count(f"{E4M3X4_TO_BF16}(") == converts
        assert barrier < loop.index(f"{E4M3X4_TO_BF16}(") < loop.index(f"{FENCE_ASYNC_SHARED}();", barrier) < second
        barrier = second
    mma = f"{mma_name(plan.block_m)}("
    assert body.count(mma) == 4 * plan.k_atoms
    assert barrier < loop.index(f"{WGMMA_FENCE}();") < loop.index(mma)
    assert loop.rindex(mma) < loop.index(f"{WGMMA_COMMIT}();") < loop.index(f"{wait_name(plan.block_m)}(")
    assert body.count(f"{wait_name(plan.block_m)}(") == 1  # in the loop, or after it with a group in flight
    if plan.mma_groups == 2:
        end = loop.index("\n  }\n")  # the k loop's closing brace
        assert loop.index(f"{WGMMA_COMMIT}();") < loop.index(f"{WAIT_PRIOR}();") < end
        assert end < loop.index(f"{wait_name(plan.block_m)}(")
    # the k16 slices of one atom: the tile base advanced 16 bf16 (32 bytes) at a time, inside the swizzle row
    calls = [line for line in body.splitlines() if mma in line]
    b_offsets = [int(re.search(r"(\d+)\)?\]\)\)\);$", line).group(1)) for line in calls]
    assert [b - b_offsets[0] for b in b_offsets[:4]] == [0, 16, 32, 48]
    assert body.index("w_ptr[") < body.index(f"{WAIT}();") < body.index("x_ptr[")
    assert_only_weights_before_the_wait(cuda.source, gemm.name)
    assert_triggers_after_its_last_weight_copies(body, spec, plan)
    # the prelude defines the m64n128k16 call once, for the kernels that use it
    assert cuda.source.count(f"void {mma_name(plan.block_m)}(") == 1


def test_warpgroup_gemm_needs_wgmma_and_whole_k_atoms():
    """sm_12x has no wgmma: its GEMMs stay on the tiled mma.sync kernel, as does a k of partial 64-wide
    atoms on sm_90, and asking for the warpgroup one there is an error."""
    rule = LinearMmaRule()
    qkv, qkv_fp8, short_k = (
        LinearSpec("matmul", 6144, 4096),
        LinearSpec("matmul_fp8", 6144, 4096, FP8),
        LinearSpec("matmul", 200, 96),
    )
    for spec, target in ((qkv, SM120), (qkv, SM121), (qkv_fp8, SM121), (short_k, SM90)):
        kernel = rule.apply(spec, target)
        assert kernel.knobs["gemm_wgmma"] == 0 and "gemm_n_tiles" in kernel.knobs, (spec.name, target.name)
        assert not [key for key in kernel.knobs if key.startswith("wgmma_")]
        with pytest.raises(ScheduleError, match="Fix: gemm_wgmma 0"):
            rule.apply(spec, target, {"gemm_wgmma": 1})


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"gemm_wgmma": 2}, "gemm_wgmma=2"),
        ({"gemm_n_tiles": 2}, "gemm_n_tiles .* set gemm_wgmma 0"),
        ({"gemm_wgmma": 0, "wgmma_stages": 4}, "wgmma_stages .* set gemm_wgmma 1"),
        ({"wgmma_stages": 1}, "stages >= 2"),
        ({"wgmma_warpgroups": -1}, "positive values"),
        ({"wgmma_block_m": 12}, "multiple of 8 up to 256"),
        ({"wgmma_block_m": 264}, "multiple of 8 up to 256"),
        ({"wgmma_warpgroups": 9}, "at most 8 warpgroups"),
        ({"wgmma_warpgroups": 4, "wgmma_block_m": 256, "wgmma_stages": 4}, "lower wgmma_stages"),  # 4 x 64 KiB
        ({"wgmma_mma_groups": 3}, "expected 1 .* or 2"),
        ({"wgmma_mma_groups": 2, "wgmma_stages": 2}, "more slots than groups"),
    ],
)
def test_bad_wgmma_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearMmaRule().apply(LinearSpec("matmul", 4096, 4096), SM90, knobs)


def test_wgmma_plan_fits_the_k_atoms():
    """k_splits: the largest divisor of the 64-wide atoms up to the knob; k_atoms: a power of two dividing a
    split's atoms."""
    spec = LinearSpec("matmul", 200, 384)  # 6 atoms
    knobs = {
        "warpgroups": 1,
        "block_m": 64,
        "stages": 2,
        "k_atoms": 4,
        "k_splits": 4,
        "mma_groups": 1,
        "k_reduce": 1,
        "roles": 1,
        "convert": 1,
    }
    assert fit_wgmma_plan(spec, SM90, knobs) == WgmmaPlan(1, 64, 2, 2, 3)  # 3 splits of 2 atoms, one slot each
    assert fit_wgmma_plan(spec, SM90, {**knobs, "k_splits": 1}).k_atoms == 2  # 6 atoms: 2 divides, 4 does not


def test_wgmma_calls_are_defined_per_n():
    """One definition per N a source calls: the instruction of that N and N / 2 accumulators per thread, pinned
    again after the wait; N outside wgmma's range is an error."""
    source = mma_function(40)
    assert "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16" in source
    assert source.count('"+f"(d[19])') == 2 and '"+f"(d[20])' not in source
    assert needed_prelude(f"{mma_name(128)}(a, b, c); {wait_name(64)}(a); {mma_name(128)}(a, b, c);") == (
        mma_function(64) + mma_function(128)
    )
    assert needed_prelude("mma_sync(a)") == ""
    # the register-A forms: B N-major (transposed, its 64-column blocks lbo apart) or K-major as mma_name's
    both = needed_prelude(f"{mma_rs_name(64)}(a, b, c, 8192); {mma_rk_name(128)}(a, b, c);")
    assert both == mma_rs_function(64) + mma_rk_function(128)
    assert mma_rs_function(64).count(", p, 1, 1, 1;") == mma_rk_function(128).count(", p, 1, 1, 0;") == 1
    assert "unsigned lbo" in mma_rs_function(64) and "dflash_sw128_desc(b)" in mma_rk_function(128)
    assert "{%64, %65, %66, %67}, %68" in mma_rk_function(128)  # four fragment registers, then B's descriptor
    with pytest.raises(ValueError, match="multiple of 8"):
        mma_name(12)
    with pytest.raises(ValueError, match="multiple of 8"):
        mma_rk_name(260)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
def test_few_rows_go_to_a_small_tiled_kernel(target):
    """Calls of at most gemm_rows rows: all but wide FP8 weights stream through the small tiled kernel (16
    weight rows and 16 rows of x per block, slots in shared memory, warps along k, no k split); wide FP8
    weights through GEMV mode."""
    spec = LinearSpec("matmul", 6144, 4096)
    kernel = LinearMmaRule().apply(spec, target, {"mid_rows": 0})  # every call above 32 rows on one GEMM
    # qkv is narrow on the H200's 132 SMs (four slots of 8 k steps, four warps along k: its 384 blocks fit
    # one wave of those, not of three slots of 16), wide on GB10's 48 (three of 4, four warps, four tiles)
    slots = (4, 8, 4, 1) if target is SM90 else (3, 4, 4, 4)
    assert tuple(kernel.knobs[k] for k in FEW_ROWS_KNOBS) == slots
    plan = small_tiled_plan(spec, target, kernel.knobs)
    rows = 16 * slots[3]  # weight rows per block
    assert (plan.block_n, plan.block_m, plan.threads, plan.k_splits) == (rows, 16, 32 * slots[2], 1)
    assert plan.shared_bytes() == slots[0] * slots[1] * (rows + 16) * 64 <= target.max_shared_memory_per_block
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
    func = cuda.functions[kernel.name]
    few, gemm, *merge = func.kernels
    for m in (1, 7, 16, 32):
        assert func.launches({"m": m}) == [few], m
    assert func.launches({"m": 33}) == [gemm, *merge]
    assert few.grid == ("((m + 15) // 16)", str(6144 // rows), "1") and few.block == ("32", str(slots[2]), "1")
    assert int(few.dynamic_smem) == plan.shared_bytes()
    assert len(func.workspaces) == len(merge)  # the big GEMM's k splits have one; the few-rows kernel none
    body = cuda.source[slice(*kernel_bodies(cuda.source)[few.name])]
    assert "(w_ptr + " not in body and "(x_ptr + " not in body  # both operands by async copies only
    # two x tiles, two mmas per 16-row tile and k step, each warp its share of a slot's k steps
    assert body.count(MMA_BF16) == plan.n_tiles * 2 * 2 * plan.k_steps // plan.k_warps
    assert body.index("w_ptr[") < body.index(f"{WAIT}();") < body.index("x_ptr[")
    assert_only_weights_before_the_wait(cuda.source, few.name)
    assert_triggers_after_its_last_weight_copies(body, spec, plan)
    if plan.k_warps > 1:
        # the warps along k hand their sums over through the slots once every copy landed: two barriers
        # more, and only the first warp stores
        assert body.count("__syncthreads()") == 3 and body.count("wait_group_0()") == 1
        assert body.count("y_ptr[") == 8 * plan.n_tiles
        assert body.rindex("if (((int)threadIdx.y) == 0)") < body.index("y_ptr[")
    # by shape
    # four weight tiles per block share each x tile; wide e4m3 weights take a warpgroup GEMM on sm_90 instead
    wide, wide_fp8 = (3, 4, 4, 4), (0, 0, 0, 0) if target is SM90 else (2, 4, 4, 4)
    for other, chosen in [
        (LinearSpec("matmul", 24576, 4096), wide),
        (LinearSpec("lm_head", 151936, 4096), wide),
        # 256 blocks: three slots of 16 fit one wave of the H200, not of GB10
        (LinearSpec("matmul", 4096, 4096), (3, 16, 8, 1) if target is SM90 else (4, 8, 4, 1)),
        (LinearSpec("matmul", 4096, 12288), (3, 16, 8, 1) if target is SM90 else (4, 8, 4, 1)),
        # 640 blocks fit no wave of the H200: the second; wide on GB10
        (LinearSpec("matmul", 10240, 4096), (4, 8, 4, 1) if target is SM90 else wide),
        # narrow e4m3 weights: the deepest of 8, 6, 4 and 3 slots of 4 k steps whose call is one wave
        (LinearSpec("matmul_fp8", 4096, 4096, FP8), (8, 4, 4, 1) if target is SM90 else (4, 4, 4, 1)),
        (LinearSpec("matmul_fp8", 4096, 12288, FP8), (8, 4, 4, 1) if target is SM90 else (4, 4, 4, 1)),
        (LinearSpec("matmul_fp8", 6144, 4096, FP8), (6, 4, 4, 1) if target is SM90 else wide_fp8),
        (LinearSpec("matmul_fp8", 10240, 4096, FP8), (3, 4, 4, 1) if target is SM90 else wide_fp8),
        (LinearSpec("matmul_fp8", 24576, 4096, FP8), wide_fp8),
        (LinearSpec("lm_head", 151936, 4096, FP8), wide_fp8),
        (LinearSpec("matmul", 200, 96), (3, 1, 1, 1)),  # 3 k steps: slots of one, one warp
    ]:
        knobs = LinearMmaRule().apply(other, target).knobs
        assert tuple(knobs[k] for k in FEW_ROWS_KNOBS) == chosen, other.name
        assert knobs["gemv_wgmma"] == int(other.fp8 and chosen == (0, 0, 0, 0)), other.name
    # gemv_tiled_stages 0 gives GEMV mode too, and gemm_rows 0 leaves one kernel
    for knobs in ({"gemv_tiled_stages": 0}, {"gemm_rows": 0}):
        plain = LinearMmaRule().apply(spec, target, knobs)
        assert plain.knobs["gemv_tiled_stages"] == 0
        first = lower_to_cuda(tvm.IRModule({plain.name: plain.func}), target).functions[plain.name].kernels[0]
        assert first.grid == ("384", "1", "1") and first.block == ("32", "4", "1")
    # it shares the calls with the big GEMM and has no workspace: alone, or with a k split, it is refused
    gemv_plan = fit_mma_plan(spec, target, kernel.knobs)
    with pytest.raises(ScheduleError, match="one k split"):
        mma_gemv_func(spec, gemv_plan, None, plan)


def test_wide_e4m3_weights_take_few_rows_on_a_warpgroup_gemm():
    """gemv_wgmma 1 (the default for wide e4m3 weights on wgmma targets): the calls of at most gemm_rows rows
    go to a warpgroup GEMM of 16-row x tiles, one warpgroup of 64 weight rows, the e4m3 converted into the
    wgmmas' register A fragments, no k split; 17-32 rows take two x tiles. Its slots: six where a call's blocks
    fit one wave (gate_up's 384 blocks of 36 KiB, six an SM), else four (lm_head's 2,374). Elsewhere the small
    tiled kernel keeps them, and the knob is refused where there is no wgmma."""
    for rule, spec, stages in [
        (LinearSiluRule(), LinearSpec("matmul_silu", 24576, 4096, FP8), 6),
        (LinearArgmaxRule(), LinearSpec("lm_head_argmax", 151936, 4096, FP8), 4),
        (LinearMmaRule(), LinearSpec("matmul_fp8", 24576, 4096, FP8), 6),
    ]:
        kernel = rule.apply(spec, SM90)
        assert kernel.knobs["gemv_wgmma"] == 1 and kernel.knobs["gemv_tiled_stages"] == 0, spec.name
        assert kernel.knobs["gemv_wgmma_stages"] == stages, spec.name
        plan = few_rows_wgmma_plan(spec, SM90)
        assert (plan.warpgroups, plan.block_m, plan.stages, plan.k_splits, plan.mma_groups, plan.convert) == (
            1, 16, stages, 1, 2, CONVERT_REGISTERS
        )  # fmt: skip
        assert few_rows_wgmma_plan(spec, SM90, stages=5).stages == 5
        cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
        func = cuda.functions[kernel.name]
        few, *rest = func.launches({"m": 16})
        assert func.launches({"m": 32}) == [few, *rest]  # a second x tile, no other kernel
        assert len(rest) == int(spec.picks)  # lm_head_argmax: the merge of the blocks' picks
        assert few.grid == ("((m + 15) // 16)", str(spec.n // 64), "1") and few.block == ("32", "4", "1")
        assert int(few.dynamic_smem) == plan.shared_bytes() == stages * (64 * 64 + 16 * 128)
        blocks_per_sm = SM90.shared_memory_per_sm // plan.shared_bytes()
        assert (spec.n // 64 <= blocks_per_sm * SM90.sm_count) == (stages == 6)
        body = cuda.source[slice(*kernel_bodies(cuda.source)[few.name])]
        assert f"{mma_rk_name(16)}(" in body and f"{E4M3_A_FRAGMENT}(" in body and MMA_BF16 not in body
        assert func.launches({"m": 33})[0] != few  # above gemm_rows: the GEMMs of taller tiles
        # GB10 has no wgmma: the small tiled kernel, and the knob is refused
        assert rule.apply(spec, SM121).knobs["gemv_wgmma"] == 0
        with pytest.raises(ScheduleError, match="gemv_wgmma=1"):
            rule.apply(spec, SM121, {"gemv_wgmma": 1})
    # the slots knob: given, it is used; without the warpgroup GEMM it is refused
    deep = LinearArgmaxRule().apply(LinearSpec("lm_head_argmax", 151936, 4096, FP8), SM90, {"gemv_wgmma_stages": 6})
    assert deep.knobs["gemv_wgmma_stages"] == 6
    with pytest.raises(ScheduleError, match="gemv_wgmma_stages=6"):
        LinearMmaRule().apply(LinearSpec("matmul_fp8", 4096, 4096, FP8), SM90, {"gemv_wgmma_stages": 6})
    with pytest.raises(ScheduleError, match="gemv_wgmma=2"):
        LinearMmaRule().apply(LinearSpec("matmul_fp8", 24576, 4096, FP8), SM90, {"gemv_wgmma": 2})
    # bf16 weights keep the small tiled kernel by default; the knob gives them the bf16 warpgroup GEMM
    bf16 = LinearSpec("matmul_silu", 24576, 4096)
    assert LinearSiluRule().apply(bf16, SM90).knobs["gemv_wgmma"] == 0
    kernel = LinearSiluRule().apply(bf16, SM90, {"gemv_wgmma": 1})
    assert kernel.knobs["gemv_wgmma"] == 1
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    (few,) = cuda.functions[kernel.name].launches({"m": 16})
    assert f"{mma_name(16)}(" in cuda.source[slice(*kernel_bodies(cuda.source)[few.name])]


@pytest.mark.parametrize(
    "spec", [LinearSpec("matmul_fp8", 4096, 4096, FP8), LinearSpec("matmul", 200, 96)], ids=["o_proj-fp8", "ragged"]
)
def test_weight_tiles_of_a_small_tiled_block_share_its_x_tile(spec):
    """gemv_tiled_n_tiles 2: a block of the small tiled kernel owns 32 weight rows whose two 16-row tiles
    multiply every x fragment it reads, so the grid and x's reads from L2 halve; the knob is reported, the
    ragged last block of a weight that is no multiple of 32 rows stores only rows below n."""
    base = LinearMmaRule().apply(spec, SM90, {"gemv_tiled_stages": 3, "gemv_tiled_k_steps": 4})
    kernel = LinearMmaRule().apply(spec, SM90, {"gemv_tiled_stages": 3, "gemv_tiled_k_steps": 4,
                                                "gemv_tiled_n_tiles": 2})  # fmt: skip
    assert (base.knobs["gemv_tiled_n_tiles"], kernel.knobs["gemv_tiled_n_tiles"]) == (1, 2)
    one, two = (small_tiled_plan(spec, SM90, k.knobs) for k in (base, kernel))
    assert (one.block_n, two.block_n, two.block_m, two.threads) == (16, 32, 16, one.threads)
    # a slot holds twice the weight rows and the same x rows
    assert two.stage_bytes() - one.stage_bytes() == 16 * 64 * two.k_steps
    few = [lower_to_cuda(tvm.IRModule({k.name: k.func}), SM90).functions[k.name].kernels[0] for k in (base, kernel)]
    assert [f.grid for f in few] == [("((m + 15) // 16)", str(-(-spec.n // rows)), "1") for rows in (16, 32)]
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    body = cuda.source[slice(*kernel_bodies(cuda.source)[few[1].name])]
    mma = MMA_BF16
    per_tile = 2 * two.vector // 4 * two.k_steps // two.k_warps  # two x tiles, vector / 4 mmas per k step
    assert body.count(mma) == 2 * per_tile
    assert body.count("y_ptr[") == 2 * 2 * 4
    # the ragged last block's second tile lies past n (rows 208-223 of 200): all but the last block store it
    assert ("(((int)blockIdx.y) < " in body) == (spec.n % 32 != 0)
    # GEMV mode (stages 0) has no small plan: all its knobs read 0
    gemv = LinearMmaRule().apply(spec, SM90, {"gemv_tiled_stages": 0}).knobs
    assert [gemv[k] for k in FEW_ROWS_KNOBS] == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("spec", "knobs", "used"),
    [
        (LinearSpec("matmul", 4096, 4096), {"gemv_tiled_k_steps": 16, "gemv_tiled_k_warps": 8}, (16, 8)),
        (LinearSpec("matmul", 4096, 4096), {"gemv_tiled_k_steps": 8, "gemv_tiled_k_warps": 16}, (8, 8)),
        (LinearSpec("matmul", 4096, 4096), {"gemv_tiled_k_steps": 8, "gemv_tiled_k_warps": 3}, (8, 2)),
        (LinearSpec("matmul", 200, 96), {"gemv_tiled_k_steps": 8, "gemv_tiled_k_warps": 8}, (1, 1)),  # 3 k steps
        (LinearSpec("matmul_fp8", 72, 128, FP8), {"gemv_tiled_k_steps": 4, "gemv_tiled_k_warps": 4}, (2, 2)),
    ],
)
def test_warps_along_k_split_a_slot_evenly(spec, knobs, used):
    """gemv_tiled_k_steps and gemv_tiled_k_warps are upper bounds: a slot takes the most k steps (a power of
    two) that divide k, and as many warps (a power of two) as split them evenly."""
    kernel = LinearMmaRule().apply(spec, SM90, {"gemv_tiled_stages": 3, **knobs})
    assert (kernel.knobs["gemv_tiled_k_steps"], kernel.knobs["gemv_tiled_k_warps"]) == used
    plan = small_tiled_plan(spec, SM90, kernel.knobs)
    assert plan.threads == 32 * used[1] and plan.k_steps % plan.k_warps == 0
    # the warps past the first hand their accumulators over through the slots: they fit there
    assert plan.reduce_bytes() == (used[1] - 1) * 32 * 8 * 4 <= plan.stages * plan.stage_bytes()


@pytest.mark.parametrize(
    ("knobs", "target", "message"),
    [
        ({"gemv_tiled_stages": 1}, SM90, "stages >= 2"),
        ({"gemv_tiled_stages": 8}, SM120, "lower gemv_tiled_stages or gemv_tiled_k_steps"),  # 8 x 16 KiB of 99
        ({"gemv_tiled_stages": 2, "gemv_tiled_k_warps": 0}, SM90, "positive values"),
        ({"gemv_tiled_stages": 2, "gemv_tiled_k_warps": 64}, SM90, "at most 32 warps"),
        ({"gemm_stages": 1, "gemm_wgmma": 0}, SM90, "stages >= 2"),
        ({"gemm_n_warps": -1, "gemm_wgmma": 0}, SM90, "positive values"),
        ({"gemm_n_warps": 8, "gemm_m_warps": 8, "gemm_wgmma": 0}, SM90, "at most 32 warps"),
        ({"gemm_stages": 9}, SM120, "shared memory"),  # 9 x 12 KiB of 99
        ({"gemm_n_tiles": 8, "gemm_m_tiles": 8, "gemm_wgmma": 0}, SM90, "registers"),
    ],
)
def test_bad_tiled_knobs_are_refused(knobs, target, message):
    with pytest.raises(ScheduleError, match=message):
        LinearMmaRule().apply(LinearSpec("matmul", 4096, 4096), target, knobs)
    assert LinearMmaRule().apply(
        LinearSpec("matmul", 4096, 4096), SM90, {"gemm_stages": 9, "gemm_wgmma": 0}
    )  # of 227 KiB


@pytest.mark.parametrize(
    ("spec", "knob", "used"),
    [
        (LinearSpec("matmul", 200, 96), 4, 1),  # 3 k steps
        (LinearSpec("matmul", 200, 256), 3, 2),  # 8 k steps: a power of two, not 3
        (LinearSpec("matmul", 200, 256), 8, 8),
        (LinearSpec("matmul_fp8", 72, 256, FP8), 8, 4),  # 4 FP8 k steps of 64
    ],
)
def test_tiled_slots_take_a_power_of_two_of_k_steps(spec, knob, used):
    """The rows of a slot hold 4 * k_steps 16-byte chunks, and the swizzle flips chunk bit 2 (bit 0 for FP8's
    x) of odd rows: a power of two keeps every flipped chunk inside its row."""
    kernel = LinearMmaRule().apply(
        spec, SM90, {"gemm_k_steps": knob, "gemm_k_splits": 1, "gemm_stages": 2, "gemm_wgmma": 0}
    )
    assert kernel.knobs["gemm_k_steps"] == used


# ------------------------------------------------------------------------------------------------- NVRTC


def test_family_module_compiles_for_sm90a():
    from dflash_compiler.cubin import cubin_arch
    from dflash_compiler.nvrtc import compile_cubin

    pytest.importorskip("cuda.bindings")
    kernels = [
        LinearMmaRule().apply(LinearSpec("matmul", 200, 96), SM90),
        LinearMmaRule().apply(LinearSpec("lm_head", 512, 128, FP8), SM90),
        LinearGemvRule().apply(LinearSpec("matmul", 13, 1001), SM90),
        # the warpgroup GEMM: the default shape with its k splits, and a 40-row x tile of two-atom slots
        LinearMmaRule().apply(LinearSpec("matmul", 4096, 4096), SM90),
        LinearMmaRule().apply(
            LinearSpec("lm_head", 384, 512, name="wgmma_n40"),
            SM90,
            {"wgmma_warpgroups": 1, "wgmma_block_m": 40, "wgmma_k_atoms": 2},
        ),
    ]
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), SM90)
    cubin = compile_cubin(cuda.source, SM90.arch)
    assert cubin_arch(cubin) == "sm_90a"


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_gemm_mode_compiles_for_every_arch(target):
    from dflash_compiler.cubin import cubin_arch
    from dflash_compiler.nvrtc import compile_cubin

    pytest.importorskip("cuda.bindings")
    rule = LinearMmaRule()
    kernels = [
        rule.apply(LinearSpec("matmul", 4096, 4096), target, {"x_stages": 2}),  # the target's GEMM defaults
        rule.apply(LinearSpec("matmul", 200, 96), target, {"x_stages": 1, "m_tile": 32}),  # ragged n, 1 step a warp
        rule.apply(LinearSpec("lm_head", 512, 256, FP8), target, {"x_stages": 3, "row_tiles": 2, "stages": 1}),
        rule.apply(LinearSpec("matmul", 200, 96), target, {"x_stages": 2, "n_warps": 4, "warps": 1, "m_tile": 32}),
        rule.apply(LinearSpec("matmul_fp8", 4096, 12288, FP8), target, {"x_stages": 3, "n_warps": 2, "warps": 2}),
        # the tiled GEMM above gemm_rows: FP8 with k splits, and bf16 lm_head (f32 out) of one split
        rule.apply(LinearSpec("matmul_fp8", 4096, 12288, FP8, name="tiled_fp8"), target),
        rule.apply(LinearSpec("lm_head", 520, 256), target, {"gemm_n_warps": 1, "gemm_m_tiles": 4, "gemm_wgmma": 0}),
        # warps along k in the tiled GEMM and in the small kernel of an FP8 weight
        rule.apply(
            LinearSpec("matmul", 200, 256, name="k_warps"),
            target,
            {"gemm_k_warps": 2, "gemm_k_steps": 4, "gemm_wgmma": 0},
        ),
        rule.apply(LinearSpec("matmul_fp8", 72, 256, FP8, name="few_fp8"), target, {"gemv_tiled_k_warps": 4}),
    ]
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target)
    assert cubin_arch(compile_cubin(cuda.source, target.arch)) == target.arch
