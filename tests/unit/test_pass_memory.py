"""plan_memory: every scratch value placed, no two simultaneously live values share a byte, real sizes.

What counts as scratch, when a value is live and how big it is are recomputed here from the graph (the
rules in the pass's docstring), so the checks do not reuse the pass's own bookkeeping. Golden plan
renders are written by ``python tests/unit/golden/regenerate.py`` and reviewed by hand.
"""

from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path

import pytest
from pass_harness import TINY

from dflash_compiler.config import load_drafter_config
from dflash_compiler.ir import Graph, Node, Op, Ref, TensorType, dump, eval_dim, verify
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.ir_passes.fuse_gate_up import fuse_gate_up
from dflash_compiler.ir_passes.fuse_qkv import fuse_qkv
from dflash_compiler.ir_passes.fuse_residual_norm import fuse_residual_norm
from dflash_compiler.ir_passes.plan_memory import plan_memory
from dflash_compiler.ir_passes.size_kv_cache import size_kv_cache
from dflash_compiler.lower import lower
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import MemoryPlan, PlanError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
GOLDEN_CASES = [("tiny-dflash", "append_context"), ("tiny-dflash", "propose")]
GOLDEN_OPTIONS = BuildOptions(max_batch=4, max_seq_len=256, max_ctx_rows=64)
QWEN3_8B = "qwen3-8b-dflash-b16"
QWEN3_8B_OPTIONS = BuildOptions(max_batch=8, max_seq_len=4096, max_ctx_rows=512)
SIZES = {"bfloat16": 2, "float32": 4, "int32": 4, "float8_e4m3fn": 1}
NOT_SCRATCH = {Op.INPUT, Op.WEIGHT, Op.STATE, Op.OUTPUT, Op.KV_WRITE}


def planned(example: str, options: BuildOptions, with_kv_plan: bool = True) -> dict[str, tuple[Graph, Graph]]:
    """``phase -> (graph planned, the plan's graph)`` for a lowered example."""
    cfg = load_drafter_config(EXAMPLES / example)
    ctx = PassContext(cfg, options)
    out = {}
    for phase, graph in lower(cfg).phases.items():
        source = size_kv_cache(graph, ctx) if with_kv_plan else graph
        out[phase] = (source, plan_memory(source, ctx))
    return out


def memory(graph: Graph) -> MemoryPlan:
    plan = graph.meta["memory"]
    assert isinstance(plan, MemoryPlan)
    return plan


def base(graph: Graph, ref: Ref) -> Ref:
    """No op aliases its input today (a slice is a copy), so every value is its own base."""
    return ref


def expected_values(graph: Graph, dims: dict[str, int]) -> dict[Ref, tuple[int, int, int]]:
    """``ref -> (bytes, first step, last step)`` of every scratch value, from the rules in plan_memory's doc."""
    order = graph.topo()
    step = {n: i for i, n in enumerate(order)}
    returned = {base(graph, graph.inputs(out)[0]) for out in graph.outputs()}
    readers: dict[Ref, list[int]] = {}
    for name in order:
        for ref in graph.inputs(name):
            readers.setdefault(base(graph, ref), []).append(step[name])
    values = {}
    for name in order:
        node = graph.node(name)
        for port, t in enumerate(node.outputs):
            ref = Ref(name, port)
            if node.op in NOT_SCRATCH or ref in returned:
                continue
            size = math.prod(eval_dim(d, dims) for d in t.shape) * SIZES[t.dtype]
            values[ref] = (size, step[name], max(readers.get(ref, [step[name]])))
    return values


def check_plan(graph: Graph, plan: MemoryPlan) -> dict[Ref, tuple[int, int, int]]:
    """The invariants every plan must hold; returns the independently computed values."""
    dims = dict(plan.bindings)
    assert set(dims) == set(graph.dims)
    assert plan.order == tuple(graph.topo())
    values = expected_values(graph, dims)
    buffers = {Ref(b.node, b.port): b for b in plan.buffers}
    assert set(buffers) == set(values), "every scratch value (and nothing else) has an offset"
    for ref, (size, first, last) in values.items():
        b = buffers[ref]
        assert (b.bytes, b.first_use, b.last_use) == (size, first, last), ref
        assert b.offset % 256 == 0 and b.end <= plan.arena_bytes
    for (ra, a), (rb, b) in combinations(values.items(), 2):
        if a[1] <= b[2] and b[1] <= a[2]:  # live at a common step
            x, y = buffers[ra], buffers[rb]
            assert x.end <= y.offset or y.end <= x.offset, f"{ra} and {rb} are live together and overlap"
    peak = max(sum(s for s, f, last in values.values() if f <= i <= last) for i in range(len(plan.order)))
    assert plan.peak_live_bytes == peak <= plan.arena_bytes
    assert plan.naive_bytes == sum(s for s, _, _ in values.values())
    assert plan.views == ()
    return values


