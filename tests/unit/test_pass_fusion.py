"""The fusion passes and select_rope: golden dumps, numeric equivalence, structure, idempotence.

Expected structure comes from the config and DFLASH.md (row order K0,V0,K1,V1,…; q|k|v; gate|up;
theta^(-2j/D); YaRN's 0.1·ln(factor)+1), never from the passes' own helpers. The golden files are written
by ``python tests/unit/golden/regenerate.py`` and reviewed by hand; the tests only compare.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
from pass_harness import TINY, Run, Tiny, assert_equivalent, run, tiny

from dflash_compiler.errors import DFlashError
from dflash_compiler.ir import Graph, Node, Op, Ref, TensorType, WeightCache, WeightDecl, dump, verify
from dflash_compiler.ir_passes.context import Pass, PassContext
from dflash_compiler.ir_passes.fuse_block_embed import fuse_block_embed
from dflash_compiler.ir_passes.fuse_context_kv import fuse_context_kv
from dflash_compiler.ir_passes.fuse_gate_up import fuse_gate_up
from dflash_compiler.ir_passes.fuse_gate_up_silu import GROUP, fuse_gate_up_silu
from dflash_compiler.ir_passes.fuse_head_prep import fuse_head_prep
from dflash_compiler.ir_passes.fuse_kv_writes import fuse_kv_writes
from dflash_compiler.ir_passes.fuse_lm_head_argmax import fuse_lm_head_argmax
from dflash_compiler.ir_passes.fuse_qkv import fuse_qkv
from dflash_compiler.ir_passes.fuse_residual_norm import fuse_residual_norm
from dflash_compiler.ir_passes.select_rope import RopeChoice, UnsupportedRopeError, select_rope
from dflash_compiler.lower import Program
from dflash_compiler.options import BuildOptions
from dflash_compiler.rope import rope_tables

GOLDEN = Path(__file__).resolve().parent / "golden"
PASSES: dict[str, Pass] = {
    "fuse_context_kv": fuse_context_kv,
    "fuse_qkv": fuse_qkv,
    "fuse_gate_up": fuse_gate_up,
    "fuse_residual_norm": fuse_residual_norm,
    "select_rope": select_rope,
    "fuse_head_prep": fuse_head_prep,  # after select_rope: it fuses only selected RoPE
    "fuse_kv_writes": fuse_kv_writes,
    "fuse_lm_head_argmax": fuse_lm_head_argmax,
    "fuse_block_embed": fuse_block_embed,
    "fuse_gate_up_silu": fuse_gate_up_silu,  # after fuse_gate_up: it fuses only the one-input silu_mul
}
# (pass, example, phase): the phase the pass rewrites, on tiny-dflash and on DFlash2's conv-wrapped layers.
GOLDEN_CASES: tuple[tuple[str, str, str], ...] = (
    ("fuse_context_kv", "tiny-dflash", "append_context"),
    ("fuse_qkv", "tiny-dflash", "propose"),
    ("fuse_qkv", "tiny-dflash2", "propose"),
    ("fuse_gate_up", "tiny-dflash", "propose"),
    ("fuse_gate_up", "tiny-dflash2", "propose"),
    ("fuse_residual_norm", "tiny-dflash", "propose"),
    ("fuse_residual_norm", "tiny-dflash2", "propose"),
    ("select_rope", "tiny-dflash", "propose"),
    ("select_rope", "tiny-dflash-yarn", "append_context"),
    ("fuse_lm_head_argmax", "tiny-dflash", "propose"),
    ("fuse_block_embed", "tiny-dflash", "propose"),
)
# Phases a pass must leave exactly as they are (the pattern does not occur there).
UNTOUCHED = {
    "fuse_kv_writes": "propose",
    "fuse_context_kv": "propose",
    "fuse_qkv": "append_context",
    "fuse_gate_up": "append_context",
    "fuse_residual_norm": "append_context",
    "fuse_lm_head_argmax": "append_context",
    "fuse_block_embed": "append_context",
    "fuse_gate_up_silu": "append_context",
}
# Fusing GEMMs changes fp32 summation order: KV differs by ~1e-6, logits of magnitude ~24 (tiny-dflash-yarn)
# by ~2e-5. A wrong fusion (order, slice bounds, halves) changes values by O(1), far above this.
TOL = {"rtol": 1e-4, "atol": 1e-4}


# helpers -------------------------------------------------------------------------------------------------
@functools.cache
def _tiny(name: str) -> Tiny:
    return tiny(name)


@functools.cache
def _baseline(name: str) -> Run:
    t = _tiny(name)
    return run(t.program, t.tensors)


def _ctx(t: Tiny) -> PassContext:
    return PassContext(t.config, BuildOptions())


def _apply(t: Tiny, passes: list[Pass], program: Program | None = None) -> Program:
    program = program or t.program
    for p in passes:
        program = program.with_phases(p(program.append_context, _ctx(t)), p(program.propose, _ctx(t)))
    return program


def golden_path(pass_name: str, example: str, phase: str) -> Path:
    return GOLDEN / f"{pass_name}.{example}.{phase}.txt"


def golden_text(pass_name: str, example: str, phase: str) -> str:
    """What the golden file of a case holds: the phase's dump before and after the pass."""
    t = _tiny(example)
    before = t.program.phases[phase]
    after = PASSES[pass_name](before, _ctx(t))
    header = f"# {pass_name} on {example}, phase {phase}. Regenerate: python tests/unit/golden/regenerate.py\n"
    return f"{header}# ---- before\n{dump(before)}# ---- after\n{dump(after)}"


