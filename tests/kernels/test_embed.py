"""Embed family (embed, block_ids, drop_anchor): llvm build vs the graph's numpy semantics, node
recognition, size bindings, CUDA lowering for SM90/SM121 and one NVRTC compile for sm_90a.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.elementwise import ElementwiseSpec
from dflash_compiler.schedules.embed import BlockIdsSpec, DropAnchorSpec, EmbedRule, EmbedSpec
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
DRAFTS = "nb*(blk-1)"


# --------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        (EmbedSpec(512, 64), {"m": 7}),
        (EmbedSpec(100, 37, scale=2.5), {"m": 5}),  # odd hidden: scalar accesses; scaled
        (EmbedSpec(300, 48, scale=0.5, table_dtype="float32"), {"m": 1}),  # f32 table, bf16 rows
        (EmbedSpec(8192, 4096), {"m": 16}),
        (EmbedSpec(512, 64, scale=2.0, block=8, mask_token_id=500), {"nb": 3, "m": 24}),  # block_embed
        (EmbedSpec(300, 37, block=7, mask_token_id=0), {"nb": 5, "m": 35}),  # odd hidden, mask id 0
        (BlockIdsSpec(8, 500), {"nb": 3, "m": 24}),
        (BlockIdsSpec(16, 151669), {"nb": 1, "m": 16}),
        (BlockIdsSpec(7, 383), {"nb": 37, "m": 259}),  # more ids than one block of threads
        (DropAnchorSpec(7, 64), {"m": 21, "n": 18}),
        (DropAnchorSpec(16, 4096), {"m": 32, "n": 30}),
        (DropAnchorSpec(8, 33), {"m": 16, "n": 14}),  # odd hidden
        (DropAnchorSpec(2, 40, dtype="float32", out_dtype="float32"), {"m": 10, "n": 5}),
    ],
    ids=lambda v: v.name if hasattr(v, "name") else "-".join(f"{k}{n}" for k, n in v.items()),
)
def test_llvm_matches_numpy(spec, sizes):
    assert [p.name for p in spec.params()] == [p.name for p in spec.prim_func().params]
    assert set(spec.variables()) == set(sizes)
    assert_spec_matches_numpy(spec, sizes, seed=sum(sizes.values()))


def test_specs_travel_to_a_box_without_tvm():
    """The GPU check unpickles specs and runs sample/reference where TVM is not installed."""
    assert_imports_without_tvm("dflash_compiler.schedules.embed")
    block_embed = EmbedSpec(151936, 4096, block=16, mask_token_id=151669)
    for spec in (EmbedSpec(151936, 4096), block_embed, BlockIdsSpec(16, 151669), DropAnchorSpec(16, 4096)):
        assert pickle.loads(pickle.dumps(spec)) == spec
    assert EmbedSpec(151936, 4096).bytes_moved({"m": 64}) == 64 * (4 + 4096 * 4)  # the named rows, not the table
    assert DropAnchorSpec(16, 4096).bytes_moved({"m": 32, "n": 30}) == 30 * 4096 * 4


def test_gathers_and_drops_are_exact_copies():
    spec = EmbedSpec(64, 16)
    arrays = spec.sample(np.random.default_rng(1), {"m": 9})
    np.testing.assert_array_equal(run_llvm(spec, arrays)["y"], arrays["table"][arrays["ids"]])
    drop = DropAnchorSpec(4, 16)
    arrays = drop.sample(np.random.default_rng(2), {"m": 12, "n": 9})
    expected = arrays["x"].reshape(3, 4, 16)[:, 1:].reshape(9, 16)
    np.testing.assert_array_equal(run_llvm(drop, arrays)["y"], expected)


def test_block_ids_layout():
    spec = BlockIdsSpec(4, 99)
    got = run_llvm(spec, {"anchors": np.array([5, 6, 7], np.int32), "ids": np.zeros(12, np.int32)})["ids"]
    np.testing.assert_array_equal(got, [5, 99, 99, 99, 6, 99, 99, 99, 7, 99, 99, 99])


def test_block_embed_gathers_the_block_ids_rows():
    """block_embed's rows are embed's of block_ids' ids: the anchor's row, then the mask token's."""
    spec = EmbedSpec(128, 16, block=4, mask_token_id=99)
    table = EmbedSpec(128, 16).sample(np.random.default_rng(3), {"m": 1})["table"]
    anchors = np.array([5, 6, 7], np.int32)
    got = run_llvm(spec, {"anchors": anchors, "table": table, "y": np.zeros((12, 16), table.dtype)})["y"]
    ids = run_llvm(BlockIdsSpec(4, 99), {"anchors": anchors, "ids": np.zeros(12, np.int32)})["ids"]
    np.testing.assert_array_equal(got, table[ids])
    assert spec.name == "embed_b4_mask99_v128_h16" and [p.name for p in spec.params()] == ["anchors", "table", "y"]
    assert spec.bytes_moved({"nb": 3, "m": 12}) == 3 * 4 + 12 * 16 * 4  # the anchors, not the ids


