"""choose_precision and calibration: golden dumps, which linears convert, the e4m3 weights, numbers, auto.

Expected names and bounds come from the config's layer list and e4m3's format (3 mantissa bits, max 448),
never from the pass's own helpers. Golden files are written by
``python tests/unit/golden/regenerate.py`` and reviewed by hand; the tests only compare.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from pass_harness import TINY, tiny

from dflash_compiler.calibrate import collect_calibration
from dflash_compiler.config import Family
from dflash_compiler.graph_runner import GraphDrafter
from dflash_compiler.ir import Graph, Node, Op, TensorType, WeightCache, WeightDecl, dump, interpret, verify
from dflash_compiler.ir.weights import e4m3_as_f32, quantize_fp8_rows
from dflash_compiler.ir_passes.choose_precision import choose_precision, fp8_relative_error
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.ir_passes.fuse_context_kv import fuse_context_kv
from dflash_compiler.ir_passes.fuse_qkv import fuse_qkv
from dflash_compiler.lower import Program
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import Choice, PlanError, PrecisionMap
from dflash_compiler.protocol import Scenario, run_scenario

GOLDEN = Path(__file__).resolve().parent / "golden"
GOLDEN_CASES = [("tiny-dflash", "append_context"), ("tiny-dflash", "propose")]
GOLDEN_OPTIONS = BuildOptions(precision="fp8", exclude=("layers.0.*",))
E4M3_MAX = 448.0
E4M3_REL = 2.0**-4  # half a unit in the last place with 3 mantissa bits
E4M3_SUBNORMAL_ABS = 2.0**-10  # half the subnormal spacing 2^-9 (in the scaled domain)
LINEAR_OPS = (Op.MATMUL, Op.MATMUL_FP8, Op.LM_HEAD)
PROPOSE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# helpers ---------------------------------------------------------------------------------------------------
@cache
def calibration(example: str) -> dict[str, np.ndarray]:
    t = tiny(example)
    return collect_calibration(t.program, t.tensors)


def context(example: str, calibrated: bool = True, **options) -> PassContext:
    t = tiny(example)
    return PassContext(
        t.config,
        BuildOptions(**options),
        t.tensors.__getitem__,
        calibration(example) if calibrated else None,
    )


def convert(example: str, ctx: PassContext) -> Program:
    program = tiny(example).program
    return program.with_phases(*(choose_precision(g, ctx) for g in program.phases.values()))


def precision_map(graph: Graph) -> PrecisionMap:
    plan = graph.meta["precision"]
    assert isinstance(plan, PrecisionMap)
    return plan


def linears_of(program: Program) -> dict[str, tuple[Choice, float | None]]:
    out = {}
    for graph in program.phases.values():
        for lin in precision_map(graph).linears:
            out[lin.name] = (lin.choice, lin.error)
    return out


def expected_linear_names(example: str) -> set[str]:
    """Every linear of the lowered drafter by checkpoint name: fc, per-layer attention and MLP, lm_head."""
    cfg = tiny(example).config
    names = {"fc", "lm_head"}
    for i in range(cfg.num_layers):
        names |= {f"layers.{i}.{leaf}" for leaf in PROPOSE_LINEARS + MLP_LINEARS}
        if cfg.dflash2 is not None:
            names |= {f"layers.{i}.attention_conv.kernel_projection", f"layers.{i}.mlp_conv.kernel_projection"}
    if cfg.dflash2 is not None:
        names.add("candidate_selector.hidden_projection")
    return names


def golden_path(example: str, phase: str) -> Path:
    return GOLDEN / f"choose_precision.{example}.{phase}.txt"


def golden_text(example: str, phase: str) -> str:
    t = tiny(example)
    before = t.program.phases[phase]
    ctx = PassContext(t.config, GOLDEN_OPTIONS)
    after = choose_precision(before, ctx)
    header = (
        f"# choose_precision on {example}, phase {phase}, precision fp8, exclude ['layers.0.*']. "
        "Regenerate: python tests/unit/golden/regenerate.py\n"
    )
    return header + "# ---- before\n" + dump(before) + "# ---- after\n" + dump(after)


class _LogitRecorder:
    """Forwards to a GraphDrafter and keeps every propose's logits (the lm_head output)."""

    def __init__(self, drafter: GraphDrafter) -> None:
        self.drafter = drafter
        self.logits: list[np.ndarray] = []

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def propose(self, seq_ids, anchors):
        drafts = self.drafter.propose(seq_ids, anchors)
        self.logits.append(np.array(self.drafter.last_values["propose"]["lm_head"]))
        return drafts


