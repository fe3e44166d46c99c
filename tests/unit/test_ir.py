"""Graph IR: construction, verification, dumps and the interpreter's independent semantics."""

from __future__ import annotations

import numpy as np
import pytest
from pass_harness import TINY, tiny

from dflash_compiler.ir import (
    Graph,
    Node,
    Op,
    Ref,
    TensorType,
    VerifyError,
    WeightCache,
    WeightDecl,
    dump,
    eval_dim,
    interpret,
    to_dot,
    verify,
)
from dflash_compiler.ir.interpret import InterpretError, attention_mask
from dflash_compiler.ir.ops import OpKind

F32 = "float32"


def _small_graph() -> Graph:
    g = Graph("t", {"rows": "rows"})
    x = g.add("x", Node.make(Op.INPUT, [TensorType(F32, ("rows", 4))]))
    w = g.add("w", Node.make(Op.WEIGHT, [TensorType(F32, (3, 4))], decl=WeightDecl.of("w")))
    y = g.add("y", Node.make(Op.MATMUL, [TensorType(F32, ("rows", 3))]), [x, w])
    g.add("out", Node.make(Op.OUTPUT, [TensorType(F32, ("rows", 3))]), [y])
    return g


def test_every_op_has_a_kind_and_spec():
    from dflash_compiler.ir.spec import SPECS

    assert set(SPECS) == set(Op)
    assert {op.kind for op in Op} == set(OpKind)
    assert Op.MATMUL_FP8.kind is OpKind.LINEAR and Op.BLOCK_ATTENTION.kind is OpKind.ATTENTION


def test_nodes_are_frozen_records():
    node = Node.make(Op.SCALE, [TensorType(F32, (2,))], factor=2.0)
    with pytest.raises(AttributeError):
        node.op = Op.ADD  # type: ignore[misc]
    assert node.attr("factor") == 2.0
    assert node.with_attrs(factor=3.0).attr("factor") == 3.0 and node.attr("factor") == 2.0
    with pytest.raises(KeyError, match="no attribute"):
        node.attr("missing")


def test_eval_dim():
    assert eval_dim("nb*(blk-1)", {"nb": 3, "blk": 16}) == 45
    assert eval_dim(7, {}) == 7
    with pytest.raises(KeyError, match="no binding"):
        eval_dim("ctx", {})


def test_interpret_matmul_and_shape_check():
    g = _small_graph()
    verify(g)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 4)), rng.standard_normal((3, 4))
    out = interpret(g, {"x": x}, WeightCache({"w": w}), {}, {"rows": 5})
    np.testing.assert_allclose(out["out"], x @ w.T, rtol=1e-5, atol=1e-6)
    with pytest.raises(InterpretError, match="declared"):
        interpret(g, {"x": x}, WeightCache({"w": w}), {}, {"rows": 6})


def test_verify_reports_bad_graphs():
    g = _small_graph()
    g.set_node("w", Node.make(Op.WEIGHT, [TensorType(F32, (3, 5))], decl=WeightDecl.of("w")))
    with pytest.raises(VerifyError, match="inner dims differ"):
        verify(g)
    g = _small_graph()
    g.set_node("y", Node.make(Op.RMSNORM, [TensorType(F32, ("rows", 3))]))
    with pytest.raises(VerifyError, match="missing attributes"):
        verify(g)
    g = _small_graph()
    g.set_node("x", Node.make(Op.INPUT, [TensorType(F32, ("ctx", 4))]))
    with pytest.raises(VerifyError, match="undeclared dims"):
        verify(g)
    g = _small_graph()
    g.set_node("w", Node.make(Op.WEIGHT, [TensorType(F32, (3, 4))], decl=WeightDecl("no_such_transform", ("w",))))
    with pytest.raises(VerifyError, match="unknown weight transform"):
        verify(g)


def test_graph_rewrite_helpers():
    g = _small_graph()
    g.add("z", Node.make(Op.SCALE, [TensorType(F32, ("rows", 3))], factor=2.0), ["y"])
    g.redirect(Ref("y"), Ref("z"), keep=["z"])
    assert g.inputs("out") == [Ref("z")]
    assert g.inputs("z") == [Ref("y")]
    h = g.copy()
    h.add("dead", Node.make(Op.SCALE, [TensorType(F32, ("rows", 3))], factor=1.0), ["y"])
    assert h.prune() == ["dead"]
    assert "dead" not in h and len(g) == len(h)
    with pytest.raises(ValueError, match="still has readers"):
        g.remove(["y"])
    with pytest.raises(ValueError, match="unknown node"):
        g.add("bad", Node.make(Op.ADD, [TensorType(F32, ("rows", 3))]), ["y", "nope"])


@pytest.mark.parametrize("name", TINY)
def test_lowered_graphs_verify_and_dump(name):
    t = tiny(name)
    for graph in t.program.phases.values():
        verify(graph)
        text = dump(graph)
        assert text.count("\n") == len(graph) + 1
        assert f"graph {graph.name}" in text
        dot = to_dot(graph)
        assert dot.startswith(f'digraph "{graph.name}"') and dot.count("->") == graph._g.number_of_edges()


def test_lowered_graph_structure_qwen3_8b():
    from pass_harness import EXAMPLES

    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.lower import lower

    program = lower(load_drafter_config(EXAMPLES / "qwen3-8b-dflash-b16"))
    propose = program.propose
    matmuls = [n for n, _ in propose.nodes_of(Op.MATMUL)]
    assert len(matmuls) == 5 * 7  # q, k, v, o, gate, up, down per layer
    assert propose.type_of("lm_head").shape == ("nb*(blk-1)", 151936)
    assert [n for n, _ in program.append_context.nodes_of(Op.KV_WRITE)][:2] == ["l0.write_k", "l0.write_v"]
    attn = propose.node("l0.attention")
    assert (attn.attr("causal"), attn.attr("window"), attn.attr("heads"), attn.attr("kv_heads")) == (False, None, 32, 8)


def test_attention_mask_matches_definition():
    q = np.array([10, 11, 12])
    k = np.arange(13)
    full = attention_mask(q, k, causal=False, window=None)
    assert full.all()
    causal = attention_mask(q, k, causal=True, window=3)
    for i, qp in enumerate(q):
        for kp in k:
            assert causal[i, kp] == (kp <= qp and qp - kp < 3)
    sym = attention_mask(q, k, causal=False, window=2)
    for i, qp in enumerate(q):
        for kp in k:
            assert sym[i, kp] == (abs(int(qp) - int(kp)) < 2)


def test_conv2_against_loop():
    from dflash_compiler.ir.interpret import _IMPL

    rng = np.random.default_rng(1)
    blk, width, k, g = 4, 8, 2, 4
    x = rng.standard_normal((2 * blk, width))
    dyn = rng.standard_normal((2 * blk, 2 * k * (width // g)))
    base = rng.standard_normal((2, k, width))
    node = Node.make(Op.CONV2, [TensorType(F32, (2 * blk, width))], tap=1, kernel=k, group=g, block=blk)
    got = _IMPL[Op.CONV2](node, [x, dyn, base])
    d = dyn.reshape(2, blk, 2, k, width // g)
    want = np.zeros((2, blk, width))
    xs = x.reshape(2, blk, width)
    for s in range(2):
        for t in range(blk):
            for c in range(width):
                for o in range(k):
                    if t - o >= 0:
                        want[s, t, c] += (base[1, o, c] + d[s, t, 1, o, c // g]) * xs[s, t - o, c]
    np.testing.assert_allclose(got, want.reshape(2 * blk, width), rtol=1e-5, atol=1e-6)
