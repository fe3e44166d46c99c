"""Block attention family: llvm builds vs the interpreter's `_block_attention` (the CPU twin of the very
TVMScript the CUDA kernel is made from, at the CPU layout and at each target's default layout), node
recognition and views, layout fitting, CUDA lowering for SM90/SM121 and one NVRTC compile for sm_90a.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from dflash_compiler.ir import Node, Op, TensorType
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.attention import AttentionLayout, AttentionRule, BlockAttentionSpec, fit_layout
from dflash_compiler.schedules.attention_merge import MERGE_ELEMENTS, merge_blocking
from dflash_compiler.schedules.base import OpInstance, ScheduleError
from dflash_compiler.schedules.check import mismatches
from dflash_compiler.targets import SM90, SM121

tvm = pytest.importorskip("tvm")
ml_dtypes = pytest.importorskip("ml_dtypes")

from kernel_harness import (  # noqa: E402
    assert_spec_matches_numpy,
    assert_split_grid_is_the_used_spans,
    assert_split_waits_and_merge_triggers,
)

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM
from dflash_compiler.schedules.attention import attention_func  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BF16 = "bfloat16"

QWEN3_8B = BlockAttentionSpec(block=16, heads=32, kv_heads=8, head_dim=128, causal=False)
TINY_SWA = BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=True, window=12)


def _sizes(spec: BlockAttentionSpec, nb: int, maxp: int, pages: int | None = None) -> dict[str, int]:
    return {"nb": nb, "m": nb * spec.block, "maxp": maxp, "pages": nb * maxp if pages is None else pages}


# --------------------------------------------------------------------------------- numerics (llvm)


@pytest.mark.parametrize(
    ("spec", "nb", "maxp"),
    [
        (BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=False), 3, 3),  # tiny-dflash full
        (TINY_SWA, 2, 4),  # tiny-dflash: causal sliding window
        (BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=False, window=10), 2, 4),  # symmetric
        (BlockAttentionSpec(block=7, heads=4, kv_heads=2, head_dim=16, causal=False), 3, 2),  # dspark: 7 rows
        (QWEN3_8B, 2, 5),
        (BlockAttentionSpec(block=5, heads=6, kv_heads=3, head_dim=20, causal=True), 2, 3),  # odd sizes
        (BlockAttentionSpec(block=4, heads=2, kv_heads=2, head_dim=64, causal=False, page_size=8), 2, 6),  # MHA
    ],
    ids=["tiny-full", "tiny-causal-w12", "tiny-w10", "dspark-b7", "qwen3-8b", "odd", "mha-page8"],
)
def test_llvm_matches_interpreter(spec, nb, maxp):
    assert_spec_matches_numpy(spec, _sizes(spec, nb, maxp), seed=nb * 100 + maxp)


@cache
def _llvm(spec: BlockAttentionSpec, layout: AttentionLayout):
    return tvm.compile(attention_func(spec, layout, device=False), target=tvm.target.Target({"kind": "llvm"}))


def _with_lengths(spec: BlockAttentionSpec, arrays: dict[str, np.ndarray], lens: list[int]) -> dict[str, np.ndarray]:
    """`arrays` with these cached lengths and each sequence's block right after its cached rows."""
    arrays["cache_lens"] = np.array(lens, np.int32)
    arrays["blk_positions"] = (arrays["cache_lens"][:, None] + np.arange(spec.block)).reshape(-1).astype(np.int32)
    return arrays