def test_embed_sample_of_a_real_table_is_cheap_and_valid():
    spec = EmbedSpec(8192, 4096)
    arrays = spec.sample(np.random.default_rng(0), {"m": 64})
    table = arrays["table"].astype(np.float32)
    assert np.all((np.abs(table) >= 1) & (np.abs(table) < 2))
    assert arrays["ids"].min() >= 0 and arrays["ids"].max() < 8192
    ref = spec.reference(arrays)["y"]  # the reference reads only the named rows
    np.testing.assert_array_equal(ref, table[arrays["ids"]])


@pytest.mark.parametrize(
    ("spec", "sizes", "message"),
    [
        (BlockIdsSpec(8, 500), {"nb": 2, "m": 15}, "bind m = nb \\* block"),
        (EmbedSpec(512, 64, block=8, mask_token_id=5), {"nb": 2, "m": 15}, "bind m = nb \\* block"),
        (DropAnchorSpec(8, 64), {"m": 15, "n": 14}, "m=15 and n=14, expected m = nb \\* 8 and n = nb \\* 7"),
        (DropAnchorSpec(8, 64), {"m": 16, "n": 15}, "bind m = nb \\* block and n = nb \\* \\(block - 1\\)"),
    ],
)
def test_sample_refuses_inconsistent_sizes(spec, sizes, message):
    with pytest.raises(ScheduleError, match=message):
        spec.sample(np.random.default_rng(0), sizes)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EmbedSpec(248320, 10240), "more than 2\\^31 elements"),
        (lambda: EmbedSpec(0, 64), "positive sizes"),
        (lambda: EmbedSpec(64, 64, table_dtype="int8"), "dtype int8 not supported"),
        (lambda: BlockIdsSpec(1, 5), "at least 2"),
        (lambda: BlockIdsSpec(8, -1), "non-negative int32"),
        (lambda: EmbedSpec(64, 64, block=1, mask_token_id=5), "at least 2"),
        (lambda: EmbedSpec(64, 64, block=8, mask_token_id=64), "past the table's 64 rows"),
        (lambda: DropAnchorSpec(1, 64), "at least 2"),
        (lambda: DropAnchorSpec(8, 0), "hidden size must be positive"),
    ],
)
def test_spec_validation(make, message):
    with pytest.raises(ScheduleError, match=message):
        make()


# ------------------------------------------------------------------------------------------ the rule


def _inst(op: Op, out: TensorType, *inputs: TensorType, **attrs) -> OpInstance:
    return OpInstance(f"n.{op.value}", Node.make(op, [out], **attrs), tuple(inputs))


