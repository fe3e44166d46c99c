"""Build options: one typed, frozen object; every field is recorded in the artifact's manifest."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    sliding_window_only: bool = Field(
        default=False, description="sliding-window layers keep only their window of context rows"
    )

    @model_validator(mode="after")
    def _check(self) -> BuildOptions:
        if self.exclude and self.precision is Precision.BF16:
            raise ValueError("exclude only applies with precision fp8 or auto; remove it or change precision")
        return self
