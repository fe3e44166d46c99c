"""Run a loaded artifact and the numpy reference through the same scripted scenario and compare drafts.

`dflash-compile run` and the GPU tests use it: the scenario drives several sequences of different prompt
lengths through propose / append steps with acceptance, a rollback of padded verify rows, and a free
followed by a new sequence reusing the freed pages (`protocol.Scenario`). Step latency is the median of
the drafter's propose calls (host inputs in, drafts out, so it includes the copies).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from dflash_compiler.compare import DraftComparison, compare_drafts
from dflash_compiler.config import DrafterConfig
from dflash_compiler.ir.weights import quantize_fp8_rows
from dflash_compiler.plans import Choice, PrecisionMap
from dflash_compiler.protocol import Scenario, ScenarioRun, run_scenario
from dflash_compiler.reference import BatchedReference, ReferenceDrafter
from dflash_compiler.tensors import expected_drafter_tensors

Tensors = Callable[[str], np.ndarray]


@dataclass
class SelfCheck:
    comparison: DraftComparison
    run: ScenarioRun
    propose_ms: list[float]

    @property
    def median_propose_ms(self) -> float:
        return statistics.median(self.propose_ms) if self.propose_ms else float("nan")


class _Timed:
    """A drafter wrapper that records how long each propose call takes."""

    def __init__(self, drafter: object) -> None:
        self.inner = drafter
        self.propose_ms: list[float] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def propose(self, seq_ids: object, anchors: object) -> object:
        start = time.perf_counter()
        out = self.inner.propose(seq_ids, anchors)  # type: ignore[attr-defined]
        self.propose_ms.append((time.perf_counter() - start) * 1e3)
        return out


def _as_compiled(precision: Mapping[str, PrecisionMap], tensor: Tensors) -> Tensors:
    """The checkpoint tensors as a build with these precision maps (`Manifest.precision`) computes with them.

    A tensor that every linear reading it keeps in FP8 comes back through its e4m3 rows and per-row scales
    (`quantize_fp8_rows`, as pack-weights stores it; a fused weight's rows are quantized row by row, so
    quantizing each source alone is the same). The reference run on these tensors is the reference of the
    compiled drafter, and an FP8 build is held to the same near-tie rule as a bf16 one. A tensor read in
    FP8 by one phase and in bf16 by another (precision `auto`) keeps its checkpoint values.
    """
    uses: dict[str, set[Choice]] = {}
    for plan in precision.values():
        for linear in plan.linears:
            for name in linear.sources:
                uses.setdefault(name, set()).add(linear.choice)
    fp8 = {name for name, choices in uses.items() if choices == {Choice.FP8}}

    def source(name: str) -> np.ndarray:
        value = tensor(name)
        if name not in fp8:
            return value
        rows, scale = quantize_fp8_rows(value)
        return np.asarray(rows, np.float32) * scale[:, None]

    return source


def reference_for(cfg: DrafterConfig, tensor: Tensors) -> BatchedReference:
    weights = {name: tensor(name) for name in expected_drafter_tensors(cfg)}
    ref = ReferenceDrafter(cfg, weights, tensor("target.embed_tokens"), tensor("target.lm_head"))
    return BatchedReference(ref)


def default_scenario(sequences: int = 4, steps: int = 20, seed: int = 0) -> Scenario:
    prompts = tuple(3 + 13 * i for i in range(sequences))  # different lengths, crossing page boundaries
    return Scenario(
        prompt_lengths=prompts, steps=steps, seed=seed, padded_every=3, replace_at=steps // 2, replacement_prompt=9
    )


def self_check(
    drafter: object,
    cfg: DrafterConfig,
    tensor: Tensors,
    scenario: Scenario,
    precision: Mapping[str, PrecisionMap],
    reference: ScenarioRun | None = None,
) -> SelfCheck:
    """Run `drafter` and the reference of the build through `scenario` and compare their drafts.

    `tensor` gives the checkpoint tensors and `precision` the build's precision maps (`Manifest.precision`):
    the reference computes with the weights as the build quantized them (`_as_compiled`).
    """
    timed = _Timed(drafter)
    got = run_scenario(timed, cfg, scenario)
    ref = reference or run_scenario(reference_for(cfg, _as_compiled(precision, tensor)), cfg, scenario)
    return SelfCheck(compare_drafts(cfg.family, ref.records, got.records), got, timed.propose_ms[1:])