def run_steps(program: Program, tensors: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(tokens, logits) of every propose step of the default scenario; its inputs do not depend on drafts."""
    for graph in program.phases.values():
        verify(graph)
    cfg = program.config
    rec = _LogitRecorder(GraphDrafter(program, tensors, num_pages=64, max_seq_len=512))
    records = run_scenario(rec, cfg, Scenario()).records
    return [r.tokens.reshape(-1) for r in records], rec.logits


# (a) golden dumps ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("example", "phase"), GOLDEN_CASES)
def test_golden_dump(example: str, phase: str) -> None:
    path = golden_path(example, phase)
    assert path.exists(), f"{path} missing: run python tests/unit/golden/regenerate.py"
    assert golden_text(example, phase) == path.read_text(), (
        f"{path.name} differs: if the change is intended, run "
        "python tests/unit/golden/regenerate.py and review the diff"
    )


# (b) which linears convert ---------------------------------------------------------------------------------
def test_fp8_converts_exactly_the_linears_not_excluded() -> None:
    t = tiny("tiny-dflash")
    program = convert("tiny-dflash", PassContext(t.config, GOLDEN_OPTIONS))
    choices = linears_of(program)
    assert set(choices) == expected_linear_names("tiny-dflash")
    excluded = {n for n in choices if n.startswith("layers.0.")}
    assert {n for n, (c, _) in choices.items() if c is Choice.BF16} == excluded
    assert {n for n, (c, _) in choices.items() if c is Choice.FP8} == set(choices) - excluded
    for graph in program.phases.values():
        verify(graph)
        for name in graph.names():
            node = graph.node(name)
            ins = [ref.node for ref in graph.inputs(name)]
            if node.op is Op.MATMUL:  # bf16 linears read their checkpoint tensor, all in layer 0
                assert ins[1].startswith("layers.0."), name
            if node.op is Op.MATMUL_FP8 or (node.op is Op.LM_HEAD and len(ins) == 3):
                w8, scale = graph.node(ins[1]), graph.node(ins[2])
                assert w8.type.dtype == "float8_e4m3fn" and scale.type.dtype == "float32"
                source = w8.attr("decl").sources[0]
                assert w8.attr("decl") == WeightDecl("fp8_e4m3_rows", (source,), output=0)
                assert scale.attr("decl") == WeightDecl("fp8_e4m3_rows", (source,), output=1)
                assert not source.checkpoint_names()[0].startswith("layers.0.")
        ops = [graph.node(n).op for n in graph.names()]
        if graph.name == "propose":  # layers 1, 2 x 7 linears; lm_head keeps its op in the 3-input form
            assert ops.count(Op.MATMUL_FP8) == 14 and ops.count(Op.MATMUL) == 7
            assert len(graph.inputs("lm_head")) == 3
        else:  # fc + k/v of layers 1, 2
            assert ops.count(Op.MATMUL_FP8) == 5 and ops.count(Op.MATMUL) == 2


def test_pass_is_pure_and_bf16_only_records() -> None:
    t = tiny("tiny-dflash")
    for graph in t.program.phases.values():
        before = dump(graph)
        out = choose_precision(graph, PassContext(t.config, GOLDEN_OPTIONS))
        assert dump(graph) == before and "precision" not in graph.meta
        assert out is not graph
        kept = choose_precision(graph, PassContext(t.config, BuildOptions()))
        assert dump(kept).split("meta precision")[0] == before.split("meta ")[0]
        plan = precision_map(kept)
        assert all(lin.choice is Choice.BF16 and lin.error is None for lin in plan.linears)


def test_fp8_without_calibration_records_no_errors_and_with_it_measures() -> None:
    blind = linears_of(convert("tiny-dflash", context("tiny-dflash", calibrated=False, precision="fp8")))
    assert all(err is None for _, err in blind.values())
    measured = linears_of(convert("tiny-dflash", context("tiny-dflash", precision="fp8")))
    assert all(c is Choice.FP8 and err is not None and 0 < err < E4M3_REL for c, err in measured.values())


def test_unmatched_exclude_globs_are_recorded() -> None:
    program = convert("tiny-dflash", context("tiny-dflash", precision="fp8", exclude=("fc", "lm_head", "nope.*")))
    assert precision_map(program.append_context).unmatched_exclude == ("lm_head", "nope.*")
    assert precision_map(program.propose).unmatched_exclude == ("fc", "nope.*")


def _fused_graph() -> Graph:
    """x @ [a; b].T and x @ [c; d].T with nested concat_rows declarations, as fusion passes make them."""
    g = Graph("fused", {"rows": "rows"})
    x = g.add("x", Node.make(Op.INPUT, [TensorType("float32", ("rows", 32))]))
    ab = WeightDecl("concat_rows", (WeightDecl.of("layers.0.a.weight"), "layers.1.b.weight"))
    cd = WeightDecl("concat_rows", (WeightDecl("concat_rows", ("layers.1.c.weight",)), WeightDecl.of("d.weight")))
    for name, decl in (("ab", ab), ("cd", cd)):
        w = g.add(f"{name}.weight", Node.make(Op.WEIGHT, [TensorType("float32", (24, 32))], decl=decl))
        y = g.add(name, Node.make(Op.MATMUL, [TensorType("float32", ("rows", 24))]), [x, w])
        g.add(f"{name}.out", Node.make(Op.OUTPUT, [TensorType("float32", ("rows", 24))]), [y])
    return g


def test_fused_weight_is_fp8_only_if_no_source_is_excluded() -> None:
    rng = np.random.default_rng(0)
    names = ("layers.0.a.weight", "layers.1.b.weight", "layers.1.c.weight", "d.weight")
    tensors = {n: rng.standard_normal((12, 32)).astype(np.float32) for n in names}
    graph = _fused_graph()
    ctx = PassContext(tiny("tiny-dflash").config, BuildOptions(precision="fp8", exclude=("layers.0.*",)))
    out = choose_precision(graph, ctx)
    verify(out)
    plan = precision_map(out)
    ab, cd = plan.get("layers.0.a+layers.1.b"), plan.get("layers.1.c+d")
    assert ab.choice is Choice.BF16 and ab.reason == "source 'layers.0.a' excluded by 'layers.0.*'"
    assert cd.choice is Choice.FP8 and cd.sources == ("layers.1.c.weight", "d.weight")
    assert out.node("ab").op is Op.MATMUL and out.node("cd").op is Op.MATMUL_FP8
    w8 = out.node(out.inputs("cd")[1].node).attr("decl")
    assert w8.sources == (graph.node("cd.weight").attr("decl"),)  # the nested declaration, unchanged
    x = rng.standard_normal((5, 32)).astype(np.float32)
    before, after = (interpret(g, {"x": x}, WeightCache(tensors), {}, {"rows": 5}) for g in (graph, out))
    np.testing.assert_array_equal(before["ab.out"], after["ab.out"])
    rel = np.linalg.norm(after["cd.out"] - before["cd.out"]) / np.linalg.norm(before["cd.out"])
    assert 0 < rel < E4M3_REL


# (c) the e4m3 weights --------------------------------------------------------------------------------------
def test_e4m3_weight_times_scale_reconstructs_w() -> None:
    t = tiny("tiny-dflash")
    graph = choose_precision(t.program.propose, PassContext(t.config, GOLDEN_OPTIONS))
    cache = WeightCache(t.tensors)
    checked = 0
    for name in graph.names():
        if graph.node(name).op is not Op.MATMUL_FP8 and not (name == "lm_head" and len(graph.inputs(name)) == 3):
            continue
        w8_node, scale_node = (graph.node(ref.node) for ref in graph.inputs(name)[1:])
        w8, scale = cache.get(w8_node.attr("decl")), cache.get(scale_node.attr("decl"))
        w = t.tensors[w8_node.attr("decl").checkpoint_names()[0]]
        assert w8.dtype == ml_dtypes.float8_e4m3fn and w8.shape == w.shape and scale.shape == (w.shape[0],)
        q = w8.astype(np.float32)
        np.testing.assert_array_equal(np.abs(q).max(axis=1), E4M3_MAX)  # each row's max-abs entry maps to 448
        np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / E4M3_MAX, rtol=1e-6)
        err = np.abs(q * scale[:, None] - w)
        bound = np.maximum(E4M3_REL * np.abs(w), E4M3_SUBNORMAL_ABS * scale[:, None]) * (1 + 1e-5)
        assert np.all(err <= bound), f"{name}: worst {np.max(err / bound):.3f} of the e4m3 bound"
        normal = np.abs(q) >= 2.0**-6
        assert np.max(err[normal] / np.abs(w[normal])) < 0.07
        checked += 1
    assert checked == 15  # 14 matmuls of layers 1-2 and lm_head


# (d) numbers before/after ----------------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_fp8_logits_stay_within_the_summed_linear_errors(example: str) -> None:
    """Bound: ‖Δlogits‖/‖logits‖ ≤ Σ e_i over every FP8 linear of both phases (e_i its recorded error).

    To first order each linear adds its relative output error once to the residual stream; RMSNorm
    removes scale, so errors add up rather than compound (the triangle inequality sums them). A layer can
    amplify one error a few times (seen up to ~4x in the random tiny drafters), which the sum over all
    linears covers with margin; a wrong scale or transposed weight gives O(1) errors and fails it.
    """
    t = tiny(example)
    program = convert(example, context(example, precision="fp8"))
    budget = sum(err for c, err in linears_of(program).values() if c is Choice.FP8 and err is not None)
    tokens_a, logits_a = run_steps(t.program, t.tensors)
    tokens_b, logits_b = run_steps(program, t.tensors)
    qualified = 0
    for a, b, ta, tb in zip(logits_a, logits_b, tokens_a, tokens_b, strict=True):
        rel = np.linalg.norm(b - a) / np.linalg.norm(a)
        assert 0 < rel <= budget, f"logit error {rel:.4f} above the summed linear errors {budget:.4f}"
        if t.config.family is not Family.DFLASH:
            continue  # drafts come from a selector / Markov walk, not the row argmax
        top2 = np.sort(a, axis=1)[:, -2:]
        safe = top2[:, 1] - top2[:, 0] > 2 * np.max(np.abs(b - a), axis=1)
        np.testing.assert_array_equal(ta[safe], tb[safe])
        qualified += int(safe.sum())
    if t.config.family is Family.DFLASH:
        total = sum(len(row) for row in tokens_a)
        print(f"{example}: {qualified}/{total} draft rows have a top-2 gap above twice their logit error")
        assert qualified >= 20, "too few rows with a safe top-2 gap for the draft check to mean much"


def test_lm_head_alone_errs_exactly_its_measured_error() -> None:
    t = tiny("tiny-dflash")
    names = expected_linear_names("tiny-dflash") - {"lm_head"}
    program = convert("tiny-dflash", context("tiny-dflash", precision="fp8", exclude=tuple(sorted(names))))
    assert linears_of(program)["lm_head"][0] is Choice.FP8
    drafter = GraphDrafter(program, t.tensors, num_pages=16, max_seq_len=128)
    drafter.create(0)
    drafter.append_context([0], [np.ones((9, t.config.fc_in_features), np.float32)], [np.arange(9)])
    drafter.propose([0], [3])
    values = drafter.last_values["propose"]
    x, logits = values["drop_anchor"], values["lm_head"]
    w = t.tensors["target.lm_head"]
    expected = np.linalg.norm(logits - x @ w.T) / np.linalg.norm(x @ w.T)
    assert expected == pytest.approx(fp8_relative_error(x, w), rel=1e-3)
    assert 0.005 < expected < E4M3_REL


def test_fp8_error_summed_over_weight_row_chunks_is_the_whole_matrix_formula(monkeypatch) -> None:
    """fp8_relative_error sums both norms chunk of weight rows by chunk; with chunks of 7 rows (ragged last
    one) it must give the formula computed on whole matrices in float64."""
    from dflash_compiler.ir_passes import choose_precision as module

    rng = np.random.default_rng(4)
    x = rng.standard_normal((37, 96)).astype(np.float32)
    w = (rng.standard_normal((50, 96)) * np.linspace(0.01, 3, 50)[:, None]).astype(np.float32)
    w8, scale = quantize_fp8_rows(w)
    w_hat = w8.astype(np.float64) * scale[:, None]
    exact = np.linalg.norm(x @ (w_hat - w).T) / np.linalg.norm(x.astype(np.float64) @ w.T)
    monkeypatch.setattr(module, "_ERROR_CHUNK_ELEMS", 7 * 96)
    assert fp8_relative_error(x, w) == pytest.approx(exact, rel=1e-5)
    assert fp8_relative_error(x, np.zeros_like(w)) == 0.0


def test_a_fused_weights_error_is_measured_part_by_part_without_building_it(monkeypatch) -> None:
    """interleave_rows(concat_rows(a, b)) and concat_rows(a, b, c) are row placements: their FP8 error on x is
    the one of the materialized fused matrix (f64 formula), while the measurement reads only the parts."""
    from dflash_compiler.ir.weights import TRANSFORMS, interleave_rows
    from dflash_compiler.ir_passes.choose_precision import _Linear, _measure, row_parts

    rng = np.random.default_rng(7)
    parts = {
        n: (rng.standard_normal((r, 64)) * s).astype(np.float32)
        for n, r, s in (("a", 32, 0.02), ("b", 32, 3.0), ("c", 8, 0.5))
    }
    x = rng.standard_normal((21, 64)).astype(np.float32)
    gate_up = WeightDecl("interleave_rows", (WeightDecl("concat_rows", ("a", "b")),), (("group", 8),))
    qkv = WeightDecl("concat_rows", ("a", "b", "c"))
    fused = {
        gate_up: interleave_rows(np.concatenate([parts["a"], parts["b"]]), group=8)[0],
        qkv: np.concatenate([parts["a"], parts["b"], parts["c"]]),
    }
    assert row_parts(gate_up) == (WeightDecl.of("a"), WeightDecl.of("b"))
    assert row_parts(qkv) == tuple(WeightDecl.of(n) for n in "abc")
    assert row_parts(WeightDecl("fp8_e4m3_rows", (qkv,), output=1)) == (WeightDecl("fp8_e4m3_rows", (qkv,), output=1),)
    built: list[str] = []
    for name in ("concat_rows", "interleave_rows"):
        monkeypatch.setitem(
            TRANSFORMS, name, lambda *a, _f=TRANSFORMS[name], _n=name, **k: built.append(_n) or _f(*a, **k)
        )
    for decl, w in fused.items():
        w8, scale = quantize_fp8_rows(w)
        w_hat = w8.astype(np.float64) * scale[:, None]
        exact = np.linalg.norm(x @ (w_hat - w).T) / np.linalg.norm(x.astype(np.float64) @ w.T)
        lin = _Linear("fused", ("l",), decl, w.shape, None)
        ctx = PassContext(tiny("tiny-dflash").config, BuildOptions(precision="auto"), parts.__getitem__, {"fused": x})
        assert _measure(lin, "propose", ctx) == pytest.approx(exact, rel=1e-5)
    assert built == []


def test_e4m3_table_gives_every_codes_value() -> None:
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(16, 16)
    got = e4m3_as_f32(codes)
    assert got.dtype == np.float32 and got.shape == (16, 16)
    np.testing.assert_array_equal(got.view(np.uint32), codes.astype(np.float32).view(np.uint32))
    assert got[0, 8] == 2.0**-6 and got[7, 14] == 448.0 and got[0, 1] == 2.0**-9 and np.isnan(got[7, 15])


# (e) auto ---------------------------------------------------------------------------------------------------
def test_auto_build_reads_each_checkpoint_tensor_once() -> None:
    """Calibration and choose_precision share one float32 read of every tensor (a real-shape drafter's
    checkpoint is gigabytes); the decisions are those of a build given the plain tensors."""
    from dflash_compiler.pipeline import optimize

    t = tiny("tiny-dflash")
    reads: dict[str, int] = {}

    def source(name: str) -> np.ndarray:
        reads[name] = reads.get(name, 0) + 1
        return t.tensors[name]

    options = BuildOptions(precision="auto", fp8_error_budget=0.03)
    counted = optimize(t.config, options, source)
    assert reads and set(reads.values()) == {1}, {n: c for n, c in reads.items() if c != 1}
    plain = optimize(t.config, options, t.tensors.__getitem__)
    for phase in ("append_context", "propose"):
        assert counted.phases[phase].meta["precision"] == plain.phases[phase].meta["precision"]
    assert any(lin.choice is Choice.FP8 for lin in counted.propose.meta["precision"].linears)


def test_auto_tiny_budget_keeps_everything_bf16() -> None:
    choices = linears_of(convert("tiny-dflash", context("tiny-dflash", precision="auto", fp8_error_budget=1e-6)))
    assert choices and all(c is Choice.BF16 and err is not None and err > 1e-6 for c, err in choices.values())


def test_auto_huge_budget_turns_everything_fp8() -> None:
    choices = linears_of(convert("tiny-dflash", context("tiny-dflash", precision="auto", fp8_error_budget=10.0)))
    assert set(choices) == expected_linear_names("tiny-dflash")
    assert all(c is Choice.FP8 for c, _ in choices.values())


@pytest.mark.parametrize("example", ["tiny-dflash", "tiny-dflash2"])
def test_auto_middle_budget_follows_the_recorded_errors(example: str) -> None:
    measured = linears_of(convert(example, context(example, precision="fp8")))
    budget = float(np.median([err for _, err in measured.values()]))
    program = convert(example, context(example, precision="auto", fp8_error_budget=budget))
    choices = linears_of(program)
    for name, (choice, err) in choices.items():
        assert err == pytest.approx(measured[name][1], rel=1e-9)
        assert (choice is Choice.FP8) == (err <= budget), name
    fp8 = {n for n, (c, _) in choices.items() if c is Choice.FP8}
    assert 0 < len(fp8) < len(choices)
    for graph in program.phases.values():
        verify(graph)
        fp8_nodes = {n for n in graph.names() if len(graph.inputs(n)) == 3 and graph.node(n).op in LINEAR_OPS}
        planned = {n for lin in precision_map(graph).linears if lin.choice is Choice.FP8 for n in lin.nodes}
        assert fp8_nodes == planned


def test_auto_without_calibration_refuses() -> None:
    with pytest.raises(PlanError, match="calibration") as info:
        convert("tiny-dflash", context("tiny-dflash", calibrated=False, precision="auto"))
    assert "collect_calibration" in str(info.value)
    t = tiny("tiny-dflash")
    with pytest.raises(PlanError, match="tensors"):
        choose_precision(t.program.propose, PassContext(t.config, BuildOptions(precision="auto")))


def test_auto_with_everything_excluded_needs_no_calibration() -> None:
    t = tiny("tiny-dflash")
    ctx = PassContext(t.config, BuildOptions(precision="auto", exclude=("*",)))
    plan = precision_map(choose_precision(t.program.propose, ctx))
    assert all(lin.choice is Choice.BF16 and lin.reason == "excluded by '*'" for lin in plan.linears)


def test_calibration_records_the_rows_each_weight_multiplies() -> None:
    t = tiny("tiny-dflash")
    cal = calibration("tiny-dflash")
    cfg = t.config
    assert cal["fc.weight"].shape[1] == cfg.fc_in_features
    assert cal["target.lm_head"].shape[1] == cfg.hidden_size
    k = "layers.1.self_attn.k_proj.weight"  # read by both phases: block rows and context rows
    both, ctx_rows, blk_rows = cal[k], cal[f"append_context/{k}"], cal[f"propose/{k}"]
    assert len(both) == len(ctx_rows) + len(blk_rows)
    assert len(blk_rows) % cfg.block_size == 0 and len(cal["propose/target.lm_head"]) % cfg.gamma == 0
    # hidden_norm output rows have RMS ~ the norm weight's scale (1 ± 0.1), never the raw taps' scale
    rms = np.sqrt((ctx_rows**2).mean(axis=1))
    assert np.all((rms > 0.5) & (rms < 2.0))


def test_fused_weights_find_their_rows_under_their_sources() -> None:
    """The pipeline calibrates the lowered program; a fused weight's rows are its sources' rows of its phase."""
    t = tiny("tiny-dflash")
    plain = PassContext(t.config, BuildOptions())
    phases = {}
    for phase, graph in t.program.phases.items():
        for rewrite in (fuse_context_kv, fuse_qkv):
            graph = rewrite(graph, plain)
        phases[phase] = graph
    fused = t.program.with_phases(phases["append_context"], phases["propose"])
    options = BuildOptions(precision="auto", fp8_error_budget=10.0)
    lowered_rows = PassContext(t.config, options, t.tensors.__getitem__, calibration("tiny-dflash"))
    own_rows = PassContext(t.config, options, t.tensors.__getitem__, collect_calibration(fused, t.tensors))
    for graph in fused.phases.values():
        a, b = (precision_map(choose_precision(graph, ctx)) for ctx in (lowered_rows, own_rows))
        assert [lin.name for lin in a.linears] == [lin.name for lin in b.linears]
        for x, y in zip(a.linears, b.linears, strict=True):
            assert x.error == pytest.approx(y.error, rel=1e-4), x.name
    names = [lin.name for lin in precision_map(choose_precision(fused.propose, own_rows)).linears]
    assert "layers.0.self_attn.q_proj+layers.0.self_attn.k_proj+layers.0.self_attn.v_proj" in names
