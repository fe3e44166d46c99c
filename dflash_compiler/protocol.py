"""The multi-step drafting protocol (DFLASH.md §2), scripted in advance and driven against any drafter.

A sequence's :class:`SequenceScript` fixes everything a target would feed the drafter: the prompt's taps
and, per round, the anchor, the taps of all ``B`` verified rows and the accepted count ``a``. Rounds commit
rows ``p0 .. p0 + a`` and move the anchor to ``p0 + a + 1``. Draft tokens never feed back, so two drafters
that split a near-tie differently still see identical inputs in every later round.

:func:`run_scenario` drives a batched drafter (:class:`DrafterLike`: the numpy reference behind
:class:`~dflash_compiler.reference.BatchedReference`, the interpreted graphs, the GPU runtime) through
several scripted sequences of different prompt lengths in lockstep. Some rounds append the whole verified
block and roll back to the committed length (serving engines' padded mode); that must give the same
drafts as appending only the committed rows. One round may free a sequence and admit a new one, so freed
pages are reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dflash_compiler.config import DrafterConfig


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
class ContextRows:
    """New context rows of some sequences, as `append_context` takes them (`taps[i]` at `positions[i]` of
    sequence `seq_ids[i]`), and the rows each of those sequences keeps once they are appended: `lengths[i]`
    (a serving engine that appended a whole verified block keeps the accepted rows), or all (None)."""

    seq_ids: Sequence[int]
    taps: Sequence[Any]
    positions: Sequence[Any]
    lengths: Sequence[int] | None = None

    def __post_init__(self) -> None:
        counts = {"taps": len(self.taps), "positions": len(self.positions)}
        if self.lengths is not None:
            counts["lengths"] = len(self.lengths)
        for name, count in counts.items():
            if count != len(self.seq_ids):
                raise ValueError(
                    f"ContextRows: expected one entry of {name} per sequence ({len(self.seq_ids)}), found {count}"
                )

    def append_to(self, drafter: DrafterLike) -> None:
        """`append_context` of the rows, then each sequence rolled back to the rows it keeps."""
        if self.seq_ids:
            drafter.append_context(self.seq_ids, self.taps, self.positions)
        self.roll_back(drafter)

    def roll_back(self, drafter: DrafterLike) -> None:
        """Each sequence back to the rows it keeps (after the rows were appended)."""
        for seq_id, length in zip(self.seq_ids, self.lengths or (), strict=False):
            if drafter.length(seq_id) != length:
                drafter.rollback(seq_id, length)


@runtime_checkable
class SteppingDrafter(DrafterLike, Protocol):
    """A drafter that also takes a whole serving step in one call: `rows` appended and rolled back to what
    they keep, then the proposal of `seq_ids` (`Drafter.step` runs it as one replay on the GPU)."""

    def step(self, rows: ContextRows, seq_ids: Sequence[int], anchors: Sequence[int]) -> DraftsLike: ...


@dataclass(frozen=True)
class ScriptStep:
    """One round: propose at ``p0`` from ``anchor``; the target then returns ``verify_taps [B, F]`` for the
    rows ``p0 .. p0+B-1`` and accepts ``accepted`` drafts, committing rows ``p0 .. p0+accepted``."""

    p0: int
    anchor: int
    verify_taps: np.ndarray
    accepted: int

    @property
    def committed_taps(self) -> np.ndarray:
        return self.verify_taps[: self.accepted + 1]

    @property
    def committed_positions(self) -> np.ndarray:
        return self.p0 + np.arange(self.accepted + 1, dtype=np.int64)


@dataclass(frozen=True)
class SequenceScript:
    """Everything one sequence feeds a drafter, fixed in advance: the prompt's taps and the rounds."""

    prompt_taps: np.ndarray
    steps: tuple[ScriptStep, ...]

    def context_before(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """All committed context rows visible at round ``step``: ``(taps [S, F], positions [S])``."""
        taps = [self.prompt_taps] + [s.committed_taps for s in self.steps[:step]]
        positions = [np.arange(self.prompt_taps.shape[0], dtype=np.int64)]
        positions += [s.committed_positions for s in self.steps[:step]]
        return np.concatenate(taps), np.concatenate(positions)


def _random_token(rng: np.random.Generator, cfg: DrafterConfig) -> int:
    token = int(rng.integers(0, cfg.vocab_size))
    return (token + 1) % cfg.vocab_size if token == cfg.mask_token_id else token


def make_script(cfg: DrafterConfig, prompt_length: int, steps: int, seed: int, index: int = 0) -> SequenceScript:
    """Deterministic inputs of one sequence, drawn from ``(seed, index)``.

    Taps are N(0, 1) float32. Every round gets fresh taps for all ``B`` verified rows, so the rows of
    rejected tokens differ from the rows later committed at the same positions (as with a real target): a
    drafter that fails to drop them diverges.
    """
    if prompt_length < 1:
        raise ValueError("prompts need at least one token")
    rng = np.random.default_rng([seed, index])
    features, block = cfg.fc_in_features, cfg.block_size
    prompt = rng.standard_normal((prompt_length, features)).astype(np.float32)
    p0, rounds = prompt_length, []
    for _ in range(steps):
        anchor = _random_token(rng, cfg)
        verify = rng.standard_normal((block, features)).astype(np.float32)
        accepted = int(rng.integers(0, cfg.gamma + 1))
        rounds.append(ScriptStep(p0=p0, anchor=anchor, verify_taps=verify, accepted=accepted))
        p0 += accepted + 1
    return SequenceScript(prompt_taps=prompt, steps=tuple(rounds))


@dataclass(frozen=True)
class Scenario:
    prompt_lengths: tuple[int, ...] = (5, 17, 30, 3)
    steps: int = 10
    seed: int = 0
    padded_every: int = 3  # every k-th round appends the whole verified block, then rolls back (0: never)
    replace_at: int | None = 4  # at this round, free the first live sequence and admit a new one
    replacement_prompt: int = 21
    # each round's rows (and a new sequence's prompt) appended by the next round's `step` call, together
    # with its proposal, instead of by `append_context` right away (the drafter must be a SteppingDrafter)
    stepped: bool = False


@dataclass(frozen=True)
class StepRecord:
    step: int
    seq_ids: tuple[int, ...]
    anchors: tuple[int, ...]
    tokens: np.ndarray  # [nb, gamma]
    confidences: np.ndarray | None
    accepted: tuple[int, ...]
    drafts: Any  # what the drafter returned, for finer comparisons (e.g. the reference's proposals)


@dataclass
class ScenarioRun:
    """The scripts by sequence id, the round each sequence joined at, and one record per round."""

    scripts: dict[int, SequenceScript] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)

    def script_step(self, seq_id: int, step: int) -> int:
        """Index into ``scripts[seq_id].steps`` of scenario round ``step``."""
        return step - self.joined[seq_id]


