"""The tensor set a drafter checkpoint must hold, derived from its config (DFLASH.md §3).

Names are the checkpoint's own (no ``model.`` prefix). Shapes are exact. Floating-point storage
dtypes BF16/F16/F32 are accepted for every tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_compiler.config import DrafterConfig, Family

FLOAT_DTYPES: frozenset[str] = frozenset({"BF16", "F16", "F32"})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str  # "linear" (a weight applied as x @ W.T), "norm", "conv_base", "embedding", "bias"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def layer_prefix(i: int) -> str:
    return f"layers.{i}."


def expected_drafter_tensors(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """Every tensor the drafter checkpoint must contain, in a stable order."""
    H, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    specs: list[TensorSpec] = [
        TensorSpec("fc.weight", (H, cfg.fc_in_features), "linear"),
        TensorSpec("hidden_norm.weight", (H,), "norm"),
        TensorSpec("norm.weight", (H,), "norm"),
    ]
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        specs += [
            TensorSpec(p + "input_layernorm.weight", (H,), "norm"),
            TensorSpec(p + "post_attention_layernorm.weight", (H,), "norm"),
            TensorSpec(p + "self_attn.q_proj.weight", (cfg.q_size, H), "linear"),
            TensorSpec(p + "self_attn.k_proj.weight", (cfg.kv_size, H), "linear"),
            TensorSpec(p + "self_attn.v_proj.weight", (cfg.kv_size, H), "linear"),
            TensorSpec(p + "self_attn.o_proj.weight", (H, cfg.q_size), "linear"),
            TensorSpec(p + "self_attn.q_norm.weight", (D,), "norm"),
            TensorSpec(p + "self_attn.k_norm.weight", (D,), "norm"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, H), "linear"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, H), "linear"),
            TensorSpec(p + "mlp.down_proj.weight", (H, inter), "linear"),
        ]
        if cfg.family is Family.DFLASH2:
            assert cfg.dflash2 is not None
            k, g = cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                specs += [
                    TensorSpec(p + f"{conv}.base_kernel", (2, k, H), "conv_base"),
                    TensorSpec(p + f"{conv}.kernel_projection.weight", (2 * k * H // g, H), "linear"),
                ]
    if cfg.family is Family.DFLASH2:
        assert cfg.dflash2 is not None
        r, V = cfg.dflash2.selector_rank, cfg.vocab_size
        specs += [
            TensorSpec("candidate_selector.hidden_projection.weight", (r, H), "linear"),
            TensorSpec("candidate_selector.predecessor_codebook", (V, r), "embedding"),
            TensorSpec("candidate_selector.successor_codebook", (V, r), "embedding"),
        ]
    if cfg.family is Family.DSPARK:
        assert cfg.dspark is not None
        r, V = cfg.dspark.markov_rank, cfg.vocab_size
        specs += [
            TensorSpec("markov_head.markov_w1.weight", (V, r), "embedding"),
            TensorSpec("markov_head.markov_w2.weight", (V, r), "linear"),
        ]
        if cfg.dspark.enable_confidence_head:
            width = H + r if cfg.dspark.confidence_head_with_markov else H
            specs += [
                TensorSpec("confidence_head.proj.weight", (1, width), "linear"),
                TensorSpec("confidence_head.proj.bias", (1,), "bias"),
            ]
    return {s.name: s for s in specs}


def parameter_count(cfg: DrafterConfig) -> int:
    return sum(s.numel for s in expected_drafter_tensors(cfg).values())
