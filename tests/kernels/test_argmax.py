"""ARGMAX / TOPK family: llvm builds match numpy (ties included), the rule's choices, CUDA lowering, NVRTC.

The CUDA schedule's index math runs only on a GPU (the lead's bundle check); here it is lowered for SM90
and SM121, its launch shape checked, and the family's module compiled once with NVRTC for sm_90a.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules import ScheduleError
from dflash_compiler.schedules.argmax import ArgmaxRule, ArgmaxSpec, TopKSpec
from dflash_compiler.schedules.base import OpInstance
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
pytest.importorskip("ml_dtypes")

from kernel_harness import assert_spec_matches_numpy, kernel_body, lowered_per_target, run_llvm  # noqa: E402

F32, I32 = "float32", "int32"
ROWS = "nb*(blk-1)"


# ------------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (ArgmaxSpec(vocab=151936), 3),  # Qwen3: 38 chunks, the last one partial
        (ArgmaxSpec(vocab=1001), 7),  # odd vocabulary, one chunk
        (ArgmaxSpec(vocab=9001, chunk=1024), 5),  # odd vocabulary over 9 chunks
        (ArgmaxSpec(vocab=384), 1),
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_argmax_matches_numpy(spec, rows):
    assert spec.variables() == ("m",)
    assert_spec_matches_numpy(spec, {"m": rows}, seed=rows)


@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (TopKSpec(vocab=384, k=5), 14),  # tiny-dflash2
        (TopKSpec(vocab=1001, k=7), 3),  # odd vocabulary and k
        (TopKSpec(vocab=5003, k=16, chunk=1024), 4),  # 5 chunks, the last one nearly empty
        (TopKSpec(vocab=248320, k=16), 2),  # Qwen3.8-27B-DFlash2
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_topk_matches_numpy(spec, rows):
    got = assert_spec_matches_numpy(spec, {"m": rows}, seed=rows)
    assert np.all(np.diff(got["values"], axis=1) <= 0)  # descending


def _tied_rows(vocab: int) -> np.ndarray:
    """Rows whose maxima (and runners-up) repeat, within a chunk and across chunk boundaries."""
    rng = np.random.default_rng(3)
    rows = np.round(rng.standard_normal((6, vocab)), 1).astype(np.float32)  # few distinct values: many ties
    rows[1] = 0.0  # every entry tied
    rows[2, [5, 700, 1500, vocab - 1]] = 9.0  # the same maximum in three chunks
    rows[3] = -np.inf  # nothing but -inf
    rows[3, [900, 1800]] = -1e38
    rows[4, ::7] = 4.0
    rows[5, [vocab - 1, 2]] = np.inf
    return rows


def test_ties_go_to_the_lowest_index():
    spec = ArgmaxSpec(vocab=2003, chunk=512)
    logits = _tied_rows(spec.vocab)
    got = run_llvm(spec, {"logits": logits, "ids": np.zeros(len(logits), np.int32)})
    np.testing.assert_array_equal(got["ids"], spec.reference({"logits": logits})["ids"])
    assert got["ids"][1] == 0 and got["ids"][2] == 5 and got["ids"][5] == 2


def test_topk_ties_keep_the_lower_index_first():
    spec = TopKSpec(vocab=2003, k=9, chunk=512)
    logits = _tied_rows(spec.vocab)
    rows = len(logits)
    arrays = {"logits": logits, "values": np.zeros((rows, spec.k), F32), "ids": np.zeros((rows, spec.k), I32)}
    got = run_llvm(spec, arrays)
    ref = spec.reference({"logits": logits})
    np.testing.assert_array_equal(got["ids"], ref["ids"])
    np.testing.assert_array_equal(got["values"], ref["values"])
    np.testing.assert_array_equal(got["ids"][1], np.arange(spec.k))


def test_sample_has_no_ties_at_the_top():
    spec = TopKSpec(vocab=384, k=5)
    logits = spec.sample(np.random.default_rng(0), {"m": 64})["logits"]
    top = -np.sort(-logits, axis=1)[:, : spec.k + 1]
    assert np.all(np.diff(top, axis=1) < 0)


# ------------------------------------------------------------------------------------------- the rule


def _instance(op: Op, vocab: int | str = 151936, dtype: str = F32, **attrs) -> OpInstance:
    if op is Op.TOPK:
        k = attrs.get("k", 16)
        outputs = [TensorType(F32, (ROWS, k)), TensorType(I32, (ROWS, k))]
    else:
        outputs = [TensorType(I32, (ROWS,))]
    return OpInstance("pick", Node.make(op, outputs, **attrs), (TensorType(dtype, (ROWS, vocab)),))


def test_rule_recognises_the_real_nodes():
    rule = ArgmaxRule()
    assert rule.spec_of(_instance(Op.ARGMAX)) == ArgmaxSpec(vocab=151936)  # qwen3-8b-dflash-b16
    assert rule.spec_of(_instance(Op.TOPK, 248320, k=16)) == TopKSpec(vocab=248320, k=16)  # qwen3.8-27b-dflash2
    assert rule.spec_of(_instance(Op.TOPK, 384, k=5)) == TopKSpec(vocab=384, k=5)  # tiny-dflash2
    spec = ArgmaxSpec(vocab=1001)
    assert rule.spec_of(spec) is spec
    kernel = rule.apply(_instance(Op.TOPK, 384, k=5), SM90)
    assert kernel is not None and kernel.name == "topk_v384_k5_c512"
    assert kernel.func.attrs["tirx.is_scheduled"] and "tirx.is_scheduled" not in kernel.reference.attrs
    assert [p.name for p in kernel.reference.params] == ["logits", "values", "ids"]


@pytest.mark.parametrize(
    "subject",
    [
        _instance(Op.ARGMAX, dtype="bfloat16"),
        _instance(Op.ARGMAX, vocab="V"),
        _instance(Op.TOPK, 384, k=600),
        _instance(Op.SOFTCAP, 384, cap=20.0),
        Node.make(Op.ARGMAX, [TensorType(I32, (ROWS,))]),
        TopKSpec(vocab=384, k=5).prim_func,
        None,
    ],
    ids=["bf16", "symbolic-vocab", "k>vocab", "softcap", "bare-node", "callable", "none"],
)
def test_rule_declines_other_work(subject):
    assert ArgmaxRule().apply(subject, SM90) is None


def test_default_knobs_read_capabilities():
    small = SM90.model_copy(update={"max_threads_per_block": 512, "warp_size": 32})
    assert ArgmaxRule().default_knobs(SM90) == {"threads": 256, "merge_threads": 128}
    assert ArgmaxRule().default_knobs(small)["threads"] == 128


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"threads": 48}, "multiple of 32"),
        ({"threads": 2048}, "up to 1024"),
        ({"threads": 96}, "not a multiple of threads=96"),
        ({"chunk": 1024}, "unknown knob"),
    ],
)
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        ArgmaxRule().apply(ArgmaxSpec(vocab=151936), SM90, knobs)


def test_spec_validation():
    with pytest.raises(ScheduleError, match="vocabulary size"):
        ArgmaxSpec(vocab=0)
    with pytest.raises(ScheduleError, match="multiple of 32"):
        ArgmaxSpec(vocab=1000, chunk=100)
    with pytest.raises(ScheduleError, match="k must be in"):
        TopKSpec(vocab=100, k=101)


# ------------------------------------------------------------------------------------------- lowering

LOWERED = [  # (spec, knobs, stage-1 grid, stage-1 block, stage-2 block)
    (ArgmaxSpec(vocab=151936), {}, ("m", "38", "1"), "256", "64"),
    (ArgmaxSpec(vocab=1001), {"threads": 128}, ("m", "1", "1"), "128", "32"),
    (TopKSpec(vocab=248320, k=16), {}, ("m", "61", "1"), "256", "128"),
    (TopKSpec(vocab=384, k=5), {}, ("m", "1", "1"), "256", "32"),
]


@pytest.fixture(scope="module")
def lowered():
    return lowered_per_target(ArgmaxRule(), LOWERED)


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(("spec", "knobs", "grid", "threads", "merge"), LOWERED, ids=lambda x: getattr(x, "name", ""))
def test_two_kernels_and_a_workspace(lowered, target, spec, knobs, grid, threads, merge):
    cuda = lowered(target)
    func = cuda.functions[spec.name]
    first, second = func.kernels
    assert first.grid == grid and first.block == (threads, "1", "1")
    assert second.grid == ("m", "1", "1") and second.block == (merge, "1", "1")
    assert first.dynamic_smem == second.dynamic_smem == "0"
    assert func.variables == ("m",)
    if isinstance(spec, ArgmaxSpec):  # the (rank, key) partials between the two kernels: one [2, m, chunks]
        assert [(ws.dtype, ws.shape) for ws in func.workspaces] == [(F32, (f"(m * {2 * spec.chunks})",))]
    else:  # ranks and keys apart
        for ws in func.workspaces:
            assert ws.dtype == F32 and ws.shape in (("m",), (f"((m * {spec.chunks * spec.k}))",))
        assert len(func.workspaces) == 2
    assert "2147483647" not in kernel_body(cuda.source, spec.name)  # no local array of symbolic size
    assert "2147483647" not in cuda.source


def test_nvrtc_compiles_the_family(lowered):
    from kernel_harness import assert_nvrtc_builds

    assert_nvrtc_builds(lowered(SM90))


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
def test_argmax_stage_one_loads_every_vector_first(lowered, target):
    """A stage-1 thread issues all of its loads (16-byte vectors where the vocabulary is a multiple of 4)
    before the first comparison, so its whole share of the chunk is in flight at once; an odd vocabulary
    takes scalar loads. The warps' winners meet through xor shuffles and one shared-memory round."""
    cuda = lowered(target)
    qwen = kernel_body(cuda.source, "argmax_v151936_c4096")
    loads = [i for i in range(len(qwen)) if qwen.startswith("*(float4*)(vals_ptr", i)]
    assert len(loads) == 4 and loads[-1] < qwen.index("key_ptr[0] <")
    assert qwen.count("__shfl_xor_sync") == 2 * 5 * 2  # key and rank, 5 rounds, within and across warps
    odd = kernel_body(cuda.source, "argmax_v1001_c1024")
    assert "float4" not in odd and "vals_ptr[7] = logits_ptr[" in odd
