"""Write example checkpoints: a random-weight drafter and the target tensors it borrows (``make-example``).

``write_example`` resolves a bundled example (``examples/<name>/config.json``) or a config path, then writes

* ``drafter/config.json`` (the config file copied byte for byte) and ``drafter/model.safetensors``;
* ``target/config.json`` (a minimal Qwen3 causal-LM config) and its safetensors, one file or shards plus
  ``model.safetensors.index.json``: ``model.embed_tokens.weight`` and, unless tied, ``lm_head.weight``.

Values come from :mod:`dflash_compiler.synth` (deterministic in ``(seed, tensor name)``); the files are
byte-identical for identical inputs. Tensors are generated and written one at a time, so a 1B-parameter
drafter never holds more than one tensor (in fp32 and in its storage dtype) in memory. Everything is
written under a temporary directory next to the output and renamed into place at the end.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dflash_compiler.config import DrafterConfig, load_drafter_config
from dflash_compiler.errors import ConfigError, InputError, Problem
from dflash_compiler.row_blocks import cast_rows
from dflash_compiler.synth import random_tensor, target_tensor_specs
from dflash_compiler.tensors import expected_drafter_tensors
from dflash_compiler.weights import INDEX_NAME

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"

# storage dtype option -> (numpy dtype, safetensors name, HF torch_dtype)
STORAGE_DTYPES: dict[str, tuple[np.dtype, str, str]] = {
    "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16", "bfloat16"),
    "fp32": (np.dtype(np.float32), "F32", "float32"),
}
_SAFETENSORS_METADATA = {"format": "pt"}  # what torch-written files carry; transformers checks it


@dataclass(frozen=True)
class TensorToWrite:
    """One tensor of a file being written: its layout, and how to produce its values when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    dtype_name: str
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExampleCheckpoint:
    """What :func:`write_example` wrote."""

    source: Path  # the drafter config.json used
    config: DrafterConfig
    drafter_dir: Path
    target_dir: Path
    dtype: str
    seed: int
    files: tuple[Path, ...]  # every file written, relative to the output directory
    drafter_parameters: int


# ---------------------------------------------------------------------------------------------- examples


def list_examples() -> list[str]:
    """Names of the bundled example drafters (folders of ``examples/`` holding a config.json)."""
    if not EXAMPLES_DIR.is_dir():
        return []
    return sorted(p.name for p in EXAMPLES_DIR.iterdir() if (p / "config.json").is_file())


def example_config_path(name: str) -> Path:
    """The config.json of a bundled example; raises :class:`ConfigError` naming the available ones."""
    path = EXAMPLES_DIR / name / "config.json"
    if name and "/" not in name and path.is_file():
        return path
    available = list_examples()
    expected = f"one of {', '.join(available)}" if available else f"a bundled example under {EXAMPLES_DIR}"
    fix = "pass one of those names or a path to a drafter config.json"
    if not available:
        fix = "the examples/ folder ships with the source tree: install with `pip install -e .` from a checkout"
    raise ConfigError("example", [Problem("example name", repr(name), expected, fix)])


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A drafter config.json from a path (file, or directory holding one) or a bundled example name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    return example_config_path(str(name_or_path))


# --------------------------------------------------------------------------------------------- safetensors


def _header_bytes(tensors: Sequence[TensorToWrite]) -> bytes:
    header: dict[str, object] = {"__metadata__": _SAFETENSORS_METADATA}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype_name, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it


def write_safetensors(path: Path, tensors: Sequence[TensorToWrite]) -> int:
    """Stream ``tensors`` (in name order) into one safetensors file; returns the bytes of tensor data."""
    ordered = sorted(tensors, key=lambda t: t.name)
    header = _header_bytes(ordered)
    with path.open("wb") as fh:
        fh.write(len(header).to_bytes(8, "little"))
        fh.write(header)
        for t in ordered:
            values = np.asarray(t.make())
            if values.dtype != t.dtype:  # storage rounding from float32, whatever the producer computed in
                values = cast_rows(values.astype(np.float32, copy=False), t.dtype)
            values = np.ascontiguousarray(values)
            if values.shape != t.shape:
                raise AssertionError(f"{t.name}: produced {values.shape}, declared {t.shape}")
            fh.write(values.reshape(-1).view(np.uint8).data)
            del values
    return sum(t.nbytes for t in ordered)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_sharded(directory: Path, tensors: Sequence[TensorToWrite], shards: int) -> list[str]:
    """``model.safetensors``, or ``shards`` files (tensors split in order) plus the HF index; returns file names."""
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors)
        return ["model.safetensors"]
    groups = [list(g) for g in np.array_split(np.arange(len(tensors)), shards)]
    weight_map: dict[str, str] = {}
    names = []
    for i, group in enumerate(groups):
        name = _shard_name(i, shards)
        write_safetensors(directory / name, [tensors[j] for j in group])
        weight_map.update({tensors[j].name: name for j in group})
        names.append(name)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_NAME]


