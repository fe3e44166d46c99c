"""Drafter config front end: config.json → a validated, frozen :class:`DrafterConfig`.

Reading rules (DFLASH.md §3):

* every known key is looked up in ``dflash_config`` first, then at the top level;
* HF v4 ``rope_theta``/``rope_scaling`` and HF v5 ``rope_parameters`` both resolve to one :class:`RopeSpec`;
* per-layer attention comes from ``layer_types`` (or the Qwen3 ``use_sliding_window``/``max_window_layers``
  rule), and causality defaults to ``layer_type == "sliding_attention"`` unless ``is_causal`` is set;
* keys this compiler does not know are kept in :attr:`DrafterConfig.unknown_keys`, never dropped;
* keys that would change the math in ways the compiler does not implement are refused.

All problems are collected and raised together as one :class:`ConfigError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from dflash_compiler.errors import ConfigError, Problem, short
from dflash_compiler.rope import RopeSpec, RopeType


class Family(StrEnum):
    DFLASH = "dflash"
    DFLASH2 = "dflash2"
    DSPARK = "dspark"


ARCHITECTURES: dict[str, Family] = {
    "DFlashDraftModel": Family.DFLASH,
    "DFlash2DraftModel": Family.DFLASH2,
    "DSparkDraftModel": Family.DSPARK,
    "Qwen3DSparkModel": Family.DSPARK,
}


class AttentionKind(StrEnum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"


class LayerAttention(BaseModel):
    """How one draft layer's block rows attend: mask = causal? ∧ window (symmetric when non-causal)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: AttentionKind
    causal: bool
    window: int | None  # None: no window (full layers)

    def describe(self) -> str:
        if self.kind is AttentionKind.FULL:
            return "full, causal" if self.causal else "full, non-causal"
        shape = "causal" if self.causal else "symmetric"
        return f"sliding W={self.window}, {shape}"


class DFlash2Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


class MarkovHeadType(StrEnum):
    VANILLA = "vanilla"


class DSparkSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    markov_rank: int
    markov_head_type: MarkovHeadType
    enable_confidence_head: bool
    confidence_head_with_markov: bool


# Keys read from the merged (dflash_config over top-level) namespace, with their JSON types.
class _RawFields(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    architectures: list[str] | None = None
    model_type: str | None = None
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    partial_rotary_factor: float | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    max_window_layers: int | None = None
    is_causal: bool | None = None
    causal: bool | None = None
    num_target_layers: int
    block_size: int
    vocab_size: int
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    tie_word_embeddings: bool = False
    mask_token_id: int
    mask_token: str | None = None
    target_layer_ids: list[int] | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    projector_type: str | None = None
    markov_rank: int | None = None
    markov_head_type: str | None = None
    enable_confidence_head: bool | None = None
    confidence_head_alpha: float | None = None
    confidence_head_with_markov: bool | None = None
    attention_mode: str | None = None


# Known keys that carry no meaning for the compiled forward (kept out of the unknown list).
_INFORMATIONAL = frozenset(
    {
        "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
        "transformers_version", "use_cache", "initializer_range", "attention_dropout",
        "num_anchors", "mrope_section", "mrope_interleaved", "rope_type",
    }
)  # fmt: skip

# Known keys whose semantics this compiler does not implement: refused when set to a non-default value.
_UNSUPPORTED: dict[str, str] = {
    "use_swa": "MiMo-style drafter switches are not supported; express sliding layers with layer_types",
    "swa_window_size": "use sliding_window with layer_types instead",
    "attention_sink_bias": "attention sink biases (MiMo) are not supported",
    "attention_value_scale": "attention value scaling (MiMo) is not supported",
    "use_aux_hidden_state": "MiMo aux hidden states are not supported",
    "d2t": "reduced-vocabulary drafters (d2t mapping) are not supported",
}

_POSITIVE_INTS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "num_target_layers", "vocab_size",
    "target_hidden_size", "sliding_window", "conv_kernel_size", "conv_group_size", "selector_rank",
    "selector_top_k", "markov_rank", "draft_vocab_size",
)  # fmt: skip

_EXPECTED_TYPE = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "missing": "a value (the field is required)",
}


