"""Artifacts of bundled examples on the GPU: drafts equal the reference's over a scripted scenario.

Artifacts are compiled on the build box without weights (`dflash-compile compile examples/NAME --target
sm_90 -o DIR`) and passed with `--artifact DIR`. Here the example's random checkpoint is generated, packed
into a copy of the artifact (numpy only), and the drafter runs >= 20 steps with 4 sequences of different
lengths, padded verify rows rolled back, and a sequence freed and replaced (page reuse). CUDA-graph replays
(context launches padded to a multiple of 16 rows) and plain launches, and each round's rows appended by the
next round's `Drafter.step` (one graph of both phases), must give identical drafts.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SEED = 0


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "artifact_dir" in metafunc.fixturenames:
        dirs = metafunc.config.getoption("--artifact")
        metafunc.parametrize("artifact_dir", dirs, ids=[Path(d).name for d in dirs])


def _example_of(manifest) -> str:
    from dflash_compiler.artifact import config_sha256
    from dflash_compiler.checkpoint import example_config_path, list_examples
    from dflash_compiler.config import load_drafter_config

    for name in list_examples():
        if config_sha256(load_drafter_config(example_config_path(name)).raw) == manifest.config_sha256:
            return name
    raise AssertionError(f"{manifest.name} was not compiled from a bundled example")


def _packed(artifact_dir: str, tmp_path: Path) -> tuple[Path, Any, Path, Any]:
    """A copy of the artifact packed with its example's random checkpoint: (artifact, manifest, checkpoint dir,
    drafter config)."""
    from dflash_compiler.artifact import load_manifest
    from dflash_compiler.checkpoint import write_example
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.pack import pack_weights

    artifact = tmp_path / Path(artifact_dir).name
    shutil.copytree(artifact_dir, artifact)
    manifest = load_manifest(artifact, require=())
    ckpt = tmp_path / "ckpt"
    write_example(_example_of(manifest), ckpt, seed=SEED)
    pack_weights(artifact, ckpt / "drafter", ckpt / "target")
    return artifact, manifest, ckpt, load_drafter_config(ckpt / "drafter")


def test_artifact_drafts_match_reference(artifact_dir, tmp_path):
    from dflash_compiler.protocol import run_scenario
    from dflash_compiler.runtime.drafter import Drafter
    from dflash_compiler.selfcheck import default_scenario, self_check
    from dflash_compiler.sources import checkpoint_source

    artifact, _, ckpt, cfg = _packed(artifact_dir, tmp_path)
    tensor = checkpoint_source(cfg, ckpt / "drafter", ckpt / "target")
    scenario = default_scenario(sequences=4, steps=20, seed=SEED)

    graphed = Drafter.load(artifact, use_graphs=True)
    replayed: list[tuple[str, ...]] = []  # the phases of each graph replay
    replay = graphed.graphs.run

    def counted(chain, stream):
        replayed.append(tuple(phase.plan.name for phase, _ in chain))
        replay(chain, stream)

    graphed.graphs.run = counted
    # an FP8 build is checked against the reference of its own (quantized) weights
    first = self_check(graphed, cfg, tensor, scenario, graphed.manifest.precision)
    graphed.close()
    # every proposal and every context launch was a graph replay (context rows padded: a few captures)
    assert replayed.count(("propose",)) >= len(first.run.records)
    assert replayed.count(("append_context",)) >= len(first.run.records)
    print(f"\n{artifact.name}: {first.comparison.summary()}; propose median {first.median_propose_ms:.3f} ms")
    assert first.comparison.ok, "\n".join(first.comparison.mismatches[:20])
    decisions = sum(r.tokens.size for r in first.run.records)
    assert first.comparison.compared >= 50, f"only {first.comparison.compared} of {decisions} decisions are clear"

    plain = Drafter.load(artifact, use_graphs=False, device=graphed.device)
    second = run_scenario(plain, cfg, scenario)  # compared with the graph run, not the reference again
    plain.close()
    for a, b in zip(first.run.records, second.records, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"graph vs plain, step {a.step}")

    # each round's rows appended by the next round's step: one graph of both phases, rollbacks inside it
    stepped = Drafter.load(artifact, use_graphs=True, device=graphed.device)
    third = run_scenario(stepped, cfg, replace(scenario, stepped=True))
    captured = len(stepped.graphs)
    stepped.close()
    assert captured >= 2, f"step() captured {captured} graphs over {len(third.records)} rounds"
    for a, b in zip(first.run.records, third.records, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"separate phases vs step(), step {a.step}")


def test_target_tensors_are_borrowed_zero_copy(artifact_dir, tmp_path):
    """embed_tokens / lm_head passed as the serving engine's device tensors (DLPack) give the same drafts."""
    torch = pytest.importorskip("torch")
    from dflash_compiler.artifact import WEIGHTS
    from dflash_compiler.protocol import run_scenario
    from dflash_compiler.runtime.drafter import Drafter
    from dflash_compiler.selfcheck import default_scenario
    from dflash_compiler.weights import WeightSet

    artifact, manifest, _, cfg = _packed(artifact_dir, tmp_path)
    scenario = default_scenario(sequences=2, steps=6, seed=SEED)
    stored = WeightSet(artifact / WEIGHTS)
    # An FP8 build stores lm_head quantized (`target.lm_head.e4m3` + scales): only bf16 tensors are borrowable.
    shared = [n for n in ("target.embed_tokens", "target.lm_head") if n in manifest.weights]
    assert shared and all(manifest.weights[n].dtype == "bfloat16" for n in shared)
    borrowed = {name: torch.from_numpy(stored.get(name).view(np.int16)).view(torch.bfloat16).cuda() for name in shared}
    own = Drafter.load(artifact)
    want = run_scenario(own, cfg, scenario)
    own.close()
    other = Drafter.load(artifact, external_weights=borrowed, device=own.device)
    for name, tensor in borrowed.items():
        assert other.weights[name] == tensor.data_ptr()
    got = run_scenario(other, cfg, scenario)
    other.close()
    for a, b in zip(want.records, got.records, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_device_taps_give_the_drafts_of_host_taps(artifact_dir, tmp_path):
    """Context rows given as bf16 CUDA tensors, mixed with host rows in one call (copied device to device
    into the same launch's input), give the drafts of the same rows given as host arrays."""
    torch = pytest.importorskip("torch")
    from dflash_compiler.protocol import run_scenario
    from dflash_compiler.runtime.drafter import Drafter
    from dflash_compiler.selfcheck import default_scenario

    artifact, _, _, cfg = _packed(artifact_dir, tmp_path)
    scenario = default_scenario(sequences=3, steps=6, seed=SEED)

    class OnDevice(Drafter):
        """Every other sequence's rows as a CUDA tensor (float32 → bf16 rounds to nearest even, as on the host)."""

        def append_context(self, seq_ids, taps, positions):
            moved = [
                torch.from_numpy(np.asarray(t, np.float32)).to(torch.bfloat16).cuda() if i % 2 == 0 else t
                for i, t in enumerate(taps)
            ]
            super().append_context(seq_ids, moved, positions)

    host = Drafter.load(artifact)
    want = run_scenario(host, cfg, scenario)
    host.close()
    device = OnDevice.load(artifact, device=host.device)
    got = run_scenario(device, cfg, scenario)
    device.close()
    for a, b in zip(want.records, got.records, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=f"step {a.step}")
