"""make-example writer: every tiny example round-trips, files are deterministic and safetensors-compatible."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from dflash_compiler import checkpoint
from dflash_compiler.checkpoint import example_config_path, list_examples, write_example
from dflash_compiler.errors import ConfigError, InputError
from dflash_compiler.synth import random_drafter_weights, random_target_weights
from dflash_compiler.target_model import check_target, load_target
from dflash_compiler.weights import WeightSet, check_drafter_weights

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = [name for name in list_examples() if name.startswith("tiny-")]


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_bundled_examples_are_listed():
    assert {"tiny-dflash", "tiny-dflash2", "tiny-dspark", "tiny-dflash-yarn", "qwen3-8b-dflash-b16"} <= set(
        list_examples()
    )
    assert example_config_path("tiny-dflash") == EXAMPLES / "tiny-dflash" / "config.json"


def test_unknown_example_lists_the_available_ones():
    with pytest.raises(ConfigError) as err:
        example_config_path("tiny-nope")
    (problem,) = err.value.problems
    assert problem.found == "'tiny-nope'"
    assert "tiny-dflash" in problem.expected and "qwen3-8b-dflash-b16" in problem.expected


@pytest.mark.parametrize("name", TINY)
def test_tiny_example_round_trips(tmp_path, name):
    written = write_example(name, tmp_path / "out", seed=7)
    cfg = written.config
    ws = WeightSet(written.drafter_dir)
    report = check_drafter_weights(cfg, ws)
    assert report.dtypes == {"BF16": report.num_tensors}
    for tensor, values in random_drafter_weights(cfg, 7).items():
        np.testing.assert_array_equal(ws.get(tensor), values.astype(ml_dtypes.bfloat16), err_msg=tensor)
    target = load_target(written.target_dir, cfg)
    check_target(cfg, target)
    expected = random_target_weights(cfg, 7, tied=cfg.tie_word_embeddings)
    np.testing.assert_array_equal(
        target.embed_tokens(as_f32=True), expected["embed_tokens"].astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    np.testing.assert_array_equal(
        target.lm_head(as_f32=True), expected["lm_head"].astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    assert target.tied is cfg.tie_word_embeddings
    assert ("lm_head.weight" in target.weights) is not cfg.tie_word_embeddings


def test_written_files_and_configs(tmp_path):
    written = write_example("tiny-dflash", tmp_path, seed=0)
    assert [str(f) for f in written.files] == [
        "drafter/config.json",
        "drafter/model.safetensors",
        "target/config.json",
        "target/model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "target"]  # no staging leftovers
    source = EXAMPLES / "tiny-dflash" / "config.json"
    assert (written.drafter_dir / "config.json").read_bytes() == source.read_bytes()
    target_cfg = json.loads((written.target_dir / "config.json").read_text())
    assert target_cfg == {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "vocab_size": 512,
        "num_hidden_layers": 8,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def test_fp32_storage_keeps_synth_values_exactly(tmp_path):
    written = write_example("tiny-dspark", tmp_path, seed=1, dtype="fp32")
    ws = WeightSet(written.drafter_dir)
    for tensor, values in random_drafter_weights(written.config, 1).items():
        assert ws.info(tensor)[0] == "F32"
        np.testing.assert_array_equal(ws.get(tensor), values)
    assert json.loads((written.target_dir / "config.json").read_text())["torch_dtype"] == "float32"


def test_safetensors_library_reads_the_files(tmp_path):
    written = write_example("tiny-dflash2", tmp_path, seed=0)
    ws = WeightSet(written.drafter_dir)
    for file in sorted(tmp_path.rglob("*.safetensors")):  # data starts 8-byte aligned, as safetensors writes it
        assert int.from_bytes(file.read_bytes()[:8], "little") % 8 == 0, file
    with safe_open(str(written.drafter_dir / "model.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == ws.names()
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            np.testing.assert_array_equal(f.get_tensor(name), ws.get(name))


def test_same_inputs_give_identical_bytes(tmp_path):
    write_example("tiny-dflash", tmp_path / "a", seed=3, target_shards=2)
    write_example("tiny-dflash", tmp_path / "b", seed=3, target_shards=2)
    write_example("tiny-dflash", tmp_path / "c", seed=4, target_shards=2)
    a, b, c = (all_files(tmp_path / x) for x in "abc")
    assert a == b
    assert a["drafter/model.safetensors"] != c["drafter/model.safetensors"]


def test_sharded_target_matches_the_single_file(tmp_path):
    single = write_example("tiny-dspark", tmp_path / "one", seed=0)
    sharded = write_example("tiny-dspark", tmp_path / "two", seed=0, target_shards=2)
    index = json.loads((sharded.target_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "lm_head.weight": "model-00002-of-00002.safetensors",
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 2 * 512 * 64 * 2
    assert not (sharded.target_dir / "model.safetensors").exists()
    one = load_target(single.target_dir)
    two = load_target(sharded.target_dir)
    np.testing.assert_array_equal(two.embed_tokens(), one.embed_tokens())
    np.testing.assert_array_equal(two.lm_head(), one.lm_head())
    check_target(sharded.config, two)


def test_config_path_and_directory_inputs(tmp_path):
    config = EXAMPLES / "tiny-dflash-yarn" / "config.json"
    by_file = write_example(config, tmp_path / "f", seed=0)
    by_dir = write_example(config.parent, tmp_path / "d", seed=0)
    assert by_file.source == by_dir.source == config
    assert all_files(tmp_path / "f") == all_files(tmp_path / "d")


def test_bad_options_are_reported_together(tmp_path):
    with pytest.raises(InputError) as err:
        write_example("tiny-dflash-yarn", tmp_path / "out", seed=0, dtype="int8", target_shards=2)
    msgs = [p.render() for p in err.value.problems]
    assert msgs[0].startswith("dtype: found 'int8'; expected one of bf16, fp32")
    assert msgs[1].startswith("target_shards: found 2; expected 1..1 (a tied target has one tensor)")
    assert not (tmp_path / "out").exists()


def test_output_path_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(InputError, match=r"out: found a file; expected a directory \(or nothing\)"):
        write_example("tiny-dflash", tmp_path / "out", seed=0)


def test_invalid_config_is_refused(tmp_path):
    raw = json.loads((EXAMPLES / "tiny-dflash" / "config.json").read_text())
    raw["hidden_size"] = "big"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="hidden_size"):
        write_example(tmp_path / "config.json", tmp_path / "out", seed=0)


def test_existing_output_needs_overwrite(tmp_path):
    write_example("tiny-dflash", tmp_path, seed=0)
    with pytest.raises(InputError, match=r"drafter: found an existing path"):
        write_example("tiny-dflash", tmp_path, seed=1)
    write_example("tiny-dflash", tmp_path, seed=1, overwrite=True)
    fresh = write_example("tiny-dflash", tmp_path / "fresh", seed=1)
    assert all_files(tmp_path / "drafter") == all_files(fresh.drafter_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "fresh", "target"]


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = checkpoint.random_tensor

    def flaky(spec, seed):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk full")
        return real(spec, seed)

    monkeypatch.setattr(checkpoint, "random_tensor", flaky)
    with pytest.raises(RuntimeError, match="disk full"):
        write_example("tiny-dflash", tmp_path / "new", seed=0)
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="disk full"):
        write_example("tiny-dflash", tmp_path / "kept", seed=0)
    assert list((tmp_path / "kept").iterdir()) == []


def test_random_draws_are_one_stream_per_row_block():
    """A tensor of one block is the plain draw of tensor_rng(seed, name); a larger one draws block b's rows
    from tensor_rng(seed, f"{name}#{b}") (blocks of DRAW_BLOCK_ELEMS values, generated on every core), with
    the role's affine map applied in float32."""
    from dflash_compiler.synth import DRAW_BLOCK_ELEMS, standard_normal, tensor_rng

    small = standard_normal(3, "w", (40, 50), 0.1, 1.0)
    plain = tensor_rng(3, "w").standard_normal((40, 50), dtype=np.float32)
    np.testing.assert_array_equal(small, np.float32(1.0) + np.float32(0.1) * plain)

    cols = 1000
    rows_per_block = DRAW_BLOCK_ELEMS // cols
    shape = (2 * rows_per_block + 7, cols)  # two whole blocks and a ragged third
    big = standard_normal(3, "lm_head", shape, 0.5)
    for b, name in enumerate(("lm_head", "lm_head#1", "lm_head#2")):
        lo, hi = b * rows_per_block, min((b + 1) * rows_per_block, shape[0])
        want = tensor_rng(3, name).standard_normal((hi - lo, cols), dtype=np.float32) * np.float32(0.5)
        np.testing.assert_array_equal(big[lo:hi], want, err_msg=name)
    np.testing.assert_array_equal(big, standard_normal(3, "lm_head", shape, 0.5))
    assert abs(float(big.std()) - 0.5) < 0.005 and abs(float(big.mean())) < 0.005


