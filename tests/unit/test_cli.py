"""The `dflash-compile` command: summaries on good input, exit 1 with every problem on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from dflash_compiler.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.iterdir()))
def test_validate_every_bundled_config(name):
    result = invoke("validate", EXAMPLES / name)
    assert result.exit_code == 0, result.output
    assert "valid" in result.output and "block size / drafts (gamma)" in result.output
    assert "not checked (config.json only)" in result.output


def test_validate_summary_of_qwen3_8b():
    out = invoke("validate", EXAMPLES / "qwen3-8b-dflash-b16").output
    assert "dflash (DFlashDraftModel)" in out
    assert "5x full, non-causal" in out
    assert "32 / 8 x 128" in out
    assert "16 / 15" in out
    assert "1,048,626,432" in out
    assert "default, theta=1e+06" in out
    assert "unknown keys (kept)" in out and "none" in out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    result = invoke("make-example", "tiny-dspark", out, "--seed", "3")
    assert result.exit_code == 0, result.output
    return out


def test_make_example_then_validate(checkpoint):
    result = invoke("validate", checkpoint / "drafter", "--target-model", checkpoint / "target")
    assert result.exit_code == 0, result.output
    assert "all finite" in result.output and "lm_head.weight (BF16)" in result.output


def test_make_example_refuses_to_overwrite_without_force(checkpoint):
    result = invoke("make-example", "tiny-dspark", checkpoint, "--seed", "3")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert invoke("make-example", "tiny-dspark", checkpoint, "--seed", "3", "--force").exit_code == 0


def test_unknown_example_lists_available(tmp_path):
    result = invoke("make-example", "no-such-drafter", tmp_path / "x")
    assert result.exit_code == 1
    assert "tiny-dflash" in result.output


def test_bad_config_exits_1_with_all_problems(tmp_path):
    raw = json.loads((EXAMPLES / "tiny-dflash" / "config.json").read_text())
    raw["num_key_value_heads"] = 3
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    result = invoke("validate", tmp_path)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "2 problem(s)" in result.output
    assert "num_key_value_heads" in result.output and "rope_scaling.rope_type" in result.output
    assert "fix:" in result.output


def test_broken_weights_exit_1_naming_tensors(checkpoint, tmp_path):
    bad = tmp_path / "drafter"
    shutil.copytree(checkpoint / "drafter", bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["norm.weight"]
    tensors["fc.weight"] = np.full_like(tensors["fc.weight"], np.nan)
    save_file(tensors, str(bad / "model.safetensors"))
    result = invoke("validate", bad)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "norm.weight" in result.output and "fc.weight" in result.output and "NaN" in result.output


def test_target_mismatch_exit_1(checkpoint, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(checkpoint / "target", target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (target / "config.json").write_text(json.dumps(cfg))
    result = invoke("validate", checkpoint / "drafter", "--target-model", target)
    assert result.exit_code == 1 and "vocab" in result.output


def test_missing_directory(tmp_path):
    result = invoke("validate", tmp_path / "nowhere")
    assert result.exit_code == 1 and "no such file" in result.output


def test_plan_prints_plans_and_dumps_every_step(tmp_path):
    result = invoke(
        "plan", EXAMPLES / "qwen3-8b-dflash-b16", "--max-batch", "8", "--max-seq-len", "4096", "--dump-dir", tmp_path
    )
    assert result.exit_code == 0, result.output
    assert "kv 2065 pages x 327680 B" in result.output
    assert "propose memory" in result.output and "naive" in result.output
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert len(dumps) == 2 * 15  # lowering + 14 passes, both phases
    assert dumps[0] == "00_lower.append_context.txt" and dumps[-1] == "14_plan_memory.propose.txt"
    assert "matmul" in (tmp_path / "01_fuse_context_kv.append_context.txt").read_text()


def test_plan_fp8_with_weights_and_bad_options(checkpoint):
    drafter, target = checkpoint / "drafter", checkpoint / "target"
    result = invoke("plan", drafter, "--target-model", target, "--precision", "auto")
    assert result.exit_code == 0, result.output
    assert "precision auto" in result.output
    bad = invoke("plan", drafter, "--precision", "int4")
    assert bad.exit_code == 1 and "precision" in bad.output and "Traceback" not in bad.output
    bad = invoke("plan", drafter, "--exclude", "lm_head")
    assert bad.exit_code == 1 and "exclude only applies" in bad.output
