"""DFlash2 family (CONV2, SELECTOR): llvm builds match numpy, the rule's choices, CUDA lowering, NVRTC.

The CUDA schedule's index math runs only on a GPU (the lead's bundle check); here it is lowered for SM90
and SM121, its launch shape checked, and the family's module compiled once with NVRTC for sm_90a.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules import ScheduleError
from dflash_compiler.schedules.base import OpInstance
from dflash_compiler.schedules.dflash2 import Conv2Spec, DFlash2Rule, SelectorSpec
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
ml_dtypes = pytest.importorskip("ml_dtypes")

from kernel_harness import assert_spec_matches_numpy, kernel_body, lowered_per_target, run_llvm  # noqa: E402

BF16, F32, I32 = "bfloat16", "float32", "int32"
BLOCK_ROWS, DRAFT_ROWS = "nb*blk", "nb*(blk-1)"


# ------------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (Conv2Spec(width=64, kernel=2, group=16, block=8, tap=0), 16),  # tiny-dflash2
        (Conv2Spec(width=64, kernel=2, group=16, block=8, tap=1), 8),
        (Conv2Spec(width=5120, kernel=2, group=16, block=8, tap=1), 24),  # Qwen3.8-27B-DFlash2
        (Conv2Spec(width=99, kernel=3, group=33, block=5, tap=0), 15),  # odd sizes, three taps
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_conv2_matches_numpy(spec, rows):
    assert spec.variables() == ("m",)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=rows)


def test_conv2_never_reaches_across_a_block():
    """Row 0 of each block sees only itself: with zero dynamic taps the output is base[tap, 0] * x there."""
    spec = Conv2Spec(width=32, kernel=2, group=16, block=4, tap=1)
    rng = np.random.default_rng(1)
    arrays = spec.sample(rng, {"m": 8})
    arrays["dyn"][:] = 0
    arrays["x"][4] = 1  # a block start: the row before it (another block) must not leak in
    got = run_llvm(spec, arrays)["y"].astype(np.float32)
    expected = (arrays["base"][1, 0].astype(np.float32) * arrays["x"][4].astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got[4], expected.astype(np.float32))


@pytest.mark.parametrize(
    ("spec", "seqs"),
    [
        (SelectorSpec(vocab=384, top_k=5, rank=8, block=8), 2),  # tiny-dflash2
        (SelectorSpec(vocab=3001, top_k=16, rank=256, block=8), 3),  # Qwen3.8-27B-DFlash2's k and rank
        (SelectorSpec(vocab=997, top_k=3, rank=13, block=4), 5),  # odd sizes
        (SelectorSpec(vocab=50, top_k=7, rank=40, block=2), 1),  # one draft per sequence
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_selector_matches_numpy(spec, seqs):
    assert spec.variables() == ("m", "nb")
    assert_spec_matches_numpy(spec, {"m": seqs * spec.gamma, "nb": seqs}, seed=seqs)


def test_selector_walk_depends_on_the_previous_pick():
    """Changing only the anchor changes the later picks: the walk is not a per-row argmax of the values."""
    spec = SelectorSpec(vocab=300, top_k=8, rank=32, block=6)
    arrays = spec.sample(np.random.default_rng(5), {"m": 5 * 4, "nb": 4})
    arrays["values"][:] = 0  # only the codebook term decides
    first = run_llvm(spec, arrays)["tokens"]
    arrays["anchors"] = (arrays["anchors"] + 1) % spec.vocab
    second = run_llvm(spec, arrays)["tokens"]
    assert np.any(first != second)
    np.testing.assert_array_equal(second, spec.reference(arrays)["tokens"])


def test_selector_ties_pick_the_lowest_slot():
    spec = SelectorSpec(vocab=100, top_k=6, rank=8, block=3)
    arrays = spec.sample(np.random.default_rng(2), {"m": 4, "nb": 2})
    arrays["values"][:] = 1.5  # every score ties: the codebooks add zero
    arrays["succ"][:] = 0
    got = run_llvm(spec, arrays)["tokens"]
    np.testing.assert_array_equal(got, arrays["ids"][:, 0])
    np.testing.assert_array_equal(got, spec.reference(arrays)["tokens"])


# ------------------------------------------------------------------------------------------- the rule


def _conv2_node(width: int | str = 5120, dtype: str = BF16, tap: int = 0) -> OpInstance:
    groups = width // 16 if isinstance(width, int) else "g"
    node = Node.make(Op.CONV2, [TensorType(dtype, (BLOCK_ROWS, width))], block=8, group=16, kernel=2, tap=tap)
    inputs = (
        TensorType(dtype, (BLOCK_ROWS, width)),
        TensorType(BF16, (BLOCK_ROWS, 4 * groups if isinstance(groups, int) else "d")),
        TensorType(BF16, (2, 2, width)),
    )
    return OpInstance("l0.attn_conv_in", node, inputs)


def _selector_node(vocab: int = 248320, k: int = 16, rank: int = 256, values: str = F32) -> OpInstance:
    node = Node.make(Op.SELECTOR, [TensorType(I32, (DRAFT_ROWS,))], block=8)
    inputs = (
        TensorType(values, (DRAFT_ROWS, k)),
        TensorType(I32, (DRAFT_ROWS, k)),
        TensorType(BF16, (DRAFT_ROWS, rank)),
        TensorType(I32, ("nb",)),
        TensorType(BF16, (vocab, rank)),
        TensorType(BF16, (vocab, rank)),
    )
    return OpInstance("selector", node, inputs)


def test_rule_recognises_the_real_nodes():
    rule = DFlash2Rule()
    assert rule.spec_of(_conv2_node()) == Conv2Spec(width=5120, kernel=2, group=16, block=8, tap=0)
    assert rule.spec_of(_conv2_node(64, tap=1)) == Conv2Spec(width=64, kernel=2, group=16, block=8, tap=1)
    assert rule.spec_of(_selector_node()) == SelectorSpec(vocab=248320, top_k=16, rank=256, block=8)
    assert rule.spec_of(_selector_node(384, 5, 8)) == SelectorSpec(vocab=384, top_k=5, rank=8, block=8)
    kernel = rule.apply(_selector_node(384, 5, 8), SM121)
    assert kernel is not None and kernel.name == "selector_v384_k5_r8_b8"
    assert [p.name for p in kernel.reference.params] == ["values", "ids", "hidden", "anchors", "pred", "succ", "tokens"]
    assert kernel.func.attrs["tirx.is_scheduled"]


@pytest.mark.parametrize(
    "subject",
    [
        _conv2_node(dtype=F32),
        _conv2_node(width="w"),
        _selector_node(values=BF16),
        _selector_node(k=600, vocab=300),
        OpInstance("x", Node.make(Op.ARGMAX, [TensorType(I32, (DRAFT_ROWS,))]), (TensorType(F32, (DRAFT_ROWS, 8)),)),
        "selector",
        None,
    ],
    ids=["conv2-f32", "conv2-symbolic", "selector-bf16-values", "selector-k>vocab", "argmax", "string", "none"],
)
def test_rule_declines_other_work(subject):
    assert DFlash2Rule().apply(subject, SM90) is None


@pytest.mark.parametrize(
    ("spec", "knobs", "message"),
    [
        (Conv2Spec(width=64, kernel=2, group=16, block=8, tap=0), {"threads": 40}, "multiple of 32"),
        (SelectorSpec(vocab=384, top_k=5, rank=8, block=8), {"lanes": 3}, "power of two"),
        (SelectorSpec(vocab=384, top_k=5, rank=8, block=8), {"lanes": 64}, "up to the warp size"),
        (SelectorSpec(vocab=4096, top_k=40, rank=256, block=8), {"lanes": 32}, "exceeds 1024 threads"),
        (SelectorSpec(vocab=384, top_k=5, rank=8, block=8), {"threads": 64.0}, "must be an int"),
    ],
)
def test_bad_knobs_are_refused(spec, knobs, message):
    with pytest.raises(ScheduleError, match=message):
        DFlash2Rule().apply(spec, SM90, knobs)


def test_spec_validation():
    with pytest.raises(ScheduleError, match="multiple of group"):
        Conv2Spec(width=100, kernel=2, group=16, block=8, tap=0)
    with pytest.raises(ScheduleError, match="tap must be 0 or 1"):
        Conv2Spec(width=64, kernel=2, group=16, block=8, tap=2)
    with pytest.raises(ScheduleError, match="exceeds the vocabulary"):
        SelectorSpec(vocab=4, top_k=5, rank=8, block=8)
    with pytest.raises(ScheduleError, match="m must be nb"):
        SelectorSpec(vocab=40, top_k=5, rank=8, block=8).sample(np.random.default_rng(0), {"m": 8, "nb": 2})


# ------------------------------------------------------------------------------------------- lowering

LOWERED = [  # (spec, knobs, grid, block)
    (Conv2Spec(width=5120, kernel=2, group=16, block=8, tap=0), {}, ("m", "20", "1"), ("256", "1", "1")),
    (Conv2Spec(width=64, kernel=2, group=16, block=8, tap=1), {}, ("m", "1", "1"), ("64", "1", "1")),
    (SelectorSpec(vocab=248320, top_k=16, rank=256, block=8), {}, ("nb", "1", "1"), ("16", "16", "1")),
    (SelectorSpec(vocab=384, top_k=5, rank=8, block=8), {}, ("nb", "1", "1"), ("8", "5", "1")),
]


@pytest.fixture(scope="module")
def lowered():
    return lowered_per_target(DFlash2Rule(), LOWERED)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(("spec", "knobs", "grid", "block"), LOWERED, ids=lambda x: getattr(x, "name", ""))
def test_one_kernel_per_node(lowered, target, spec, knobs, grid, block):
    cuda = lowered(target)
    func = cuda.functions[spec.name]
    (launch,) = func.kernels
    assert launch.grid == grid and launch.block == block
    assert launch.dynamic_smem == "0" and func.workspaces == ()
    assert func.variables == (("m",) if isinstance(spec, Conv2Spec) else ("m", "nb"))
    assert "2147483647" not in kernel_body(cuda.source, spec.name)  # no local array of symbolic size


def test_nvrtc_compiles_the_family(lowered):
    from kernel_harness import assert_nvrtc_builds

    assert_nvrtc_builds(lowered(SM90))