def _readers(graph: Graph, ref: Ref | str) -> list[str]:
    return [dst for dst, _ in graph.users(ref)]


def _ops(graph: Graph, op: Op) -> list[str]:
    return [name for name, _ in graph.nodes_of(op)]


def _weight_of(graph: Graph, matmul: str) -> tuple[str, Node]:
    w = graph.inputs(matmul)[1].node
    return w, graph.node(w)


def _source_of(graph: Graph, ref: Ref, through: tuple[Op, ...] = (Op.HEAD_RMSNORM, Op.ROPE)) -> Ref:
    while graph.node(ref.node).op in through:
        ref = graph.inputs(ref.node)[0]
    return ref


def _slice_of(graph: Graph, ref: Ref) -> tuple[str, int, int]:
    """(sliced node, start, stop) of the SLICE a value comes from."""
    src = _source_of(graph, ref)
    node = graph.node(src.node)
    assert node.op is Op.SLICE, f"{src.node} is {node.op.value}, expected a slice"
    return graph.inputs(src.node)[0].node, int(node.attr("start")), int(node.attr("stop"))


def _materialize(t: Tiny, node: Node) -> np.ndarray:
    return WeightCache(t.tensors).get(node.attr("decl"))


# (a) golden dumps ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("pass_name", "example", "phase"), GOLDEN_CASES)
def test_golden_dump(pass_name: str, example: str, phase: str) -> None:
    path = golden_path(pass_name, example, phase)
    assert path.exists(), f"{path} missing: run python tests/unit/golden/regenerate.py and review it"
    assert golden_text(pass_name, example, phase) == path.read_text(), (
        f"{pass_name} changed the dump of {example}/{phase}; if intended, run "
        "python tests/unit/golden/regenerate.py and review the diff"
    )


# (b) numeric equivalence over the multi-step protocol -------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
@pytest.mark.parametrize("pass_name", list(PASSES))
def test_pass_preserves_numbers(pass_name: str, example: str) -> None:
    t = _tiny(example)
    assert_equivalent(_baseline(example), run(_apply(t, [PASSES[pass_name]]), t.tensors), **TOL)


