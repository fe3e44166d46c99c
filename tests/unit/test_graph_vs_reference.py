"""The interpreted graphs, lowered and fully optimized, reproduce the numpy reference step by step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pass_harness import TINY, tiny

from dflash_compiler.graph_runner import GraphDrafter
from dflash_compiler.options import BuildOptions
from dflash_compiler.protocol import ContextRows, Scenario, run_scenario
from dflash_compiler.reference import BatchedReference, ReferenceDrafter

SCENARIO = Scenario(prompt_lengths=(5, 17, 30, 3), steps=12, seed=7)


def _reference(t):
    return BatchedReference(
        ReferenceDrafter(
            t.config,
            {k: v for k, v in t.tensors.items() if not k.startswith("target.")},
            t.tensors["target.embed_tokens"],
            t.tensors["target.lm_head"],
        )
    )


def _reference_records(t):
    return run_scenario(_reference(t), t.config, SCENARIO).records


def _graph_records(t, program):
    cfg = program.config
    drafter = GraphDrafter(program, t.tensors, num_pages=64, max_seq_len=512)
    return run_scenario(drafter, cfg, SCENARIO).records


def _assert_same(ref, got):
    assert len(ref) == SCENARIO.steps == len(got)
    for r, g in zip(ref, got, strict=True):
        assert r.seq_ids == g.seq_ids
        np.testing.assert_array_equal(r.tokens, g.tokens, err_msg=f"step {r.step}")
        if r.confidences is not None:
            np.testing.assert_allclose(r.confidences, g.confidences, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_lowered_graphs_match_reference(name):
    t = tiny(name)
    _assert_same(_reference_records(t), _graph_records(t, t.program))


@pytest.mark.parametrize("name", TINY)
def test_optimized_graphs_match_reference(name):
    t = tiny(name)
    from dflash_compiler.pipeline import optimize

    program = optimize(t.config, BuildOptions(max_batch=4, max_seq_len=256))
    _assert_same(_reference_records(t), _graph_records(t, program))


def test_drafts_are_not_degenerate():
    """Guards the comparison above: the drafts vary across steps, sequences and positions."""
    for name in TINY:
        records = _reference_records(tiny(name))
        tokens = np.concatenate([r.tokens.reshape(-1) for r in records])
        assert len(np.unique(tokens)) >= 20, name


class _CountingSteps(GraphDrafter):
    """Counts the calls a stepped scenario makes of each entry point."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"step": 0, "append_context": 0, "propose": 0}

    def step(self, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(*args, **kwargs)

    def append_context(self, *args, **kwargs):
        self.calls["append_context"] += 1
        return super().append_context(*args, **kwargs)

    def propose(self, *args, **kwargs):
        self.calls["propose"] += 1
        return super().propose(*args, **kwargs)


def test_stepped_scenario_matches_reference():
    """Each round's rows appended by the next round's step (padded rounds rolled back inside it, a new
    sequence's prompt with the others' rows) give the reference's drafts, which append right away."""
    t = tiny(TINY[0])
    drafter = _CountingSteps(t.program, t.tensors, num_pages=64, max_seq_len=512)
    stepped = replace(SCENARIO, stepped=True)
    got = run_scenario(drafter, t.config, stepped).records
    _assert_same(_reference_records(t), got)
    # every proposal went through step; append_context ran inside those steps and once to flush the last rows
    assert drafter.calls == {"step": SCENARIO.steps, "append_context": SCENARIO.steps + 1, "propose": SCENARIO.steps}


def test_stepped_scenario_needs_a_stepping_drafter():
    t = tiny(TINY[0])
    with pytest.raises(TypeError, match=r"has none\. Fix: run it with Scenario"):
        run_scenario(_reference(t), t.config, replace(SCENARIO, stepped=True))


def test_context_rows_need_one_entry_per_sequence():
    taps = [np.zeros((1, 4), np.float32)] * 2
    ContextRows([0, 1], taps, [np.arange(1)] * 2, lengths=[1, 1])  # consistent
    with pytest.raises(ValueError, match=r"one entry of lengths per sequence \(2\), found 1"):
        ContextRows([0, 1], taps, [np.arange(1)] * 2, lengths=[1])
    with pytest.raises(ValueError, match=r"one entry of taps per sequence \(2\), found 1"):
        ContextRows([0, 1], taps[:1], [np.arange(1)] * 2)
