"""The artifact: one self-describing directory per (drafter, target, options).

```
manifest.json        everything the build decided (schema below), every file's sha256, its own digest
kernels.cubin        every kernel of both phases for the target's SM
kernels.cu           the CUDA source it was built from (for reading, not loading)
graph.txt            both phase graphs after the last pass
weights.safetensors  packed weights under their WEIGHT node names (absent until `pack-weights`)
```

The manifest is canonical JSON (sorted keys, no timestamps), so identical inputs give byte-identical
artifacts. It is written to a temporary directory that is renamed into place: a failed build leaves
nothing behind. `load_manifest` refuses a manifest of another schema, a manifest whose digest does not
match its content, and a file that is missing, truncated, edited or swapped, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from dflash_compiler.codegen import HostFunction
from dflash_compiler.errors import DFlashError
from dflash_compiler.launch_plan import PhasePlan
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import KVCachePlan, MemoryPlan, PrecisionMap
from dflash_compiler.targets import Target

SCHEMA_VERSION = 4
MANIFEST = "manifest.json"
CUBIN = "kernels.cubin"
SOURCE = "kernels.cu"
GRAPH = "graph.txt"
WEIGHTS = "weights.safetensors"


class ArtifactError(DFlashError):
    """The artifact is incomplete, corrupted, or not for this device; the message names the file and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileRecord(_Frozen):
    sha256: str
    bytes: int


class WeightRecord(_Frozen):
    """One packed tensor: its dtype and shape, and the declaration that computes it from the checkpoints."""

    dtype: str
    shape: tuple[int, ...]
    decl: dict[str, Any]


class KernelRecord(_Frozen):
    rule: str
    knobs: dict[str, int]


class Versions(_Frozen):
    dflash_compiler: str
    tvm: str
    nvrtc: str


class Roofline(_Frozen):
    """Predicted propose latency: the bytes a step must move over the target's DRAM bandwidth."""

    bandwidth_bytes_per_s: float
    weight_bytes: int  # every weight the propose step streams, once (lm_head included; gathered tables not)
    context_weight_bytes: int  # the weights only the append_context step streams (its fc, fused context K/V)
    kv_bytes_per_cached_row: int  # K and V of every layer for one cached position
    predicted_us: dict[str, float]  # "nb=1 ctx=4096" -> µs


class MemoryTotal(_Frozen):
    weights: int
    kv_cache: int
    arenas: int
    io: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.arenas + self.io


class Manifest(_Frozen):
    schema_version: int
    name: str
    versions: Versions
    target: Target
    options: BuildOptions
    config: dict[str, Any]  # the drafter's config.json as read
    config_sha256: str
    block_size: int
    family: str
    weights: dict[str, WeightRecord]
    precision: dict[str, PrecisionMap]
    kv_cache: KVCachePlan
    memory: dict[str, MemoryPlan]
    kernels: dict[str, HostFunction]
    kernel_rules: dict[str, KernelRecord]
    phases: dict[str, PhasePlan]
    memory_total: MemoryTotal
    roofline: Roofline
    files: dict[str, FileRecord]
    digest: str = ""  # sha256 of this manifest's canonical JSON with digest ""

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1) + "\n"

    def sealed(self) -> Manifest:
        """This manifest with `digest` set over everything else."""
        blank = self.model_copy(update={"digest": ""})
        return self.model_copy(update={"digest": hashlib.sha256(blank.canonical_json().encode()).hexdigest()})


def config_sha256(raw: Mapping[str, Any]) -> str:
    """A hash of a drafter config as read (canonical JSON); `pack-weights` checks the checkpoint against it."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def file_record(data: bytes) -> FileRecord:
    return FileRecord(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def _hash_file(path: Path) -> FileRecord:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(sha256=digest.hexdigest(), bytes=size)


def write_artifact(out_dir: Path, manifest: Manifest, files: Mapping[str, bytes], overwrite: bool = False) -> Manifest:
    """Write `files` and the sealed manifest (with their hashes) to `out_dir` via a temp dir and a rename;
    returns the sealed manifest as written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ArtifactError(f"{out_dir} exists. Fix: choose another -o, or pass --force to replace it")

    def fill(tmp: Path) -> dict[str, FileRecord]:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        return {name: file_record(data) for name, data in files.items()}

    return _stage(out_dir, manifest, fill)


def add_file(artifact: Path, name: str, write: Callable[[Path], object]) -> Manifest:
    """Add (or replace) one file of an artifact: `write(path)` fills it; the manifest is re-sealed.

    The other files are linked (or copied) into a staged artifact that replaces the old one, so a
    failure leaves the old one intact.
    """
    artifact = Path(artifact)
    manifest = load_manifest(artifact, require=())

    def fill(tmp: Path) -> dict[str, FileRecord]:
        for child in artifact.iterdir():
            if child.name not in (MANIFEST, name):
                try:
                    os.link(child, tmp / child.name)
                except OSError:
                    shutil.copy2(child, tmp / child.name)
        write(tmp / name)
        return {**manifest.files, name: _hash_file(tmp / name)}

    return _stage(artifact, manifest, fill)


