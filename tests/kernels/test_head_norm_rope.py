"""Per-head family (head_rmsnorm, rope): llvm build vs the graph's numpy semantics for head dims 16, 64,
128 and 256, node recognition, knobs, CUDA lowering for SM90/SM121 and one NVRTC compile for sm_90a.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.elementwise import ElementwiseSpec
from dflash_compiler.schedules.head_norm_rope import HeadNormRopeRule, HeadRMSNormSpec, HeadRopeSpec, head_layout
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

BF16 = "bfloat16"
ROWS = "nb*blk"
EPS = 1e-6


# --------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (HeadRMSNormSpec(4, 16, EPS), 7),
        (HeadRMSNormSpec(3, 64, 1e-5), 5),
        (HeadRMSNormSpec(32, 128, EPS), 3),
        (HeadRMSNormSpec(1, 256, EPS), 1),
        (HeadRMSNormSpec(5, 24, EPS), 2),  # head_dim not a power of two
        (HeadRopeSpec(4, 16), 7),
        (HeadRopeSpec(3, 64, attention_factor=0.7), 5),
        (HeadRopeSpec(32, 128), 3),
        (HeadRopeSpec(2, 256, attention_factor=1.2), 2),
        (HeadRopeSpec(3, 6), 4),  # odd half: scalar accesses
    ],
    ids=lambda v: v.name if hasattr(v, "name") else str(v),
)
def test_llvm_matches_numpy(spec, rows):
    assert [p.name for p in spec.params()] == [p.name for p in spec.prim_func().params]
    assert spec.variables() == ("m",)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=spec.head_dim + rows)


def test_specs_travel_to_a_box_without_tvm():
    """The GPU check unpickles specs and runs sample/reference where TVM is not installed."""
    assert_imports_without_tvm("dflash_compiler.schedules.head_norm_rope")
    for spec in (HeadRMSNormSpec(32, 128, EPS), HeadRopeSpec(8, 128, attention_factor=0.5)):
        assert pickle.loads(pickle.dumps(spec)) == spec


def test_heads_are_normalised_independently():
    spec = HeadRMSNormSpec(2, 16, EPS)
    arrays = spec.sample(np.random.default_rng(0), {"m": 1})
    x = np.concatenate([np.full(16, 0.5), np.full(16, 8.0)]).astype(arrays["x"].dtype)[None]
    arrays.update(x=x, w=np.ones(16, x.dtype))
    got = run_llvm(spec, arrays)["y"].astype(np.float32)
    np.testing.assert_allclose(got, np.ones((1, 32)), rtol=4e-3)  # each head scaled by its own rms


def test_rope_at_position_zero_is_the_attention_factor():
    spec = HeadRopeSpec(2, 8, attention_factor=0.5)
    arrays = spec.sample(np.random.default_rng(0), {"m": 2})
    arrays["positions"] = np.zeros(2, np.int32)
    got = run_llvm(spec, arrays)["y"].astype(np.float32)
    np.testing.assert_allclose(got, arrays["x"].astype(np.float32) * 0.5, rtol=4e-3)


def test_spec_validation():
    with pytest.raises(ScheduleError, match="eps must be positive"):
        HeadRMSNormSpec(4, 16, 0.0)
    with pytest.raises(ScheduleError, match="even head_dim"):
        HeadRopeSpec(4, 15)
    with pytest.raises(ScheduleError, match="positive sizes"):
        HeadRMSNormSpec(0, 16, EPS)


# ------------------------------------------------------------------------------------------ the rule


def _act(width: int | str, rows: str = ROWS, dtype: str = BF16) -> TensorType:
    return TensorType(dtype, (rows, width))


def _norm(width: int | str, head_dim: int, rows: str = ROWS, weight: int | None = None, dtype: str = BF16):
    node = Node.make(Op.HEAD_RMSNORM, [_act(width, rows, dtype)], eps=EPS, head_dim=head_dim)
    inputs = (_act(width, rows, dtype), TensorType(BF16, (weight or head_dim,)))
    return OpInstance("l0.q_norm", node, inputs)


def _rope(width: int | str, head_dim: int, rows: str = ROWS, positions: str = "int32", table: int | None = None):
    node = Node.make(Op.ROPE, [_act(width, rows)], attention_factor=1, head_dim=head_dim)
    inputs = (_act(width, rows), TensorType(positions, (rows,)), TensorType("float32", (table or head_dim // 2,)))
    return OpInstance("l0.q_rope", node, inputs)


REAL_NODES = [  # as in /tmp/dump/*/06_select_rope.*.txt (qwen3-8b-dflash-b16, tiny-dflash), before fuse_head_prep
    (_norm(4096, 128), "head_rmsnorm_h32_d128"),
    (_norm(1024, 128, rows="ctx"), "head_rmsnorm_h8_d128"),
    (_norm(64, 16), "head_rmsnorm_h4_d16"),
    (_rope(4096, 128), "rope_h32_d128"),
    (_rope(1024, 128, rows="ctx"), "rope_h8_d128"),
    (_rope(32, 16), "rope_h2_d16"),
]


@pytest.mark.parametrize(("inst", "name"), REAL_NODES, ids=[n for _, n in REAL_NODES])
def test_rule_recognises_real_nodes(inst, name):
    assert_rule_schedules_node(HeadNormRopeRule(), inst, SM90, name, {"threads": 256, "vector_bytes": 16})


@pytest.mark.parametrize(
    "subject",
    [
        _norm(4096, 128, dtype="float32"),
        _norm(4000, 128),  # not whole heads
        _norm("w", 128),
        _norm(4096, 128, weight=4096),
        _rope(4096, 128, positions="int64"),
        _rope(4096, 128, table=128),
        _rope(60, 15),  # odd head_dim
        OpInstance("r", Node.make(Op.ROPE, [_act(64)], head_dim=16, rope=(("theta", 1e4),)), (_act(64), _act(1))),
        OpInstance("s", Node.make(Op.SILU_MUL, [_act(64)]), (_act(128),)),
        ElementwiseSpec(Op.ADD, 8, arity=2),
        "rope",
    ],
    ids=["f32", "partial-head", "symbolic-width", "weight-shape", "int64-positions", "table-length", "odd-head-dim",
         "table-less-rope", "silu-mul", "other-spec", "string"],
)  # fmt: skip
def test_rule_declines_other_work(subject):
    assert HeadNormRopeRule().spec_of(subject) is None
    assert HeadNormRopeRule().apply(subject, SM90) is None


@pytest.mark.parametrize(
    ("heads", "head_dim", "parts", "knobs", "vector", "lanes", "per_block"),
    [
        (32, 128, 1, {}, 8, 16, 16),
        (8, 128, 1, {}, 8, 16, 8),
        (4, 16, 1, {}, 8, 2, 4),
        (32, 128, 2, {}, 8, 8, 32),
        (40, 128, 2, {}, 8, 8, 20),  # whole heads per block: 40 = 2 x 20
        (7, 256, 1, {"threads": 64}, 8, 32, 1),  # two heads fit, but 7 is prime: one per block
        (32, 128, 1, {"vector_bytes": 4}, 2, 64, 4),
    ],
)
def test_head_layout(heads, head_dim, parts, knobs, vector, lanes, per_block):
    layout = head_layout("t", SM90, {"threads": 256, "vector_bytes": 16, **knobs}, heads, head_dim, parts)
    assert (layout.vector, layout.lanes, layout.heads_per_block) == (vector, lanes, per_block)


def test_knobs_are_checked():
    with pytest.raises(ScheduleError, match="needs 128 lanes"):
        HeadNormRopeRule().apply(HeadRMSNormSpec(8, 256, EPS), SM90, {"threads": 64, "vector_bytes": 4})
    with pytest.raises(ScheduleError, match="multiple of 32"):
        HeadNormRopeRule().apply(HeadRopeSpec(8, 128), SM90, {"threads": 40})
    small = SM121.model_copy(update={"max_threads_per_block": 512})
    assert HeadNormRopeRule().default_knobs(small) == {"threads": 128, "vector_bytes": 16}


# ------------------------------------------------------------------------------------ CUDA lowering

LOWERED = [  # (spec, knobs, grid, block)
    (HeadRMSNormSpec(32, 128, EPS), {}, ("m", "2", "1"), ("16", "16", "1")),
    (HeadRMSNormSpec(8, 128, EPS), {}, ("m", "1", "1"), ("16", "8", "1")),
    (HeadRMSNormSpec(4, 16, EPS), {}, ("m", "1", "1"), ("2", "4", "1")),
    (HeadRMSNormSpec(16, 64, EPS), {}, ("m", "1", "1"), ("8", "16", "1")),
    (HeadRMSNormSpec(2, 256, 1e-5), {}, ("m", "1", "1"), ("32", "2", "1")),
    (HeadRMSNormSpec(8, 128, 1e-5), {"vector_bytes": 2}, ("m", "4", "1"), ("128", "2", "1")),  # cross-warp sum
    (HeadRopeSpec(32, 128), {}, ("m", "1", "1"), ("8", "32", "1")),
    (HeadRopeSpec(8, 128), {}, ("m", "1", "1"), ("8", "8", "1")),
    (HeadRopeSpec(4, 16), {}, ("m", "1", "1"), ("1", "4", "1")),
    (HeadRopeSpec(16, 64, attention_factor=0.7), {}, ("m", "1", "1"), ("4", "16", "1")),
    (HeadRopeSpec(4, 256), {"threads": 32}, ("m", "2", "1"), ("16", "2", "1")),
    (HeadRMSNormSpec(5, 24, EPS), {}, ("m", "1", "1"), ("3", "5", "1")),  # 3 lanes per head
    (HeadRopeSpec(3, 6), {}, ("m", "1", "1"), ("3", "3", "1")),  # scalar accesses
    (HeadRopeSpec(4, 64), {"vector_bytes": 2}, ("m", "1", "1"), ("32", "4", "1")),
]


@pytest.fixture(scope="module")
def lowered():
    """The family's module lowered once per target."""
    return lowered_per_target(HeadNormRopeRule(), LOWERED)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(("spec", "knobs", "grid", "block"), LOWERED, ids=[s.name for s, *_ in LOWERED])
def test_lowered_launch_shape(lowered, target, spec, knobs, grid, block):
    func = lowered(target).functions[spec.name]
    (launch,) = func.kernels  # one launch per node
    assert launch.grid == grid and launch.block == block
    assert launch.dynamic_smem == "0"
    assert func.workspaces == ()
    body = kernel_body(lowered(target).source, spec.name)
    for size in re.findall(r"alignas\(\d+\) \w+ \w+_local_ptr\[(\d+)\]", body):
        assert int(size) <= 16  # a lane's vectors of x in registers; never a head- or row-sized local array
    shared = [int(n) for n in re.findall(r"__shared__ alignas\(\d+\) \w+ \w+\[(\d+)\]", body)]
    if isinstance(spec, HeadRopeSpec):
        assert shared == [spec.head_dim // 2] * 2  # the row's cos and sin tables
        assert "__syncthreads" in body
    if knobs.get("vector_bytes", 16) == 16 and spec.head_dim % 16 == 0:
        assert "*(uint4*)(x_ptr" in body  # 16-byte loads of x


def test_nvrtc_compiles_the_family_for_sm90a(lowered):
    assert_nvrtc_builds(lowered(SM90))
