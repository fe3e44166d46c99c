"""pack-weights: compute the artifact's packed tensors from the checkpoints (numpy + safetensors only).

Runs on the deploy box, which has no TVM: the manifest declares every packed tensor (fused K/V and QKV
rows, FP8 rows and their scales, the RoPE table) as a transform of checkpoint tensors, and this applies
the declarations exactly as the build's interpreter did. Tensors are read as stored, so a bf16 weight
packed as bf16 is copied rather than widened to float32 and rounded back (the same bytes), and each
transform's result is held only until the last packed tensor that needs it is written. The checkpoint
must be the one the artifact was compiled for: its config must hash to the manifest's.
"""

from __future__ import annotations

from pathlib import Path

from dflash_compiler.artifact import WEIGHTS, ArtifactError, Manifest, add_file, config_sha256, load_manifest
from dflash_compiler.checkpoint import TensorToWrite, write_safetensors
from dflash_compiler.config import load_drafter_config
from dflash_compiler.ir.weights import WeightCache, WeightDecl
from dflash_compiler.plans import numpy_dtype
from dflash_compiler.sources import checkpoint_source

# manifest dtype -> safetensors dtype name
_STORAGE = {"bfloat16": "BF16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}


def pack_weights(artifact: Path, drafter_dir: Path, target_model: Path) -> Manifest:
    """Write `weights.safetensors` into `artifact` (re-sealing its manifest); returns the new manifest."""
    manifest = load_manifest(artifact, require=())
    cfg = load_drafter_config(drafter_dir)
    if config_sha256(cfg.raw) != manifest.config_sha256:
        raise ArtifactError(
            f"{drafter_dir}/config.json is not the config {artifact} was compiled from (sha256 differs). "
            f"Fix: pack with the drafter it was built for, or rebuild: dflash-compile compile {drafter_dir} ..."
        )
    decls = {name: WeightDecl.from_json(record.decl) for name, record in manifest.weights.items()}
    source = checkpoint_source(cfg, Path(drafter_dir), Path(target_model), as_stored=True)
    cache = WeightCache(source, expected=decls.values())
    tensors = []
    for name, record in sorted(manifest.weights.items()):
        if record.dtype not in _STORAGE:
            raise ArtifactError(f"weight {name}: dtype {record.dtype} cannot be stored; known {sorted(_STORAGE)}")
        dtype, stored = numpy_dtype(record.dtype), _STORAGE[record.dtype]
        tensors.append(TensorToWrite(name, record.shape, dtype, stored, make=lambda d=decls[name]: cache.take(d)))
    return add_file(Path(artifact), WEIGHTS, lambda path: write_safetensors(path, tensors))
