"""Elementwise family (silu_mul, add, scale, softcap, slice): llvm build vs the graph's numpy semantics,
node recognition, knob handling, CUDA lowering for SM90/SM121 and one NVRTC compile for sm_90a.

The CUDA schedule's index math runs only on a GPU (the lead's H200 check from the spec); here the lowered
kernels' launch shapes, vector accesses and register arrays are checked.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.elementwise import ElementwiseRule, ElementwiseSpec, number_tag, vector_elements
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
pytest.importorskip("ml_dtypes")

from kernel_harness import (  # noqa: E402 - after the TVM skip
    assert_imports_without_tvm,
    assert_nvrtc_builds,
    assert_rule_schedules_node,
    assert_spec_matches_numpy,
    kernel_body,
    lowered_per_target,
    run_llvm,
)

F32 = "float32"
BF16 = "bfloat16"
ROWS = "nb*blk"
DRAFTS = "nb*(blk-1)"


def _silu(width: int, arity: int = 1) -> ElementwiseSpec:
    return ElementwiseSpec(Op.SILU_MUL, width, arity=arity)


def _slice(start: int, stop: int, source: int) -> ElementwiseSpec:
    return ElementwiseSpec(Op.SLICE, stop - start, in_width=source, attrs=(("start", start), ("stop", stop)))


# --------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (_silu(100), 1),
        (_silu(12288), 3),
        (_silu(37, arity=2), 7),  # odd width: scalar accesses
        (ElementwiseSpec(Op.ADD, 4096, arity=2), 5),
        (ElementwiseSpec(Op.ADD, 65, arity=2, out_dtype=F32), 3),  # bf16 in, f32 out
        (ElementwiseSpec(Op.SCALE, 384, F32, F32, attrs=(("factor", 0.2),)), 5),
        (ElementwiseSpec(Op.SCALE, 33, attrs=(("factor", -1.5),)), 2),
        (ElementwiseSpec(Op.SOFTCAP, 383, F32, F32, attrs=(("cap", 20),)), 4),
        (ElementwiseSpec(Op.SOFTCAP, 512, F32, F32, attrs=(("cap", 30.0),)), 1),
        (_slice(64, 96, 128), 6),
        (_slice(4096, 5120, 6144), 3),
        (_slice(3, 34, 50), 5),  # odd start and width
    ],
    ids=lambda v: v.name if isinstance(v, ElementwiseSpec) else str(v),
)
def test_llvm_matches_numpy(spec, rows):
    assert [p.name for p in spec.params()] == [p.name for p in spec.prim_func().params]
    assert spec.variables() == ("m",)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=spec.width + rows)


def test_specs_travel_to_a_box_without_tvm():
    """The GPU check unpickles specs and runs sample/reference where TVM is not installed."""
    assert_imports_without_tvm("dflash_compiler.schedules.elementwise")
    spec = _slice(4096, 5120, 6144)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.bytes_moved({"m": 16}) == 16 * 1024 * (2 + 2)  # only the sliced columns are read
    assert _silu(12288).bytes_moved({"m": 2}) == 2 * 12288 * (2 * 2 + 2)


def test_slice_is_an_exact_copy():
    spec = _slice(5, 40, 64)
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    arrays = spec.sample(np.random.default_rng(0), {"m": 3})
    arrays["x"] = x.astype(arrays["x"].dtype)

    got = run_llvm(spec, arrays)["y"]
    np.testing.assert_array_equal(got.astype(np.float32), x[:, 5:40])


def test_softcap_saturates_like_numpy():
    spec = ElementwiseSpec(Op.SOFTCAP, 4, F32, F32, attrs=(("cap", 20),))
    arrays = {"x": np.array([[-1e4, -20.0, 0.5, 1e4]], np.float32), "y": np.zeros((1, 4), np.float32)}

    got = run_llvm(spec, arrays)["y"]
    np.testing.assert_allclose(got, np.tanh(arrays["x"] / 20) * 20, rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------------------------------ the rule


def _inst(op: Op, out: TensorType, *inputs: TensorType, **attrs) -> OpInstance:
    return OpInstance(f"n.{op.value}", Node.make(op, [out], **attrs), tuple(inputs))


def _bf16(width: int | str, rows: str = ROWS) -> TensorType:
    return TensorType("bfloat16", (rows, width))


def _f32(width: int | str, rows: str = DRAFTS) -> TensorType:
    return TensorType(F32, (rows, width))


REAL_NODES = [  # as in /tmp/dump/*/10_plan_memory.*.txt (qwen3-8b-dflash-b16, qwen3.5-9b, tiny-dspark)
    (_inst(Op.SILU_MUL, _bf16(12288), _bf16(24576)), "silu_mul_w12288"),
    (_inst(Op.SILU_MUL, _bf16(17408), _bf16(34816)), "silu_mul_w17408"),
    (_inst(Op.SILU_MUL, _bf16(128), _bf16(128), _bf16(128)), "silu_mul2_w128"),
    (_inst(Op.SLICE, _bf16(1024), _bf16(6144), start=4096, stop=5120), "slice_w1024_of6144_at4096"),
    (_inst(Op.SLICE, _bf16(32, "ctx"), _bf16(128, "ctx"), start=96, stop=128), "slice_w32_of128_at96"),
    (_inst(Op.SCALE, _f32(384), _f32(384), factor=0.2), "scale_w384_factor0p2_f32"),
    (_inst(Op.SOFTCAP, _f32(384), _f32(384), cap=20), "softcap_w384_cap20_f32"),
    (_inst(Op.ADD, _bf16(4096), _bf16(4096), _bf16(4096)), "add_w4096"),
]


@pytest.mark.parametrize(("inst", "name"), REAL_NODES, ids=[n for _, n in REAL_NODES])
def test_rule_recognises_real_nodes(inst, name):
    assert_rule_schedules_node(ElementwiseRule(), inst, SM90, name, {"threads": 256, "vector_bytes": 16})


@pytest.mark.parametrize(
    "subject",
    [
        _inst(Op.MATMUL, _bf16(8), _bf16(16), TensorType(BF16, (8, 16))),
        _inst(Op.SILU_MUL, TensorType("int32", (ROWS, 8)), TensorType("int32", (ROWS, 16))),
        _inst(Op.SILU_MUL, _bf16(60), _bf16(100)),  # not gate|up
        _inst(Op.ADD, _bf16(8), _bf16(8), _f32(8, ROWS)),
        _inst(Op.ADD, _bf16("h"), _bf16("h"), _bf16("h")),
        _inst(Op.SCALE, TensorType("float16", (ROWS, 8)), TensorType("float16", (ROWS, 8)), factor=2.0),
        _inst(Op.SCALE, TensorType(F32, (8,)), TensorType(F32, (8,)), factor=2.0),  # 1-D
        _inst(Op.SLICE, _bf16(32), _bf16(64), start=48, stop=80),
        _inst(Op.SOFTCAP, _f32(8), _f32(8), cap=0.0),
        _inst(Op.SILU_MUL, _bf16(8), _bf16(16, "ctx")),  # rows differ
        Node.make(Op.ADD, [_bf16(8)]),  # a bare node: no input types
        "silu_mul",
        None,
    ],
    ids=[
        "matmul", "int32", "not-gate-up", "mixed-dtypes", "symbolic-width", "f16", "1d", "slice-out-of-range",
        "cap-0", "rows-differ", "bare-node", "string", "none",
    ],
)  # fmt: skip
def test_rule_declines_other_work(subject):
    assert ElementwiseRule().spec_of(subject) is None
    assert ElementwiseRule().apply(subject, SM90) is None


def test_default_knobs_read_capabilities_not_names():
    small = SM90.model_copy(update={"max_threads_per_block": 256})
    assert ElementwiseRule().default_knobs(small) == {"threads": 64, "vector_bytes": 16}
    assert ElementwiseRule().default_knobs(SM121) == {"threads": 256, "vector_bytes": 16}


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"tiles": 4}, "unknown knob"),
        ({"threads": 48}, "multiple of 32"),
        ({"threads": 2048}, "up to 1024"),
        ({"vector_bytes": 3}, r"expected one of \(2, 4, 8, 16\)"),
        ({"threads": 128.0}, "must be an int"),
    ],
)
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        ElementwiseRule().apply(_silu(4096), SM90, knobs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"op": Op.MATMUL, "width": 8}, "not one of"),
        ({"op": Op.ADD, "width": 8}, "1 inputs, expected 2"),
        ({"op": Op.SCALE, "width": 8}, "expected \\['factor'\\]"),
        ({"op": Op.SCALE, "width": 0, "attrs": (("factor", 1.0),)}, "width must be positive"),
        ({"op": Op.SLICE, "width": 8, "in_width": 16, "attrs": (("start", 4), ("stop", 20))}, "0 <= start"),
        ({"op": Op.SOFTCAP, "width": 8, "attrs": (("cap", -1.0),)}, "cap must be positive"),
        ({"op": Op.ADD, "width": 8, "arity": 2, "in_dtype": "int32"}, "dtype int32 not supported"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        ElementwiseSpec(**kwargs)


def test_names_are_unique_per_computation():
    names = {ElementwiseSpec(Op.SCALE, 8, attrs=(("factor", f),)).name for f in (0.2, 0.25, 2.0, -2.0, 1e-6, 0.1 + 0.2)}
    assert len(names) == 6
    assert number_tag(0.2) == "0p2" and number_tag(20) == "20" and number_tag(-1e-6) == "m1em06"
    assert _silu(8).name != _silu(8, arity=2).name
    assert ElementwiseSpec(Op.ADD, 8, arity=2).name != ElementwiseSpec(Op.ADD, 8, arity=2, out_dtype=F32).name


@pytest.mark.parametrize(
    ("vector_bytes", "dtypes", "extents", "expected"),
    [
        (16, ("bfloat16",), (12288,), 8),
        (16, ("float32",), (151936,), 4),
        (16, ("bfloat16", "float32"), (64,), 4),  # widest dtype decides
        (16, ("bfloat16",), (1024, 6144, 4096), 8),
        (16, ("bfloat16",), (36, 72, 4), 4),  # offset 4 limits the vector
        (16, ("bfloat16",), (31, 50, 3), 1),
        (4, ("bfloat16",), (4096,), 2),
        (2, ("float32",), (4096,), 1),
    ],
)
def test_vector_width(vector_bytes, dtypes, extents, expected):
    assert vector_elements(vector_bytes, dtypes, extents) == expected


# ------------------------------------------------------------------------------------ CUDA lowering

LOWERED = [  # (spec, knobs, grid, block, vector access expected in the source)
    (_silu(12288), {}, ("m", "6", "1"), ("256", "1", "1"), "uint4"),
    (_silu(37, arity=2), {}, ("m", "1", "1"), ("64", "1", "1"), None),
    (
        ElementwiseSpec(Op.ADD, 4096, arity=2),
        {"threads": 128, "vector_bytes": 8},
        ("m", "8", "1"),
        ("128", "1", "1"),
        "nv_bfloat164",
    ),
    (
        ElementwiseSpec(Op.SOFTCAP, 151936, F32, F32, attrs=(("cap", 30),)),
        {},
        ("m", "149", "1"),
        ("256", "1", "1"),
        "float4",
    ),
    (
        ElementwiseSpec(Op.SCALE, 384, F32, F32, attrs=(("factor", 0.2),)),
        {},
        ("m", "1", "1"),
        ("96", "1", "1"),
        "float4",
    ),
    (_slice(4096, 5120, 6144), {}, ("m", "1", "1"), ("128", "1", "1"), "uint4"),
    (_slice(3, 34, 50), {"vector_bytes": 2}, ("m", "1", "1"), ("32", "1", "1"), None),
]


@pytest.fixture(scope="module")
def lowered():
    """The family's module lowered once per target."""
    return lowered_per_target(ElementwiseRule(), LOWERED)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(("spec", "knobs", "grid", "block", "vector"), LOWERED, ids=[s.name for s, *_ in LOWERED])
def test_lowered_launch_shape(lowered, target, spec, knobs, grid, block, vector):
    cuda = lowered(target)
    func = cuda.functions[spec.name]
    (launch,) = func.kernels  # one launch per node
    assert launch.grid == grid and launch.block == block
    assert launch.dynamic_smem == "0"
    assert func.workspaces == ()
    body = kernel_body(cuda.source, spec.name)
    for size in re.findall(r"alignas\(\d+\) \w+ \w+_local_ptr\[(\d+)\]", body):
        assert int(size) <= 16  # one vector per tap in registers; never a row-sized or symbolic local array
    if vector is not None:
        assert f"*({vector}*)" in body


def test_nvrtc_compiles_the_family_for_sm90a(lowered):
    assert_nvrtc_builds(lowered(SM90))