def _run(spec: BlockAttentionSpec, layout: AttentionLayout, arrays: dict[str, np.ndarray]) -> np.ndarray:
    dev = tvm.cpu()
    tensors = {p.name: tvm.runtime.tensor(np.ascontiguousarray(arrays[p.name]), dev) for p in spec.params()}
    _llvm(spec, layout)[spec.name](*[tensors[p.name] for p in spec.params()])
    return tensors["out"].numpy()


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("spec", "nb", "maxp"),
    [
        (QWEN3_8B, 2, 24),  # up to 400 keys: many splits of one chunk, the merge
        (BlockAttentionSpec(block=8, heads=32, kv_heads=8, head_dim=128, causal=False, window=100), 2, 20),
        (TINY_SWA, 3, 4),  # shrunk to one warp
    ],
    ids=["qwen3-8b", "qwen-swa100", "tiny"],
)
def test_gpu_layouts_compute_the_same_on_cpu(target, spec, nb, maxp):
    """The CUDA kernel's exact text with serial thread loops, at the layout the rule picks for the target."""
    layout = fit_layout(spec, target, **AttentionRule().default_knobs(target))
    arrays = spec.sample(np.random.default_rng(nb + maxp), _sizes(spec, nb, maxp))
    got = {"out": _run(spec, layout, arrays)}
    assert not mismatches(spec, got, spec.reference(arrays), arrays)


def test_corner_cases_of_lengths_and_windows():
    """Empty caches, a window narrower than the block, and a sequence whose window hides all cached rows."""
    spec = BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=False, window=3)
    arrays = _with_lengths(spec, spec.sample(np.random.default_rng(5), _sizes(spec, 3, 8)), [0, 128, 37])
    got = {"out": _run(spec, AttentionLayout(threads=32, chunk=4, splits=5), arrays)}
    assert not mismatches(spec, got, spec.reference(arrays), arrays)


@pytest.mark.parametrize(
    ("splits", "lens"),
    [
        # one pass of 20: all 20 splits (240 keys, 12 per split), 17 (4 keys each), 5 (the pass of 8), 3 (of 4)
        (20, [232, 60, 9, 3]),
        # 28 splits: a pass of 24 and a ragged one of 4 for 28 and 17 used, the narrow pass of 16 for 15
        (28, [328, 60, 52, 3]),
    ],
    ids=["one-pass", "two-passes"],
)
def test_the_merge_takes_the_narrowest_pass_that_holds_the_used_splits(splits, lens):
    """The merge adds a sequence's used splits in one pass of at most MERGE_PASS (its loads clamped to the last
    used split, the guard on the values), in passes of that many and a ragged last one above it, or in the
    narrowest of the 4-, 8- and 16-wide passes that holds them."""
    spec = BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=False)
    arrays = _with_lengths(spec, spec.sample(np.random.default_rng(splits), _sizes(spec, 4, 24)), lens)
    got = {"out": _run(spec, AttentionLayout(threads=32, chunk=4, splits=splits), arrays)}
    assert not mismatches(spec, got, spec.reference(arrays), arrays)


