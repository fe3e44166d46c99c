"""RMSNorm family: the unscheduled PrimFunc built for llvm matches numpy; the rule's choices and errors.

The CUDA schedule's index math runs only on a GPU (tests/gpu); here it is lowered and its launch shape
checked, and tests/kernels/test_codegen.py compiles it for every target arch.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules import RULES, RMSNormRule, RMSNormSpec, ScheduleError, apply_rules
from dflash_compiler.targets import SM90, SM120, SM121

tvm = pytest.importorskip("tvm")
ml_dtypes = pytest.importorskip("ml_dtypes")

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM
from dflash_compiler.schedules.rmsnorm import rmsnorm_func  # noqa: E402

BF16 = ml_dtypes.bfloat16
EPS = 1e-6
ROWS = (1, 7, 33)
HIDDEN = (64, 4096)


@pytest.fixture(scope="module")
def cpu_build():
    """llvm executables of the unscheduled funcs, built once per (hidden, residual)."""
    cache: dict[tuple[int, bool], tuple[RMSNormSpec, object]] = {}

    def get(hidden: int, residual: bool) -> tuple[RMSNormSpec, object]:
        if (hidden, residual) not in cache:
            spec = RMSNormSpec(hidden=hidden, eps=EPS, residual=residual)
            ex = tvm.compile(rmsnorm_func(spec), target=tvm.target.Target({"kind": "llvm"}))
            cache[hidden, residual] = (spec, ex)
        return cache[hidden, residual]

    return get


def _rms_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + EPS) * w.astype(np.float64)


def _assert_bf16_close(got: np.ndarray, ref: np.ndarray) -> None:
    """bf16 keeps 8 significant bits: rounding costs at most 2^-9 relative; allow twice that."""
    err = np.abs(got.astype(np.float64) - ref)
    bound = 4e-3 * np.abs(ref) + 1e-6
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"at {worst}: got {got[worst]}, expected {ref[worst]}"


def _run(ex, spec: RMSNormSpec, arrays: list[np.ndarray], out_shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    dev = tvm.cpu()
    outs = [tvm.runtime.empty(shape, "bfloat16", dev) for shape in out_shapes]
    ex[spec.name](*[tvm.runtime.tensor(a, dev) for a in arrays], *outs)
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_llvm_matches_numpy(cpu_build, hidden, rows):
    spec, ex = cpu_build(hidden, False)
    rng = np.random.default_rng(rows * 1000 + hidden)
    x = (rng.standard_normal((rows, hidden)) * 3).astype(BF16)
    w = rng.uniform(0.5, 1.5, hidden).astype(BF16)
    (y,) = _run(ex, spec, [x, w], [(rows, hidden)])
    assert y.dtype == BF16
    _assert_bf16_close(y, _rms_ref(x, w))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_residual_llvm_matches_numpy(cpu_build, hidden, rows):
    spec, ex = cpu_build(hidden, True)
    rng = np.random.default_rng(rows * 1000 + hidden + 1)
    a = rng.standard_normal((rows, hidden)).astype(BF16)
    b = (rng.standard_normal((rows, hidden)) * 0.5).astype(BF16)
    w = rng.uniform(0.5, 1.5, hidden).astype(BF16)
    s, y = _run(ex, spec, [a, b, w], [(rows, hidden), (rows, hidden)])
    total = a.astype(np.float32) + b.astype(np.float32)
    np.testing.assert_array_equal(s, total.astype(BF16))  # one f32 add, one rounding: exact
    _assert_bf16_close(y, _rms_ref(total, w))  # the norm reads the f32 sum, not the rounded s


def test_zero_rows_are_finite(cpu_build):
    spec, ex = cpu_build(64, False)
    x = np.zeros((3, 64), BF16)
    (y,) = _run(ex, spec, [x, np.ones(64, BF16)], [(3, 64)])
    assert np.all(y.astype(np.float32) == 0)


# ------------------------------------------------------------------------------------------ the rule


def _node(op: Op = Op.RMSNORM, dtype: str = "bfloat16", width: int | str = 4096) -> Node:
    outputs = [TensorType(dtype, ("nb*blk", width))] * (2 if op is Op.RMSNORM_RESIDUAL else 1)
    return Node.make(op, outputs, eps=EPS)


def test_rule_schedules_graph_nodes():
    kernel = RMSNormRule().apply(_node(), SM90)
    assert kernel is not None
    assert kernel.name == "rmsnorm_h4096"
    assert kernel.rule == "rmsnorm"
    assert dict(kernel.knobs) == {"threads": 512, "vector_bytes": 16}
    assert kernel.func.attrs["tirx.is_scheduled"]
    assert "tirx.is_scheduled" not in kernel.reference.attrs
    residual = RMSNormRule().apply(_node(Op.RMSNORM_RESIDUAL), SM121)
    assert residual is not None and residual.name == "rmsnorm_residual_h4096"
    assert [p.name for p in residual.reference.params] == ["a", "b", "w", "s", "y"]


def test_rule_accepts_its_own_primfunc():
    func = rmsnorm_func(RMSNormSpec(hidden=256, eps=1e-5, name="final_norm"))
    kernel = RMSNormRule().apply(func, SM120)
    assert kernel is not None and kernel.name == "final_norm"
    assert float(kernel.reference.attrs["dflash.eps"]) == pytest.approx(1e-5)


@pytest.mark.parametrize(
    "subject",
    [
        _node(dtype="float32"),
        _node(width="h"),
        Node.make(Op.MATMUL, [TensorType("bfloat16", ("m", 8))]),
        "rmsnorm",
        None,
    ],
    ids=["f32", "symbolic-width", "matmul", "string", "none"],
)
def test_rule_declines_other_work(subject):
    assert RMSNormRule().apply(subject, SM90) is None


def test_apply_rules_refuses_when_nothing_applies():
    with pytest.raises(ScheduleError, match="no schedule rule applies to matmul on sm_90"):
        apply_rules(RULES, Node.make(Op.MATMUL, [TensorType("bfloat16", ("m", 8))]), SM90)
    assert apply_rules(RULES, _node(), SM90).name == "rmsnorm_h4096"


def test_default_knobs_read_capabilities_not_names():
    small = SM90.model_copy(update={"max_threads_per_block": 256})
    assert RMSNormRule().default_knobs(small)["threads"] == 128
    assert RMSNormRule().default_knobs(SM90)["threads"] == 512


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"tiles": 4}, "unknown knob"),
        ({"threads": 48}, "multiple of 32"),
        ({"threads": 2048}, "up to 1024"),
        ({"vector_bytes": 3}, "2, 4, 8 or 16"),
        ({"threads": 128.0}, "must be an int"),
    ],
)
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        RMSNormRule().apply(_node(), SM90, knobs)


def test_rows_too_wide_for_registers_are_refused_with_the_threads_that_fit():
    with pytest.raises(ScheduleError, match=r"holds 64 elements .* raise the threads knob to at least 1024"):
        RMSNormRule().apply(_node(Op.RMSNORM_RESIDUAL, width=32768), SM90)
    assert RMSNormRule().apply(_node(Op.RMSNORM_RESIDUAL, width=32768), SM90, {"threads": 1024}) is not None


def _kernel_body(source: str, name: str) -> str:
    start = source.index("{", source.index(f"void __launch_bounds__(512) {name}_kernel("))
    return source[start : source.index("\n}\n", start)]


@pytest.mark.parametrize("residual", [False, True])
def test_weight_is_loaded_before_the_wait_and_the_row_once_after_it(residual):
    """The weight is read before the wait by a relaxed load, which the machine code keeps there (a plain
    read-only load ptxas scheduled after it); after the wait the kernel reads each input once, all before its
    one barrier (module docstring)."""
    from dflash_compiler.dependent_launch import LOAD_BEFORE_WAIT
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.sass import kernel_opcodes, loads_before_wait

    kernel = RMSNormRule().apply(_node(Op.RMSNORM_RESIDUAL if residual else Op.RMSNORM), SM90)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    body = _kernel_body(cuda.source, kernel.name)
    wait, trigger = body.index("dflash_wait_for_inputs();"), body.index("dflash_launch_dependents();")
    weight = body.index(f"{LOAD_BEFORE_WAIT}((&(wl_ptr[0])), (&(w_ptr[")
    assert body.count("w_ptr[") == body.count(LOAD_BEFORE_WAIT) == 1 and weight < wait < trigger
    (opcodes,) = kernel_opcodes(compile_cubin(cuda.source, SM90.arch)).values()
    assert loads_before_wait(opcodes) == 1  # the weight's one 16-byte load a thread
    inputs = ("a_ptr", "b_ptr") if residual else ("x_ptr",)
    for name in inputs:
        assert body.count(f"*(uint4*)({name}") == 1 and trigger < body.index(f"*(uint4*)({name}")
    assert body.count("__syncthreads()") == 1
    assert max(body.index(f"*(uint4*)({name}") for name in inputs) < body.index("__syncthreads()")
    assert "__shared__ alignas(64) float shared_ptr[16]" in body  # one sum per warp, not the row


@pytest.mark.parametrize(
    ("hidden", "knobs", "threads", "vector_bytes"),
    [
        (4096, {}, 512, 16),
        (4096, {"threads": 128}, 128, 16),
        (64, {}, 32, 16),  # 8 vectors: one warp, predicated
        (1000, {}, 128, 16),  # 125 vectors
        (1001, {}, 512, 2),  # odd width: scalar loads
        (4096, {"vector_bytes": 8}, 512, 8),
    ],
)
def test_launch_shape_follows_knobs(hidden, knobs, threads, vector_bytes):
    kernel = RMSNormRule().apply(RMSNormSpec(hidden=hidden, eps=EPS), SM90, knobs)
    assert kernel is not None
    assert dict(kernel.knobs) == {"threads": threads, "vector_bytes": vector_bytes}
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    (launch,) = cuda.functions[kernel.name].kernels
    assert launch.grid == ("m", "1", "1")  # one block per row
    assert launch.block == (str(threads), "1", "1")
    assert launch.dynamic_smem == "0"


def test_spec_validation():
    with pytest.raises(ScheduleError, match="hidden size must be positive"):
        RMSNormSpec(hidden=0, eps=EPS)
    with pytest.raises(ScheduleError, match="eps must be positive"):
        RMSNormSpec(hidden=8, eps=0.0)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("hidden", "rows"), [(64, 1), (1001, 5), (4096, 16)])
def test_spec_reference_agrees_with_llvm(residual, hidden, rows):
    from kernel_harness import assert_spec_matches_numpy

    spec = RMSNormSpec(hidden=hidden, eps=EPS, residual=residual)
    assert [p.name for p in spec.params()] == [p.name for p in rmsnorm_func(spec).params]
    assert spec.variables() == ("m",)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=hidden + rows)