# the real drafter ------------------------------------------------------------------------------------------
def test_qwen3_8b_propose_plan() -> None:
    graph, out = planned(QWEN3_8B, QWEN3_8B_OPTIONS)["propose"]
    plan = memory(out)
    print(f"\nqwen3-8b propose: {plan.summary()}")
    check_plan(out, plan)
    assert dict(plan.bindings) == {"nb": 8, "blk": 16, "pages": 8 * 258 + 1, "maxp": 258}
    logits = plan.buffer("lm_head")
    assert logits.shape == (15 * 8, 151936) and logits.bytes == 15 * 8 * 151936 * 4  # gamma·nb rows, f32
    hidden = 15 * 8 * 4096 * 2  # drop_anchor, the lm_head's input, live with the logits
    assert plan.arena_bytes == plan.peak_live_bytes == logits.bytes + hidden == 73912320
    assert plan.arena_bytes < plan.naive_bytes
    assert plan.summary() == "arena 70.5 MiB (naive 172.5 MiB, 41%)"
    assert dump(graph) == dump(out).replace(f"meta memory = {plan.summary()}\n", "")


def test_qwen3_8b_append_context_plan() -> None:
    graph, out = planned(QWEN3_8B, QWEN3_8B_OPTIONS)["append_context"]
    plan = memory(out)
    print(f"\nqwen3-8b append_context: {plan.summary()}")
    check_plan(out, plan)
    assert dict(plan.bindings) == {"ctx": 512, "pages": 8 * 258 + 1}
    fc = 512 * 4096 * 2  # fc's output and hidden_norm's are live together while hidden_norm runs
    assert plan.buffer("fc").bytes == plan.buffer("hidden_norm").bytes == fc
    assert plan.arena_bytes == plan.peak_live_bytes == 2 * fc
    assert plan.summary() == "arena 8.0 MiB (naive 28.0 MiB, 29%)"
    assert "memory" not in graph.meta, "plan_memory must not mutate its input"


def test_plan_without_a_kv_plan_computes_the_same_page_bounds() -> None:
    with_kv = memory(planned(QWEN3_8B, QWEN3_8B_OPTIONS)["propose"][1])
    without = memory(planned(QWEN3_8B, QWEN3_8B_OPTIONS, with_kv_plan=False)["propose"][1])
    assert with_kv == without


def test_maxp_follows_the_recorded_kv_plan() -> None:
    budget = BuildOptions(max_batch=8, max_seq_len=4096, kv_budget_bytes=300 * 327680)
    plan = memory(planned(QWEN3_8B, budget)["propose"][1])
    assert dict(plan.bindings)["pages"] == 300 and dict(plan.bindings)["maxp"] == 258


# tiny drafters ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", TINY)
def test_tiny_lowered_plans(example: str) -> None:
    for phase, (_, out) in planned(example, GOLDEN_OPTIONS).items():
        plan = memory(out)
        values = check_plan(out, plan)
        assert values and plan.arena_bytes < plan.naive_bytes, phase
        if phase == "propose":
            assert plan.buffer("lm_head").shape[0] == 4 * (out.node("drop_anchor").attr("block") - 1)


@pytest.mark.parametrize("example", ["tiny-dflash", "tiny-dflash2"])
def test_tiny_fused_plans_with_slices_and_two_output_nodes(example: str) -> None:
    cfg = load_drafter_config(EXAMPLES / example)
    ctx = PassContext(cfg, GOLDEN_OPTIONS)
    graph = lower(cfg).propose
    for rewrite in (fuse_qkv, fuse_gate_up, fuse_residual_norm):
        graph = rewrite(graph, ctx)
    verify(graph)
    plan = memory(plan_memory(graph, ctx))
    check_plan(graph, plan)
    slices = [name for name in graph.names() if graph.node(name).op is Op.SLICE]
    assert slices, "fused q/k/v are column slices of one matmul"
    for name in slices:  # a slice is copied out: a buffer of its own, while its source dies at the last copy
        source = graph.inputs(name)[0]
        assert plan.buffer(name).first_use >= plan.buffer(source.node, source.port).first_use
    two_outputs = [b for b in plan.buffers if b.port == 1]
    assert two_outputs, "rmsnorm_residual's normed output (port 1) is a buffer of its own"


def test_unknown_dim_is_refused() -> None:
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    g = Graph("odd", {"rows": "rows"})
    x = g.add("x", Node.make(Op.INPUT, [TensorType("float32", ("rows", 4))]))
    y = g.add("y", Node.make(Op.SCALE, [TensorType("float32", ("rows", 4))], factor=2.0), [x])
    g.add("out", Node.make(Op.OUTPUT, [TensorType("float32", ("rows", 4))]), [y])
    with pytest.raises(PlanError, match="rows"):
        plan_memory(g, PassContext(cfg, BuildOptions()))


# golden ----------------------------------------------------------------------------------------------------
def golden_path(example: str, phase: str) -> Path:
    return GOLDEN / f"plan_memory.{example}.{phase}.txt"


def golden_text(example: str, phase: str) -> str:
    _, out = planned(example, GOLDEN_OPTIONS)[phase]
    header = (
        f"# plan_memory on {example}, phase {phase}, max_batch 4, max_seq_len 256, max_ctx_rows 64. "
        "Regenerate: python tests/unit/golden/regenerate.py\n"
    )
    return header + memory(out).render()


@pytest.mark.parametrize(("example", "phase"), GOLDEN_CASES)
def test_golden_plan(example: str, phase: str) -> None:
    path = golden_path(example, phase)
    assert path.exists(), f"{path} missing: run python tests/unit/golden/regenerate.py"
    assert golden_text(example, phase) == path.read_text(), (
        f"{path.name} differs: if the change is intended, run "
        "python tests/unit/golden/regenerate.py and review the diff"
    )