def test_the_f32_tensor_source_maps_the_embedding_and_the_interpreter_gathers_its_rows_exactly(tmp_path):
    """checkpoint_source gives every tensor in float32 except the embedding table, which a lookup only
    gathers: the stored table, read-only over the file. The interpreter's lookups in it are the lookups in
    the float32 table, bit for bit."""
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.ir import Node, Op, TensorType, evaluate_node
    from dflash_compiler.sources import checkpoint_source

    write_example("tiny-dflash", tmp_path, seed=2)
    cfg = load_drafter_config(tmp_path / "drafter")
    source = checkpoint_source(cfg, tmp_path / "drafter", tmp_path / "target")
    target = load_target(tmp_path / "target", cfg)
    table, full = source("target.embed_tokens"), target.embed_tokens(as_f32=True)
    assert table.dtype == ml_dtypes.bfloat16 and not table.flags.writeable
    np.testing.assert_array_equal(table.astype(np.float32), full)
    assert source("target.lm_head").dtype == np.float32
    ids = np.array([3, cfg.vocab_size - 1, 0, 3], np.int32)
    node = Node.make(Op.EMBED, [TensorType("bfloat16", ("m", cfg.hidden_size))], scale=0.5)
    (got,) = evaluate_node(node, [ids, table])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, full[ids] * np.float32(0.5))