def _stage(out_dir: Path, manifest: Manifest, fill: Callable[[Path], dict[str, FileRecord]]) -> Manifest:
    """Fill a temp dir beside `out_dir`, seal the manifest over the files' records, then rename into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        sealed = manifest.model_copy(update={"files": fill(tmp)}).sealed()
        (tmp / MANIFEST).write_text(sealed.canonical_json())
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sealed


def _replace(staged: Path, out_dir: Path) -> None:
    """Move a staged directory into place; an existing one is moved aside first and removed after."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        staged.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staged.rename(out_dir)


def load_manifest(artifact: Path, require: tuple[str, ...] = (CUBIN,), unread: tuple[str, ...] = ()) -> Manifest:
    """The verified manifest of `artifact`: schema, digest, and the hash of every recorded file.

    `require` names files that must be present (the runtime needs the cubin and the weights). `unread`
    names recorded files the caller will not read, whose hashes are not checked (a drafter given every
    weight by the serving engine never opens the weights file: hashing gigabytes would be its whole load).
    """
    artifact = Path(artifact)
    path = artifact / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{artifact}: no {MANIFEST}. Fix: point at a directory written by `dflash-compile compile`")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{path}: not valid JSON ({err}). Fix: rebuild the artifact") from err
    found = raw.get("schema_version") if isinstance(raw, dict) else None
    if found != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path}: schema version {found!r}, this dflash-compiler reads version {SCHEMA_VERSION}. "
            "Fix: rebuild the artifact with this version (`dflash-compile compile ...`)"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as err:
        raise ArtifactError(f"{path}: does not match the manifest schema:\n{err}\nFix: rebuild the artifact") from err
    if manifest.sealed().digest != manifest.digest:
        raise ArtifactError(
            f"{path}: its digest does not match its content (the manifest was edited). Fix: rebuild the artifact"
        )
    verify_files(artifact, manifest, tuple(name for name in sorted(manifest.files) if name not in unread))
    require_files(artifact, manifest, require)
    return manifest


def verify_files(artifact: Path, manifest: Manifest, names: tuple[str, ...]) -> None:
    """Check the size and hash of each of `names` the manifest records."""
    for name in names:
        if name in manifest.files:
            _check_file(Path(artifact), name, manifest.files[name])


def require_files(artifact: Path, manifest: Manifest, names: tuple[str, ...]) -> None:
    """Refuse a verified manifest that lacks one of `names`, saying how to produce it."""
    for name in names:
        if name not in manifest.files:
            fix = (
                "run `dflash-compile pack-weights ARTIFACT DRAFTER_DIR --target-model DIR`"
                if name == WEIGHTS
                else "rebuild the artifact"
            )
            raise ArtifactError(f"{artifact}: has no {name}. Fix: {fix}")


def _check_file(artifact: Path, name: str, record: FileRecord) -> None:
    path = artifact / name
    if not path.is_file():
        raise ArtifactError(f"{path}: missing (the manifest lists it). Fix: rebuild or re-pack the artifact")
    size = path.stat().st_size
    if size != record.bytes:
        raise ArtifactError(
            f"{path}: {size} bytes, the manifest says {record.bytes} (truncated or replaced). "
            "Fix: rebuild or re-pack the artifact"
        )
    found = _hash_file(path)
    if found.sha256 != record.sha256:
        raise ArtifactError(
            f"{path}: sha256 {found.sha256[:16]}…, the manifest says {record.sha256[:16]}… (edited or swapped "
            "with another artifact's). Fix: rebuild or re-pack the artifact"
        )


def human_summary(manifest: Manifest) -> list[tuple[str, str]]:
    """The closing summary of `compile` and the head of `inspect`: label, value rows."""
    from dflash_compiler.plans import human_bytes

    total = manifest.memory_total
    predicted = ", ".join(f"{k}: {v:.0f} µs" for k, v in manifest.roofline.predicted_us.items())
    weights = manifest.files.get(WEIGHTS)
    rows = [
        ("target", f"{manifest.target.name} ({manifest.target.arch}, {manifest.target.description})"),
        ("drafter", f"{manifest.family}, block {manifest.block_size}, config sha256 {manifest.config_sha256[:12]}"),
        (
            "kernels",
            f"{len(manifest.kernels)} functions, {sum(len(f.kernels) for f in manifest.kernels.values())} "
            f"CUDA kernels, cubin {human_bytes(manifest.files[CUBIN].bytes) if CUBIN in manifest.files else '-'}",
        ),
        ("calls", ", ".join(f"{name} {len(p.calls)}" for name, p in manifest.phases.items())),
        ("weights", f"{human_bytes(total.weights)}" + ("" if weights else " (not packed: run pack-weights)")),
        ("precision", "; ".join(f"{phase}: {m.summary()}" for phase, m in manifest.precision.items())),
        ("kv pool", manifest.kv_cache.summary()),
        ("scratch", f"arenas {human_bytes(total.arenas)}, io {human_bytes(total.io)}"),
        ("device memory", human_bytes(total.total)),
        ("predicted step", f"{predicted} (roofline at {manifest.roofline.bandwidth_bytes_per_s / 1e12:.2f} TB/s)"),
    ]
    if manifest.options.knobs:
        overrides = (f"{rule}.{k}={v}" for rule, knobs in manifest.options.knobs.items() for k, v in knobs.items())
        rows.append(("knob overrides", " ".join(overrides)))
    return rows
