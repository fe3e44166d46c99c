"""Build options: one typed, frozen object; every field is recorded in the artifact's manifest."""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from dflash_compiler.errors import InputError, Problem


class Precision(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"
    AUTO = "auto"


class BuildOptions(BaseModel):
    """What a build decides beyond the drafter's config. No environment variable changes any of it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int | None = Field(
        default=None, ge=2, description="serve with this block size instead of the config's (anchor + drafts)"
    )
    max_batch: int = Field(default=16, ge=1, description="sequences per propose step (the largest batch bucket)")
    max_seq_len: int = Field(default=8192, ge=1, description="longest sequence (context rows) the cache admits")
    max_ctx_rows: int = Field(
        default=512, ge=1, description="most new context rows one append_context call takes (all sequences)"
    )
    precision: Precision = Field(default=Precision.BF16, description="weights of the linear layers")
    exclude: tuple[str, ...] = Field(
        default=(), description="ModelOpt-style globs of linears kept in bf16, e.g. 'layers.0.*', 'lm_head'"
    )
    fp8_error_budget: float = Field(
        default=0.02, gt=0, description="auto precision: largest relative output error a linear may take in FP8"
    )
    kv_budget_bytes: int | None = Field(
        default=None, ge=1, description="size the KV pool from this many bytes instead of max_batch x max_seq_len"
    )
    dependent_launch: bool = Field(
        default=True,
        description="launch each kernel as a programmatic dependent of the one before it (sm_90+), so it starts "
        "while that one drains (dependent_launch.py); on the H200 the Qwen3-8B bf16 step measured 1.061 / 1.972 / "
        "2.396 / 4.293 ms with it and 1.097 / 1.987 / 2.428 / 4.266 ms without at nb = 1 / 4 / 8 / 16 "
        "(bench/propose.py)",
    )
    weight_tiles: bool = Field(
        default=True,
        description="store the linears' own weights as 64 x 64 tiles, so a GEMM's slot of weight rows is one "
        "contiguous run (ir_passes/tile_weights.py, which has the step measured both ways); off: row-major",
    )
    sliding_window_only: bool = Field(
        default=False, description="sliding-window layers keep only their window of context rows"
    )
    knobs: dict[str, dict[str, StrictInt]] = Field(
        default_factory=dict,
        description="schedule knobs over the target's defaults, per rule name: {rule: {knob: value}} (a tuning "
        "choice, an A/B build); the build refuses a rule or knob it does not know and a rule no kernel used",
    )

    @model_validator(mode="after")
    def _check(self) -> BuildOptions:
        if self.exclude and self.precision is Precision.BF16:
            raise ValueError("exclude only applies with precision fp8 or auto; remove it or change precision")
        return self


KNOB_SYNTAX = "RULE.KNOB=INT, e.g. block_attention_wgmma.stages=4"


def knob_overrides(texts: Iterable[str]) -> dict[str, dict[str, int]]:
    """`{rule: {knob: value}}` from `RULE.KNOB=VALUE` texts (the CLI's and the benchmarks' spelling of knob
    overrides); refuses, naming each, a text of another shape and a knob given twice."""
    out: dict[str, dict[str, int]] = {}
    problems = []
    for text in texts:
        match = re.fullmatch(r"\s*(\w+)\.(\w+)\s*=\s*(-?\d+)\s*", text)
        if match is None:
            problems.append(
                Problem("knob", repr(text), KNOB_SYNTAX, "spell it so (`inspect` lists each kernel's rule and knobs)")
            )
            continue
        rule, knob, value = match.group(1), match.group(2), int(match.group(3))
        if knob in out.setdefault(rule, {}):
            problems.append(
                Problem("knob", repr(text), f"{rule}.{knob} once (it is already {out[rule][knob]})", "give it once")
            )
        out[rule][knob] = value
    if problems:
        raise InputError("build options", problems)
    return out
