"""lm_head_argmax (an lm_head whose logits only feed an argmax): the spec and its CPU oracle against numpy,
the rules' choice, the kernel table (tiled or warpgroup GEMM with the argmax epilogue, then one merge
block per row, no [m, vocab] store), the generated epilogue, refused knobs, and NVRTC builds for every arch.
The kernels against numpy on the GPU: tests/gpu/test_kernels.py over a bench/kernels.py bundle.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.ir.interpret import evaluate_node
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.linear import FP8, I32, LinearSpec, spec_of
from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearGemvRule, LinearMmaRule
from dflash_compiler.targets import SM90, SM120, SM121

tvm = pytest.importorskip("tvm")
ml_dtypes = pytest.importorskip("ml_dtypes")

from kernel_harness import assert_nvrtc_builds, assert_spec_matches_numpy  # noqa: E402 - TVM

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM

VOCAB, HIDDEN = 1000, 256  # 1000 = 15 blocks of 64 rows and a ragged 40; 5 of 192 and a ragged 40


def _spec(fp8: bool = False, n: int = VOCAB, k: int = HIDDEN) -> LinearSpec:
    return LinearSpec("lm_head_argmax", n, k, weight_dtype=FP8 if fp8 else "bfloat16")


def _instance(fp8: bool) -> OpInstance:
    x = TensorType("bfloat16", ("nb*(blk-1)", HIDDEN))
    w = TensorType(FP8 if fp8 else "bfloat16", (VOCAB, HIDDEN))
    scale = [TensorType("float32", (VOCAB,))] if fp8 else []
    node = Node.make(Op.LM_HEAD_ARGMAX, [TensorType(I32, ("nb*(blk-1)",))])
    return OpInstance("argmax", node, (x, w, *scale))


# --------------------------------------------------------------------------------------- spec and oracle
def test_spec_is_lm_heads_inputs_and_one_id_per_row():
    spec = _spec(fp8=True)
    assert spec.name == "lm_head_argmax_fp8_n1000_k256" and spec.out_dtype == I32
    assert [(p.name, p.dtype, p.shape, p.role) for p in spec.params()] == [
        ("x", "bfloat16", ("m", HIDDEN), "in"),
        ("w", FP8, (VOCAB, HIDDEN), "in"),
        ("scale", "float32", (VOCAB,), "in"),
        ("y", I32, ("m",), "out"),  # the ids
    ]
    # the weight and scales once, x once, 4 bytes of id per row: the logits never cross memory
    assert spec.bytes_moved({"m": 120}) == VOCAB * HIDDEN + 4 * VOCAB + 120 * HIDDEN * 2 + 120 * 4
    with pytest.raises(ScheduleError, match="int32 ids"):
        LinearSpec("lm_head_argmax", VOCAB, HIDDEN, out_dtype="float32")
    with pytest.raises(ScheduleError, match="bfloat16 or float32"):
        LinearSpec("lm_head", VOCAB, HIDDEN, out_dtype=I32)
    with pytest.raises(ScheduleError, match="exact below 2\\^24"):  # id 2^24 + 1 would round
        LinearSpec("lm_head_argmax", 2**24 + 64, 64)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 15, 120])
def test_cpu_oracle_matches_numpy(fp8, rows):
    spec = _spec(fp8)
    arrays = spec.sample(np.random.default_rng(rows), {"m": rows})
    # the samples' exact sums tie often: the lowest id must win, as np.argmax's does
    logits = evaluate_node(Node.make(Op.LM_HEAD, [TensorType("float32", ("m", VOCAB))]),
                           [arrays["x"], arrays["w"], *([arrays["scale"]] if fp8 else [])])[0]  # fmt: skip
    ties = [int(np.sum(row == row.max())) for row in logits]
    assert all(t >= 2 for t in ties[:3]), ties[:3]
    np.testing.assert_array_equal(spec.reference(arrays)["y"], np.argmax(logits, axis=1))
    assert_spec_matches_numpy(spec, {"m": rows}, seed=rows)


# ------------------------------------------------------------------------------------------------ rules
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_rules(fp8):
    inst = _instance(fp8)
    assert spec_of(inst) == _spec(fp8)
    # the argmax epilogue is the tiled kernels', under its own rule: knobs chosen for the linears stay theirs
    assert LinearGemvRule().apply(inst, SM90) is None and LinearMmaRule().apply(inst, SM90) is None
    kernel = LinearArgmaxRule().apply(inst, SM90)
    assert kernel is not None and kernel.name == _spec(fp8).name and kernel.rule == "linear_argmax"
    assert kernel.knobs["gemv_tiled_stages"] > 0 and kernel.knobs["wgmma_k_splits"] == 1


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"wgmma_k_splits": 2}, "k splits 2"),
        ({"gemm_wgmma": 0, "gemm_k_splits": 4}, "k splits 4"),
        ({"gemv_tiled_stages": 0}, "gemv_tiled_stages=0"),
        ({"x_stages": 2}, "x_stages=2"),
    ],
)
def test_knobs_without_the_epilogue_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        LinearArgmaxRule().apply(_spec(n=151936, k=4096), SM90, knobs)


def test_defaults_never_split_k():
    """A narrow vocabulary whose lm_head takes k splits on both GEMMs takes none with the argmax."""
    plain = LinearSpec("lm_head", 2048, 4096, weight_dtype=FP8)
    picks = LinearSpec("lm_head_argmax", 2048, 4096, weight_dtype=FP8)
    for target, key in ((SM90, "wgmma_k_splits"), (SM120, "gemm_k_splits")):
        assert LinearMmaRule().apply(plain, target).knobs[key] > 1
        assert LinearArgmaxRule().apply(picks, target).knobs[key] == 1


# ------------------------------------------------------------------------------------------ kernel table
def _lowered(spec, target, knobs=None):
    # every call above gemm_rows on the 128-row GEMM (the 64-row one below mid_rows: test_linear_mid.py)
    kernel = LinearArgmaxRule().apply(spec, target, {"mid_rows": 0, **(knobs or {})})
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), target)
    return kernel, cuda, cuda.functions[kernel.name]


@pytest.mark.parametrize(("target", "block_n"), [(SM90, 192), (SM120, 64)], ids=["wgmma", "tiled"])
def test_kernel_table(target, block_n):
    spec = _spec(n=151936, k=4096)
    kernel, _, func = _lowered(spec, target)
    assert kernel.knobs.get("wgmma_warpgroups", 0) * 64 in (block_n, 0)
    small, small_merge, large, large_merge = func.kernels
    for m in (15, 32):  # few rows: the small tiled kernel (64 weight rows a block), then its merge
        assert [k.name for k in func.launches({"m": m})] == [small.name, small_merge.name]
        assert small.launch_dims({"m": m})[0] == (-(-m // 16), 151936 // 64, 1)
        assert small_merge.launch_dims({"m": m})[0:2] == ((m, 1, 1), (256, 1, 1))
    for m in (33, 120, 240):
        assert [k.name for k in func.launches({"m": m})] == [large.name, large_merge.name]
        assert large.launch_dims({"m": m})[0] == (-(-m // 128), -(-151936 // block_n), 1)
        assert large_merge.launch_dims({"m": m})[0] == (m, 1, 1)
    # the workspaces: a (rank, value) pair per row and block along n, never [m, vocab]
    sizes = sorted(evaluate("*".join(w.shape), {"m": 120}) for w in func.workspaces)
    assert sizes == sorted([2 * 120 * (151936 // 64), 2 * 120 * -(-151936 // block_n)]), func.workspaces
    assert [p.shape for p in func.params][-1] == ("m",)


def test_merges_issue_every_load_before_ranking():
    """Each merge thread's share of a row's block pairs (ten at 16 rows: 2,374 blocks of 64 weight rows, 256
    threads) is loaded before the first comparison in the machine code, not one L2 round trip per pair."""
    pytest.importorskip("cuda.bindings")
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.sass import kernel_opcodes

    _, cuda, func = _lowered(_spec(n=151936, k=4096), SM90)
    opcodes = kernel_opcodes(compile_cubin(cuda.source, SM90.arch))
    for merge, pairs in ((func.kernels[1], -(-151936 // 64 // 256)), (func.kernels[3], -(-151936 // 192 // 256))):
        code = opcodes[merge.name]
        loads = [i for i, op in enumerate(code) if op == "LDG"]
        assert len(loads) == 2 * pairs, (merge.name, len(loads))
        assert loads[-1] < min(code.index("FSETP"), code.index("BRA")), merge.name


def test_epilogue_ranks_per_row_then_per_block():
    """The warpgroup kernel: after its last wgmma wait, three shuffle rounds over the lanes that share x rows
    (xor 16, 8, 4: never 2 or 1, which hold other rows) per row a thread holds, a barrier before the
    slots overlay the pipeline's shared memory and one after, then one thread per row writes its pair."""
    spec = _spec(n=151936, k=4096)
    _, cuda, func = _lowered(spec, SM90)
    definition = rf"void __launch_bounds__\(\d+\) {func.kernels[2].name}\([^)]*\) \{{\n(.*?)\n\}}\n"
    found = re.search(definition, cuda.source, re.S)
    assert found is not None
    body = found.group(1)
    tail = body[body.index("dflash_wgmma_wait_n128") :]
    offsets = re.findall(r"__shfl_xor_sync\(\(uint\)4294967295, (?:key|rank)_ptr\[0\], (\d+), 32\)", tail)
    assert len(offsets) == 2 * 3 * 2 * 16  # key and rank, 3 rounds, 32 x rows a thread holds
    assert set(offsets) == {"16", "8", "4"}
    assert tail.count("__syncthreads()") == 2
    first_slot_write = tail.index("((float*)smem_ptr)[")
    assert tail.index("__syncthreads()") < first_slot_write < tail.rindex("__syncthreads()")
    assert not re.search(r"\by\[", body)  # no logits stored
    pair = body[body.rindex("__syncthreads()") :]
    assert re.search(r"\] = rank_ptr\[0\];", pair) and re.search(r"\] = key_ptr\[0\];", pair)


