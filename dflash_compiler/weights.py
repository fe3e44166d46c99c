"""Lazy safetensors access and the drafter checkpoint check (DFLASH.md §3).

:class:`WeightSet` opens a checkpoint directory (one or more ``*.safetensors`` files, or shards listed by
``model.safetensors.index.json``) and reads only the headers; tensor bytes are read on demand, one tensor
(or one chunk of a tensor) at a time. The header is parsed here rather than through ``safetensors`` so that
every inconsistency (truncated file, offsets past the end, a shard the index names but that is missing)
becomes a :class:`WeightsError` that names the file and says how to fix it.

:func:`check_drafter_weights` compares a checkpoint against :func:`expected_drafter_tensors` and reports
every missing, unexpected, misshaped and wrongly typed tensor (and, optionally, every tensor holding
NaN/Inf) in one error.
"""

from __future__ import annotations

import difflib
import json
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dflash_compiler.config import DrafterConfig
from dflash_compiler.errors import Problem, WeightsError, short
from dflash_compiler.row_blocks import cast_rows
from dflash_compiler.tensors import FLOAT_DTYPES, expected_drafter_tensors

INDEX_NAME = "model.safetensors.index.json"
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors refuses headers above 100 MB too
_CHUNK_BYTES = 64 * 1024 * 1024

# safetensors dtype name -> (numpy dtype or None where numpy has none, bytes per element)
_DTYPES: dict[str, tuple[np.dtype[Any] | None, int]] = {
    "BOOL": (np.dtype(np.bool_), 1),
    "U8": (np.dtype("<u1"), 1),
    "I8": (np.dtype("<i1"), 1),
    "U16": (np.dtype("<u2"), 2),
    "I16": (np.dtype("<i2"), 2),
    "U32": (np.dtype("<u4"), 4),
    "I32": (np.dtype("<i4"), 4),
    "U64": (np.dtype("<u8"), 8),
    "I64": (np.dtype("<i8"), 8),
    "F16": (np.dtype("<f2"), 2),
    "F32": (np.dtype("<f4"), 4),
    "F64": (np.dtype("<f8"), 8),
    "BF16": (np.dtype(ml_dtypes.bfloat16), 2),
    "F8_E4M3": (np.dtype(ml_dtypes.float8_e4m3fn), 1),
    "F8_E5M2": (np.dtype(ml_dtypes.float8_e5m2), 1),
    "F8_E8M0": (np.dtype(ml_dtypes.float8_e8m0fnu), 1),
}
_INEXACT = frozenset({"F16", "F32", "F64", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})

# Tensors a DeepSpec-format drafter may carry (copies of the target's), under either prefix.
OWN_HEAD_NAMES = frozenset({"embed_tokens.weight", "lm_head.weight"})


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, the absolute byte offset of its data, and its layout."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def has_safetensors(path: str | Path) -> bool:
    """Whether ``path`` is a safetensors file or a directory holding one (or a shard index)."""
    path = Path(path)
    if path.is_file():
        return path.name.endswith(".safetensors")
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / INDEX_NAME).is_file())


# ---------------------------------------------------------------------------------------------- reading


def _header_problem(file: Path, found: str, expected: str) -> Problem:
    return Problem(
        str(file),
        found,
        expected,
        "the file is truncated or not a safetensors file: download or export it again",
    )


