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
