"""Target model reading: config layouts, tensor name prefixes, tying, sharding, and every incompatibility."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_compiler.config import DrafterConfig, load_drafter_config
from dflash_compiler.errors import ConfigError, WeightsError
from dflash_compiler.synth import random_target_weights
from dflash_compiler.target_model import check_target, load_target

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def cfg() -> DrafterConfig:
    return load_drafter_config(EXAMPLES / "tiny-dflash")  # V 512, H 64, 8 target layers, taps [1, 3, 5]


def qwen_config(cfg: DrafterConfig, **changes: object) -> dict:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": cfg.target_hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_target_layers,
        "tie_word_embeddings": False,
    }
    return base | changes


def write_target(directory: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(directory / shard))
        weight_map |= dict.fromkeys(part, shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def standard_tensors(cfg: DrafterConfig) -> dict[str, np.ndarray]:
    w = random_target_weights(cfg, 3)
    return {"model.embed_tokens.weight": w["embed_tokens"].astype(BF16), "lm_head.weight": w["lm_head"].astype(BF16)}


def problems_of(err: pytest.ExceptionInfo[WeightsError]) -> list[str]:
    return [p.render() for p in err.value.problems]


# ----------------------------------------------------------------------------------------- reading


def test_standard_untied_target(tmp_path, cfg):
    tensors = standard_tensors(cfg)
    target = load_target(write_target(tmp_path, qwen_config(cfg), tensors), cfg)
    assert (target.embed_name, target.lm_head_name, target.tied) == (
        "model.embed_tokens.weight",
        "lm_head.weight",
        False,
    )
    report = check_target(cfg, target)
    assert report.dtypes == ("BF16", "BF16") and report.values_checked
    assert target.embed_tokens().dtype == BF16
    np.testing.assert_array_equal(
        target.embed_tokens(as_f32=True), tensors["model.embed_tokens.weight"].astype(np.float32)
    )
    np.testing.assert_array_equal(target.lm_head(as_f32=True), tensors["lm_head.weight"].astype(np.float32))
    assert ("target lm_head", "lm_head.weight (BF16)") in report.rows()


def test_tied_target_uses_the_embedding_as_lm_head(tmp_path, cfg):
    embed = standard_tensors(cfg)["model.embed_tokens.weight"]
    config = qwen_config(cfg, tie_word_embeddings=True)
    target = load_target(write_target(tmp_path, config, {"model.embed_tokens.weight": embed}))
    assert target.tied and target.lm_head_name is None
    np.testing.assert_array_equal(target.lm_head(), embed)
    report = check_target(cfg, target)
    assert report.tied and report.lm_head_name == "model.embed_tokens.weight"


def test_tied_target_ignores_a_stored_lm_head(tmp_path, cfg):
    tensors = standard_tensors(cfg)
    target = load_target(write_target(tmp_path, qwen_config(cfg, tie_word_embeddings=True), tensors))
    np.testing.assert_array_equal(target.lm_head(), tensors["model.embed_tokens.weight"])
    assert any("lm_head.weight is ignored" in note for note in check_target(cfg, target).notes)


@pytest.mark.parametrize(("has_head", "tied"), [(False, True), (True, False)])
def test_tying_inferred_when_the_config_does_not_say(tmp_path, cfg, has_head, tied):
    tensors = standard_tensors(cfg)
    if not has_head:
        del tensors["lm_head.weight"]
    config = qwen_config(cfg)
    del config["tie_word_embeddings"]
    target = load_target(write_target(tmp_path, config, tensors))
    assert target.tied is tied
    assert any("does not set tie_word_embeddings" in note for note in target.notes)
    check_target(cfg, target)


@pytest.mark.parametrize("prefix", ["", "model.", "model.language_model.", "language_model.model."])
@pytest.mark.parametrize("head", ["lm_head.weight", "language_model.lm_head.weight"])
def test_embedding_prefixes_and_lm_head_names(tmp_path, cfg, prefix, head):
    t = standard_tensors(cfg)
    tensors = {f"{prefix}embed_tokens.weight": t["model.embed_tokens.weight"], head: t["lm_head.weight"]}
    target = load_target(write_target(tmp_path, qwen_config(cfg), tensors))
    assert (target.embed_name, target.lm_head_name) == (f"{prefix}embed_tokens.weight", head)
    check_target(cfg, target)


def test_multimodal_config_nests_text_fields(tmp_path, cfg):
    text = qwen_config(cfg)
    del text["architectures"], text["tie_word_embeddings"]
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False, "text_config": text}
    t = standard_tensors(cfg)
    tensors = {
        "model.language_model.embed_tokens.weight": t["model.embed_tokens.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    target = load_target(write_target(tmp_path, config, tensors))
    assert (
        target.config.hidden_size == cfg.hidden_size
        and target.config.origin["hidden_size"] == "text_config.hidden_size"
    )
    assert target.config.tie_word_embeddings is False
    check_target(cfg, target)


def test_text_config_values_win_over_top_level(tmp_path, cfg):
    config = qwen_config(cfg, hidden_size=1, text_config={"hidden_size": cfg.hidden_size})
    target = load_target(write_target(tmp_path, config, standard_tensors(cfg)))
    assert target.config.hidden_size == cfg.hidden_size


def test_sharded_target_reads_like_a_single_file(tmp_path, cfg):
    tensors = standard_tensors(cfg)
    single = load_target(write_target(tmp_path / "single", qwen_config(cfg), tensors))
    sharded = load_target(write_target(tmp_path / "sharded", qwen_config(cfg), tensors, shards=2))
    assert len(sharded.weights.files) == 2 and sharded.weights.index_path is not None
    np.testing.assert_array_equal(sharded.embed_tokens(), single.embed_tokens())
    np.testing.assert_array_equal(sharded.lm_head(), single.lm_head())
    check_target(cfg, sharded)


def test_drafter_config_picks_the_matching_candidate(tmp_path, cfg):
    t = standard_tensors(cfg)
    tensors = {
        "embed_tokens.weight": np.zeros((7, cfg.hidden_size), BF16),  # first in search order, wrong shape
        "model.language_model.embed_tokens.weight": t["model.embed_tokens.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }
    path = write_target(tmp_path, qwen_config(cfg), tensors)
    assert load_target(path).embed_name == "embed_tokens.weight"
    assert load_target(path, cfg).embed_name == "model.language_model.embed_tokens.weight"


# ------------------------------------------------------------------------------------------ broken


def test_missing_config_json(tmp_path, cfg):
    save_file(standard_tensors(cfg), str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"config.json: found no such file; expected the target's config.json"):
        load_target(tmp_path)


def test_mistyped_config_field(tmp_path, cfg):
    path = write_target(tmp_path, qwen_config(cfg, hidden_size="64", tie_word_embeddings="no"), standard_tensors(cfg))
    with pytest.raises(ConfigError) as err:
        load_target(path)
    msgs = [p.render() for p in err.value.problems]
    assert msgs == [
        "hidden_size: found '64'; expected a positive integer. Fix: write hidden_size as a positive integer "
        "in the target config.json",
        "tie_word_embeddings: found 'no'; expected true or false. Fix: write tie_word_embeddings as true or "
        "false in the target config.json",
    ]


def test_target_hidden_size_mismatch(tmp_path, cfg):
    target = load_target(write_target(tmp_path, qwen_config(cfg, hidden_size=128), standard_tensors(cfg)))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    (msg,) = problems_of(err)
    assert msg.startswith("target config.json hidden_size: found 128; expected 64 (the drafter's target_hidden_size)")


def test_target_vocab_mismatch(tmp_path, cfg):
    t = random_target_weights(cfg, 0)
    tensors = {"model.embed_tokens.weight": t["embed_tokens"][:500], "lm_head.weight": t["lm_head"][:500]}
    target = load_target(write_target(tmp_path, qwen_config(cfg, vocab_size=500), tensors))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    msgs = problems_of(err)
    assert msgs[0].startswith("target config.json vocab_size: found 500; expected 512 (the drafter's vocab_size)")
    assert "model.embed_tokens.weight: found shape [500, 64]; expected [vocab_size, hidden_size] = [512, 64]" in msgs[1]
    assert msgs[2].startswith("lm_head.weight: found shape [500, 64]")
    assert len(msgs) == 3


def test_target_too_shallow_for_the_taps(tmp_path, cfg):
    target = load_target(write_target(tmp_path, qwen_config(cfg, num_hidden_layers=4), standard_tensors(cfg)))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    depth, taps = problems_of(err)
    assert depth.startswith(
        "target config.json num_hidden_layers: found 4; expected 8 (the drafter's num_target_layers)"
    )
    assert "found 4 layers; expected more than 5 layers (the drafter taps layers [1, 3, 5])" in taps


def test_target_missing_lm_head_and_not_tied(tmp_path, cfg):
    tensors = standard_tensors(cfg)
    del tensors["lm_head.weight"]
    target = load_target(write_target(tmp_path, qwen_config(cfg), tensors))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    (msg,) = problems_of(err)
    assert msg.startswith(
        "target lm_head: found none of lm_head.weight, language_model.lm_head.weight, and tie_word_embeddings is false"
    )
    with pytest.raises(WeightsError, match=r"found none of lm_head\.weight"):
        target.lm_head()


def test_target_missing_embedding_names_the_searched_names(tmp_path, cfg):
    tensors = {"lm_head.weight": standard_tensors(cfg)["lm_head.weight"]}
    target = load_target(write_target(tmp_path, qwen_config(cfg), tensors))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    (msg,) = problems_of(err)
    assert (
        "target embed_tokens: found none of embed_tokens.weight, model.embed_tokens.weight, "
        "model.language_model.embed_tokens.weight, language_model.model.embed_tokens.weight" in msg
    )


def test_target_integer_embedding_and_nonfinite_head(tmp_path, cfg):
    tensors = standard_tensors(cfg)
    tensors["model.embed_tokens.weight"] = np.zeros((512, 64), np.int8)
    tensors["lm_head.weight"][5, :3] = np.nan
    tensors["lm_head.weight"][6, 0] = np.inf
    target = load_target(write_target(tmp_path, qwen_config(cfg), tensors))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    msgs = problems_of(err)
    assert msgs[0].startswith("model.embed_tokens.weight: found dtype I8; expected one of BF16, F16, F32")
    assert msgs[1].startswith("lm_head.weight: found 3 NaN and 1 Inf value(s) among 32768")
    with pytest.raises(WeightsError) as err:  # without the value scan only the dtype problem remains
        check_target(cfg, target, check_values=False)
    assert [p.where for p in err.value.problems] == ["model.embed_tokens.weight"]


def test_all_target_problems_reported_together(tmp_path, cfg):
    config = qwen_config(cfg, hidden_size=32, vocab_size=100, num_hidden_layers=2)
    del config["vocab_size"]
    tensors = {"model.embed_tokens.weight": np.zeros((100, 32), np.float32)}
    target = load_target(write_target(tmp_path, config, tensors))
    with pytest.raises(WeightsError) as err:
        check_target(cfg, target)
    wheres = [p.where for p in err.value.problems]
    assert wheres == [
        "target config.json hidden_size",
        "target config.json vocab_size",
        "target config.json num_hidden_layers",
        "target config.json num_hidden_layers",
        "target lm_head",
        "model.embed_tokens.weight",
    ]
    assert err.value.problems[1].found == "nothing"
