"""head_prep family: llvm build vs the graph's numpy semantics (windows that copy, norm, rope or both; head
dims 16 to 256), node recognition, the CUDA kernel's layout (vector accesses, shuffles over a head's lanes
only) for SM90/SM121, and one NVRTC compile for sm_90a. The CUDA kernel itself runs on the GPU box
(tests/gpu/test_kernels.py and bench/kernels.py against the same numpy reference).
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.head_prep import HeadPrepRule, HeadPrepSpec
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
pytest.importorskip("ml_dtypes")

from kernel_harness import (  # noqa: E402 - after the TVM skip
    assert_imports_without_tvm,
    assert_nvrtc_builds,
    assert_spec_matches_numpy,
    kernel_body,
    lowered_per_target,
    run_llvm,
)

BF16 = "bfloat16"
QKV = ((0, 4096, True, True), (4096, 5120, True, True), (5120, 6144, False, False))  # a Qwen3-8B layer
CONTEXT = tuple((s * 1024, (s + 1) * 1024, s % 2 == 0, s % 2 == 0) for s in range(10))  # 5 layers' K|V

SPECS = [
    HeadPrepSpec(width=96, head_dim=16, windows=((0, 64, True, True), (64, 80, True, True), (80, 96, False, False))),
    HeadPrepSpec(
        width=256, head_dim=64, windows=((64, 192, False, True), (0, 64, True, False)), eps=1e-5, attention_factor=0.7
    ),
    HeadPrepSpec(width=6144, head_dim=128, windows=QKV),
    HeadPrepSpec(
        width=512, head_dim=256, windows=((0, 256, True, True), (256, 512, False, False)), attention_factor=1.2
    ),
    HeadPrepSpec(width=10240, head_dim=128, windows=CONTEXT),
]


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name[:60])
def test_llvm_matches_numpy(spec, rows):
    assert [p.name for p in spec.params()] == [p.name for p in spec.prim_func().params]
    assert_spec_matches_numpy(spec, {"m": rows}, seed=spec.head_dim + rows)


def test_windows_match_the_separate_ops():
    """Norm then RoPE of a window equals the head_rmsnorm and rope nodes applied one after the other; a copy
    window is the slice."""
    from dflash_compiler.ir import evaluate_node

    spec = SPECS[0]
    arrays = spec.sample(np.random.default_rng(3), {"m": 5})
    got = run_llvm(spec, arrays)
    x = arrays["x"].astype(np.float32)
    for j, (w, (start, stop)) in enumerate(zip(("w0", "w1"), ((0, 64), (64, 80)), strict=True)):
        norm = Node.make(Op.HEAD_RMSNORM, [TensorType(BF16, ("m", stop - start))], eps=spec.eps, head_dim=16)
        rope = Node.make(Op.ROPE, [TensorType(BF16, ("m", stop - start))], head_dim=16, attention_factor=1.0)
        (normed,) = evaluate_node(norm, [x[:, start:stop], arrays[w]])
        (want,) = evaluate_node(rope, [normed, arrays["positions"], arrays["inv_freq"]])
        np.testing.assert_allclose(got[f"y{j}"].astype(np.float32), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(got["y2"], arrays["x"][:, 80:96])


def test_spec_validation():
    with pytest.raises(ScheduleError, match="16·2\\^i"):
        HeadPrepSpec(width=48, head_dim=24, windows=((0, 48, True, True),))
    with pytest.raises(ScheduleError, match="whole heads"):
        HeadPrepSpec(width=128, head_dim=64, windows=((0, 96, True, True),))
    with pytest.raises(ScheduleError, match="at least one window"):
        HeadPrepSpec(width=128, head_dim=64, windows=())


def test_specs_travel_to_a_box_without_tvm():
    assert_imports_without_tvm("dflash_compiler.schedules.head_prep")
    assert pickle.loads(pickle.dumps(SPECS[2])) == SPECS[2]


# ------------------------------------------------------------------------------------------ the rule


def _node(width, head_dim=128, windows=QKV, dtype=BF16, positions="int32", table=None, weight=None):
    outs = [TensorType(dtype, ("nb*blk", b - a)) for a, b, _, _ in windows]
    node = Node.make(Op.HEAD_PREP, outs, windows=windows, head_dim=head_dim, eps=1e-6, attention_factor=1.0)
    norms = sum(w[2] for w in windows)
    inputs = (
        TensorType(dtype, ("nb*blk", width)),
        TensorType(positions, ("nb*blk",)),
        TensorType("float32", (table or head_dim // 2,)),
        *[TensorType(BF16, (weight or head_dim,))] * norms,
    )
    return OpInstance("l0.qkv.heads", node, inputs)


def test_rule_takes_the_real_node():
    inst = _node(6144)
    kernel = HeadPrepRule().apply(inst, SM90)
    assert kernel is not None and kernel.spec == SPECS[2] and dict(kernel.knobs) == {"threads": 128}
    assert [p.name for p in kernel.func.params] == [p.name for p in SPECS[2].params()]
    assert len(SPECS[2].params()) == len(inst.inputs) + len(inst.outputs)


@pytest.mark.parametrize(
    "subject",
    [_node(6144, dtype="float32"), _node("w"), _node(6144, positions="int64"), _node(6144, table=128),
     _node(6144, weight=64), _node(48, head_dim=24, windows=((0, 48, True, True),)), "head_prep"],
    ids=["f32", "symbolic-width", "int64-positions", "table-length", "weight-shape", "head-dim-24", "string"],
)  # fmt: skip
def test_rule_declines_other_work(subject):
    assert HeadPrepRule().spec_of(subject) is None
    assert HeadPrepRule().apply(subject, SM90) is None


def test_knobs_are_checked():
    with pytest.raises(ScheduleError, match="multiple of 32"):
        HeadPrepRule().apply(SPECS[2], SM90, {"threads": 40})


# ------------------------------------------------------------------------------------ CUDA lowering

LOWERED = [(spec, {}) for spec in SPECS] + [(SPECS[2], {"threads": 256})]


@pytest.fixture(scope="module")
def lowered():
    return lowered_per_target(HeadPrepRule(), LOWERED[:-1])


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name[:60])
def test_lowered_kernel(lowered, target, spec):
    func = lowered(target).functions[spec.name]
    (launch,) = func.kernels
    lanes = spec.head_dim // 16
    assert launch.grid == ("m", str(-(-spec.heads // (128 // lanes))), "1") and launch.block == ("128", "1", "1")
    body = kernel_body(lowered(target).source, spec.name)
    assert body.count("*(uint4*)(x_ptr") == 2 * len(spec.windows)  # both halves of a head, 16 bytes per lane
    for j in range(len(spec.windows)):
        assert body.count(f"*(uint4*)(y{j}_ptr") == 2
    shuffles = re.findall(r"__shfl_xor_sync\(\(\(uint\)(\d+) << [^,]*\), \w+\[0\], (\d+), (\d+)\)", body)
    butterfly = [(str((1 << lanes) - 1), str(1 << b), str(lanes)) for b in range(lanes.bit_length() - 1)]
    assert shuffles == butterfly * spec.norms  # only a head's own lanes, once per norm window
    # one sincosf per RoPE window, in a loop over the lane's 8 frequencies that stays a loop: the kernel's
    # code stays small (unrolled sinf/cosf with their slow paths made the 10-window context kernel 168 KB)
    ropes = sum(w[3] for w in spec.windows)
    assert body.count("sincosf(") == ropes and body.count("#pragma unroll 1") == ropes
    assert "cosf(" not in body.replace("sincosf(", "")
    # what no kernel of the step writes is read before the wait (norm weights, positions, the angles), x
    # after it, by every thread whatever its window
    wait = body.index("dflash_wait_for_inputs();")
    assert body.count("dflash_wait_for_inputs();") == 1 and body.index("dflash_launch_dependents();") > wait
    assert body[:wait].count("sincosf(") == ropes and body[:wait].count("positions_ptr[") == ropes
    for i in range(spec.norms):
        assert f"w{i}_ptr[" in body[:wait] and f"w{i}_ptr[" not in body[wait:]
    assert "x_ptr" not in body[:wait]
    assert body[: body.index("\n", wait)].rsplit("\n", 1)[-1] == "  dflash_wait_for_inputs();"  # outside every branch


def test_nvrtc_compiles_the_family_for_sm90a(lowered):
    assert_nvrtc_builds(lowered(SM90))
