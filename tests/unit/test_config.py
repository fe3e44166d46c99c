"""Drafter config front end: every bundled config validates, broken ones fail with a precise message."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dflash_compiler.config import (
    AttentionKind,
    Family,
    default_target_layer_ids,
    load_drafter_config,
    parse_drafter_config,
)
from dflash_compiler.errors import ConfigError
from dflash_compiler.rope import RopeType, rope_tables
from dflash_compiler.tensors import expected_drafter_tensors, parameter_count

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALL_EXAMPLES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "config.json").is_file())


def test_examples_present():
    for name in (
        "qwen3-8b-dflash-b16",
        "qwen3-4b-dflash-b16",
        "qwen3.5-9b-dflash",
        "qwen3.8-27b-dflash2",
        "qwen3-8b-dspark",
        "tiny-dflash",
        "tiny-dflash2",
        "tiny-dspark",
    ):
        assert name in ALL_EXAMPLES


@pytest.mark.parametrize("name", ALL_EXAMPLES)
def test_every_bundled_config_validates(name):
    cfg = load_drafter_config(EXAMPLES / name)
    assert cfg.gamma == cfg.block_size - 1
    assert len(cfg.layers) == cfg.num_layers
    assert cfg.unknown_keys == ()
    assert set(expected_drafter_tensors(cfg)) >= {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_qwen3_8b_fields():
    cfg = load_drafter_config(EXAMPLES / "qwen3-8b-dflash-b16")
    assert cfg.family is Family.DFLASH
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 5, 32, 8, 128)
    assert cfg.block_size == 16 and cfg.gamma == 15
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.mask_token_id == 151669
    assert cfg.rope.rope_type is RopeType.DEFAULT and cfg.rope.theta == 1e6
    assert all(layer.kind is AttentionKind.FULL and not layer.causal for layer in cfg.layers)
    # 3 + 11 L tensors, ~1.05 B parameters (fc alone is 84 M), 20 KiB of bf16 KV per context row.
    assert len(expected_drafter_tensors(cfg)) == 58
    assert expected_drafter_tensors(cfg)["fc.weight"].numel == 4096 * 5 * 4096
    assert 1.0e9 < parameter_count(cfg) < 1.1e9
    assert cfg.kv_bytes_per_token == 20 * 1024


def test_dflash2_fields_come_from_dflash_config():
    cfg = load_drafter_config(EXAMPLES / "qwen3.8-27b-dflash2")
    assert cfg.family is Family.DFLASH2
    assert cfg.block_size == 8 and cfg.gamma == 7
    assert cfg.dflash2 is not None and cfg.dflash2.selector_top_k == 16
    assert cfg.rope.theta == 1e7
    assert all(layer.window == 2048 and not layer.causal for layer in cfg.layers)
    specs = expected_drafter_tensors(cfg)
    # [2 K H / g, H]: 1664 x 6656 for the H=6656 fixture, 1280 x 5120 here.
    assert specs["layers.0.attention_conv.kernel_projection.weight"].shape == (1280, 5120)
    assert specs["candidate_selector.predecessor_codebook"].shape == (248320, 256)


def test_dspark_fields():
    cfg = load_drafter_config(EXAMPLES / "qwen3-8b-dspark")
    assert cfg.family is Family.DSPARK and cfg.block_size == 7
    assert cfg.dspark is not None and cfg.dspark.markov_rank == 256 and cfg.dspark.enable_confidence_head
    assert expected_drafter_tensors(cfg)["confidence_head.proj.weight"].shape == (1, 4096 + 256)


def test_dflash_config_takes_precedence(example_raw):
    raw = example_raw("qwen3-8b-dflash-b16")
    raw["dflash_config"]["block_size"] = 10
    raw["mask_token_id"] = 7
    cfg = parse_drafter_config(raw)
    assert cfg.block_size == 10
    assert cfg.mask_token_id == 151669


def test_unknown_keys_are_kept_and_listed(example_raw):
    raw = example_raw("tiny-dflash")
    raw["my_extra"] = 1
    raw["dflash_config"]["experimental_flag"] = True
    cfg = parse_drafter_config(raw)
    assert cfg.unknown_keys == ("dflash_config.experimental_flag", "my_extra")
    assert cfg.raw["my_extra"] == 1


def test_default_target_layer_ids(example_raw):
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert default_target_layer_ids(36, 1) == (18,)
    raw = example_raw("qwen3-8b-dflash-b16")
    del raw["dflash_config"]["target_layer_ids"]
    cfg = parse_drafter_config(raw)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.target_layer_ids_defaulted
    assert any("default" in note for note in cfg.notes)


def test_rope_v4_and_v5_forms_agree(example_raw):
    v4 = example_raw("tiny-dspark")
    v4["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    v5 = example_raw("tiny-dspark")
    del v5["rope_theta"], v5["rope_scaling"]
    v5["rope_parameters"] = {
        "rope_theta": 1000000,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    a, b = parse_drafter_config(v4).rope, parse_drafter_config(v5).rope
    assert a == b and a.rope_type is RopeType.YARN


def test_legacy_type_key_and_linear(example_raw):
    raw = example_raw("tiny-dspark")
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    cfg = parse_drafter_config(raw)
    inv, att = rope_tables(cfg.rope, cfg.head_dim)
    base, _ = rope_tables(cfg.rope.model_copy(update={"rope_type": RopeType.DEFAULT}), cfg.head_dim)
    np.testing.assert_allclose(inv, base / 2.0)
    assert att == 1.0


def test_yarn_tables_match_formula():
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash-yarn")
    inv, att = rope_tables(cfg.rope, cfg.head_dim)
    assert att == pytest.approx(0.1 * np.log(4.0) + 1.0)
    plain = 1.0 / (1e6 ** (np.arange(0, 12, 2) / 12))
    # Highest-frequency pairs are extrapolated (unchanged), lowest are interpolated by 1/factor.
    assert inv[0] == pytest.approx(plain[0])
    assert inv[-1] == pytest.approx(plain[-1] / 4.0)
    assert np.all(inv <= plain + 1e-15) and np.all(inv >= plain / 4.0 - 1e-15)


def test_sliding_layers_default_causal_and_is_causal_override(example_raw):
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    assert [(layer.kind, layer.causal, layer.window) for layer in cfg.layers] == [
        (AttentionKind.SLIDING, True, 12),
        (AttentionKind.SLIDING, True, 12),
        (AttentionKind.FULL, False, None),
    ]
    raw = example_raw("tiny-dflash")
    raw["is_causal"] = False
    assert not any(layer.causal for layer in parse_drafter_config(raw).layers)


def test_qwen3_sliding_rule_without_layer_types(example_raw):
    raw = example_raw("tiny-dspark")
    del raw["layer_types"]
    raw.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    cfg = parse_drafter_config(raw)
    assert [layer.kind for layer in cfg.layers] == [AttentionKind.FULL, AttentionKind.SLIDING]


def test_partial_rotary_factor_is_ignored_with_a_note(example_raw):
    raw = example_raw("tiny-dflash")
    raw["partial_rotary_factor"] = 0.25
    cfg = parse_drafter_config(raw)
    assert any("partial_rotary_factor" in n for n in cfg.notes)


def test_block_size_override():
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash").with_block_size(4)
    assert cfg.block_size == 4 and cfg.gamma == 3
    with pytest.raises(ConfigError, match="block_size"):
        cfg.with_block_size(1)


Mutation = Callable[[dict], None]


def _set(path: str, value) -> Mutation:
    def apply(raw: dict) -> None:
        node = raw
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return apply


def _delete(path: str) -> Mutation:
    def apply(raw: dict) -> None:
        node = raw
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]

    return apply


# (example, mutation, where the error must point, text the message must contain)
BROKEN: list[tuple[str, Mutation, str, str]] = [
    ("tiny-dflash", _set("dflash_config.target_layer_ids", []), "dflash_config.target_layer_ids",
     "at least one target layer id"),
    ("tiny-dflash", _set("dflash_config.target_layer_ids", [1, 8]), "dflash_config.target_layer_ids",
     "0 <= id < num_target_layers (8)"),
    ("tiny-dflash", _set("dflash_config.target_layer_ids", [1, 1]), "dflash_config.target_layer_ids",
     "distinct ids"),
    ("tiny-dflash", _set("num_key_value_heads", 3), "num_key_value_heads", "a divisor of num_attention_heads"),
    ("tiny-dflash", _set("head_dim", 15), "head_dim", "an even number"),
    ("tiny-dflash", lambda r: (r.pop("head_dim"), r.update(num_attention_heads=3, num_key_value_heads=3)),
     "head_dim", "hidden_size divisible by num_attention_heads"),
    ("tiny-dflash", _set("rope_scaling", {"rope_type": "longrope", "factor": 2.0}), "rope_scaling.rope_type",
     "one of default, linear, yarn"),
    ("tiny-dflash2", _set("rope_parameters.rope_type", "dynamic"), "rope_parameters.rope_type",
     "one of default, linear, yarn"),
    ("tiny-dflash", _set("rope_scaling", {"rope_type": "yarn"}), "rope_scaling.factor", "a number > 0"),
    ("tiny-dflash2", _delete("dflash_config.selector_top_k"), "dflash_config.selector_top_k",
     "selector_rank and selector_top_k together"),
    ("tiny-dflash2", _delete("dflash_config.conv_kernel_size"), "dflash_config.conv_kernel_size",
     "conv_kernel_size and conv_group_size together"),
    ("tiny-dflash", _set("block_size", 1), "block_size", "an integer >= 2"),
    ("tiny-dflash2", _set("dflash_config.block_size", 0), "dflash_config.block_size", "an integer >= 2"),
    ("tiny-dflash", _set("hidden_size", -64), "hidden_size", "an integer > 0"),
    ("tiny-dflash", _set("intermediate_size", 0), "intermediate_size", "an integer > 0"),
    ("tiny-dflash", _set("hidden_size", "64"), "hidden_size", "an integer"),
    ("tiny-dflash", _set("rms_norm_eps", "1e-6"), "rms_norm_eps", "a number"),
    ("tiny-dflash", _set("dflash_config.target_layer_ids", "1,3,5"), "dflash_config.target_layer_ids", "a list"),
    ("tiny-dflash", _delete("vocab_size"), "vocab_size", "the field is required"),
    ("tiny-dflash", _set("dflash_config.mask_token_id", 512), "dflash_config.mask_token_id",
     "0 <= id < vocab_size (512)"),
    ("tiny-dflash", _set("layer_types", ["full_attention"]), "layer_types", "one entry per draft layer"),
    ("tiny-dflash", _set("layer_types", ["full_attention", "linear_attention", "full_attention"]),
     "layer_types[1]", "full_attention"),
    ("tiny-dflash", _delete("sliding_window"), "sliding_window", "a window size"),
    ("tiny-dflash", _set("architectures", ["EagleDraftModel"]), "architectures[0]", "DFlashDraftModel"),
    ("tiny-dflash", _delete("architectures"), "architectures", "a list naming one of"),
    ("tiny-dspark", _set("dflash_config.projector_type", "domino"), "dflash_config.projector_type",
     "'dspark' or no projector_type"),
    ("tiny-dspark", _set("dflash_config.markov_head_type", "rnn"), "dflash_config.markov_head_type",
     "'vanilla'"),
    ("tiny-dspark", _delete("dflash_config.markov_rank"), "dflash_config.markov_rank", "Markov head rank"),
    ("tiny-dflash", _set("dflash_config.selector_rank", 4), "dflash_config.selector_top_k",
     "together"),
    ("tiny-dflash", _set("hidden_act", "gelu"), "hidden_act", "'silu'"),
    ("tiny-dflash", _set("attention_bias", True), "attention_bias", "false"),
    ("tiny-dflash", _set("draft_vocab_size", 32), "draft_vocab_size", "the target vocabulary (512)"),
    ("tiny-dflash", _set("dflash_config.final_logit_softcapping", -1.0),
     "dflash_config.final_logit_softcapping", "a number > 0 or null"),
    ("tiny-dflash", _set("dflash_config", [1, 2]), "dflash_config", "an object"),
    ("tiny-dflash", _set("dflash_config.use_swa", True), "dflash_config.use_swa", "unset"),
    ("tiny-dflash2", _set("dflash_config.conv_group_size", 7), "dflash_config.conv_group_size",
     "a divisor of hidden_size (64)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("example", "mutate", "where", "text"), BROKEN, ids=[f"{b[0]}:{b[2]}:{i}" for i, b in enumerate(BROKEN)]
)
def test_broken_config_is_refused_with_message(example_raw, example, mutate, where, text):
    raw = example_raw(example)
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        parse_drafter_config(raw)
    matching = [p for p in info.value.problems if p.where == where]
    assert matching, f"no problem reported at {where}: {info.value}"
    rendered = " | ".join(p.render() for p in matching)
    assert text in rendered
    assert all(p.fix for p in info.value.problems)


def test_all_problems_reported_together(example_raw):
    raw = example_raw("tiny-dflash")
    raw["num_key_value_heads"] = 3
    raw["block_size"] = 1
    raw["dflash_config"]["mask_token_id"] = -1
    with pytest.raises(ConfigError) as info:
        parse_drafter_config(raw)
    wheres = {p.where for p in info.value.problems}
    assert {"num_key_value_heads", "block_size", "dflash_config.mask_token_id"} <= wheres
    assert "3 problem(s)" in str(info.value)


def test_wrong_types_reported_together(example_raw):
    raw = example_raw("tiny-dflash")
    raw["hidden_size"] = 64.0
    raw["num_hidden_layers"] = True
    with pytest.raises(ConfigError) as info:
        parse_drafter_config(raw)
    assert {p.where for p in info.value.problems} >= {"hidden_size", "num_hidden_layers"}


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 4,')
    with pytest.raises(ConfigError, match="valid JSON"):
        load_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="a JSON object"):
        load_drafter_config(tmp_path)
