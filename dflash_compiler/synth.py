"""Deterministic random weights for a drafter and the target tensors it borrows.

Each tensor draws from its own generator seeded by ``(seed, name)``, so a tensor's values do not depend
on which other tensors are generated or in which order. Scales keep activations O(1) through the layers
(linear weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1²)), so drafts are not degenerate.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dflash_compiler.config import DrafterConfig
from dflash_compiler.row_blocks import for_row_blocks, row_spans
from dflash_compiler.tensors import TensorSpec, expected_drafter_tensors


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


# rows drawn from one stream: part of the values' definition (a larger or smaller block changes every
# tensor of more than one block), not a tuning knob
DRAW_BLOCK_ELEMS = 1 << 20


def standard_normal(seed: int, name: str, shape: tuple[int, ...], scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
    """float32 ``shift + scale · N(0, 1)`` of ``shape``, deterministic in ``(seed, name)``.

    Rows (along the first axis) are drawn in blocks of about ``DRAW_BLOCK_ELEMS`` values on every core:
    block 0 from ``tensor_rng(seed, name)``, block b > 0 from ``tensor_rng(seed, f"{name}#{b}")``, each
    filling its rows in C order. A tensor of one block is so the plain draw of one stream, and a real-shape
    lm_head (622 M values) takes seconds rather than a minute."""
    out = np.empty(shape, np.float32)
    flat = out.reshape(shape[0], -1) if out.ndim >= 2 else out.reshape(1, -1)
    step = row_spans(flat.shape[0], flat.shape[1], DRAW_BLOCK_ELEMS)[0][1] if flat.size else 1

    def block(lo: int, hi: int) -> None:
        rows = flat[lo:hi]
        index = lo // step
        rng = tensor_rng(seed, name if index == 0 else f"{name}#{index}")
        rng.standard_normal(out=rows, dtype=np.float32)
        if scale != 1.0:
            rows *= np.float32(scale)
        if shift != 0.0:
            rows += np.float32(shift)

    for_row_blocks(flat.shape[0], flat.shape[1], block, DRAW_BLOCK_ELEMS)
    return out


def random_tensor(spec: TensorSpec, seed: int) -> np.ndarray:
    """fp32 values for one tensor, deterministic in ``(seed, spec.name)`` (:func:`standard_normal`)."""
    shape = spec.shape
    if spec.role == "norm":
        return standard_normal(seed, spec.name, shape, 0.1, 1.0)
    if spec.role == "bias":
        return standard_normal(seed, spec.name, shape, 0.1)
    if spec.role == "conv_base":
        # [2, K, H]: near the identity tap (o = 0) with visible contributions from earlier rows.
        base = standard_normal(seed, spec.name, shape, 0.3)
        base[:, 0, :] += 1.0
        return base
    if spec.role == "embedding":
        return standard_normal(seed, spec.name, shape)
    if spec.role == "linear":
        return standard_normal(seed, spec.name, shape, float(np.float32(1.0 / np.sqrt(shape[-1]))))
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