class DrafterConfig(BaseModel):
    """A validated drafter config with typed, derived views. Build it with :func:`load_drafter_config`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: Family
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    target_hidden_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    target_layer_ids_defaulted: bool
    block_size: int
    mask_token_id: int
    tie_word_embeddings: bool
    rope: RopeSpec
    layers: tuple[LayerAttention, ...]
    output_multiplier: float
    final_logit_softcapping: float | None
    input_embedding_scale: float
    dflash2: DFlash2Spec | None
    dspark: DSparkSpec | None
    unknown_keys: tuple[str, ...]
    notes: tuple[str, ...]
    raw: dict[str, Any]

    @property
    def gamma(self) -> int:
        """Number of draft tokens per block (the anchor row is not a draft)."""
        return self.block_size - 1

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_taps * self.target_hidden_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer for one context row."""
        return self.num_layers * 2 * self.kv_size * 2

    def with_block_size(self, block_size: int) -> DrafterConfig:
        """The same drafter run with another block size (a serving-engine choice; ≥ 2)."""
        if block_size < 2:
            raise ConfigError(
                "block size override",
                [Problem("block_size", str(block_size), "an integer >= 2", "pass a block size of at least 2")],
            )
        return self.model_copy(update={"block_size": block_size})


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default taps: ``round(1 + i (N-4) / (L-1))``; a single draft layer taps ``N // 2``."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _merge(raw: Mapping[str, Any], problems: list[Problem]) -> tuple[dict[str, Any], dict[str, str]]:
    """Flatten ``dflash_config`` over the top level; returns (values, key -> path it came from)."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in raw.items():
        if key == "dflash_config":
            continue
        merged[key], origin[key] = value, key
    inner = raw.get("dflash_config")
    if inner is None:
        return merged, origin
    if not isinstance(inner, Mapping):
        problems.append(
            Problem("dflash_config", short(inner), "an object", "make dflash_config a JSON object or remove it")
        )
        return merged, origin
    for key, value in inner.items():
        merged[key], origin[key] = value, f"dflash_config.{key}"
    return merged, origin


def _pydantic_problems(err: ValidationError, origin: Mapping[str, str]) -> list[Problem]:
    out = []
    for item in err.errors():
        loc = item["loc"]
        key = str(loc[0]) if loc else "?"
        where = origin.get(key, key) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
        kind = item["type"]
        expected = _EXPECTED_TYPE.get(kind, item["msg"])
        if kind == "missing":
            out.append(Problem(where, "nothing", expected, f"add {key} to config.json (or to dflash_config)"))
        else:
            value = item.get("input")
            out.append(
                Problem(
                    where,
                    f"{short(value)} ({type(value).__name__})",
                    expected,
                    f"write {key} as {expected} in config.json",
                )
            )
    return out


def _resolve_rope(f: _RawFields, origin: Mapping[str, str], problems: list[Problem]) -> RopeSpec | None:
    params: dict[str, Any]
    if f.rope_parameters is not None:
        params, where = dict(f.rope_parameters), origin.get("rope_parameters", "rope_parameters")
        theta = params.pop("rope_theta", f.rope_theta)
    else:
        params = dict(f.rope_scaling or {})
        where = origin.get("rope_scaling", "rope_scaling")
        theta = f.rope_theta
    if theta is None:
        problems.append(
            Problem(
                "rope_theta",
                "nothing",
                "the RoPE base (e.g. 1000000 for Qwen3, 10000000 for Qwen3.5+)",
                "set rope_theta (HF v4) or rope_parameters.rope_theta (HF v5)",
            )
        )
        return None
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta) or theta <= 1:
        problems.append(Problem(f"{where}.rope_theta", short(theta), "a number > 1", "set a valid rope_theta"))
        return None
    type_name = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    allowed = ", ".join(t.value for t in RopeType)
    try:
        rope_type = RopeType(type_name)
    except ValueError:
        problems.append(
            Problem(
                f"{where}.rope_type",
                short(type_name),
                f"one of {allowed}",
                "use a supported RoPE variant; other scalings (llama3, longrope, dynamic) are not implemented",
            )
        )
        return None
    spec: dict[str, Any] = {"rope_type": rope_type, "theta": float(theta)}
    if rope_type is RopeType.DEFAULT:
        params.pop("factor", None)
    else:
        factor = params.pop("factor", None)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            problems.append(
                Problem(f"{where}.factor", short(factor), "a number > 0", f"set the {type_name} scaling factor")
            )
            return None
        spec["factor"] = float(factor)
    if rope_type is RopeType.YARN:
        spec["original_max_position_embeddings"] = int(
            params.pop("original_max_position_embeddings", None) or f.max_position_embeddings
        )
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                spec[key] = float(params.pop(key))
            params.pop(key, None)
        if "truncate" in params:
            spec["truncate"] = bool(params.pop("truncate"))
    if params:
        problems.append(
            Problem(
                where,
                f"unrecognised keys {sorted(params)}",
                f"only the parameters of rope_type {type_name!r}",
                "remove the extra keys or correct rope_type",
            )
        )
        return None
    return RopeSpec(**spec)


def _resolve_layers(f: _RawFields, origin: Mapping[str, str], problems: list[Problem]) -> tuple[LayerAttention, ...]:
    n = f.num_hidden_layers
    if f.layer_types is not None:
        types = list(f.layer_types)
        where = origin.get("layer_types", "layer_types")
        if len(types) != n:
            problems.append(
                Problem(
                    where,
                    f"{len(types)} entries",
                    f"one entry per draft layer (num_hidden_layers = {n})",
                    "list one layer type per layer",
                )
            )
            return ()
        allowed = {k.value for k in AttentionKind}
        bad = [(i, t) for i, t in enumerate(types) if t not in allowed]
        for i, t in bad:
            problems.append(Problem(f"{where}[{i}]", short(t), f"one of {sorted(allowed)}", "fix the layer type"))
        if bad:
            return ()
    else:
        # The HF Qwen3 rule: with use_sliding_window, layers from max_window_layers on slide.
        slide = bool(f.use_sliding_window) and f.sliding_window is not None
        first = f.max_window_layers if f.max_window_layers is not None else 0
        types = [AttentionKind.SLIDING.value if slide and i >= first else AttentionKind.FULL.value for i in range(n)]
    causal_override = f.is_causal if f.is_causal is not None else f.causal
    layers = []
    for t in types:
        kind = AttentionKind(t)
        causal = causal_override if causal_override is not None else kind is AttentionKind.SLIDING
        window = None
        if kind is AttentionKind.SLIDING:
            if f.sliding_window is None:
                problems.append(
                    Problem(
                        "sliding_window",
                        "nothing",
                        "a window size for the sliding_attention layers",
                        "set sliding_window or make those layers full_attention",
                    )
                )
                return ()
            window = f.sliding_window
        layers.append(LayerAttention(kind=kind, causal=causal, window=window))
    return tuple(layers)


def _family(f: _RawFields, origin: Mapping[str, str], problems: list[Problem]) -> tuple[Family | None, str]:
    if f.projector_type is not None and f.projector_type != "dspark":
        problems.append(
            Problem(
                origin.get("projector_type", "projector_type"),
                short(f.projector_type),
                "'dspark' or no projector_type",
                "only DFlash, DFlash2 and DSpark drafters are supported (Domino and others are not)",
            )
        )
        return None, ""
    if not f.architectures:
        if f.projector_type == "dspark":
            return Family.DSPARK, "DSparkDraftModel"
        problems.append(
            Problem(
                "architectures",
                short(f.architectures),
                f"a list naming one of {sorted(ARCHITECTURES)}",
                'add e.g. "architectures": ["DFlashDraftModel"]',
            )
        )
        return None, ""
    arch = f.architectures[0]
    if arch not in ARCHITECTURES:
        problems.append(
            Problem(
                "architectures[0]",
                short(arch),
                f"one of {sorted(ARCHITECTURES)}",
                "this compiler handles DFlash v1, DFlash2 and DSpark drafters only",
            )
        )
        return None, arch
    family = ARCHITECTURES[arch]
    if f.projector_type == "dspark" and family is not Family.DSPARK:
        problems.append(
            Problem(
                origin.get("projector_type", "projector_type"),
                "'dspark'",
                f"no projector_type for a {arch}",
                "remove projector_type or use a DSpark architecture",
            )
        )
    return family, arch


def _check_ranges(f: _RawFields, origin: Mapping[str, str], problems: list[Problem]) -> None:
    for key in _POSITIVE_INTS:
        value = getattr(f, key)
        if value is not None and value <= 0:
            problems.append(
                Problem(origin.get(key, key), str(value), "an integer > 0", f"set {key} to a positive size")
            )
    if f.block_size < 2:
        problems.append(
            Problem(
                origin.get("block_size", "block_size"),
                str(f.block_size),
                "an integer >= 2 (the anchor plus at least one draft)",
                "set block_size to e.g. 16 (DFlash) or 8 (DFlash2)",
            )
        )
    if not (math.isfinite(f.rms_norm_eps) and f.rms_norm_eps > 0):
        problems.append(Problem("rms_norm_eps", str(f.rms_norm_eps), "a number > 0", "set e.g. 1e-6"))
    if f.hidden_act != "silu":
        problems.append(
            Problem(
                "hidden_act",
                short(f.hidden_act),
                "'silu'",
                "DFlash-family drafters use SiLU-gated MLPs; other activations are not supported",
            )
        )
    if f.attention_bias:
        problems.append(Problem("attention_bias", "true", "false", "attention projections with bias are not supported"))
    for key in ("output_multiplier", "input_embedding_scale"):
        value = getattr(f, key)
        if not math.isfinite(value) or value == 0:
            problems.append(
                Problem(origin.get(key, key), str(value), "a finite non-zero number", f"set {key} (default 1.0)")
            )
    cap = f.final_logit_softcapping
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        problems.append(
            Problem(
                origin.get("final_logit_softcapping", "final_logit_softcapping"),
                str(cap),
                "a number > 0 or null",
                "set the softcap or null to disable it",
            )
        )


def _check_shapes(f: _RawFields, problems: list[Problem]) -> int | None:
    """Head arithmetic; returns head_dim when consistent."""
    heads, kv = f.num_attention_heads, f.num_key_value_heads or f.num_attention_heads
    if heads > 0 and kv > 0 and heads % kv != 0:
        problems.append(
            Problem(
                "num_key_value_heads",
                str(kv),
                f"a divisor of num_attention_heads ({heads}) for grouped-query attention",
                "fix num_attention_heads / num_key_value_heads",
            )
        )
    head_dim = f.head_dim
    if head_dim is None:
        if heads > 0 and f.hidden_size % heads != 0:
            problems.append(
                Problem(
                    "head_dim",
                    f"nothing, and hidden_size is not a multiple of num_attention_heads ({f.hidden_size} / {heads})",
                    "head_dim given, or hidden_size divisible by num_attention_heads",
                    "set head_dim explicitly",
                )
            )
            return None
        head_dim = f.hidden_size // heads if heads > 0 else None
    if head_dim is not None and head_dim > 0 and head_dim % 2 != 0:
        problems.append(Problem("head_dim", str(head_dim), "an even number (RoPE rotates pairs)", "fix head_dim"))
        return None
    return head_dim if head_dim and head_dim > 0 else None


def _check_taps(f: _RawFields, origin: Mapping[str, str], problems: list[Problem]) -> tuple[tuple[int, ...], bool]:
    n = f.num_target_layers
    if f.target_layer_ids is None:
        if n <= 0 or f.num_hidden_layers <= 0:
            return (), True
        return default_target_layer_ids(n, f.num_hidden_layers), True
    where = origin.get("target_layer_ids", "target_layer_ids")
    ids = tuple(f.target_layer_ids)
    if not ids:
        problems.append(
            Problem(
                where,
                "[]",
                "at least one target layer id",
                "list the 0-based target layers whose outputs feed the drafter, e.g. [1, 9, 17, 25, 33]",
            )
        )
        return ids, False
    bad = [i for i in ids if not 0 <= i < n]
    if bad and n > 0:
        problems.append(
            Problem(
                where,
                f"ids {bad}",
                f"0 <= id < num_target_layers ({n})",
                "check num_target_layers and the ids (they are 0-based; the tap is the output of block id)",
            )
        )
    if len(set(ids)) != len(ids):
        problems.append(Problem(where, str(list(ids)), "distinct ids", "remove the repeated ids"))
    return ids, False


def _check_family_fields(
    family: Family | None, f: _RawFields, origin: Mapping[str, str], problems: list[Problem]
) -> tuple[DFlash2Spec | None, DSparkSpec | None]:
    def at(key: str) -> str:
        return origin.get(key, f"dflash_config.{key}")

    dflash2 = dspark = None
    pairs = (("conv_kernel_size", "conv_group_size"), ("selector_rank", "selector_top_k"))
    for a, b in pairs:
        va, vb = getattr(f, a), getattr(f, b)
        if (va is None) != (vb is None):
            have, miss = (a, b) if vb is None else (b, a)
            problems.append(
                Problem(
                    at(miss),
                    f"nothing, while {have} is set",
                    f"{a} and {b} together",
                    f"set {miss} as well, or remove {have}",
                )
            )
    conv = f.conv_kernel_size is not None and f.conv_group_size is not None
    sel = f.selector_rank is not None and f.selector_top_k is not None
    if family is Family.DFLASH2:
        for ok, keys in ((conv, pairs[0]), (sel, pairs[1])):
            if not ok and all(getattr(f, k) is None for k in keys):
                problems.append(
                    Problem(
                        at(keys[0]),
                        "nothing",
                        f"{keys[0]} and {keys[1]} for a DFlash2DraftModel",
                        "add them to dflash_config (z-lab DFlash2: 2, 16, 256, 16)",
                    )
                )
        if conv and sel:
            assert f.conv_kernel_size and f.conv_group_size and f.selector_rank and f.selector_top_k
            if f.conv_group_size > 0 and f.hidden_size % f.conv_group_size != 0:
                problems.append(
                    Problem(
                        at("conv_group_size"),
                        str(f.conv_group_size),
                        f"a divisor of hidden_size ({f.hidden_size})",
                        "fix conv_group_size",
                    )
                )
            if f.selector_top_k > f.vocab_size > 0:
                problems.append(
                    Problem(at("selector_top_k"), str(f.selector_top_k), "<= vocab_size", "lower selector_top_k")
                )
            if all(v > 0 for v in (f.conv_kernel_size, f.conv_group_size, f.selector_rank, f.selector_top_k)):
                dflash2 = DFlash2Spec(
                    conv_kernel_size=f.conv_kernel_size,
                    conv_group_size=f.conv_group_size,
                    selector_rank=f.selector_rank,
                    selector_top_k=f.selector_top_k,
                )
    elif family is not None and (conv or sel):
        key = pairs[0][0] if conv else pairs[1][0]
        problems.append(
            Problem(
                at(key),
                "set",
                f"no conv/selector fields for a {family.value} drafter",
                "use architectures ['DFlash2DraftModel'] or remove the DFlash2 fields",
            )
        )
    markov_keys = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
    if family is Family.DSPARK:
        if f.markov_rank is None:
            problems.append(Problem(at("markov_rank"), "nothing", "the Markov head rank", "add markov_rank (e.g. 256)"))
        head = f.markov_head_type or MarkovHeadType.VANILLA.value
        if head not in {t.value for t in MarkovHeadType}:
            problems.append(
                Problem(
                    at("markov_head_type"),
                    short(head),
                    "'vanilla'",
                    "the gated and rnn Markov heads are not supported yet; use a vanilla-head checkpoint",
                )
            )
        if f.attention_mode not in (None, "gqa", "mha"):
            problems.append(
                Problem(at("attention_mode"), short(f.attention_mode), "'gqa' or 'mha'", "fix attention_mode")
            )
        if f.markov_rank is not None and f.markov_rank > 0 and head == MarkovHeadType.VANILLA.value:
            dspark = DSparkSpec(
                markov_rank=f.markov_rank,
                markov_head_type=MarkovHeadType.VANILLA,
                enable_confidence_head=bool(f.enable_confidence_head),
                confidence_head_with_markov=(
                    True if f.confidence_head_with_markov is None else f.confidence_head_with_markov
                ),
            )
    elif family is not None:
        present = [k for k in markov_keys if getattr(f, k) is not None]
        if present:
            problems.append(
                Problem(
                    at(present[0]),
                    "set",
                    f"no Markov/confidence fields for a {family.value} drafter",
                    "use a DSpark architecture or remove the DSpark fields",
                )
            )
    return dflash2, dspark


def parse_drafter_config(raw: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """Validate a parsed config.json mapping; raises :class:`ConfigError` listing every problem."""
    problems: list[Problem] = []
    if not isinstance(raw, Mapping):
        raise ConfigError(source, [Problem(source, type(raw).__name__, "a JSON object", "fix the file")])
    merged, origin = _merge(raw, problems)
    known = set(_RawFields.model_fields)
    fields_in = {k: v for k, v in merged.items() if k in known}
    unknown = sorted(origin[k] for k in merged if k not in known and k not in _INFORMATIONAL and k not in _UNSUPPORTED)
    for key, why in _UNSUPPORTED.items():
        value = merged.get(key)
        if value not in (None, False, 0, [], {}):
            problems.append(Problem(origin[key], short(value), "unset (or false)", why))
    try:
        f = _RawFields(**fields_in)
    except ValidationError as err:
        raise ConfigError(source, problems + _pydantic_problems(err, origin)) from None

    notes: list[str] = []
    family, arch = _family(f, origin, problems)
    _check_ranges(f, origin, problems)
    head_dim = _check_shapes(f, problems)
    taps, defaulted = _check_taps(f, origin, problems)
    if defaulted and taps:
        notes.append(f"target_layer_ids not given: using the z-lab default {list(taps)}")
    if not (0 <= f.mask_token_id < f.vocab_size):
        problems.append(
            Problem(
                origin.get("mask_token_id", "mask_token_id"),
                str(f.mask_token_id),
                f"0 <= id < vocab_size ({f.vocab_size})",
                "set the target tokenizer's <|MASK|> id (151669 for Qwen3, 248070 for Qwen3.5+)",
            )
        )
    if f.draft_vocab_size is not None and f.draft_vocab_size != f.vocab_size:
        problems.append(
            Problem(
                origin.get("draft_vocab_size", "draft_vocab_size"),
                str(f.draft_vocab_size),
                f"the target vocabulary ({f.vocab_size})",
                "reduced-vocabulary drafters (d2t mapping) are not supported",
            )
        )
    if f.partial_rotary_factor not in (None, 1.0):
        notes.append(
            f"partial_rotary_factor={f.partial_rotary_factor} ignored: DFlash drafters rotate the full head_dim"
        )
    rope = _resolve_rope(f, origin, problems)
    layers = _resolve_layers(f, origin, problems)
    dflash2, dspark = _check_family_fields(family, f, origin, problems)
    if problems:
        raise ConfigError(source, problems)
    assert family is not None and rope is not None and head_dim is not None
    return DrafterConfig(
        family=family,
        architecture=arch,
        hidden_size=f.hidden_size,
        intermediate_size=f.intermediate_size,
        num_layers=f.num_hidden_layers,
        num_heads=f.num_attention_heads,
        num_kv_heads=f.num_key_value_heads or f.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=f.rms_norm_eps,
        max_position_embeddings=f.max_position_embeddings,
        vocab_size=f.vocab_size,
        target_hidden_size=f.target_hidden_size or f.hidden_size,
        num_target_layers=f.num_target_layers,
        target_layer_ids=taps,
        target_layer_ids_defaulted=defaulted,
        block_size=f.block_size,
        mask_token_id=f.mask_token_id,
        tie_word_embeddings=f.tie_word_embeddings,
        rope=rope,
        layers=layers,
        output_multiplier=f.output_multiplier,
        final_logit_softcapping=f.final_logit_softcapping,
        input_embedding_scale=f.input_embedding_scale,
        dflash2=dflash2,
        dspark=dspark,
        unknown_keys=tuple(unknown),
        notes=tuple(notes),
        raw=dict(raw),
    )


def load_drafter_config(path: str | Path) -> DrafterConfig:
    """Read ``config.json`` (or a directory holding it) and validate it."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            str(path),
            [Problem(str(path), "no such file", "a drafter config.json", "point at the drafter's HF directory")],
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            str(path),
            [Problem(f"{path.name} line {err.lineno} col {err.colno}", err.msg, "valid JSON", "fix the syntax")],
        ) from None
    return parse_drafter_config(raw, source=str(path))