def _p_in_bf16(spec, a):
    """numpy attention (no mask) with P rounded to bf16 before it multiplies V, as the tensor-core kernel's mma
    takes it; the sum of P stays exact."""
    out = np.zeros(a["out"].shape, np.float64)
    d, blk, grp, page = spec.head_dim, spec.block, spec.group, spec.page_size
    for s, n in enumerate(a["cache_lens"]):
        keys = np.arange(n)
        slots = a["block_table"][s, keys // page]
        rows = slice(s * blk, (s + 1) * blk)
        for g in range(spec.kv_heads):
            cols = slice(g * d, (g + 1) * d)
            k = np.concatenate([a["kv"][0, slots, keys % page, g], a["k"][rows, cols]]).astype(np.float64)
            v = np.concatenate([a["kv"][1, slots, keys % page, g], a["v"][rows, cols]]).astype(np.float64)
            for h in range(g * grp, (g + 1) * grp):
                scores = a["q"][rows, h * d : (h + 1) * d].astype(np.float64) @ k.T / np.sqrt(d)
                p = np.exp(scores - scores.max(axis=1, keepdims=True))
                rounded = p.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
                out[rows, h * d : (h + 1) * d] = rounded @ v / p.sum(axis=1, keepdims=True)
    return out.astype(np.float32).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(("nb", "maxp"), [(4, 6), (64, 3)])
def test_the_check_takes_p_in_bf16_and_nothing_past_it(nb, maxp):
    """The output's tolerance scales with its terms (Σ p·|v| / Σ p), which a peaked softmax over few keys
    makes far larger than the output: P rounded to bf16 stays within the worst case of that rounding and
    passes the check; an error of three such worst cases does not."""
    spec = BlockAttentionSpec(block=16, heads=32, kv_heads=8, head_dim=128, causal=False)
    arrays = spec.sample(np.random.default_rng(0), _sizes(spec, nb, maxp))
    ref = spec.reference(arrays)["out"]
    got = _p_in_bf16(spec, arrays)
    scale = spec.error_scale("out", arrays)
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    # P's rounding (2^-8 of each term at most) and both outputs' rounding to bf16
    assert np.all(err <= (2.0**-8 * scale + 2.0**-7 * np.abs(ref.astype(np.float64))) * 1.01)
    assert float(np.max(scale)) > 4 * float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))  # it does cancel
    assert not mismatches(spec, {"out": got}, {"out": ref}, arrays)
    r64 = ref.astype(np.float64)
    i = np.unravel_index(int(np.argmax(scale / (np.abs(r64) + 1e-6))), scale.shape)  # the most cancelled
    bad = got.copy()
    bad[i] = (r64[i] + 3 * (8e-3 * abs(r64[i]) + 2.0**-8 * scale[i])).astype(ml_dtypes.bfloat16)
    (problem,) = mismatches(spec, {"out": bad}, {"out": ref}, arrays)
    assert f"1 of {ref.size} outside" in problem and "the error scale" in problem
    with pytest.raises(ScheduleError, match="pass the arrays it ran on"):
        mismatches(spec, {"out": got}, {"out": ref})


def test_the_comparison_sees_a_wrong_mask():
    """Sanity of the oracle: a causal kernel does not pass for the non-causal reference."""
    causal = BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=True)
    full = BlockAttentionSpec(block=8, heads=4, kv_heads=2, head_dim=16, causal=False)
    arrays = full.sample(np.random.default_rng(0), _sizes(full, 2, 2))
    got = {"out": _run(causal, AttentionLayout(threads=32, chunk=8, splits=2), arrays)}
    assert mismatches(full, got, full.reference(arrays), arrays)


def test_spec_contract():
    assert QWEN3_8B.name == "block_attention_b16_h32_kv8_d128"
    assert TINY_SWA.name == "block_attention_b8_h4_kv2_d16_causal_w12"
    assert [(p.name, p.shape, p.role) for p in QWEN3_8B.params()] == [
        ("q", ("m", 4096), "in"),
        ("k", ("m", 1024), "in"),
        ("v", ("m", 1024), "in"),
        ("kv", (2, "pages", 16, 8, 128), "in"),
        ("block_table", ("nb", "maxp"), "in"),
        ("cache_lens", ("nb",), "in"),
        ("blk_positions", ("m",), "in"),
        ("out", ("m", 4096), "out"),
    ]
    assert [p.name for p in TINY_SWA.prim_func().params] == [p.name for p in TINY_SWA.params()]
    assert QWEN3_8B.variables() == ("m", "pages", "nb", "maxp")
    assert pickle.loads(pickle.dumps(QWEN3_8B)) == QWEN3_8B
    for bad, message in [
        ({"heads": 6, "kv_heads": 4}, "multiple of kv_heads"),
        ({"head_dim": 30}, "multiple of 4"),
        ({"window": 0}, "window must be positive"),
        ({"block": 0}, "block must be positive"),
    ]:
        with pytest.raises(ScheduleError, match=message):
            BlockAttentionSpec(**{"block": 8, "heads": 4, "kv_heads": 2, "head_dim": 16, "causal": False, **bad})


