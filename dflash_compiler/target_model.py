"""The target model a drafter borrows from: its config and its embedding / output head (DFLASH.md §1.2, §3).

Only the target's ``config.json`` and the two tensors the drafter needs are touched: ``embed_tokens``
(input embedding of the noise block) and ``lm_head`` (the output head, or the embedding when tied).
Plain HF causal LMs keep them at ``model.embed_tokens.weight`` / ``lm_head.weight``; HF v5 multimodal
models nest the text model (``model.language_model.embed_tokens.weight``, with ``hidden_size`` etc. under
``text_config`` in the config). :func:`load_target` only reads headers; :func:`check_target` reports every
incompatibility with the drafter at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_compiler.config import DrafterConfig
from dflash_compiler.errors import ConfigError, Problem, WeightsError, short
from dflash_compiler.tensors import FLOAT_DTYPES
from dflash_compiler.weights import WeightSet, nonfinite_problem

EMBED_PREFIXES: tuple[str, ...] = ("", "model.", "model.language_model.", "language_model.model.")
EMBED_NAMES: tuple[str, ...] = tuple(p + "embed_tokens.weight" for p in EMBED_PREFIXES)
LM_HEAD_NAMES: tuple[str, ...] = ("lm_head.weight", "language_model.lm_head.weight")

_INT_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers")


@dataclass(frozen=True)
class TargetConfig:
    """The fields of a target ``config.json`` the drafter depends on; None where the file has none."""

    path: Path
    hidden_size: int | None
    vocab_size: int | None
    num_hidden_layers: int | None
    tie_word_embeddings: bool | None
    architectures: tuple[str, ...]
    origin: dict[str, str]  # field -> the key path it was read from, e.g. "text_config.hidden_size"


def _lookup(raw: dict[str, Any], text: dict[str, Any], key: str, text_first: bool) -> tuple[Any, str]:
    order = [(text, f"text_config.{key}"), (raw, key)]
    for scope, where in order if text_first else order[::-1]:
        if key in scope and scope[key] is not None:
            return scope[key], where
    return None, key


def read_target_config(path: Path) -> TargetConfig:
    """Parse a target ``config.json``; raises :class:`ConfigError` when it is unreadable or mistyped."""
    fix_json = "point --target-model at the target's HF directory (it holds config.json)"
    if not path.is_file():
        raise ConfigError(str(path), [Problem(str(path), "no such file", "the target's config.json", fix_json)])
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(str(path), [Problem(str(path), f"unreadable JSON ({err})", "valid JSON", fix_json)]) from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [Problem(str(path), short(raw), "a JSON object", fix_json)])
    text = raw.get("text_config") or {}
    problems: list[Problem] = []
    if not isinstance(text, dict):
        problems.append(Problem("text_config", short(text), "an object", "fix text_config in config.json"))
        text = {}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key in (*_INT_FIELDS, "tie_word_embeddings"):
        # The text model's sizes live in text_config; tying is a top-level switch in HF v5 multimodal configs.
        value, where = _lookup(raw, text, key, text_first=key != "tie_word_embeddings")
        want_bool = key == "tie_word_embeddings"
        if value is not None and (isinstance(value, bool) != want_bool or not isinstance(value, int)):
            kind = "true or false" if want_bool else "a positive integer"
            problems.append(Problem(where, short(value), kind, f"write {key} as {kind} in the target config.json"))
            value = None
        values[key], origin[key] = value, where
    if problems:
        raise ConfigError(str(path), problems)
    archs = raw.get("architectures") or []
    return TargetConfig(
        path=path,
        architectures=tuple(str(a) for a in archs) if isinstance(archs, list) else (),
        origin=origin,
        **values,
    )


def _pick(ws: WeightSet, candidates: tuple[str, ...], shape: tuple[int, ...] | None) -> str | None:
    """The first candidate present, preferring one whose shape is ``shape`` when several are."""
    present = [name for name in candidates if name in ws]
    matching = [name for name in present if shape is not None and ws.info(name)[1] == shape]
    return (matching or present or [None])[0]


@dataclass
class TargetModel:
    """A target checkpoint, opened lazily: the names and layouts of its embedding and output head."""

    path: Path
    config: TargetConfig
    weights: WeightSet
    embed_name: str | None  # None: no embedding tensor under any searched name
    lm_head_name: str | None  # None: tied (or missing; see ``tied``)
    tied: bool
    notes: list[str] = field(default_factory=list)

    def _stored_name(self, name: str | None, what: str, searched: tuple[str, ...]) -> str:
        if name is None:
            raise WeightsError(
                f"target model {self.path}",
                [Problem(what, f"none of {', '.join(searched)}", f"the target's {what}", "use a full HF checkpoint")],
            )
        return name

    def _array(self, name: str | None, what: str, searched: tuple[str, ...], as_f32: bool) -> np.ndarray:
        stored = self._stored_name(name, what, searched)
        return self.weights.get_f32(stored) if as_f32 else self.weights.get(stored)

    def embed_tokens(self, as_f32: bool = False) -> np.ndarray:
        """The ``[V, H]`` input embedding, as stored (or float32)."""
        return self._array(self.embed_name, "embed_tokens", EMBED_NAMES, as_f32)

    def embed_tokens_mapped(self) -> np.ndarray:
        """The ``[V, H]`` input embedding as stored, read-only over the file's pages (rows read on touch)."""
        return self.weights.get_mapped(self._stored_name(self.embed_name, "embed_tokens", EMBED_NAMES))

    def lm_head(self, as_f32: bool = False) -> np.ndarray:
        """The ``[V, H]`` output head: the embedding when tied."""
        if self.tied:
            return self.embed_tokens(as_f32)
        return self._array(self.lm_head_name, "lm_head", LM_HEAD_NAMES, as_f32)


