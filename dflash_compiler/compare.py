"""Compare a compiled drafter's drafts with the numpy reference's, step by step, allowing only near-ties.

The GPU computes in bf16 with f32 accumulation and the reference in f32, so a draft may differ where the
reference's decision was a near-tie: the gap between its best and second-best score (the logits for
DFlash, the Markov-biased logits for DSpark, the selector scores for DFlash2) is within the compiled
path's error. A decision with a clear gap must agree. DFlash2 picks among the top-k tokens of the logits,
so its decision is clear only when that candidate set is too: the gap between the k-th and (k+1)-th
logit must be clear as well (bf16 rounding swaps near-tied candidates at the set's edge, and a swapped-in
token can win the selector by a wide margin), and its selector gap must be clear of the hidden state's error:
the codebook term ``<A[pred] ⊙ (P h), Bc[c]>`` can swing the gap by many times what the score spread
suggests (the reference's ``gap_noise``). DSpark and DFlash2 pick drafts one after the other, each
conditioned on the previous pick, so after a near-tie that went the other way the rest of that block is
not comparable; DFlash's rows are independent and every clear row is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dflash_compiler.config import Family

# The final hidden state of a bf16 path is off the f32 reference's by 2-3 % (relative norm; 2.4-2.5 % on
# tiny-dflash2); a gap is clear of it at three standard deviations.
HIDDEN_REL_ERR = 0.03
NOISE_SIGMAS = 3.0


@dataclass
class DraftComparison:
    compared: int = 0  # decisions with a clear gap, all of which must agree
    agreed_near_ties: int = 0
    diverged_near_ties: int = 0
    skipped: int = 0  # after a diverged near-tie in a sequential walk
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        return (
            f"{self.compared} clear decisions compared, {len(self.mismatches)} mismatched; near-ties: "
            f"{self.agreed_near_ties} agreed, {self.diverged_near_ties} diverged ({self.skipped} later picks skipped)"
        )


def _gap(scores: np.ndarray) -> float:
    top = np.sort(np.asarray(scores, np.float64))[-2:]
    return float(top[1] - top[0]) if top.size == 2 else float("inf")


def _clear(scores: np.ndarray, rel_tol: float) -> bool:
    spread = float(scores.max() - scores.min()) or 1.0
    return _gap(scores) > rel_tol * spread


def _set_is_clear(logits: np.ndarray, k: int, rel_tol: float) -> bool:
    """The top-k set of `logits` is stable: the k-th and (k+1)-th values are a clear gap apart."""
    if k >= logits.size:
        return True
    ordered = np.sort(np.asarray(logits, np.float64))[::-1]
    spread = float(ordered[0] - ordered[-1]) or 1.0
    return float(ordered[k - 1] - ordered[k]) > rel_tol * spread


def compare_drafts(
    family: Family,
    reference: Sequence[object],
    got: Sequence[object],
    rel_tol: float = 0.02,
    hidden_rel_err: float = HIDDEN_REL_ERR,
) -> DraftComparison:
    """`reference` and `got` are `protocol.StepRecord`s of the same scenario; the reference's records carry
    its proposals. A decision is a near-tie when its top-2 gap is below `rel_tol` x the score row's spread
    (max - min), the scale bf16 rounding errors are proportional to, or, where the proposal has a
    ``gap_noise``, below `NOISE_SIGMAS` x `hidden_rel_err` x that noise."""
    out = DraftComparison()
    sequential = family is not Family.DFLASH
    for ref, mine in zip(reference, got, strict=True):
        proposals = ref.drafts.proposals  # type: ignore[attr-defined]
        for row, proposal in enumerate(proposals):
            want, have = np.asarray(ref.tokens[row]), np.asarray(mine.tokens[row])  # type: ignore[attr-defined]
            scores = np.asarray(proposal.decision_scores, np.float64)
            candidates = getattr(proposal, "candidates", None)
            gap_noise = getattr(proposal, "gap_noise", None)
            for j in range(len(want)):
                spread = float(scores[j].max() - scores[j].min()) or 1.0
                clear = _clear(scores[j], rel_tol)
                if clear and candidates is not None:
                    clear = _set_is_clear(np.asarray(proposal.logits[j]), np.shape(candidates)[1], rel_tol)
                if clear and gap_noise is not None:
                    clear = _gap(scores[j]) > NOISE_SIGMAS * hidden_rel_err * float(gap_noise[j])
                same = int(want[j]) == int(have[j])
                if clear:
                    out.compared += 1
                    if not same:
                        out.mismatches.append(
                            f"step {ref.step} seq {ref.seq_ids[row]} draft {j}: got {int(have[j])}, "  # type: ignore[attr-defined]
                            f"expected {int(want[j])} (top-2 gap {_gap(scores[j]):.4g}, spread {spread:.4g})"
                        )
                        if sequential:
                            out.skipped += len(want) - j - 1
                            break
                elif same:
                    out.agreed_near_ties += 1
                else:
                    out.diverged_near_ties += 1
                    if sequential:
                        out.skipped += len(want) - j - 1
                        break
    return out
