"""The multi-step drafting protocol (DFLASH.md §2), driven identically against any drafter.

A scenario is deterministic in its seed: several sequences with different prompt lengths are
prefilled; every step proposes for all live sequences, accepts a random prefix ``a`` of each, appends
the taps of the ``a + 1`` committed rows at ``p0 .. p0 + a`` and moves the anchor to ``p0 + a + 1``. Some
steps first append taps for the whole block and roll back to the committed length (as serving engines do
in padded mode); one step frees a sequence and admits a new one, so freed pages are reused. The numpy
reference, the interpreted graphs and the GPU runtime all implement :class:`DrafterLike`, so their
drafts can be compared step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class DraftsLike(Protocol):
    tokens: np.ndarray
    confidences: np.ndarray | None


class DrafterLike(Protocol):
    def create(self, seq_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def rollback(self, seq_id: int, length: int) -> None: ...
    def length(self, seq_id: int) -> int: ...
    def append_context(
        self, seq_ids: Sequence[int], taps: Sequence[np.ndarray], positions: Sequence[np.ndarray]
    ) -> None: ...
    def propose(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> DraftsLike: ...


@dataclass(frozen=True)
class Scenario:
    prompt_lengths: tuple[int, ...] = (5, 17, 30, 3)
    steps: int = 10
    seed: int = 0
    rollback_every: int = 3  # every k-th step appends the whole block, then rolls back
    replace_at: int | None = 4  # at this step, free the first sequence and admit a new one
    replacement_prompt: int = 21


@dataclass(frozen=True)
class StepRecord:
    step: int
    seq_ids: tuple[int, ...]
    anchors: tuple[int, ...]
    tokens: np.ndarray  # [nb, gamma]
    confidences: np.ndarray | None
    accepted: tuple[int, ...]


def run_scenario(
    drafter: DrafterLike, scenario: Scenario, fc_in_features: int, vocab_size: int, block_size: int
) -> list[StepRecord]:
    rng = np.random.default_rng(scenario.seed)
    gamma = block_size - 1

    def taps(n: int) -> np.ndarray:
        return rng.standard_normal((n, fc_in_features)).astype(np.float32)

    anchors: dict[int, int] = {}

    def admit(seq_id: int, prompt: int) -> None:
        drafter.create(seq_id)
        drafter.append_context([seq_id], [taps(prompt)], [np.arange(prompt)])
        anchors[seq_id] = int(rng.integers(vocab_size))

    for seq_id, prompt in enumerate(scenario.prompt_lengths):
        admit(seq_id, prompt)
    next_id = len(scenario.prompt_lengths)
    records = []
    for step in range(scenario.steps):
        if scenario.replace_at is not None and step == scenario.replace_at:
            victim = min(anchors)
            drafter.free(victim)
            del anchors[victim]
            admit(next_id, scenario.replacement_prompt)
            next_id += 1
        seq_ids = sorted(anchors)
        drafts = drafter.propose(seq_ids, [anchors[s] for s in seq_ids])
        accepted = tuple(int(rng.integers(gamma + 1)) for _ in seq_ids)
        p0 = [drafter.length(s) for s in seq_ids]
        if scenario.rollback_every and step % scenario.rollback_every == scenario.rollback_every - 1:
            # Taps for the whole verified block, then crop to the committed rows.
            block_taps = [taps(block_size) for _ in seq_ids]
            drafter.append_context(seq_ids, block_taps, [np.arange(p, p + block_size) for p in p0])
            for s, p, a in zip(seq_ids, p0, accepted, strict=True):
                drafter.rollback(s, p + a + 1)
        else:
            drafter.append_context(
                seq_ids,
                [taps(a + 1) for a in accepted],
                [np.arange(p, p + a + 1) for p, a in zip(p0, accepted, strict=True)],
            )
        records.append(
            StepRecord(
                step,
                tuple(seq_ids),
                tuple(anchors[s] for s in seq_ids),
                np.asarray(drafts.tokens),
                None if drafts.confidences is None else np.asarray(drafts.confidences),
                accepted,
            )
        )
        for s in seq_ids:
            anchors[s] = int(rng.integers(vocab_size))
    return records
