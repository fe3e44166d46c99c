"""KV write family: llvm build vs the interpreter's `kv_write`, node recognition and views, CUDA lowering for
SM90/SM121 and one NVRTC compile for sm_90a. The GPU run of the same spec is the lead's check bundle.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.kv_write import KVWriteRule, KVWriteSpec, KVWritesSpec
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
pytest.importorskip("ml_dtypes")

from kernel_harness import assert_spec_matches_numpy, run_llvm  # noqa: E402

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM

REPO = Path(__file__).resolve().parents[2]
BF16 = "bfloat16"


# --------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        (KVWriteSpec(kv_heads=8, head_dim=128), {"m": 37, "pages": 5}),
        (KVWriteSpec(kv_heads=2, head_dim=16), {"m": 5, "pages": 2}),  # tiny drafter
        (KVWriteSpec(kv_heads=3, head_dim=12), {"m": 9, "pages": 3}),  # odd heads; 4-wide copies
        (KVWriteSpec(kv_heads=1, head_dim=7), {"m": 16, "pages": 1}),  # odd dim: scalar copies, a full page
        (KVWriteSpec(kv_heads=4, head_dim=64, page_size=8), {"m": 1, "pages": 4}),
    ],
    ids=["qwen3-8b", "tiny", "odd-heads", "odd-dim", "page8"],
)
def test_llvm_matches_interpreter(spec, sizes):
    got = assert_spec_matches_numpy(spec, sizes, seed=sizes["m"])
    assert got["cache"].shape == (sizes["pages"], spec.page_size, spec.kv_heads, spec.head_dim)


def test_slots_outside_the_cache_are_skipped():
    """The interpreter refuses them; the kernel leaves memory it does not own alone and writes the rest."""
    spec = KVWriteSpec(kv_heads=2, head_dim=16)
    arrays = spec.sample(np.random.default_rng(1), {"m": 4, "pages": 2})
    before = arrays["cache"].copy()
    arrays["slots"] = np.array([-1, 3, 32, 31], np.int32)  # 32 = pages * 16: one past the end
    got = run_llvm(spec, arrays)["cache"]
    expected = spec.reference({**arrays, "cache": before, "rows": arrays["rows"][[1, 3]], "slots": np.array([3, 31])})
    np.testing.assert_array_equal(got, expected["cache"])


def test_reference_is_the_interpreter_on_a_one_layer_view():
    spec = KVWriteSpec(kv_heads=2, head_dim=16)
    arrays = spec.sample(np.random.default_rng(2), {"m": 3, "pages": 2})
    ref = spec.reference(arrays)["cache"]
    flat = ref.reshape(-1, 32)
    np.testing.assert_array_equal(flat[arrays["slots"]], arrays["rows"])
    untouched = np.setdiff1d(np.arange(32), arrays["slots"])
    np.testing.assert_array_equal(flat[untouched], arrays["cache"].reshape(-1, 32)[untouched])


def test_spec_contract():
    spec = KVWriteSpec(kv_heads=8, head_dim=128)
    assert spec.name == "kv_write_kv8_d128"
    assert KVWriteSpec(kv_heads=8, head_dim=128, page_size=32).name == "kv_write_kv8_d128_p32"
    assert [(p.name, p.shape, p.role) for p in spec.params()] == [
        ("cache", ("pages", 16, 8, 128), "inout"),
        ("rows", ("m", 1024), "in"),
        ("slots", ("m",), "in"),
    ]
    assert [p.name for p in spec.prim_func().params] == [p.name for p in spec.params()]
    assert spec.variables() == ("pages", "m")
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(ScheduleError, match="head_dim must be positive"):
        KVWriteSpec(kv_heads=8, head_dim=0)
    with pytest.raises(ScheduleError, match="distinct slots"):
        spec.sample(np.random.default_rng(0), {"m": 33, "pages": 2})


def test_module_imports_without_tvm():
    code = "import sys, dflash_compiler.schedules.kv_write; assert 'tvm' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=60)


# -------------------------------------------------------------------------------------------- rule


def _op(layer: int = 3, which: int = 1, cache_dtype: str = BF16, width: int = 1024, slots: str = "int32") -> OpInstance:
    """`l3.write_v = kv_write(%l3.write_k, %l3.ctx_v, %ctx_slots)` as qwen3-8b's append_context dump has it."""
    cache = TensorType(cache_dtype, (5, 2, "pages", 16, 8, 128))
    node = Node.make(Op.KV_WRITE, [cache], layer=layer, page_size=16, which=which)
    return OpInstance(f"l{layer}.write_v", node, (cache, TensorType(BF16, ("ctx", width)), TensorType(slots, ("ctx",))))


def test_rule_recognises_the_graph_node_and_binds_one_layer_view():
    rule = KVWriteRule()
    op = _op()
    assert rule.spec_of(op) == KVWriteSpec(kv_heads=8, head_dim=128)
    assert rule.views(op) == {"cache": (3, 1)}
    assert rule.views(_op(layer=0, which=0)) == {"cache": (0, 0)}
    kernel = rule.apply(op, SM90)
    assert kernel is not None and kernel.name == "kv_write_kv8_d128" and kernel.rule == "kv_write"
    assert dict(kernel.knobs) == {"threads": 256, "vector_bytes": 16}
    assert kernel.func.attrs["tirx.is_scheduled"]