def test_sample_is_valid_at_real_sizes():
    arrays = QWEN3_8B.sample(np.random.default_rng(0), _sizes(QWEN3_8B, 8, 256))
    lens, table = arrays["cache_lens"], arrays["block_table"]
    assert lens[0] == 4096 and lens.max() <= 4096 and lens.min() >= 0
    assert len(np.unique(table)) == table.size and table.max() < 8 * 256  # distinct pages in the pool
    np.testing.assert_array_equal(arrays["blk_positions"].reshape(8, 16), lens[:, None] + np.arange(16))
    with pytest.raises(ScheduleError, match="nb \\* block"):
        QWEN3_8B.sample(np.random.default_rng(0), {"nb": 2, "m": 16, "maxp": 1, "pages": 2})


def test_module_imports_without_tvm():
    code = "import sys, dflash_compiler.schedules.attention; assert 'tvm' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=60)


# -------------------------------------------------------------------------------------------- rule


def _op(
    layer: int = 2,
    block: int = 8,
    window: int | None = 2048,
    causal: bool = False,
    dtype: str = BF16,
    cache_shape: tuple = (5, 2, "pages", 16, 8, 128),
    q_width: int = 4096,
) -> OpInstance:
    """`%l2.attention = block_attention(...)` as qwen3.8-27b-dflash2's propose dump has it."""
    rows = "nb*blk"
    inputs = (
        TensorType(dtype, (rows, q_width)),
        TensorType(BF16, (rows, 1024)),
        TensorType(BF16, (rows, 1024)),
        TensorType(BF16, cache_shape),
        TensorType("int32", ("nb", "maxp")),
        TensorType("int32", ("nb",)),
        TensorType("int32", (rows,)),
    )
    attrs = dict(block=block, causal=causal, head_dim=128, heads=32, kv_heads=8, layer=layer, page_size=16)
    node = Node.make(Op.BLOCK_ATTENTION, [TensorType(BF16, (rows, 4096))], window=window, **attrs)
    return OpInstance(f"l{layer}.attention", node, inputs)


def test_rule_recognises_the_graph_node_and_binds_one_layer_view():
    rule = AttentionRule()
    op = _op()
    assert rule.spec_of(op) == BlockAttentionSpec(
        block=8, heads=32, kv_heads=8, head_dim=128, causal=False, window=2048
    )
    assert rule.views(op) == {"kv": (2,)}
    assert rule.spec_of(_op(block=16, window=None)) == QWEN3_8B
    kernel = rule.apply(_op(layer=0, block=16, window=None), SM121)
    assert kernel is not None and kernel.name == QWEN3_8B.name and kernel.rule == "block_attention"
    assert dict(kernel.knobs) == {"threads": 256, "chunk": 32, "splits": 4}
    assert kernel.func.attrs["tirx.is_scheduled"]


@pytest.mark.parametrize(
    "subject",
    [
        _op(dtype="float32"),
        _op(cache_shape=(5, 2, "pages", 16, 8, 64)),  # cache head_dim differs from the attrs
        _op(cache_shape=(2, "pages", 16, 8, 128)),  # not the 6-D cache
        _op(q_width=2048),
        OpInstance("x", Node.make(Op.MATMUL, [TensorType(BF16, ("m", 8))]), (TensorType(BF16, ("m", 8)),)),
        "block_attention",
    ],
    ids=["f32-q", "cache-dim", "cache-rank", "q-width", "matmul", "string"],
)
def test_rule_declines_other_work(subject):
    assert AttentionRule().spec_of(subject) is None
    assert AttentionRule().apply(subject, SM90) is None


def test_default_knobs_read_capabilities():
    assert AttentionRule().default_knobs(SM90) == {"threads": 256, "chunk": 32, "splits": 16}
    assert AttentionRule().default_knobs(SM121) == {"threads": 256, "chunk": 32, "splits": 4}
    small = SM90.model_copy(update={"sm_count": 10, "max_threads_per_block": 128})
    assert AttentionRule().default_knobs(small) == {"threads": 128, "chunk": 32, "splits": 1}


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"threads": 48}, "multiple of 32"),
        ({"chunk": 24}, "power of two"),
        ({"splits": 0}, "1 to 256"),
        ({"threads": 32, "chunk": 128}, "must be a multiple of 64"),
        ({"chunk": 256}, "shared memory"),  # 256 keys of f32 K and V exceed sm_121's 99 KiB even in bf16
        ({"tile": 2}, "unknown knob"),
    ],
)
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ScheduleError, match=message):
        AttentionRule().apply(QWEN3_8B, SM121, knobs)