def _parse_entry(file: Path, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo | Problem:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return _header_problem(file, f"header entry {name!r} = {short(entry)}", "dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    ok_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    ok_offsets = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
    if not isinstance(dtype, str) or not ok_shape or not ok_offsets:
        return _header_problem(
            file,
            f"header entry {name!r} = {short(entry)}",
            "a dtype string, a shape of non-negative ints and two byte offsets",
        )
    begin, end = offsets
    if not begin <= end <= data_len:
        return _header_problem(
            file,
            f"tensor {name!r} at bytes [{begin}, {end}) of a {data_len}-byte data section",
            "offsets inside the file",
        )
    size = _DTYPES.get(dtype, (None, 0))[1]
    if size and end - begin != math.prod(shape) * size:
        return _header_problem(
            file,
            f"tensor {name!r} ({dtype} {shape}) spanning {end - begin} bytes",
            f"{math.prod(shape) * size} bytes",
        )
    return TensorInfo(name, dtype, tuple(shape), file, data_start + begin, end - begin)


def read_header(file: Path) -> tuple[dict[str, TensorInfo], list[Problem]]:
    """Parse one safetensors header; returns the tensors found and the problems met."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(_HEADER_LIMIT, size - 8):
                found = f"a {size}-byte file" if n < 0 else f"a header length of {n} in a {size}-byte file"
                return {}, [_header_problem(file, found, "an 8-byte header length followed by a JSON header")]
            raw = fh.read(n)
    except OSError as err:
        return {}, [Problem(str(file), f"unreadable ({err.strerror})", "a readable file", "fix its permissions")]
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, [_header_problem(file, f"a header that is not JSON ({err})", "a JSON object header")]
    if not isinstance(header, dict):
        return {}, [_header_problem(file, f"a JSON {type(header).__name__} header", "a JSON object header")]
    header.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    problems: list[Problem] = []
    for name, entry in header.items():
        parsed = _parse_entry(file, name, entry, 8 + n, size - 8 - n)
        if isinstance(parsed, Problem):
            problems.append(parsed)
        else:
            tensors[name] = parsed
    return tensors, problems


def _read_index(index: Path) -> tuple[dict[str, str], list[Problem]]:
    fix = f"regenerate {index.name} (it maps every tensor name to its shard file)"
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, [Problem(str(index), f"unreadable JSON ({err})", "a JSON shard index", fix)]
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        return {}, [Problem(str(index), short(data), 'an object with "weight_map": {tensor: shard file}', fix)]
    return weight_map, []


class WeightSet:
    """The tensors of a safetensors checkpoint, read lazily.

    ``path`` is a directory (``model.safetensors.index.json`` with its shards, else every ``*.safetensors``
    in it) or a single ``.safetensors`` file. Opening reads only headers; raises :class:`WeightsError`
    listing every problem found.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.index_path: Path | None = None
        tensors, problems, files = self._open()
        if problems:
            raise WeightsError(f"checkpoint {self.path}", problems)
        self.files: tuple[Path, ...] = files
        self._tensors: dict[str, TensorInfo] = dict(sorted(tensors.items()))

    def _open(self) -> tuple[dict[str, TensorInfo], list[Problem], tuple[Path, ...]]:
        if self.path.is_file() and self.path.name.endswith(".safetensors"):
            tensors, problems = read_header(self.path)
            return tensors, problems, (self.path,)
        if not self.path.is_dir():
            return {}, [self._nothing_here("no such directory")], ()
        index = self.path / INDEX_NAME
        if index.is_file():
            self.index_path = index
            return self._open_sharded(index)
        files = tuple(sorted(self.path.glob("*.safetensors")))
        if not files:
            return {}, [self._nothing_here("no *.safetensors file")], ()
        tensors: dict[str, TensorInfo] = {}
        problems: list[Problem] = []
        for file in files:
            found, bad = read_header(file)
            problems += bad
            for name, info in found.items():
                if name in tensors:
                    problems.append(
                        Problem(
                            f"tensor {name}",
                            f"stored in both {tensors[name].file.name} and {file.name}",
                            "each tensor in one file",
                            f"remove the stray file, or add a {INDEX_NAME} naming the shards to use",
                        )
                    )
                tensors.setdefault(name, info)
        return tensors, problems, files

    def _nothing_here(self, found: str) -> Problem:
        return Problem(
            str(self.path),
            found,
            f"a directory with model.safetensors (or *.safetensors shards and {INDEX_NAME})",
            "point at the checkpoint directory, or download its weights into it",
        )

    def _open_sharded(self, index: Path) -> tuple[dict[str, TensorInfo], list[Problem], tuple[Path, ...]]:
        weight_map, problems = _read_index(index)
        shard_names = sorted(set(weight_map.values()))
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in shard_names:
            file = self.path / shard
            if not file.is_file():
                wanted = sorted(k for k, v in weight_map.items() if v == shard)
                problems.append(
                    Problem(
                        str(file),
                        f"no such file (the index assigns it {len(wanted)} tensor(s), e.g. {wanted[0]})",
                        f"every shard named in {index.name}",
                        "download the missing shard, or regenerate the index if the shards were renamed",
                    )
                )
                continue
            headers[shard], bad = read_header(file)
            problems += bad
        tensors: dict[str, TensorInfo] = {}
        for name, shard in weight_map.items():
            if shard not in headers:
                continue
            info = headers[shard].get(name)
            if info is None:
                problems.append(
                    Problem(
                        f"tensor {name}",
                        f"absent from {shard}",
                        f"the tensor in the shard {index.name} assigns it to",
                        "re-download the shard, or regenerate the index from the shards' headers",
                    )
                )
                continue
            tensors[name] = info
        return tensors, problems, tuple(self.path / s for s in shard_names)

    # -- lookup -----------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        info = self._tensors.get(name)
        if info is None:
            close = difflib.get_close_matches(name, self._tensors, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "check the tensor name"
            raise WeightsError(
                f"checkpoint {self.path}",
                [Problem(f"tensor {name}", "no such tensor", f"one of the {len(self)} stored tensors", hint)],
            )
        return info

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """``(safetensors dtype, shape)``, e.g. ``("BF16", (64, 128))``."""
        t = self.tensor_info(name)
        return t.dtype, t.shape

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    # -- reading ----------------------------------------------------------------------------------------

    def _np_dtype(self, info: TensorInfo) -> np.dtype[Any]:
        dtype = _DTYPES.get(info.dtype, (None, 0))[0]
        if dtype is None:
            raise WeightsError(
                f"checkpoint {self.path}",
                [
                    Problem(
                        f"tensor {info.name}",
                        f"dtype {info.dtype}",
                        f"one of {', '.join(sorted(_DTYPES))}",
                        "re-export the tensor in bf16, f16 or f32",
                    )
                ],
            )
        return dtype

    def _read_bytes(self, info: TensorInfo, start: int, count: int) -> bytearray:
        buf = bytearray(count)
        with info.file.open("rb") as fh:
            fh.seek(info.offset + start)
            got = fh.readinto(buf)
        if got != count:
            raise WeightsError(
                f"checkpoint {self.path}",
                [_header_problem(info.file, f"{got} bytes for tensor {info.name}", f"{count} bytes")],
            )
        return buf

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 arrays use ``ml_dtypes.bfloat16``); a fresh, writable array."""
        info = self.tensor_info(name)
        dtype = self._np_dtype(info)
        return np.frombuffer(self._read_bytes(info, 0, info.nbytes), dtype=dtype).reshape(info.shape)

    def get_f32(self, name: str) -> np.ndarray:
        """The tensor converted to float32 (a fresh array), read straight from the file's pages."""
        return cast_rows(self.get_mapped(name), np.float32)  # the map closes once the stored view is gone

    def get_mapped(self, name: str) -> np.ndarray:
        """The tensor as stored, read-only, over the file's pages: only the rows a caller touches are read
        (the rows an embedding lookup gathers, not the whole table)."""
        info = self.tensor_info(name)
        dtype = self._np_dtype(info)
        if info.nbytes == 0 or info.offset + info.nbytes > info.file.stat().st_size:
            return self.get(name)  # get() names the tensor and the bytes it lacks
        with info.file.open("rb") as fh:
            pages = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # stays open while the array views it
        count = math.prod(info.shape)
        return np.frombuffer(pages, dtype=dtype, count=count, offset=info.offset).reshape(info.shape)

    def iter_chunks(self, name: str, chunk_bytes: int = _CHUNK_BYTES) -> Iterator[np.ndarray]:
        """The tensor's elements, flattened, in pieces of at most ``chunk_bytes`` (bounds memory)."""
        info = self.tensor_info(name)
        dtype = self._np_dtype(info)
        step = max(1, chunk_bytes // dtype.itemsize) * dtype.itemsize
        for start in range(0, info.nbytes, step):
            count = min(step, info.nbytes - start)
            yield np.frombuffer(self._read_bytes(info, start, count), dtype=dtype)

    def nonfinite_count(self, name: str) -> tuple[int, int]:
        """``(NaN count, ±Inf count)`` of a tensor, read chunk by chunk; ``(0, 0)`` for integer tensors."""
        if self.tensor_info(name).dtype not in _INEXACT:
            return 0, 0
        nan = inf = 0
        for chunk in self.iter_chunks(name):
            values = chunk.astype(np.float32)
            nan += int(np.count_nonzero(np.isnan(values)))
            inf += int(np.count_nonzero(np.isinf(values)))
        return nan, inf

    def __repr__(self) -> str:
        return f"WeightSet({str(self.path)!r}, {len(self)} tensors in {len(self.files)} file(s))"


def nonfinite_problem(ws: WeightSet, name: str, what: str) -> Problem | None:
    """A problem naming ``name`` and its NaN/Inf counts, or None when every value is finite."""
    nan, inf = ws.nonfinite_count(name)
    if not nan and not inf:
        return None
    numel = ws.tensor_info(name).numel
    return Problem(
        name,
        f"{nan} NaN and {inf} Inf value(s) among {numel}",
        f"finite values in {what}",
        "the checkpoint is corrupt or was saved after training diverged: re-download or re-export it",
    )


# ------------------------------------------------------------------------------------- drafter check


@dataclass(frozen=True)
class WeightReport:
    """What :func:`check_drafter_weights` found in a checkpoint that passed."""

    path: Path
    num_tensors: int
    parameter_count: int  # elements of the drafter's own tensors (shipped embed/lm_head excluded)
    total_bytes: int  # stored bytes of every tensor in the checkpoint
    dtypes: dict[str, int]  # storage dtype -> number of tensors
    stored_names: dict[str, str]  # expected name (no prefix) -> name in the checkpoint
    own_heads: tuple[str, ...]  # embed_tokens / lm_head tensors the drafter ships (DeepSpec format)
    values_checked: bool
    notes: tuple[str, ...] = field(default=())

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for a summary table."""
        dtypes = ", ".join(f"{n}x {d}" for d, n in sorted(self.dtypes.items()))
        rows = [
            ("checkpoint", f"{self.num_tensors} tensors, {self.total_bytes / 2**20:.2f} MiB ({dtypes})"),
            ("weight parameters", f"{self.parameter_count:,}"),
            ("weight values", "all finite" if self.values_checked else "not scanned for NaN/Inf"),
        ]
        rows += [("note", note) for note in self.notes]
        return rows


def _canonical(name: str) -> str:
    return name.removeprefix("model.")


def _shape_formula(name: str) -> str:
    """Which config fields set an expected shape, for the fix of a shape mismatch."""
    formulas = {
        "fc.weight": "[hidden_size, len(target_layer_ids) * target_hidden_size]",
        "q_proj.weight": "[num_attention_heads * head_dim, hidden_size]",
        "k_proj.weight": "[num_key_value_heads * head_dim, hidden_size]",
        "v_proj.weight": "[num_key_value_heads * head_dim, hidden_size]",
        "o_proj.weight": "[hidden_size, num_attention_heads * head_dim]",
        "q_norm.weight": "[head_dim]",
        "k_norm.weight": "[head_dim]",
        "gate_proj.weight": "[intermediate_size, hidden_size]",
        "up_proj.weight": "[intermediate_size, hidden_size]",
        "down_proj.weight": "[hidden_size, intermediate_size]",
        "layernorm.weight": "[hidden_size]",
        "norm.weight": "[hidden_size]",
        "base_kernel": "[2, conv_kernel_size, hidden_size]",
        "kernel_projection.weight": "[2 * conv_kernel_size * hidden_size / conv_group_size, hidden_size]",
        "hidden_projection.weight": "[selector_rank, hidden_size]",
        "codebook": "[vocab_size, selector_rank]",
        "markov_w1.weight": "[vocab_size, markov_rank]",
        "markov_w2.weight": "[vocab_size, markov_rank]",
        "proj.weight": "[1, hidden_size (+ markov_rank with confidence_head_with_markov)]",
        "embed_tokens.weight": "[vocab_size, hidden_size]",
        "lm_head.weight": "[vocab_size, hidden_size]",
    }
    for suffix, formula in formulas.items():
        if name.endswith(suffix):
            return f"config.json sets it as {formula}"
    return "config.json sets it"


class _Check:
    """Collects the problems of one drafter checkpoint."""

    def __init__(self, cfg: DrafterConfig, ws: WeightSet) -> None:
        self.cfg, self.ws = cfg, ws
        self.expected = expected_drafter_tensors(cfg)
        self.problems: list[Problem] = []
        self.stored: dict[str, str] = {}  # canonical -> stored
        self.own_heads: list[str] = []
        self.unexpected: list[str] = []

    def map_names(self) -> None:
        for name in self.ws.names():
            canonical = _canonical(name)
            if canonical in self.stored:
                self.problems.append(
                    Problem(
                        name,
                        f"both {self.stored[canonical]!r} and {name!r}",
                        f"one copy of {canonical}",
                        "keep one of them (with or without the model. prefix) and re-save",
                    )
                )
            elif canonical in self.expected:
                self.stored[canonical] = name
            elif canonical in OWN_HEAD_NAMES:
                self.stored[canonical] = name
                self.own_heads.append(name)
            else:
                self.unexpected.append(name)

    def missing_and_unexpected(self) -> None:
        for name in self.expected:
            if name not in self.stored:
                self.problems.append(
                    Problem(
                        name,
                        "no such tensor in the checkpoint",
                        f"a {list(self.expected[name].shape)} tensor required by config.json",
                        self._missing_fix(name),
                    )
                )
        for name in self.unexpected:
            self.problems.append(
                Problem(
                    name,
                    f"an unexpected tensor {list(self.ws.info(name)[1])}",
                    f"only the {len(self.expected)} tensors config.json implies",
                    self._unexpected_fix(name),
                )
            )

    def _missing_fix(self, name: str) -> str:
        renamed = [u for u in self.unexpected if u.endswith("." + name)]
        if renamed:
            prefix = renamed[0][: -len(name)]
            return f"the checkpoint stores it as {renamed[0]!r}: re-save without the {prefix!r} prefix"
        return "check that config.json belongs to these weights (num_hidden_layers, architectures) or re-export"

    def _unexpected_fix(self, name: str) -> str:
        for expected in self.expected:
            if name.endswith("." + expected):
                return f"re-save it as {expected!r} (without the {name[: -len(expected)]!r} prefix)"
        if _canonical(name).startswith("layers."):
            return "a layer past num_hidden_layers (or a feature the config does not enable): fix config.json"
        return "remove it, or use a config.json whose architecture has this tensor"

    def shapes_and_dtypes(self) -> None:
        vh = [self.cfg.vocab_size, self.cfg.hidden_size]
        for canonical, name in self.stored.items():
            dtype, shape = self.ws.info(name)
            spec = self.expected.get(canonical)
            want = list(spec.shape) if spec else vh
            if list(shape) != want:
                self.problems.append(
                    Problem(
                        name,
                        f"shape {list(shape)}",
                        f"shape {want}",
                        f"{_shape_formula(canonical)}: use the config.json these weights were trained with",
                    )
                )
            if dtype not in FLOAT_DTYPES:
                self.problems.append(
                    Problem(
                        name,
                        f"dtype {dtype}",
                        f"one of {', '.join(sorted(FLOAT_DTYPES))}",
                        "convert the tensor to bf16 (quantised or integer drafter weights are not supported)",
                    )
                )

    def values(self) -> None:
        for canonical, name in self.stored.items():
            if self.ws.info(name)[0] in FLOAT_DTYPES:
                problem = nonfinite_problem(self.ws, name, f"drafter tensor {canonical}")
                if problem:
                    self.problems.append(problem)

    def report(self, values_checked: bool) -> WeightReport:
        dtypes: dict[str, int] = {}
        for name in self.ws.names():
            dtype = self.ws.info(name)[0]
            dtypes[dtype] = dtypes.get(dtype, 0) + 1
        notes = []
        if self.own_heads:
            notes.append(f"drafter ships its own embed/lm_head ({', '.join(self.own_heads)}): DeepSpec format")
        prefixed = sorted({n for c, n in self.stored.items() if n != c})
        if prefixed:
            notes.append(f"{len(prefixed)} tensor name(s) carry a 'model.' prefix; read without it")
        return WeightReport(
            path=self.ws.path,
            num_tensors=len(self.ws),
            parameter_count=sum(s.numel for s in self.expected.values()),
            total_bytes=self.ws.total_bytes,
            dtypes=dict(sorted(dtypes.items())),
            stored_names={c: self.stored[c] for c in self.expected},
            own_heads=tuple(self.own_heads),
            values_checked=values_checked,
            notes=tuple(notes),
        )


def check_drafter_weights(cfg: DrafterConfig, ws: WeightSet, check_values: bool = True) -> WeightReport:
    """Check a drafter checkpoint against its config; raises :class:`WeightsError` listing every problem.

    Tensor names may carry a ``model.`` prefix. ``embed_tokens.weight``/``lm_head.weight`` in the
    checkpoint are allowed (DeepSpec drafters ship copies of the target's) and recorded in the report.
    With ``check_values`` every float tensor is scanned for NaN/Inf, one chunk at a time.
    """
    check = _Check(cfg, ws)
    check.map_names()
    check.missing_and_unexpected()
    check.shapes_and_dtypes()
    if check_values:
        check.values()
    if check.problems:
        raise WeightsError(f"drafter checkpoint {ws.path}", check.problems)
    return check.report(check_values)