# ------------------------------------------------------------------------------------------------ example


def _drafter_tensors(cfg: DrafterConfig, seed: int, dtype: str) -> list[TensorToWrite]:
    np_dtype, st_name, _ = STORAGE_DTYPES[dtype]
    return [
        TensorToWrite(name, spec.shape, np_dtype, st_name, lambda spec=spec: random_tensor(spec, seed))
        for name, spec in expected_drafter_tensors(cfg).items()
    ]


def _target_tensors(cfg: DrafterConfig, seed: int, dtype: str) -> list[TensorToWrite]:
    """``model.embed_tokens.weight`` then (untied) ``lm_head.weight``: values of synth.random_target_weights."""
    np_dtype, st_name, _ = STORAGE_DTYPES[dtype]
    specs = target_tensor_specs(cfg)
    stored = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}
    keys = ["embed_tokens"] if cfg.tie_word_embeddings else ["embed_tokens", "lm_head"]
    return [
        TensorToWrite(stored[k], specs[k].shape, np_dtype, st_name, lambda s=specs[k]: random_tensor(s, seed))
        for k in keys
    ]


def target_config(cfg: DrafterConfig, dtype: str = "bf16") -> dict[str, object]:
    """A minimal Qwen3 causal-LM config.json matching what the drafter expects of its target."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": cfg.target_hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_target_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": STORAGE_DTYPES[dtype][2],
    }


def _check_options(out_dir: Path, dtype: str, target_shards: int, cfg: DrafterConfig, overwrite: bool) -> None:
    problems: list[Problem] = []
    if dtype not in STORAGE_DTYPES:
        problems.append(Problem("dtype", repr(dtype), f"one of {', '.join(STORAGE_DTYPES)}", "pass bf16 or fp32"))
    n_target = 1 if cfg.tie_word_embeddings else 2
    if not 1 <= target_shards <= n_target:
        why = "a tied target has one tensor" if cfg.tie_word_embeddings else "the target has two tensors"
        problems.append(
            Problem("target_shards", str(target_shards), f"1..{n_target} ({why})", f"pass 1 to {n_target} shards")
        )
    if out_dir.exists() and not out_dir.is_dir():
        problems.append(Problem(str(out_dir), "a file", "a directory (or nothing)", "choose another output path"))
    for sub in ("drafter", "target"):
        if not overwrite and (out_dir / sub).exists():
            problems.append(
                Problem(
                    str(out_dir / sub),
                    "an existing path",
                    "a fresh output location",
                    "choose another output directory, remove this one, or pass overwrite",
                )
            )
    if problems:
        raise InputError("make-example", problems)


def _stage(source: Path, cfg: DrafterConfig, stage: Path, seed: int, dtype: str, shards: int) -> list[str]:
    drafter, target = stage / "drafter", stage / "target"
    drafter.mkdir()
    target.mkdir()
    shutil.copyfile(source, drafter / "config.json")
    write_safetensors(drafter / "model.safetensors", _drafter_tensors(cfg, seed, dtype))
    (target / "config.json").write_text(json.dumps(target_config(cfg, dtype), indent=2) + "\n")
    target_files = write_sharded(target, _target_tensors(cfg, seed, dtype), shards)
    return ["drafter/config.json", "drafter/model.safetensors", "target/config.json"] + [
        f"target/{name}" for name in target_files
    ]


def _move_into_place(stage: Path, out_dir: Path) -> None:
    """Rename staged drafter/ and target/ into ``out_dir``, moving any old copies into the stage first."""
    for sub in ("drafter", "target"):
        if (out_dir / sub).exists():
            (out_dir / sub).rename(stage / f"old-{sub}")
        (stage / sub).rename(out_dir / sub)


def write_example(
    name_or_config_path: str | Path,
    out_dir: str | Path,
    seed: int,
    dtype: str = "bf16",
    target_shards: int = 1,
    overwrite: bool = False,
) -> ExampleCheckpoint:
    """Write ``out_dir/drafter`` and ``out_dir/target`` for a bundled example or a drafter config.json.

    Raises :class:`ConfigError` for an unknown example or an invalid config, and :class:`InputError` for
    bad options or (without ``overwrite``) an output that already holds ``drafter/`` or ``target/``.
    """
    source = resolve_config_path(name_or_config_path)
    cfg = load_drafter_config(source)
    out_dir = Path(out_dir)
    _check_options(out_dir, dtype, target_shards, cfg, overwrite)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".make-example-", dir=out_dir))
    try:
        files = _stage(source, cfg, stage, seed, dtype, target_shards)
        _move_into_place(stage, out_dir)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return ExampleCheckpoint(
        source=source,
        config=cfg,
        drafter_dir=out_dir / "drafter",
        target_dir=out_dir / "target",
        dtype=dtype,
        seed=seed,
        files=tuple(Path(f) for f in files),
        drafter_parameters=sum(s.numel for s in expected_drafter_tensors(cfg).values()),
    )