REAL_NODES = [  # as in /tmp/dump/*/10_plan_memory.propose.txt
    (
        _inst(
            Op.EMBED, TensorType(BF16, (ROWS, 4096)), TensorType("int32", (ROWS,)), TensorType(BF16, (151936, 4096)),
            scale=1,
        ),
        "embed_v151936_h4096",
    ),
    (
        _inst(Op.EMBED, TensorType(BF16, (ROWS, 64)), TensorType("int32", (ROWS,)), TensorType(BF16, (512, 64)),
              scale=1),
        "embed_v512_h64",
    ),
    (
        _inst(Op.BLOCK_IDS, TensorType("int32", (ROWS,)), TensorType("int32", ("nb",)), block=16,
              mask_token_id=151669),
        "block_ids_b16_mask151669",
    ),
    (
        _inst(Op.BLOCK_EMBED, TensorType(BF16, (ROWS, 4096)), TensorType("int32", ("nb",)),
              TensorType(BF16, (151936, 4096)), block=16, mask_token_id=151669, scale=1.0),
        "embed_b16_mask151669_v151936_h4096",
    ),
    (
        _inst(Op.DROP_ANCHOR, TensorType(BF16, (DRAFTS, 4096)), TensorType(BF16, (ROWS, 4096)), block=16),
        "drop_anchor_b16_h4096",
    ),
    (
        _inst(Op.DROP_ANCHOR, TensorType(BF16, (DRAFTS, 5120)), TensorType(BF16, (ROWS, 5120)), block=8),
        "drop_anchor_b8_h5120",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("inst", "name"), REAL_NODES, ids=[n for _, n in REAL_NODES])
def test_rule_recognises_real_nodes(inst, name):
    assert_rule_schedules_node(EmbedRule(), inst, SM121, name, {"threads": 256, "vector_bytes": 16})


@pytest.mark.parametrize(
    "subject",
    [
        _inst(Op.EMBED, TensorType(BF16, (ROWS, 64)), TensorType("int64", (ROWS,)), TensorType(BF16, (512, 64)),
              scale=1),
        _inst(Op.EMBED, TensorType(BF16, (ROWS, 64)), TensorType("int32", (ROWS,)), TensorType(BF16, ("v", 64)),
              scale=1),
        _inst(Op.EMBED, TensorType(BF16, (ROWS, 10240)), TensorType("int32", (ROWS,)),
              TensorType(BF16, (248320, 10240)), scale=1),
        _inst(Op.EMBED, TensorType(BF16, ("ctx", 64)), TensorType("int32", (ROWS,)), TensorType(BF16, (512, 64)),
              scale=1),
        _inst(Op.BLOCK_IDS, TensorType("int32", (ROWS,)), TensorType("int32", ("nb",)), block=1, mask_token_id=5),
        _inst(Op.BLOCK_IDS, TensorType("float32", (ROWS,)), TensorType("int32", ("nb",)), block=8, mask_token_id=5),
        _inst(Op.DROP_ANCHOR, TensorType("float16", (DRAFTS, 64)), TensorType("float16", (ROWS, 64)), block=8),
        _inst(Op.DROP_ANCHOR, TensorType(BF16, (DRAFTS, 32)), TensorType(BF16, (ROWS, 64)), block=8),
        _inst(Op.SLICE, TensorType(BF16, (ROWS, 32)), TensorType(BF16, (ROWS, 64)), start=0, stop=32),
        ElementwiseSpec(Op.ADD, 8, arity=2),
        Node.make(Op.EMBED, [TensorType(BF16, (ROWS, 64))], scale=1),
        None,
    ],
    ids=["int64-ids", "symbolic-vocab", "int32-overflow", "rows-differ", "block-1", "f32-ids", "f16",
         "width-changes", "slice", "other-spec", "bare-node", "none"],
)  # fmt: skip
def test_rule_declines_other_work(subject):
    assert EmbedRule().spec_of(subject) is None
    assert EmbedRule().apply(subject, SM90) is None


def test_default_knobs_and_bad_knobs():
    small = SM90.model_copy(update={"max_threads_per_block": 512})
    assert EmbedRule().default_knobs(small) == {"threads": 128, "vector_bytes": 16}
    with pytest.raises(ScheduleError, match="multiple of 32"):
        EmbedRule().apply(BlockIdsSpec(8, 5), SM90, {"threads": 100})
    with pytest.raises(ScheduleError, match="vector_bytes=32"):
        EmbedRule().apply(EmbedSpec(64, 64), SM90, {"vector_bytes": 32})


# ------------------------------------------------------------------------------------ CUDA lowering

LOWERED = [  # (spec, knobs, grid, block, vector access expected in the source)
    (EmbedSpec(151936, 4096), {}, ("m", "2", "1"), ("256", "1", "1"), "uint4"),
    (EmbedSpec(100, 37, scale=2.5), {}, ("m", "1", "1"), ("64", "1", "1"), None),
    (EmbedSpec(151936, 4096, block=16, mask_token_id=151669), {}, ("m", "2", "1"), ("256", "1", "1"), "uint4"),
    (BlockIdsSpec(16, 151669), {}, ("((m + 255) // 256)", "1", "1"), ("256", "1", "1"), None),
    (BlockIdsSpec(7, 500), {"threads": 64}, ("((m + 63) // 64)", "1", "1"), ("64", "1", "1"), None),
    (DropAnchorSpec(16, 4096), {}, ("n", "2", "1"), ("256", "1", "1"), "uint4"),
    (DropAnchorSpec(8, 64), {"vector_bytes": 4}, ("n", "1", "1"), ("32", "1", "1"), "nv_bfloat162"),
]


@pytest.fixture(scope="module")
def lowered():
    """The family's module lowered once per target."""
    return lowered_per_target(EmbedRule(), LOWERED)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(("spec", "knobs", "grid", "block", "vector"), LOWERED, ids=[s.name for s, *_ in LOWERED])
def test_lowered_launch_shape(lowered, target, spec, knobs, grid, block, vector):
    func = lowered(target).functions[spec.name]
    (launch,) = func.kernels  # one launch per node
    assert launch.grid == grid and launch.block == block
    assert launch.dynamic_smem == "0"
    assert func.workspaces == ()
    assert set(func.variables) == set(spec.variables())
    body = kernel_body(lowered(target).source, spec.name)
    for size in re.findall(r"alignas\(\d+\) \w+ \w+_local_ptr\[(\d+)\]", body):
        assert int(size) <= 16  # one vector in registers; never a row-sized or symbolic local array
    if vector is not None:
        assert f"*({vector}*)" in body


def test_nvrtc_compiles_the_family_for_sm90a(lowered):
    assert_nvrtc_builds(lowered(SM90))