def load_target(path: str | Path, cfg: DrafterConfig | None = None) -> TargetModel:
    """Open a target model directory (``config.json`` + safetensors); reads headers only.

    ``cfg`` is only used to choose between several candidate tensor names (the one shaped ``[V, H]`` wins).
    Incompatibilities are not raised here: call :func:`check_target`.
    """
    path = Path(path)
    config = read_target_config(path / "config.json")
    ws = WeightSet(path)
    shape = (cfg.vocab_size, cfg.hidden_size) if cfg is not None else None
    embed = _pick(ws, EMBED_NAMES, shape)
    head = _pick(ws, LM_HEAD_NAMES, shape)
    notes: list[str] = []
    if config.tie_word_embeddings is None:
        tied = head is None
        how = "tied: the checkpoint has no lm_head" if tied else f"untied: it has {head}"
        notes.append(f"config.json does not set tie_word_embeddings; {how}")
    else:
        tied = config.tie_word_embeddings
        if tied and head is not None:
            notes.append(f"tie_word_embeddings is true: {head} is ignored, the embedding is the output head")
    return TargetModel(path, config, ws, embed, None if tied else head, tied, notes)


@dataclass(frozen=True)
class TargetReport:
    """What :func:`check_target` found in a compatible target."""

    path: Path
    embed_name: str
    lm_head_name: str  # equals embed_name when tied
    tied: bool
    dtypes: tuple[str, str]  # (embed, lm_head) storage dtypes
    values_checked: bool
    notes: tuple[str, ...]

    def rows(self) -> list[tuple[str, str]]:
        head = "tied to the embedding" if self.tied else f"{self.lm_head_name} ({self.dtypes[1]})"
        rows = [
            ("target", str(self.path)),
            ("target embedding", f"{self.embed_name} ({self.dtypes[0]})"),
            ("target lm_head", head),
            ("target values", "all finite" if self.values_checked else "not scanned for NaN/Inf"),
        ]
        return rows + [("note", note) for note in self.notes]