def run_scenario(drafter: DrafterLike, cfg: DrafterConfig, scenario: Scenario) -> ScenarioRun:
    if scenario.stepped and not isinstance(drafter, SteppingDrafter):
        raise TypeError(
            f"a stepped scenario drives the drafter through step(); {type(drafter).__name__} has none. Fix: "
            "run it with Scenario(stepped=False)"
        )
    run = ScenarioRun()
    pending = _PendingRows()

    def admit(seq_id: int, prompt: int, at: int) -> None:
        script = make_script(cfg, prompt, scenario.steps - at, scenario.seed, seq_id)
        run.scripts[seq_id], run.joined[seq_id] = script, at
        drafter.create(seq_id)
        pending.add(seq_id, script.prompt_taps, np.arange(prompt), prompt)
        if not scenario.stepped:
            pending.flush(drafter)

    for seq_id, prompt in enumerate(scenario.prompt_lengths):
        admit(seq_id, prompt, 0)
    live = list(range(len(scenario.prompt_lengths)))
    for step in range(scenario.steps):
        if scenario.replace_at is not None and step == scenario.replace_at:
            gone = live.pop(0)
            pending.drop(gone)
            drafter.free(gone)
            admit(len(run.scripts), scenario.replacement_prompt, step)
            live.append(len(run.scripts) - 1)
        rounds = [run.scripts[s].steps[run.script_step(s, step)] for s in live]
        anchors = [r.anchor for r in rounds]
        if scenario.stepped:
            assert isinstance(drafter, SteppingDrafter)
            drafts = drafter.step(pending.take(), live, anchors)
        else:
            drafts = drafter.propose(live, anchors)
        for s, r in zip(live, rounds, strict=True):  # the lengths the proposal saw
            if drafter.length(s) != r.p0:
                raise AssertionError(f"sequence {s} holds {drafter.length(s)} rows, the script expects {r.p0}")
        padded = scenario.padded_every and step % scenario.padded_every == scenario.padded_every - 1
        for s, r in zip(live, rounds, strict=True):
            if padded:  # the whole verified block, rolled back to the accepted rows
                pending.add(s, r.verify_taps, r.p0 + np.arange(len(r.verify_taps)), r.p0 + r.accepted + 1)
            else:
                pending.add(s, r.committed_taps, r.committed_positions, r.p0 + r.accepted + 1)
        if not scenario.stepped:
            pending.flush(drafter)
        run.records.append(
            StepRecord(
                step,
                tuple(live),
                tuple(anchors),
                np.asarray(drafts.tokens),
                None if drafts.confidences is None else np.asarray(drafts.confidences),
                tuple(r.accepted for r in rounds),
                drafts,
            )
        )
    pending.flush(drafter)
    return run


@dataclass
class _PendingRows:
    """Context rows a scenario has yet to append: per sequence its taps, positions and the length it keeps."""

    rows: dict[int, tuple[np.ndarray, np.ndarray, int]] = field(default_factory=dict)

    def add(self, seq_id: int, taps: np.ndarray, positions: np.ndarray, keep: int) -> None:
        self.rows[seq_id] = (taps, positions, keep)

    def drop(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)

    def take(self) -> ContextRows:
        """All of them, emptied."""
        ids = list(self.rows)
        rows = ContextRows(
            ids, [self.rows[s][0] for s in ids], [self.rows[s][1] for s in ids], [self.rows[s][2] for s in ids]
        )
        self.rows.clear()
        return rows

    def flush(self, drafter: DrafterLike) -> None:
        """Append them all, then roll each sequence back to what it keeps."""
        self.take().append_to(drafter)
