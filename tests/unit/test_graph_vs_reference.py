"""The interpreted graphs, lowered and fully optimized, reproduce the numpy reference step by step."""

from __future__ import annotations

import numpy as np
import pytest
from pass_harness import TINY, tiny

from dflash_compiler.graph_runner import GraphDrafter
from dflash_compiler.options import BuildOptions
from dflash_compiler.protocol import Scenario, run_scenario
from dflash_compiler.reference import BatchedReference, ReferenceDrafter

SCENARIO = Scenario(prompt_lengths=(5, 17, 30, 3), steps=12, seed=7)


def _reference_records(t):
    ref = ReferenceDrafter(
        t.config,
        {k: v for k, v in t.tensors.items() if not k.startswith("target.")},
        t.tensors["target.embed_tokens"],
        t.tensors["target.lm_head"],
    )
    cfg = t.config
    return run_scenario(BatchedReference(ref), cfg, SCENARIO).records


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