def test_layouts_fit_the_target():
    assert fit_layout(TINY_SWA, SM90, 256, 32, 32).threads == 32  # tiny heads: idle thread rows trimmed
    wide = BlockAttentionSpec(block=16, heads=16, kv_heads=4, head_dim=256, causal=False)
    layout = fit_layout(wide, SM121, 256, 32, 8)
    assert (layout.q_f32, layout.kv_f32) == (False, False)  # f32 staging would not fit 99 KiB
    assert fit_layout(wide, SM90, 256, 32, 8).kv_f32  # 227 KiB: it does


# ----------------------------------------------------------------------------------------- lowering


@pytest.fixture(scope="module")
def lowered():
    specs = {
        "sm_90": [QWEN3_8B, TINY_SWA],
        "sm_121": [QWEN3_8B, BlockAttentionSpec(block=16, heads=16, kv_heads=4, head_dim=256, causal=False)],
    }
    out = {}
    for target in (SM90, SM121):
        kernels = [AttentionRule().apply(s, target) for s in specs[target.name]]
        out[target.name] = (kernels, lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target))
    return out


@pytest.mark.parametrize("target", [SM90, SM121], ids=lambda t: t.name)
def test_two_kernels_with_workspaces_and_sane_launches(lowered, target):
    kernels, cuda = lowered[target.name]
    for kernel in kernels:
        spec = kernel.spec
        splits, threads = kernel.knobs["splits"], fit_layout(spec, target, **kernel.knobs).threads
        func = cuda.functions[kernel.name]
        assert [k.name for k in func.kernels] == [f"{kernel.name}_kernel", f"{kernel.name}_kernel_1"]
        rows = spec.block * spec.group
        assert [(w.name, w.dtype) for w in func.workspaces] == [("part_o", "float32"), ("part_ml", "float32")]
        env = {"nb": 3, "m": 3 * spec.block, "maxp": 7, "pages": 21}
        sizes = [int(np.prod([evaluate(d, env) for d in w.shape])) for w in func.workspaces]
        assert sizes == [3 * spec.kv_heads * splits * rows * spec.head_dim, 3 * spec.kv_heads * splits * rows * 2]
        split, merge = func.kernels
        _, block, smem = split.launch_dims(env)
        assert block == (threads, 1, 1)
        assert_split_grid_is_the_used_spans(split, spec, splits, fit_layout(spec, target, **kernel.knobs).slots, env)
        assert 0 < smem <= target.max_shared_memory_per_block
        grid, block, smem = merge.launch_dims(env)
        per_block, merge_threads = merge_blocking(spec)
        assert grid == (spec.heads // per_block, spec.block, 3) and block == (merge_threads, 1, 1)
        assert merge_threads == per_block * spec.head_dim // MERGE_ELEMENTS
        assert smem <= target.max_static_shared_memory_per_block
        assert {p.source for p in split.params if p.kind == "ptr"} >= {"q", "k", "v", "kv", "part_o", "part_ml"}
        assert {p.source for p in merge.params if p.kind == "ptr"} >= {"out", "part_o", "part_ml"}
        assert_split_waits_and_merge_triggers(cuda.source, split.name, merge.name)


def test_nvrtc_compiles_for_sm90a(lowered):
    from dflash_compiler.cubin import cubin_arch
    from dflash_compiler.nvrtc import compile_cubin

    _, cuda = lowered["sm_90"]
    cubin = compile_cubin(cuda.source, "sm_90a")
    assert cubin_arch(cubin) == "sm_90a"
    for name in cuda.kernel_names():
        assert name.encode() + b"\0" in cubin