@pytest.mark.parametrize(
    "subject",
    [
        _op(cache_dtype="float32"),
        _op(width=512),
        _op(slots="int64"),
        OpInstance("x", Node.make(Op.MATMUL, [TensorType(BF16, ("m", 8))]), (TensorType(BF16, ("m", 8)),)),
        Node.make(Op.KV_WRITE, [TensorType(BF16, (1, 2, "pages", 16, 8, 128))], layer=0, which=0, page_size=16),
        None,
    ],
    ids=["f32-cache", "width-mismatch", "int64-slots", "matmul", "bare-node", "none"],
)
def test_rule_declines_other_work(subject):
    assert KVWriteRule().spec_of(subject) is None
    assert KVWriteRule().apply(subject, SM90) is None


@pytest.mark.parametrize(
    ("knobs", "message"),
    [({"threads": 48}, "multiple of 32"), ({"vector_bytes": 3}, "2, 4, 8 or 16"), ({"rows": 2}, "unknown knob")],
)
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        KVWriteRule().apply(KVWriteSpec(kv_heads=8, head_dim=128), SM90, knobs)


# ----------------------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("spec", "knobs", "rows", "grid", "block", "vector"),
    [
        (KVWriteSpec(kv_heads=8, head_dim=128), {}, 37, 19, 256, "uint4"),  # 37 rows x 128 copies / 256
        (KVWriteSpec(kv_heads=2, head_dim=16), {"threads": 64}, 5, 1, 64, "uint4"),
        (KVWriteSpec(kv_heads=3, head_dim=12), {}, 9, 1, 256, "nv_bfloat164"),
    ],
)
def test_lowered_launch_shape(target, spec, knobs, rows, grid, block, vector):
    kernel = KVWriteRule().apply(spec, target, knobs)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
    (launch,) = cuda.functions[kernel.name].kernels
    assert launch.launch_dims({"m": rows, "pages": 4}) == ((grid, 1, 1), (block, 1, 1), 0)
    assert f"*({vector}*)(cache_ptr" in cuda.source  # whole-vector stores into the page
    assert cuda.functions[kernel.name].workspaces == ()


def test_nvrtc_compiles_for_sm90a():
    from dflash_compiler.cubin import cubin_arch
    from dflash_compiler.nvrtc import compile_cubin

    kernels = [KVWriteRule().apply(s, SM90) for s in (KVWriteSpec(8, 128), KVWriteSpec(3, 12))]
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), SM90)
    cubin = compile_cubin(cuda.source, "sm_90a")
    assert cubin_arch(cubin) == "sm_90a"
    for name in cuda.kernel_names():
        assert name.encode() + b"\0" in cubin


# ------------------------------------------------------------------- kv_writes: every target in one launch

QWEN_CONTEXT = tuple((layer, which) for layer in range(5) for which in (0, 1))  # fuse_kv_writes on qwen3-8b


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        (KVWritesSpec(layers=5, kv_heads=8, head_dim=128, targets=QWEN_CONTEXT), {"m": 7, "pages": 3}),
        (KVWritesSpec(layers=2, kv_heads=2, head_dim=16, targets=((1, 1), (0, 0), (1, 0))), {"m": 5, "pages": 2}),
        (KVWritesSpec(layers=1, kv_heads=3, head_dim=12, targets=((0, 0), (0, 1))), {"m": 9, "pages": 3}),
    ],
    ids=["qwen3-8b-context", "out-of-order", "odd-heads"],
)
def test_kv_writes_llvm_matches_interpreter(spec, sizes):
    """The CPU build of the same TVMScript as the CUDA kernel (serial loops) against the interpreter, which
    is the chain of single writes fuse_kv_writes replaced."""
    got = assert_spec_matches_numpy(spec, sizes, seed=sizes["m"])["cache"]
    arrays = spec.sample(np.random.default_rng(sizes["m"]), sizes)
    flat = got.reshape(spec.layers, 2, -1, spec.width)
    for j, (layer, which) in enumerate(spec.targets):
        np.testing.assert_array_equal(flat[layer, which][arrays["slots"]], arrays[f"rows{j}"])


def test_kv_writes_rule_takes_the_fused_node_with_the_whole_cache():
    cache = TensorType(BF16, (5, 2, "pages", 16, 8, 128))
    rows = [TensorType(BF16, ("ctx", 1024))] * 10
    node = Node.make(Op.KV_WRITES, [cache], targets=QWEN_CONTEXT, page_size=16)
    op = OpInstance("l4.write_v", node, (cache, TensorType("int32", ("ctx",)), *rows))
    rule = KVWriteRule()
    spec = rule.spec_of(op)
    assert spec == KVWritesSpec(layers=5, kv_heads=8, head_dim=128, targets=QWEN_CONTEXT)
    assert rule.views(op) == {}
    assert [p.name for p in spec.params()] == ["cache", "slots", *(f"rows{j}" for j in range(10))]
    kernel = rule.apply(op, SM90)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    (launch,) = cuda.functions[kernel.name].kernels
    # 10 targets x 7 rows x 128 16-byte copies over 256-thread blocks
    assert launch.launch_dims({"m": 7, "pages": 4}) == ((35, 1, 1), (256, 1, 1), 0)
    assert cuda.source.count("*(uint4*)(cache_ptr") == 10
    with pytest.raises(ScheduleError, match="targets"):
        KVWritesSpec(layers=2, kv_heads=8, head_dim=128, targets=((2, 0),))
    from dflash_compiler.cubin import cubin_arch
    from dflash_compiler.nvrtc import compile_cubin

    assert cubin_arch(compile_cubin(cuda.source, "sm_90a")) == "sm_90a"
