"""Shared checks for passes: run a program through the multi-step protocol with the interpreter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_compiler.config import DrafterConfig, load_drafter_config
from dflash_compiler.graph_runner import GraphDrafter
from dflash_compiler.ir import Op, verify
from dflash_compiler.lower import Program, lower
from dflash_compiler.protocol import Scenario, StepRecord, run_scenario
from dflash_compiler.synth import random_drafter_weights, random_target_weights

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ("tiny-dflash", "tiny-dflash-yarn", "tiny-dflash2", "tiny-dspark")


@dataclass(frozen=True)
class Tiny:
    config: DrafterConfig
    program: Program
    tensors: dict[str, np.ndarray]


def tiny(name: str, seed: int = 0) -> Tiny:
    cfg = load_drafter_config(EXAMPLES / name)
    target = random_target_weights(cfg, seed, tied=cfg.tie_word_embeddings)
    tensors = {
        **random_drafter_weights(cfg, seed),
        "target.embed_tokens": target["embed_tokens"],
        "target.lm_head": target["lm_head"],
    }
    return Tiny(cfg, lower(cfg), tensors)


@dataclass
class Run:
    records: list[StepRecord]
    kv: np.ndarray
    logits: np.ndarray | None  # lm_head output of the last propose (None: fused with its argmax)


def run(program: Program, tensors: dict[str, np.ndarray], scenario: Scenario | None = None) -> Run:
    for graph in program.phases.values():
        verify(graph)
    cfg = program.config
    drafter = GraphDrafter(program, tensors, num_pages=64, max_seq_len=512)
    records = run_scenario(drafter, cfg, scenario or Scenario()).records
    fused = any(True for _ in program.propose.nodes_of(Op.LM_HEAD_ARGMAX))
    logits = drafter.last_values["propose"]["lm_head"] if not fused else None
    return Run(records, drafter.kv, logits)


def assert_equivalent(before: Run, after: Run, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Same drafts at every step, same KV cache contents, same final logits (to fp32 rounding)."""
    assert len(before.records) == len(after.records)
    for a, b in zip(before.records, after.records, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"step {a.step}")
        if a.confidences is not None:
            assert b.confidences is not None
            np.testing.assert_allclose(a.confidences, b.confidences, rtol=rtol, atol=atol)
    np.testing.assert_allclose(before.kv, after.kv, rtol=rtol, atol=atol)
    if before.logits is not None and after.logits is not None:  # else the lm_head is fused with its argmax,
        np.testing.assert_allclose(before.logits, after.logits, rtol=rtol, atol=atol)  # whose ids are above
