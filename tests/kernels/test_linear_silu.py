"""matmul_silu (a gate|up projection with its rows interleaved 8 at a time, and the silu_mul of its halves):
the spec and its CPU oracle against numpy, the rules' choice, the kernel table (the small tiled kernel and
the GEMM, one launch each, no workspace), the generated store, refused knobs and NVRTC builds for every arch.
The kernels against numpy on the GPU: tests/gpu/test_kernels.py over a bench/kernels.py bundle.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.ir.interpret import evaluate_node
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.linear import FP8, LinearSpec, spec_of
from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearGemvRule, LinearMmaRule, LinearSiluRule
from dflash_compiler.targets import SM90, SM120, SM121

tvm = pytest.importorskip("tvm")
ml_dtypes = pytest.importorskip("ml_dtypes")

from kernel_harness import assert_nvrtc_builds, assert_spec_matches_numpy  # noqa: E402 - TVM

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM

N, K = 1040, 256  # 65 tiles of 16 rows: a ragged last block on every kernel


def _spec(fp8: bool = False, n: int = N, k: int = K) -> LinearSpec:
    return LinearSpec("matmul_silu", n, k, weight_dtype=FP8 if fp8 else "bfloat16")


def test_spec_takes_gate_up_and_gives_half_the_columns():
    spec = _spec(fp8=True)
    assert spec.name == "matmul_silu_fp8_n1040_k256"
    assert [(p.name, p.shape) for p in spec.params()] == [("x", ("m", K)), ("w", (N, K)), ("scale", (N,)),
                                                          ("y", ("m", N // 2))]  # fmt: skip
    assert spec.bytes_moved({"m": 16}) == N * K + 4 * N + 16 * K * 2 + 16 * (N // 2) * 2
    with pytest.raises(ScheduleError, match="multiple of 16"):
        LinearSpec("matmul_silu", 1032, K)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_cpu_oracle_matches_numpy(fp8, rows):
    spec = _spec(fp8)
    arrays = spec.sample(np.random.default_rng(rows), {"m": rows})
    # the reference: silu(gate) * up of the de-interleaved halves of the plain projection
    plain = Node.make(Op.MATMUL_FP8 if fp8 else Op.MATMUL, [TensorType("float32", ("m", N))])
    y = evaluate_node(plain, [arrays["x"], arrays["w"], *([arrays["scale"]] if fp8 else [])])[0]
    blocks = y.reshape(rows, N // 16, 2, 8)
    gate, up = blocks[:, :, 0].reshape(rows, -1), blocks[:, :, 1].reshape(rows, -1)
    np.testing.assert_allclose(spec.reference(arrays)["y"], gate / (1 + np.exp(-gate)) * up, rtol=1e-6, atol=1e-6)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=rows)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_rules(fp8):
    x = TensorType("bfloat16", ("nb*blk", K))
    w = TensorType(FP8 if fp8 else "bfloat16", (N, K))
    scale = [TensorType("float32", (N,))] if fp8 else []
    inst = OpInstance("l0.silu_mul", Node.make(Op.MATMUL_SILU, [TensorType("bfloat16", ("nb*blk", N // 2))], group=8),
                      (x, w, *scale))  # fmt: skip
    assert spec_of(inst) == _spec(fp8)
    for rule in (LinearMmaRule(), LinearArgmaxRule(), LinearGemvRule()):
        assert rule.apply(inst, SM90) is None
    kernel = LinearSiluRule().apply(inst, SM90)
    assert kernel is not None and kernel.rule == "linear_silu" and kernel.knobs["wgmma_k_splits"] == 1


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"wgmma_k_splits": 2}, "k splits 2"),
        ({"gemv_tiled_stages": 0}, "gemv_tiled_stages=0"),
        ({"x_stages": 2}, "x_stages=2"),
    ],
)
def test_knobs_without_the_epilogue_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearSiluRule().apply(_spec(n=24576, k=4096), SM90, knobs)


def test_store_refuses_a_split_plan():
    from dflash_compiler.schedules.linear_tiled import TiledPlan, store_macro

    plan = TiledPlan(n_warps=2, m_warps=2, n_tiles=2, m_tiles=2, stages=2, k_splits=2, vector=8)
    with pytest.raises(ScheduleError, match="2 k splits"):
        store_macro(_spec(), plan)
    assert store_macro(_spec(), TiledPlan(**{**plan.__dict__, "k_splits": 1})) is not None


@pytest.mark.parametrize("target", [SM90, SM120], ids=lambda t: t.name)
def test_kernel_table_and_store(target):
    kernel = LinearSiluRule().apply(_spec(n=24576, k=4096), target, {"mid_rows": 0})  # no 64-row GEMM
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
    func = cuda.functions[kernel.name]
    small, large = func.kernels
    assert func.workspaces == ()  # no k split, no partial sums
    for m, launched in ((16, small), (32, small), (33, large), (128, large)):
        assert func.launches({"m": m}) == [launched]
    assert [p.shape for p in func.params][-1] == ("m", str(24576 // 2))
    # each thread's store: silu(gate) * up of accumulators e and e + 2 (rows g and g + 8 of a 16-row tile)
    stores = re.findall(r"float gate(?:_\d+)? = acc_ptr\[(\d+)\];\s*float up(?:_\d+)? = acc_ptr\[(\d+)\];", cuda.source)
    assert stores and all(int(up) == int(gate) + 2 for gate, up in stores)
    assert "expf(" in cuda.source


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_compiles_for_every_arch(target):
    pytest.importorskip("cuda.bindings")
    rule = LinearSiluRule()
    kernels = [rule.apply(_spec(), target), rule.apply(_spec(fp8=True), target)]
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target)
    assert_nvrtc_builds(cuda, target.arch)