@pytest.mark.parametrize("example", TINY)
def test_all_passes_in_sequence_preserve_numbers(example: str) -> None:
    t = _tiny(example)
    program = _apply(t, list(PASSES.values()))
    for graph in program.phases.values():
        verify(graph)
    assert not _ops(program.propose, Op.ADD) and len(_readers(program.append_context, "hidden_norm")) == 1
    assert_equivalent(_baseline(example), run(program, t.tensors), **TOL)


# (d) idempotence, purity, untouched phases ---------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
@pytest.mark.parametrize("pass_name", list(PASSES))
def test_pass_is_idempotent_and_pure(pass_name: str, example: str) -> None:
    t = _tiny(example)
    for phase, graph in t.program.phases.items():
        before = dump(graph)
        once = PASSES[pass_name](graph, _ctx(t))
        assert dump(graph) == before, f"{pass_name} mutated its input {phase}"
        verify(once)
        assert dump(PASSES[pass_name](once, _ctx(t))) == dump(once), f"{pass_name} twice != once on {phase}"
        if UNTOUCHED.get(pass_name) == phase:
            assert dump(once) == before


# (c) structure: fuse_context_kv --------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fuse_context_kv_structure(example: str) -> None:
    t = _tiny(example)
    cfg = t.config
    g = fuse_context_kv(t.program.append_context, _ctx(t))
    readers = _readers(g, "hidden_norm")
    assert len(readers) == 1 and g.node(readers[0]).op is Op.MATMUL
    fused = readers[0]
    kv = cfg.num_kv_heads * cfg.head_dim
    wname, w = _weight_of(g, fused)
    assert (fused, wname) == ("ctx_kv", "ctx_kv.weight")
    assert w.type.shape == (cfg.num_layers * 2 * kv, cfg.hidden_size)
    order = [f"layers.{i}.self_attn.{p}_proj.weight" for i in range(cfg.num_layers) for p in "kv"]
    assert w.attr("decl") == WeightDecl("concat_rows", tuple(order))
    np.testing.assert_array_equal(_materialize(t, w), np.concatenate([t.tensors[n] for n in order]))
    assert len(_ops(g, Op.MATMUL)) == 2  # fc and the fused K/V GEMM
    assert {n for n, _ in g.nodes_of(Op.WEIGHT)}.isdisjoint(order), "old k/v weights must be pruned"
    for name, node in g.nodes_of(Op.KV_WRITE):
        i, which = int(node.attr("layer")), int(node.attr("which"))
        start = (2 * i + which) * kv
        assert _slice_of(g, g.inputs(name)[1]) == (fused, start, start + kv), name


