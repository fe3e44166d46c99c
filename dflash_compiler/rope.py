"""RoPE variants: the config-level spec and the tables every consumer derives from it.

The compiler, the numpy reference and the kernels all take RoPE as two numbers per rotary pair: the
inverse frequency table ``inv_freq[D/2]`` and one ``attention_factor`` that scales cos and sin (YaRN's
mscale). Plain RoPE is ``attention_factor = 1``. The rotation is neox rotate-half over the full head_dim.
"""

from __future__ import annotations

import math
from enum import StrEnum

import numpy as np
from pydantic import BaseModel, ConfigDict


class RopeType(StrEnum):
    DEFAULT = "default"
    LINEAR = "linear"
    YARN = "yarn"


class RopeSpec(BaseModel):
    """A resolved RoPE configuration (HF v4 ``rope_scaling`` and v5 ``rope_parameters`` both map here)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: RopeType
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def describe(self) -> str:
        if self.rope_type is RopeType.DEFAULT:
            return f"default, theta={self.theta:g}"
        if self.rope_type is RopeType.LINEAR:
            return f"linear, theta={self.theta:g}, factor={self.factor:g}"
        return (
            f"yarn, theta={self.theta:g}, factor={self.factor:g}, "
            f"original_max_position_embeddings={self.original_max_position_embeddings}, "
            f"attention_factor={rope_tables(self, 2)[1]:.6g}"
        )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(spec: RopeSpec, head_dim: int) -> tuple[np.ndarray, float]:
    """Return ``(inv_freq[head_dim // 2] float64, attention_factor)`` for ``spec``.

    YaRN follows the HF transformers formulation: NTK-by-parts blend of interpolated and extrapolated
    frequencies between the correction dims of ``beta_fast``/``beta_slow``, and
    ``attention_factor = 0.1 ln(factor) + 1`` unless the config gives it (or mscale/mscale_all_dim).
    """
    dim = head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    pos_freqs = spec.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if spec.rope_type is RopeType.DEFAULT:
        return inv_freq, 1.0
    if spec.rope_type is RopeType.LINEAR:
        return inv_freq / spec.factor, 1.0
    # YaRN
    if spec.original_max_position_embeddings is None:
        raise ValueError("yarn RoPE needs original_max_position_embeddings")
    factor = spec.factor
    if spec.attention_factor is not None:
        attention_factor = spec.attention_factor
    elif spec.mscale and spec.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        original = spec.original_max_position_embeddings
        assert original is not None
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_interp = inv_freq / factor
    blended = inv_interp * (1.0 - extrapolation_weight) + inv_freq * extrapolation_weight
    return blended, float(attention_factor)


def cos_sin(positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables ``[len(positions), D]`` (rotate-half layout: the D/2 angles repeated twice)."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles) * attention_factor, np.sin(angles) * attention_factor


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Neox rotate-half RoPE. ``x [T, heads, D]``, ``cos/sin [T, D]``."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
