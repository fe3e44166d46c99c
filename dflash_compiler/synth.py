"""Deterministic random weights for a drafter and the target tensors it borrows.

Each tensor draws from its own generator seeded by ``(seed, name)``, so a tensor's values do not depend
on which other tensors are generated or in which order. Scales keep activations O(1) through the layers
(linear weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1²)), so drafts are not degenerate.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dflash_compiler.config import DrafterConfig
from dflash_compiler.tensors import TensorSpec, expected_drafter_tensors


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def random_tensor(spec: TensorSpec, seed: int) -> np.ndarray:
    """fp32 values for one tensor, deterministic in ``(seed, spec.name)``."""
    rng = tensor_rng(seed, spec.name)
    shape = spec.shape

    def normal() -> np.ndarray:
        # float32 draws: a real-shape lm_head (151936 x 4096) stays at 2.5 GB instead of 5 GB.
        return rng.standard_normal(shape, dtype=np.float32)

    if spec.role == "norm":
        return (1.0 + 0.1 * normal()).astype(np.float32)
    if spec.role == "bias":
        return (0.1 * normal()).astype(np.float32)
    if spec.role == "conv_base":
        # [2, K, H]: near the identity tap (o = 0) with visible contributions from earlier rows.
        base = 0.3 * normal()
        base[:, 0, :] += 1.0
        return base.astype(np.float32)
    if spec.role == "embedding":
        return normal()
    if spec.role == "linear":
        fan_in = shape[-1]
        w = normal()
        w *= np.float32(1.0 / np.sqrt(fan_in))
        return w
    raise ValueError(f"unknown tensor role {spec.role!r} for {spec.name}")


def random_drafter_weights(cfg: DrafterConfig, seed: int) -> dict[str, np.ndarray]:
    """fp32 random values for every tensor of :func:`expected_drafter_tensors`."""
    return {name: random_tensor(spec, seed) for name, spec in expected_drafter_tensors(cfg).items()}


def target_tensor_specs(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """The target tensors the drafter borrows: the input embedding and the output head."""
    shape = (cfg.vocab_size, cfg.hidden_size)
    return {
        "embed_tokens": TensorSpec("embed_tokens", shape, "embedding"),
        "lm_head": TensorSpec("lm_head", shape, "linear"),
    }


def random_target_weights(cfg: DrafterConfig, seed: int, tied: bool = False) -> dict[str, np.ndarray]:
    """``{"embed_tokens": [V, H], "lm_head": [V, H]}`` fp32; ``tied`` makes lm_head the embedding."""
    specs = target_tensor_specs(cfg)
    embed = random_tensor(specs["embed_tokens"], seed)
    lm_head = embed if tied else random_tensor(specs["lm_head"], seed)
    return {"embed_tokens": embed, "lm_head": lm_head}