# (c) structure: fuse_head_prep ---------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fuse_head_prep_structure(example: str) -> None:
    """Each layer's q|k|v slices with their norms and RoPE, and every layer's context K|V slices, become one
    HEAD_PREP whose windows follow the fused weights' row order (DFLASH.md); head dims the kernel cannot lay
    out (16·2^i only) keep their nodes."""
    t = _tiny(example)
    cfg = t.config
    program = _apply(t, [fuse_context_kv, fuse_qkv, select_rope])
    after = _apply(t, [fuse_head_prep], program)
    if cfg.head_dim not in (16, 32, 64, 128, 256, 512):
        assert all(dump(after.phases[p]) == dump(program.phases[p]) for p in program.phases)
        return
    normed = bool(_ops(program.propose, Op.HEAD_RMSNORM))
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for phase, g in after.phases.items():
        assert not _ops(g, Op.SLICE) and not _ops(g, Op.HEAD_RMSNORM) and not _ops(g, Op.ROPE), phase
        for _, node in g.nodes_of(Op.HEAD_PREP):
            assert node.attr("head_dim") == cfg.head_dim and float(node.attr("attention_factor")) > 0
    g = after.propose
    for name, node in g.nodes_of(Op.BLOCK_ATTENTION):
        i = int(node.attr("layer"))
        refs = g.inputs(name)[:3]
        prep = refs[0].node
        assert [r.port for r in refs] == [0, 1, 2] and {r.node for r in refs} == {prep}
        windows = ((0, qd, normed, True), (qd, qd + kvd, normed, True), (qd + kvd, qd + 2 * kvd, False, False))
        assert g.node(prep).attr("windows") == windows
        qkv, positions, table, *weights = g.inputs(prep)
        assert (g.node(qkv.node).op, positions.node, table.node) == (Op.MATMUL, "blk_positions", "rope.inv_freq")
        norms = [f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"] if normed else []
        assert [g.node(w.node).attr("decl").sources[0] for w in weights] == norms
    g = after.append_context
    (prep,) = _ops(g, Op.HEAD_PREP)
    assert g.inputs(prep)[0].node == "ctx_kv"
    assert g.node(prep).attr("windows") == tuple(
        (s * kvd, (s + 1) * kvd, normed and s % 2 == 0, s % 2 == 0) for s in range(2 * cfg.num_layers)
    )
    for name, node in g.nodes_of(Op.KV_WRITE):
        assert g.inputs(name)[1] == Ref(prep, 2 * int(node.attr("layer")) + int(node.attr("which"))), name
    assert_equivalent(_baseline(example), run(after, t.tensors), **TOL)


@pytest.mark.parametrize("example", TINY)
def test_fuse_kv_writes_structure(example: str) -> None:
    """append_context's writes of every layer's K then V into the step's slots become one node whose targets
    follow the layers; the rows each target reads are the ones its KV_WRITE read."""
    t = _tiny(example)
    cfg = t.config
    before = t.program.append_context
    g = fuse_kv_writes(before, _ctx(t))
    assert not _ops(g, Op.KV_WRITE)
    (fused,) = _ops(g, Op.KV_WRITES)
    targets = tuple((i, which) for i in range(cfg.num_layers) for which in (0, 1))
    assert g.node(fused).attr("targets") == targets
    cache, slots, *rows = g.inputs(fused)
    assert (cache.node, slots.node) == ("kv_cache", "ctx_slots")
    writes = before.nodes_of(Op.KV_WRITE)
    old = {(int(n.attr("layer")), int(n.attr("which"))): before.inputs(name)[1] for name, n in writes}
    assert rows == [old[t] for t in targets]
    assert _readers(g, fused) == _readers(before, _ops(before, Op.KV_WRITE)[-1])  # the phase's cache output
    assert_equivalent(_baseline(example), run(_apply(t, [fuse_kv_writes]), t.tensors), **TOL)


def test_fuse_head_prep_needs_selected_rope() -> None:
    t = _tiny("tiny-dflash")
    program = _apply(t, [fuse_context_kv, fuse_qkv])  # RoPE still reads no table
    assert all(dump(fuse_head_prep(g, _ctx(t))) == dump(g) for g in program.phases.values())


# (c) structure: fuse_qkv ---------------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fuse_qkv_structure(example: str) -> None:
    t = _tiny(example)
    cfg = t.config
    before, g = t.program.propose, fuse_qkv(t.program.propose, _ctx(t))
    assert len(_ops(g, Op.MATMUL)) == len(_ops(before, Op.MATMUL)) - 2 * cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, node in g.nodes_of(Op.BLOCK_ATTENTION):
        i = int(node.attr("layer"))
        q, k, v = (_slice_of(g, ref) for ref in g.inputs(name)[:3])
        fused = q[0]
        assert (q, k, v) == ((fused, 0, qd), (fused, qd, qd + kvd), (fused, qd + kvd, qd + 2 * kvd))
        x = before.inputs(_source_of(before, before.inputs(name)[0]).node)[0]  # what q_proj read
        assert g.inputs(fused)[0] == x
        assert [r for r in _readers(g, x) if g.node(r).op is Op.MATMUL] == [fused]
        _, w = _weight_of(g, fused)
        names = tuple(f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkv")
        assert w.attr("decl") == WeightDecl("concat_rows", names) and w.type.shape == (qd + 2 * kvd, cfg.hidden_size)
        np.testing.assert_array_equal(_materialize(t, w), np.concatenate([t.tensors[n] for n in names]))


# (c) structure: fuse_gate_up -----------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fuse_gate_up_structure(example: str) -> None:
    t = _tiny(example)
    cfg = t.config
    before, g = t.program.propose, fuse_gate_up(t.program.propose, _ctx(t))
    assert len(_ops(g, Op.MATMUL)) == len(_ops(before, Op.MATMUL)) - cfg.num_layers
    assert len(_ops(g, Op.SLICE)) == len(_ops(before, Op.SLICE)) == 0
    acts = _ops(g, Op.SILU_MUL)
    assert len(acts) == cfg.num_layers
    for i, act in enumerate(acts):
        (src,) = g.inputs(act)
        assert g.node(src.node).op is Op.MATMUL
        assert g.inputs(src.node)[0] == before.inputs(before.inputs(act)[0].node)[0]  # same MLP input
        _, w = _weight_of(g, src.node)
        names = (f"layers.{i}.mlp.gate_proj.weight", f"layers.{i}.mlp.up_proj.weight")
        assert w.attr("decl") == WeightDecl("concat_rows", names)
        assert w.type.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
        assert g.node(act).type.shape[-1] == cfg.intermediate_size


# (c) structure: fuse_residual_norm -----------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fuse_residual_norm_structure(example: str) -> None:
    t = _tiny(example)
    layers = t.config.num_layers
    g = fuse_residual_norm(t.program.propose, _ctx(t))
    assert not _ops(g, Op.ADD)
    assert len(_ops(g, Op.RMSNORM_RESIDUAL)) == 2 * layers  # attn → post_norm, mlp → next input_norm / final
    assert _ops(g, Op.RMSNORM) == ["l0.input_norm"]  # reads the embedding, not an add
    last = g.inputs("drop_anchor")[0]
    assert last == Ref(f"l{layers - 1}.mlp_residual", 1), "final_norm must be port 1 of the last residual"
    assert g.inputs(last.node)[2].node == "norm.weight"
    for name in _ops(g, Op.RMSNORM_RESIDUAL):
        assert _readers(g, Ref(name, 1)), f"{name}: the normalised sum must replace the rmsnorm's readers"
    # The residual stream (port 0) goes on into the next fused add.
    assert g.inputs("l1.attn_residual")[0] == Ref("l0.mlp_residual", 0)


def _two_norm_graph() -> Graph:
    g = Graph("t", {"rows": "rows"})
    f32 = TensorType("float32", ("rows", 4))
    a = g.add("a", Node.make(Op.INPUT, [f32]))
    b = g.add("b", Node.make(Op.INPUT, [f32]))
    w = g.add("w", Node.make(Op.WEIGHT, [TensorType("float32", (4,))], decl=WeightDecl.of("w")))
    s = g.add("s", Node.make(Op.ADD, [f32]), [a, b])
    n1 = g.add("n1", Node.make(Op.RMSNORM, [f32], eps=1e-6), [s, w])
    n2 = g.add("n2", Node.make(Op.RMSNORM, [f32], eps=1e-6), [s, w])
    both = g.add("both", Node.make(Op.ADD, [f32]), [n1, n2])
    g.add("out", Node.make(Op.OUTPUT, [f32]), [both])
    return g


def test_fuse_residual_norm_skips_an_add_with_two_norm_readers() -> None:
    t = _tiny("tiny-dflash")
    g = _two_norm_graph()
    assert dump(fuse_residual_norm(g, _ctx(t))) == dump(g)


# (c) structure: fuse_lm_head_argmax ----------------------------------------------------------------------
def test_fuse_lm_head_argmax_structure() -> None:
    t = _tiny("tiny-dflash")
    before = t.program.propose
    g = fuse_lm_head_argmax(before, _ctx(t))
    assert not _ops(g, Op.LM_HEAD) and not _ops(g, Op.ARGMAX)
    assert _ops(g, Op.LM_HEAD_ARGMAX) == ["argmax"]  # the argmax's name: its readers read it unchanged
    assert g.inputs("argmax") == before.inputs("lm_head")  # drop_anchor's rows and the target's lm_head
    assert g.node("argmax").outputs == before.node("argmax").outputs  # int32 [nb*(blk-1)]
    assert _readers(g, "argmax") == ["tokens"]


@pytest.mark.parametrize("example", ["tiny-dflash2", "tiny-dspark"])
def test_fuse_lm_head_argmax_leaves_logits_other_ops_read(example: str) -> None:
    t = _tiny(example)  # DFlash2's top-k and DSpark's Markov walk read the logits
    assert _ops(t.program.propose, Op.LM_HEAD)
    assert dump(fuse_lm_head_argmax(t.program.propose, _ctx(t))) == dump(t.program.propose)


def _head_graph(readers: int, fp8: bool, k: int = 64) -> Graph:
    g = Graph("t", {"rows": "rows"})
    x = g.add("x", Node.make(Op.INPUT, [TensorType("bfloat16", ("rows", k))]))
    w_type = TensorType("float8_e4m3fn" if fp8 else "bfloat16", (100, k))
    w = g.add("w", Node.make(Op.WEIGHT, [w_type], decl=WeightDecl.of("w")))
    scale = [g.add("s", Node.make(Op.WEIGHT, [TensorType("float32", (100,))], decl=WeightDecl.of("s")))] if fp8 else []
    logits = g.add("lm_head", Node.make(Op.LM_HEAD, [TensorType("float32", ("rows", 100))]), [x, w, *scale])
    ids = TensorType("int32", ("rows",))
    g.add("argmax", Node.make(Op.ARGMAX, [ids]), [logits])
    g.add("tokens", Node.make(Op.OUTPUT, [ids]), ["argmax"])
    if readers > 1:
        g.add("logits", Node.make(Op.OUTPUT, [TensorType("float32", ("rows", 100))]), [logits])
    return g


def test_fuse_lm_head_argmax_takes_the_fp8_form_and_skips_shared_logits() -> None:
    t = _tiny("tiny-dflash")
    fused = fuse_lm_head_argmax(_head_graph(1, fp8=True), _ctx(t))
    verify(fused)
    assert _ops(fused, Op.LM_HEAD_ARGMAX) == ["argmax"]
    assert [ref.node for ref in fused.inputs("argmax")] == ["x", "w", "s"]
    shared = _head_graph(2, fp8=False)  # the logits are also a graph output: they must be written
    assert dump(fuse_lm_head_argmax(shared, _ctx(t))) == dump(shared)
    odd_k = _head_graph(1, fp8=False, k=48)  # no tensor-core kernel takes k = 48: nothing to fuse
    assert dump(fuse_lm_head_argmax(odd_k, _ctx(t))) == dump(odd_k)


# (c) structure: fuse_gate_up_silu ------------------------------------------------------------------------
def test_interleave_rows_alternates_the_halves_by_group() -> None:
    from dflash_compiler.ir.weights import interleave_rows

    rows = np.arange(32)  # gate rows 0..15, up rows 16..31
    (got,) = interleave_rows(np.stack([rows, -rows], axis=1), group=8)
    assert got[:, 0].tolist() == [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert got[:, 1].tolist() == (-got[:, 0]).tolist()  # whole rows move
    with pytest.raises(ValueError, match="multiple of 8"):
        interleave_rows(np.zeros(24), group=8)


@pytest.mark.parametrize("example", TINY)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fuse_gate_up_silu_structure(example: str, precision: str) -> None:
    from dflash_compiler.ir_passes.choose_precision import choose_precision
    from dflash_compiler.options import Precision

    t = _tiny(example)
    ctx = PassContext(t.config, BuildOptions(precision=Precision(precision)), t.tensors.__getitem__)
    before = choose_precision(fuse_gate_up(t.program.propose, ctx), ctx)
    g = fuse_gate_up_silu(before, ctx)
    verify(g)
    if t.config.hidden_size % 64:  # tiny-dflash-yarn's k = 48: no tensor-core kernel, so nothing to fuse
        assert dump(g) == dump(before)
        return
    assert not _ops(g, Op.SILU_MUL)
    fused = _ops(g, Op.MATMUL_SILU)
    assert fused == [f"l{i}.silu_mul" for i in range(t.config.num_layers)]
    for name in fused:
        layer = name.split(".")[0]
        assert g.node(name).attr("group") == GROUP and g.node(name).outputs == before.node(name).outputs
        assert _readers(g, name) == _readers(before, name)  # the down projection
        inputs = g.inputs(name)
        assert inputs == before.inputs(f"{layer}.gate_up")  # x, then the weight (and the FP8 scale) nodes
        for ref in inputs[1:]:
            decl, old = g.node(ref.node).attr("decl"), before.node(ref.node).attr("decl")
            assert decl == WeightDecl("interleave_rows", (old,), (("group", GROUP),)), ref.node
        assert len(inputs) == (3 if precision == "fp8" else 2)
    # the same drafts, cache and logits over the multi-step protocol (FP8: with the quantized weights)
    plain_program = t.program.with_phases(t.program.append_context, before)
    fused_program = t.program.with_phases(t.program.append_context, g)
    assert_equivalent(run(plain_program, t.tensors), run(fused_program, t.tensors), **TOL)
    # the interleaved weight: gate rows r..r+7, then up rows r..r+7, ...
    w = _materialize(t, g.node(g.inputs(fused[0])[1].node))
    plain = _materialize(t, before.node(before.inputs("l0.gate_up")[1].node))
    half = plain.shape[0] // 2
    np.testing.assert_array_equal(w[GROUP : 2 * GROUP], plain[half : half + GROUP])
    np.testing.assert_array_equal(w[2 * GROUP : 3 * GROUP], plain[GROUP : 2 * GROUP])


# (c) structure: fuse_block_embed -------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fuse_block_embed_structure(example: str) -> None:
    t = _tiny(example)
    before = t.program.propose
    g = fuse_block_embed(before, _ctx(t))
    assert not _ops(g, Op.BLOCK_IDS) and not _ops(g, Op.EMBED)
    assert _ops(g, Op.BLOCK_EMBED) == ["embed"]  # the embed's name: its readers read it unchanged
    assert [ref.node for ref in g.inputs("embed")] == ["anchors", "target.embed_tokens"]
    node, cfg = g.node("embed"), t.config
    assert (node.attr("block"), node.attr("mask_token_id")) == (cfg.block_size, cfg.mask_token_id)
    assert node.attr("scale") == cfg.input_embedding_scale and node.outputs == before.node("embed").outputs
    assert _readers(g, "embed") == _readers(before, "embed")


def test_fuse_block_embed_skips_ids_read_twice() -> None:
    t = _tiny("tiny-dflash")
    g = Graph("t", {"nb": "nb", "rows": "rows"})
    anchors = g.add("anchors", Node.make(Op.INPUT, [TensorType("int32", ("nb",))]))
    table = g.add("table", Node.make(Op.WEIGHT, [TensorType("bfloat16", (10, 4))], decl=WeightDecl.of("table")))
    ids_type = TensorType("int32", ("rows",))
    ids = g.add("ids", Node.make(Op.BLOCK_IDS, [ids_type], block=4, mask_token_id=9), [anchors])
    rows = g.add("rows", Node.make(Op.EMBED, [TensorType("bfloat16", ("rows", 4))], scale=1.0), [ids, table])
    g.add("out", Node.make(Op.OUTPUT, [TensorType("bfloat16", ("rows", 4))]), [rows])
    g.add("ids_out", Node.make(Op.OUTPUT, [ids_type]), [ids])
    assert dump(fuse_block_embed(g, _ctx(t))) == dump(g)


# (c, e) structure and values: select_rope ----------------------------------------------------------------
def _table(t: Tiny, g: Graph) -> np.ndarray:
    ropes = _ops(g, Op.ROPE)
    tables = {g.inputs(r)[2] for r in ropes}
    assert len(tables) == 1, "one shared table node per phase"
    (table,) = tables
    node = g.node(table.node)
    assert node.op is Op.WEIGHT and node.type == TensorType("float32", (t.config.head_dim // 2,))
    assert not any(g.node(r).has("rope") for r in ropes)
    return _materialize(t, node)


@pytest.mark.parametrize("phase", ["append_context", "propose"])
def test_select_rope_default_table(phase: str) -> None:
    t = _tiny("tiny-dflash")
    d = t.config.head_dim
    g = select_rope(t.program.phases[phase], _ctx(t))
    expected = 10000.0 ** (-np.arange(0, d, 2) / d)  # DFLASH.md §1.3: theta^(-2j/D)
    np.testing.assert_allclose(_table(t, g), expected.astype(np.float32), rtol=1e-7)
    assert {g.node(r).attr("attention_factor") for r in _ops(g, Op.ROPE)} == {1.0}
    choice = g.meta["rope"]
    assert isinstance(choice, RopeChoice)
    assert (choice.rope_type.value, choice.theta, choice.attention_factor, choice.table_length) == (
        "default",
        10000.0,
        1.0,
        d // 2,
    )


@pytest.mark.parametrize("phase", ["append_context", "propose"])
def test_select_rope_yarn_table_and_attention_factor(phase: str) -> None:
    t = _tiny("tiny-dflash-yarn")
    g = select_rope(t.program.phases[phase], _ctx(t))
    inv_freq, _ = rope_tables(t.config.rope, t.config.head_dim)
    np.testing.assert_array_equal(_table(t, g), inv_freq.astype(np.float32))
    factor = 0.1 * math.log(4.0) + 1.0  # YaRN mscale for factor 4 (the example's rope_parameters)
    (found,) = {g.node(r).attr("attention_factor") for r in _ops(g, Op.ROPE)}
    assert found == pytest.approx(factor, rel=1e-12)
    choice = g.meta["rope"]
    assert choice.rope_type.value == "yarn" and choice.theta == 1e6 and choice.table_length == 6
    assert choice.attention_factor == pytest.approx(factor)
    assert "yarn" in dump(g).splitlines()[-1]


def _with_rope_type(graph: Graph, node: str, rope_type: str) -> Graph:
    g = graph.copy()
    spec = dict(g.node(node).attr("rope")) | {"rope_type": rope_type}
    g.set_node(node, g.node(node).with_attrs(rope=spec))
    return g


@pytest.mark.parametrize("variant", ["llama3", "dynamic"])
def test_select_rope_refuses_unknown_variants(variant: str) -> None:
    t = _tiny("tiny-dflash")
    g = _with_rope_type(t.program.append_context, "l1.ctx_k_rope", variant)
    with pytest.raises(UnsupportedRopeError) as info:
        select_rope(g, _ctx(t))
    message = str(info.value)
    assert isinstance(info.value, DFlashError)
    for part in ("'l1.ctx_k_rope'", f"'{variant}'", "'default', 'linear', 'yarn'", "Fix:"):
        assert part in message, (part, message)


def test_select_rope_refuses_yarn_without_original_length() -> None:
    t = _tiny("tiny-dflash-yarn")
    g = t.program.append_context.copy()
    node = g.node("l0.ctx_k_rope")
    spec = dict(node.attr("rope")) | {"original_max_position_embeddings": None}
    g.set_node("l0.ctx_k_rope", node.with_attrs(rope=spec))
    with pytest.raises(UnsupportedRopeError, match=r"'l0\.ctx_k_rope'.*original_max_position_embeddings"):
        select_rope(g, _ctx(t))
