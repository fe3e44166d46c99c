"""DSpark family (MARKOV_WALK, CONFIDENCE): llvm builds match numpy, the rule's choices, CUDA lowering, NVRTC.

The CUDA schedule's index math runs only on a GPU (the lead's bundle check); here it is lowered for SM90
and SM121, its launch shape checked, and the family's module compiled once with NVRTC for sm_90a.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules import ScheduleError
from dflash_compiler.schedules.base import OpInstance
from dflash_compiler.schedules.dspark import ConfidenceSpec, DSparkRule, MarkovWalkSpec
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
pytest.importorskip("ml_dtypes")

from kernel_harness import assert_spec_matches_numpy, kernel_body, lowered_per_target, run_llvm  # noqa: E402

BF16, F32, I32 = "bfloat16", "float32", "int32"
ROWS = "nb*(blk-1)"


# ------------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "seqs"),
    [
        (MarkovWalkSpec(vocab=512, rank=16, block=7), 2),  # tiny-dspark: one chunk
        (MarkovWalkSpec(vocab=5001, rank=24, block=4, chunk=1024), 3),  # odd vocabulary over 5 chunks
        (MarkovWalkSpec(vocab=151936, rank=256, block=7), 1),  # Qwen3-8B-DSpark
        (MarkovWalkSpec(vocab=700, rank=8, block=16), 1),  # a 16-block: 15 sequential steps
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_markov_walk_matches_numpy(spec, seqs):
    assert spec.variables() == ("m", "nb")
    assert_spec_matches_numpy(spec, {"m": seqs * spec.gamma, "nb": seqs}, seed=seqs)


def test_markov_walk_follows_its_previous_token():
    """With flat logits the bias alone decides: a different anchor changes the whole walk."""
    spec = MarkovWalkSpec(vocab=900, rank=16, block=5)
    arrays = spec.sample(np.random.default_rng(4), {"m": 12, "nb": 3})
    arrays["logits"][:] = 0
    first = run_llvm(spec, arrays)["tokens"]
    np.testing.assert_array_equal(first, spec.reference(arrays)["tokens"])
    arrays["anchors"] = (arrays["anchors"] + 7) % spec.vocab
    assert np.any(run_llvm(spec, arrays)["tokens"] != first)


def test_markov_walk_ties_pick_the_lowest_id():
    spec = MarkovWalkSpec(vocab=3000, rank=8, block=3, chunk=1024)
    arrays = spec.sample(np.random.default_rng(6), {"m": 4, "nb": 2})
    arrays["w2"][:] = 0  # no bias
    arrays["logits"][:] = 1.0
    arrays["logits"][:, [2999, 1500, 1024]] = 5.0  # the same maximum in three chunks
    got = run_llvm(spec, arrays)["tokens"]
    np.testing.assert_array_equal(got, [1024] * 4)
    np.testing.assert_array_equal(got, spec.reference(arrays)["tokens"])


@pytest.mark.parametrize(
    ("spec", "seqs"),
    [
        (ConfidenceSpec(hidden=64, vocab=512, rank=16, block=7, with_markov=True), 2),  # tiny-dspark
        (ConfidenceSpec(hidden=4096, vocab=151936, rank=256, block=7, with_markov=True), 2),  # Qwen3-8B-DSpark
        (ConfidenceSpec(hidden=99, vocab=300, rank=7, block=4, with_markov=True), 3),  # odd sizes
        (ConfidenceSpec(hidden=64, vocab=512, rank=16, block=7, with_markov=False), 2),
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_confidence_matches_numpy(spec, seqs):
    got = assert_spec_matches_numpy(spec, {"m": seqs * spec.gamma, "nb": seqs}, seed=seqs)
    assert np.all((got["confidence"] > 0) & (got["confidence"] < 1))


def test_confidence_reads_the_anchor_then_the_previous_token():
    spec = ConfidenceSpec(hidden=32, vocab=50, rank=8, block=4, with_markov=True)
    arrays = spec.sample(np.random.default_rng(8), {"m": 6, "nb": 2})
    base = run_llvm(spec, arrays)["confidence"]
    arrays["anchors"][1] = (arrays["anchors"][1] + 1) % spec.vocab  # sequence 1's first row only
    changed = run_llvm(spec, arrays)["confidence"] != base
    np.testing.assert_array_equal(changed, [False, False, False, True, False, False])


# ------------------------------------------------------------------------------------------- the rule


def _markov_node(vocab: int = 151936, rank: int = 256, logits: str = F32) -> OpInstance:
    node = Node.make(Op.MARKOV_WALK, [TensorType(I32, (ROWS,))], block=7)
    weights = TensorType(BF16, (vocab, rank))
    inputs = (TensorType(logits, (ROWS, vocab)), TensorType(I32, ("nb",)), weights, weights)
    return OpInstance("markov_walk", node, inputs)


def _confidence_node(hidden: int = 4096, vocab: int = 151936, rank: int = 256, markov: bool = True) -> OpInstance:
    node = Node.make(Op.CONFIDENCE, [TensorType(F32, (ROWS,))], block=7, with_markov=markov)
    inputs = (
        TensorType(BF16, (ROWS, hidden)),
        TensorType(I32, (ROWS,)),
        TensorType(I32, ("nb",)),
        TensorType(BF16, (vocab, rank)),
        TensorType(BF16, (1, hidden + (rank if markov else 0))),
        TensorType(BF16, (1,)),
    )
    return OpInstance("confidence", node, inputs)


def test_rule_recognises_the_real_nodes():
    rule = DSparkRule()
    assert rule.spec_of(_markov_node()) == MarkovWalkSpec(vocab=151936, rank=256, block=7)  # qwen3-8b-dspark
    assert rule.spec_of(_markov_node(512, 16)) == MarkovWalkSpec(vocab=512, rank=16, block=7)  # tiny-dspark
    assert rule.spec_of(_confidence_node()) == ConfidenceSpec(4096, 151936, 256, 7, True)
    assert rule.spec_of(_confidence_node(64, 512, 16)) == ConfidenceSpec(64, 512, 16, 7, True)
    assert rule.spec_of(_confidence_node(64, 512, 16, markov=False)) == ConfidenceSpec(64, 512, 16, 7, False)
    kernel = rule.apply(_markov_node(512, 16), SM121)
    assert kernel is not None and kernel.name == "markov_walk_v512_r16_b7_c512"
    assert [p.name for p in kernel.reference.params] == ["logits", "anchors", "w1", "w2", "tokens"]
    assert kernel.func.attrs["tirx.is_scheduled"]


def _mismatched_proj() -> OpInstance:
    op = _confidence_node(64, 512, 16)
    inputs = (*op.inputs[:4], TensorType(BF16, (1, 64)), op.inputs[5])  # the Markov half missing
    return OpInstance(op.name, op.node, inputs)


@pytest.mark.parametrize(
    "subject",
    [
        _markov_node(logits=BF16),
        _markov_node(vocab="V"),
        _mismatched_proj(),
        OpInstance("x", Node.make(Op.ARGMAX, [TensorType(I32, (ROWS,))]), (TensorType(F32, (ROWS, 8)),)),
        None,
    ],
    ids=["markov-bf16-logits", "markov-symbolic", "confidence-proj-width", "argmax", "none"],
)
def test_rule_declines_other_work(subject):
    assert DSparkRule().apply(subject, SM90) is None


@pytest.mark.parametrize(
    ("spec", "knobs", "message"),
    [
        (MarkovWalkSpec(vocab=512, rank=16, block=7), {"threads": 33}, "multiple of 32"),
        (MarkovWalkSpec(vocab=5000, rank=16, block=7), {"threads": 96}, "not a multiple of threads=96"),
        (MarkovWalkSpec(vocab=512, rank=16, block=7), {"lanes": 4}, "unknown knob"),
        (MarkovWalkSpec(vocab=100000, rank=16, block=7, chunk=16384), {}, "shared memory"),
    ],
)
def test_bad_knobs_are_refused(spec, knobs, message):
    with pytest.raises(ScheduleError, match=message):
        DSparkRule().apply(spec, SM90, knobs)


def test_spec_validation():
    with pytest.raises(ScheduleError, match="block >= 2"):
        MarkovWalkSpec(vocab=100, rank=8, block=1)
    with pytest.raises(ScheduleError, match="multiple of 32"):
        MarkovWalkSpec(vocab=100, rank=8, block=7, chunk=48)
    with pytest.raises(ScheduleError, match="m must be nb"):
        ConfidenceSpec(8, 10, 2, 7, True).sample(np.random.default_rng(0), {"m": 5, "nb": 1})


# ------------------------------------------------------------------------------------------- lowering

LOWERED = [  # (spec, knobs)
    (MarkovWalkSpec(vocab=151936, rank=256, block=7), {}),
    (MarkovWalkSpec(vocab=512, rank=16, block=7), {}),
    (ConfidenceSpec(hidden=4096, vocab=151936, rank=256, block=7, with_markov=True), {}),
    (ConfidenceSpec(hidden=64, vocab=512, rank=16, block=7, with_markov=False), {}),
]


@pytest.fixture(scope="module")
def lowered():
    return lowered_per_target(DSparkRule(), LOWERED)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
def test_markov_walk_is_one_kernel_per_step_and_a_last_one(lowered, target):
    cuda = lowered(target)
    spec = LOWERED[0][0]
    func = cuda.functions[spec.name]
    assert func.variables == ("m", "nb")
    *steps, last = func.kernels
    assert len(steps) == spec.gamma
    for launch in steps:  # sequences fastest, then the 149 vocabulary chunks; a warp per w2 row
        assert launch.grid == ("nb", "149", "1") and launch.block == ("32", "8", "1")
    assert last.grid == ("nb", "1", "1") and last.block == ("128", str(spec.gamma), "1")
    assert [w.shape for w in func.workspaces] == [("((nb * 149))",)] * (2 * spec.gamma)  # (rank, key) per step
    small = cuda.functions[LOWERED[1][0].name]
    assert [k.grid for k in small.kernels[:-1]] == [("nb", "1", "1")] * 6  # one chunk
    assert "2147483647" not in cuda.source  # no local array of symbolic size in any kernel


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(("spec", "threads"), [(LOWERED[2][0], "256"), (LOWERED[3][0], "64")], ids=["8b", "tiny"])
def test_confidence_is_one_block_per_row(lowered, target, spec, threads):
    cuda = lowered(target)
    (launch,) = cuda.functions[spec.name].kernels
    assert launch.grid == ("m", "1", "1") and launch.block == (threads, "1", "1")
    assert "2147483647" not in kernel_body(cuda.source, spec.name)


def test_nvrtc_compiles_the_family(lowered):
    from kernel_harness import assert_nvrtc_builds

    assert_nvrtc_builds(lowered(SM90))
