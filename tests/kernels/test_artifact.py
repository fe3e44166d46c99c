"""The artifact: a full compile of a tiny drafter, manifest round trip, determinism, tamper and SM checks,
pack-weights, and the launch plan's consistency with the kernel table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_compiler.artifact import (
    CUBIN,
    GRAPH,
    MANIFEST,
    SCHEMA_VERSION,
    SOURCE,
    WEIGHTS,
    ArtifactError,
    Manifest,
    load_manifest,
    verify_files,
)
from dflash_compiler.checkpoint import write_example
from dflash_compiler.config import load_drafter_config
from dflash_compiler.cubin import cubin_arch
from dflash_compiler.ir.weights import WeightCache, WeightDecl
from dflash_compiler.options import BuildOptions
from dflash_compiler.plans import dtype_bytes
from dflash_compiler.targets import SM90, SM121

pytest.importorskip("tvm")

EXAMPLE = "tiny-dflash"
OPTIONS = BuildOptions(max_batch=4, max_seq_len=256, max_ctx_rows=64, weight_tiles=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / EXAMPLE
    write_example(EXAMPLE, out, seed=3)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory, checkpoint) -> tuple[Path, Manifest]:
    from dflash_compiler.pipeline import compile_drafter

    cfg = load_drafter_config(checkpoint / "drafter")
    out = tmp_path_factory.mktemp("art") / f"{EXAMPLE}-sm_121"
    return compile_drafter(cfg, OPTIONS, SM121, out)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_artifact_holds_its_files_and_decisions(built):
    path, manifest = built
    assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST, CUBIN, SOURCE, GRAPH])
    assert cubin_arch((path / CUBIN).read_bytes()) == "sm_121a"
    assert manifest.target == SM121 and manifest.options == OPTIONS
    assert set(manifest.phases) == {"append_context", "propose"}
    assert dict(manifest.phases["propose"].dim_maxima)["pages"] == manifest.kv_cache.num_pages
    # every call's kernel is in the table, every kernel in the table is used
    used = {c.kernel for p in manifest.phases.values() for c in p.calls}
    assert used == set(manifest.kernels) == set(manifest.kernel_rules)
    # every compute node of the graphs has exactly one call
    for name, plan in manifest.phases.items():
        nodes = [c.node for c in plan.calls]
        assert len(nodes) == len(set(nodes)), name
    roof = manifest.roofline
    assert set(roof.predicted_us) == {"nb=1 ctx=256", "nb=4 ctx=256"}  # quoted at the longest admitted context
    for nb in (1, 4):
        expected = (roof.weight_bytes + nb * 256 * roof.kv_bytes_per_cached_row) / SM121.dram_bandwidth_bytes_per_s
        assert roof.predicted_us[f"nb={nb} ctx=256"] == pytest.approx(expected * 1e6, abs=0.05)
    assert roof.kv_bytes_per_cached_row == manifest.kv_cache.bytes_per_page // 16
    # the step streams every weight its calls read except the embedding table, which it only gathers rows of
    for phase, field in (("propose", roof.weight_bytes), ("append_context", roof.context_weight_bytes)):
        plan = manifest.phases[phase]
        read = {b.value for c in plan.calls for b in c.buffers if plan.values[b.value].kind == "weight"}
        if phase == "append_context":
            read -= {b.value for c in manifest.phases["propose"].calls for b in c.buffers}
        streamed = read - {"target.embed_tokens"}
        assert field == sum(np.prod(manifest.weights[w].shape) * dtype_bytes(manifest.weights[w].dtype)
                            for w in streamed), phase  # fmt: skip
    assert "target.embed_tokens" in {b.value for c in manifest.phases["propose"].calls for b in c.buffers}
    assert manifest.memory_total.total > manifest.kv_cache.total_bytes


def test_manifest_round_trip(built):
    path, manifest = built
    again = Manifest.model_validate_json((path / MANIFEST).read_text())
    assert again == manifest
    assert again.canonical_json() == (path / MANIFEST).read_text()


def test_identical_inputs_give_identical_bytes(built, checkpoint, tmp_path):
    from dflash_compiler.pipeline import compile_drafter

    path, _ = built
    cfg = load_drafter_config(checkpoint / "drafter")
    other, _ = compile_drafter(cfg, OPTIONS, SM121, tmp_path / path.name)
    for name in (MANIFEST, CUBIN, SOURCE, GRAPH):
        assert (other / name).read_bytes() == (path / name).read_bytes(), name


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / CUBIN).write_bytes((p / CUBIN).read_bytes()[:-100]), "kernels.cubin: .* bytes, the manifest"),
        (
            lambda p: (p / GRAPH).write_text((p / GRAPH).read_text().replace("rmsnorm", "rmsnorM", 1)),
            "graph.txt: sha256 .*edited or swapped",
        ),
        (lambda p: (p / SOURCE).unlink(), "kernels.cu: missing"),
        (
            lambda p: (p / MANIFEST).write_text((p / MANIFEST).read_text().replace('"max_batch": 4', '"max_batch": 5')),
            "manifest.json: its digest does not match",
        ),
        (
            lambda p: (p / MANIFEST).write_text(
                (p / MANIFEST).read_text().replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99')
            ),
            "schema version 99",
        ),
        (lambda p: (p / MANIFEST).write_text("{"), "not valid JSON"),
    ],
    ids=["truncated", "edited", "missing", "manifest-edited", "schema", "garbage"],
)
def test_damaged_artifacts_are_refused_naming_the_file(built, tmp_path, damage, message):
    path = _copy(built[0], tmp_path)
    damage(path)
    with pytest.raises(ArtifactError, match=message):
        load_manifest(path)


def test_weights_file_is_hashed_only_when_read(built, checkpoint, tmp_path):
    """A drafter given every weight by the engine never opens the weights file, so its hash (gigabytes) is
    not checked; anyone reading it still gets the damaged file named."""
    from dflash_compiler.pack import pack_weights

    path = _copy(built[0], tmp_path)
    pack_weights(path, checkpoint / "drafter", checkpoint / "target")
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (path / WEIGHTS).write_bytes(bytes(data))
    manifest = load_manifest(path, require=(CUBIN,), unread=(WEIGHTS,))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: sha256"):
        verify_files(path, manifest, (WEIGHTS,))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: sha256"):
        load_manifest(path)


def test_swapped_file_is_refused(built, checkpoint, tmp_path):
    from dflash_compiler.pipeline import compile_drafter

    path = _copy(built[0], tmp_path / "a")
    cfg = load_drafter_config(checkpoint / "drafter")
    other, _ = compile_drafter(cfg, OPTIONS, SM90, tmp_path / "b" / "other")
    shutil.copy(other / CUBIN, path / CUBIN)
    with pytest.raises(ArtifactError, match=r"kernels\.cubin"):
        load_manifest(path)


def test_runtime_refuses_another_sm_with_the_rebuild_command(built):
    from dflash_compiler.runtime.drafter import Drafter

    class Hopper:  # what the runtime reads of a device before it touches CUDA
        compute_capability = (9, 0)
        name = "NVIDIA H200"

    with pytest.raises(ArtifactError, match=r"built for sm_121 .* this GPU \(NVIDIA H200\) is 9.0.*--target sm_90"):
        Drafter.load(built[0], device=Hopper(), external_weights=dict.fromkeys(built[1].weights, 1))


def test_runtime_asks_for_packed_weights(built):
    from dflash_compiler.runtime.drafter import Drafter

    with pytest.raises(ArtifactError, match=r"has no weights\.safetensors\. Fix: run `dflash-compile pack-weights"):
        Drafter.load(built[0], device=object())


def test_pack_weights_writes_the_declared_tensors(built, checkpoint, tmp_path):
    from dflash_compiler.pack import pack_weights
    from dflash_compiler.sources import checkpoint_source
    from dflash_compiler.weights import WeightSet

    path = _copy(built[0], tmp_path)
    manifest = pack_weights(path, checkpoint / "drafter", checkpoint / "target")
    assert load_manifest(path, require=(CUBIN, WEIGHTS)) == manifest
    stored = WeightSet(path / WEIGHTS)
    assert sorted(stored.names()) == sorted(manifest.weights)
    cfg = load_drafter_config(checkpoint / "drafter")
    cache = WeightCache(checkpoint_source(cfg, checkpoint / "drafter", checkpoint / "target"))
    for name, record in manifest.weights.items():
        got = stored.get(name)
        assert str(got.dtype) == record.dtype and got.shape == record.shape
        want = cache.get(WeightDecl.from_json(record.decl)).astype(np.float32)
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(got.dtype).astype(np.float32), err_msg=name)
    fused = [n for n, r in manifest.weights.items() if "concat_rows" in _transforms(r.decl)]
    assert fused, "the tiny drafter has fused K/V, QKV and gate/up weights"
    tiled = [n for n, r in manifest.weights.items() if r.decl["transform"] == "tiles"]
    assert tiled, "the tiny drafter's 64-row linear weights are stored as tiles (the check above compares them)"


def _transforms(decl: dict) -> list[str]:
    """Every transform of a declaration's JSON form, nested sources included."""
    nested = [t for s in decl["sources"] if isinstance(s, dict) for t in _transforms(s)]
    return [decl["transform"], *nested]


def test_pack_weights_refuses_another_drafter(built, tmp_path):
    from dflash_compiler.pack import pack_weights

    other = tmp_path / "other"
    write_example("tiny-dspark", other, seed=1)
    path = _copy(built[0], tmp_path / "a")
    with pytest.raises(ArtifactError, match=r"is not the config .* was compiled from"):
        pack_weights(path, other / "drafter", other / "target")
    assert WEIGHTS not in load_manifest(path, require=()).files, "a refused pack leaves the artifact as it was"


def test_weight_decl_json_round_trip(built):
    for record in built[1].weights.values():
        decl = WeightDecl.from_json(record.decl)
        assert decl.to_json() == record.decl
        assert json.loads(json.dumps(decl.to_json())) == record.decl
