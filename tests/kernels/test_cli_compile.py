"""`dflash-compile compile / inspect / pack-weights`: the artifact commands end to end on a tiny drafter."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dflash_compiler.artifact import WEIGHTS, load_manifest
from dflash_compiler.checkpoint import write_example
from dflash_compiler.cli import app

pytest.importorskip("tvm")

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_compile_packs_and_inspect_verifies(tmp_path):
    write_example("tiny-dspark", tmp_path / "ckpt", seed=2)
    out = tmp_path / "tiny-dspark-sm_120"
    result = _run(
        "compile",
        tmp_path / "ckpt" / "drafter",
        "--target-model",
        tmp_path / "ckpt" / "target",
        "--target",
        "sm_120",
        "--max-batch",
        "2",
        "--max-seq-len",
        "128",
        "-o",
        out,
    )
    assert result.exit_code == 0, result.output
    for label in ("schedule done", "nvrtc done", "emit done", "pack-weights done", "kv pool", "predicted step"):
        assert label in result.output
    manifest = load_manifest(out, require=(WEIGHTS,))
    assert manifest.target.name == "sm_120" and manifest.options.max_batch == 2
    shown = _run("inspect", out)
    assert shown.exit_code == 0 and "sm_120a" in shown.output and "propose" in shown.output
    again = _run("compile", tmp_path / "ckpt" / "drafter", "--target", "sm_120", "-o", out)
    assert again.exit_code == 1 and "exists" in again.output and "--force" in again.output


def test_compile_refuses_an_unknown_target_and_inspect_a_damaged_artifact(tmp_path):
    write_example("tiny-dflash", tmp_path / "ckpt", seed=2)
    bad = _run("compile", tmp_path / "ckpt" / "drafter", "--target", "sm_89", "-o", tmp_path / "x")
    assert bad.exit_code == 1 and "--target" in bad.output and "sm_90" in bad.output
    assert not (tmp_path / "x").exists()
    out = tmp_path / "a"
    assert (
        _run(
            "compile",
            tmp_path / "ckpt" / "drafter",
            "--target",
            "sm_90",
            "--max-batch",
            "2",
            "--max-seq-len",
            "128",
            "-o",
            out,
        ).exit_code
        == 0
    )
    (out / "graph.txt").write_text("edited")
    shown = _run("inspect", out)
    assert shown.exit_code == 1 and "graph.txt" in shown.output
    packed = _run("pack-weights", out, tmp_path / "ckpt" / "drafter", "--target-model", tmp_path / "ckpt" / "target")
    assert packed.exit_code == 1 and "graph.txt" in packed.output


def _compile_tiny(tmp_path, out, *extra):
    return _run(
        "compile", tmp_path / "ckpt" / "drafter", "--target", "sm_90", "--max-batch", "2", "--max-seq-len", "128",
        "-o", out, *extra,
    )  # fmt: skip


def test_knob_overrides_reach_the_kernels_and_the_manifest(tmp_path):
    write_example("tiny-dflash", tmp_path / "ckpt", seed=2)
    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    assert _compile_tiny(tmp_path, plain).exit_code == 0
    result = _compile_tiny(tmp_path, tuned, "--knob", "block_attention.splits=2", "--knob", "rmsnorm.vector_bytes=8")
    assert result.exit_code == 0, result.output
    assert "block_attention.splits=2 rmsnorm.vector_bytes=8" in result.output  # the summary's overrides row
    base, manifest = load_manifest(plain), load_manifest(tuned)
    assert manifest.options.knobs == {"block_attention": {"splits": 2}, "rmsnorm": {"vector_bytes": 8}}
    attention = [r for r in manifest.kernel_rules.values() if r.rule == "block_attention"]
    norms = [r for r in manifest.kernel_rules.values() if r.rule == "rmsnorm"]
    assert attention and all(r.knobs["splits"] == 2 for r in attention)
    assert norms and all(r.knobs["vector_bytes"] == 8 for r in norms)
    assert all(r.knobs["splits"] == 16 for r in base.kernel_rules.values() if r.rule == "block_attention")
    assert (plain / "kernels.cu").read_text() != (tuned / "kernels.cu").read_text()
    shown = _run("inspect", tuned)
    assert shown.exit_code == 0 and "knob overrides" in shown.output and "rmsnorm_h64" in shown.output


def test_weight_layout_option_reaches_the_graph_and_the_manifest(tmp_path):
    write_example("tiny-dflash", tmp_path / "ckpt", seed=2)
    tiled, rows = tmp_path / "tiled", tmp_path / "rows"
    assert _compile_tiny(tmp_path, rows, "--no-weight-tiles").exit_code == 0
    result = _compile_tiny(tmp_path, tiled)  # tiled by default (BuildOptions.weight_tiles)
    assert result.exit_code == 0, result.output
    on, off = load_manifest(tiled), load_manifest(rows)
    assert on.options.weight_tiles and not off.options.weight_tiles
    assert any(r.decl["transform"] == "tiles" for r in on.weights.values())
    assert not any(r.decl["transform"] == "tiles" for r in off.weights.values())
    assert "_t64" in (tiled / "kernels.cu").read_text() and "_t64" not in (rows / "kernels.cu").read_text()


@pytest.mark.parametrize(
    ("knob", "message"),
    [
        ("block_attention.splits", "RULE.KNOB=INT"),
        ("block_attention.splits=two", "RULE.KNOB=INT"),
        ("attention.splits=2", "unknown rule(s) attention"),
        ("block_attention_wgmma.early=1", "made no kernel of this build"),
        ("block_attention.split=2", "unknown knob(s) split"),
    ],
)
def test_bad_knob_overrides_are_refused_and_write_nothing(tmp_path, knob, message):
    write_example("tiny-dflash", tmp_path / "ckpt", seed=2)
    result = _compile_tiny(tmp_path, tmp_path / "x", "--knob", knob)
    assert result.exit_code == 1 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "x").exists()