def _config_problems(cfg: DrafterConfig, tc: TargetConfig) -> list[Problem]:
    fix = "point --target-model at the model this drafter was trained for, or fix the drafter's config.json"
    wanted = {
        "hidden_size": (cfg.target_hidden_size, "the drafter's target_hidden_size"),
        "vocab_size": (cfg.vocab_size, "the drafter's vocab_size"),
        "num_hidden_layers": (cfg.num_target_layers, "the drafter's num_target_layers"),
    }
    problems: list[Problem] = []
    for key, (want, what) in wanted.items():
        value = getattr(tc, key)
        where = f"target config.json {tc.origin[key]}"
        if value is None:
            problems.append(Problem(where, "nothing", f"{want} ({what})", f"add {key} to the target config.json"))
        elif value != want:
            problems.append(Problem(where, str(value), f"{want} ({what})", fix))
    top = max(cfg.target_layer_ids)
    if tc.num_hidden_layers is not None and top >= tc.num_hidden_layers:
        problems.append(
            Problem(
                f"target config.json {tc.origin['num_hidden_layers']}",
                f"{tc.num_hidden_layers} layers",
                f"more than {top} layers (the drafter taps layers {list(cfg.target_layer_ids)})",
                "use the deeper target this drafter was trained for, or fix target_layer_ids",
            )
        )
    return problems


def _tensor_problems(cfg: DrafterConfig, target: TargetModel, check_values: bool) -> list[Problem]:
    ws = target.weights
    problems: list[Problem] = []
    if target.embed_name is None:
        problems.append(
            Problem(
                "target embed_tokens",
                f"none of {', '.join(EMBED_NAMES)}",
                "the target's input embedding",
                "use a complete HF checkpoint of the target (its embedding is missing)",
            )
        )
    if not target.tied and target.lm_head_name is None:
        problems.append(
            Problem(
                "target lm_head",
                f"none of {', '.join(LM_HEAD_NAMES)}, and tie_word_embeddings is false",
                "an lm_head tensor, or tie_word_embeddings: true",
                "use a complete HF checkpoint, or set tie_word_embeddings if the target ties its output head",
            )
        )
    want = (cfg.vocab_size, cfg.hidden_size)
    for name in dict.fromkeys(n for n in (target.embed_name, target.lm_head_name) if n is not None):
        dtype, shape = ws.info(name)
        if shape != want:
            problems.append(
                Problem(
                    name,
                    f"shape {list(shape)}",
                    f"[vocab_size, hidden_size] = {list(want)} from the drafter config",
                    "use the target this drafter was trained for",
                )
            )
        if dtype not in FLOAT_DTYPES:
            problems.append(
                Problem(
                    name,
                    f"dtype {dtype}",
                    f"one of {', '.join(sorted(FLOAT_DTYPES))}",
                    "use the bf16 release of the target (quantised embeddings are not supported)",
                )
            )
        elif check_values:
            problem = nonfinite_problem(ws, name, "the target's embedding / lm_head")
            if problem:
                problems.append(problem)
    return problems


def check_target(cfg: DrafterConfig, target: TargetModel, check_values: bool = True) -> TargetReport:
    """Check that ``target`` is the model ``cfg`` drafts for; raises :class:`WeightsError` listing every problem."""
    problems = _config_problems(cfg, target.config) + _tensor_problems(cfg, target, check_values)
    if problems:
        raise WeightsError(f"target model {target.path}", problems)
    assert target.embed_name is not None
    head = target.embed_name if target.tied else target.lm_head_name
    assert head is not None
    return TargetReport(
        path=target.path,
        embed_name=target.embed_name,
        lm_head_name=head,
        tied=target.tied,
        dtypes=(target.weights.info(target.embed_name)[0], target.weights.info(head)[0]),
        values_checked=check_values,
        notes=tuple(target.notes),
    )
