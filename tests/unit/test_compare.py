"""compare_drafts: clear decisions must agree; near-ties may differ; DFlash2's candidate set must be clear too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_compiler.compare import compare_drafts
from dflash_compiler.config import Family


@dataclass
class _Proposal:
    decision_scores: np.ndarray
    logits: np.ndarray
    candidates: np.ndarray | None = None
    gap_noise: np.ndarray | None = None


@dataclass
class _Drafts:
    proposals: tuple[_Proposal, ...]


@dataclass
class _Record:
    step: int
    seq_ids: tuple[int, ...]
    tokens: np.ndarray
    drafts: object = None


def _pair(ref_tokens, got_tokens, proposal):
    ref = _Record(0, (0,), np.array([ref_tokens]), _Drafts((proposal,)))
    return [ref], [_Record(0, (0,), np.array([got_tokens]))]


def test_clear_decisions_must_agree_and_near_ties_may_not():
    logits = np.array([[5.0, 1.0, 0.0, -1.0], [2.0, 1.999, 0.0, -3.0]])
    proposal = _Proposal(decision_scores=logits, logits=logits)
    ref, got = _pair([0, 0], [0, 1], proposal)
    out = compare_drafts(Family.DFLASH, ref, got)
    assert out.ok and out.compared == 1 and out.diverged_near_ties == 1
    ref, got = _pair([0, 0], [1, 0], proposal)
    out = compare_drafts(Family.DFLASH, ref, got)
    assert not out.ok and "draft 0: got 1, expected 0" in out.mismatches[0]


def test_dflash2_decision_is_a_near_tie_when_its_candidate_set_is():
    # the selector's pick is clear among the candidates, but the 2nd and 3rd logits (k = 2) are tied:
    # rounding can swap a new token into the set, so a different pick is not a mismatch
    logits = np.array([[4.0, 1.0, 0.999, -2.0]])
    scores = np.array([[3.0, -1.0]])
    proposal = _Proposal(decision_scores=scores, logits=logits, candidates=np.array([[0, 1]]))
    ref, got = _pair([0], [2], proposal)
    out = compare_drafts(Family.DFLASH2, ref, got)
    assert out.ok and out.compared == 0 and out.diverged_near_ties == 1
    clear_set = _Proposal(
        decision_scores=scores, logits=np.array([[4.0, 1.0, -1.5, -2.0]]), candidates=np.array([[0, 1]])
    )
    ref, got = _pair([0], [2], clear_set)
    assert not compare_drafts(Family.DFLASH2, ref, got).ok


def test_dflash2_decision_is_a_near_tie_when_the_hidden_states_error_can_swing_its_gap():
    # gap 4.0 of spread 4.0 is clear by the scores alone; a selector term whose gap moves 50 per unit of
    # relative hidden-state error moves it by 1.5 (one standard deviation) at 3 %, so 4.0 is within 3 sigma
    logits = np.array([[4.0, 1.0, -1.5, -2.0]])
    scores = np.array([[3.0, -1.0]])
    steep = _Proposal(decision_scores=scores, logits=logits, candidates=np.array([[0, 1]]), gap_noise=np.array([50.0]))
    ref, got = _pair([0], [1], steep)
    out = compare_drafts(Family.DFLASH2, ref, got)
    assert out.ok and out.compared == 0 and out.diverged_near_ties == 1
    flat = _Proposal(decision_scores=scores, logits=logits, candidates=np.array([[0, 1]]), gap_noise=np.array([40.0]))
    ref, got = _pair([0], [1], flat)
    assert not compare_drafts(Family.DFLASH2, ref, got).ok  # 3 x 0.03 x 40 = 3.6 < 4.0