# --------------------------------------------------------------------------------------------- NVRTC
# by wgmma: a 40-row x tile and two warpgroups; else two warps along n and m, warps along k
SHAPES = {
    True: {"wgmma_warpgroups": 2, "wgmma_block_m": 40},
    False: {"gemm_n_warps": 2, "gemm_m_warps": 2, "gemm_n_tiles": 1, "gemm_m_tiles": 2, "gemm_k_warps": 2,
            "gemm_k_steps": 2, "gemm_stages": 2},
}  # fmt: skip


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_compiles_for_every_arch(target):
    pytest.importorskip("cuda.bindings")
    rule = LinearArgmaxRule()
    kernels = [
        rule.apply(_spec(), target),  # ragged last block on both kernels
        rule.apply(_spec(fp8=True), target),
        rule.apply(LinearSpec("lm_head_argmax", 520, 256, name="picks_shapes"), target, SHAPES[target.wgmma]),
    ]
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target)
    assert_nvrtc_builds(cuda, target.arch)


def test_slots_must_fit_in_the_pipelines_shared_memory():
    from types import SimpleNamespace

    from dflash_compiler.schedules.linear_argmax import pick_bytes, pick_macro

    plan = SimpleNamespace(n_tiles=1, m_tiles=16, block_n=256, block_m=128, n_warps=16, threads=512)
    assert pick_bytes(plan) == 2 * 16 * 128 * 4
    with pytest.raises(ScheduleError, match="do not fit"):
        pick_macro(_spec(), SimpleNamespace(**vars(plan), shared_bytes=lambda: pick_bytes(plan) - 4))
    assert pick_macro(_spec(), SimpleNamespace(**vars(plan), shared_bytes=lambda: pick_bytes(plan))) is not None
