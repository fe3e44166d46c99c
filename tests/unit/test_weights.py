"""WeightSet (lazy safetensors access) and the drafter checkpoint check, on valid and broken checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_compiler.config import DrafterConfig, load_drafter_config
from dflash_compiler.errors import WeightsError
from dflash_compiler.synth import random_drafter_weights
from dflash_compiler.tensors import expected_drafter_tensors, parameter_count
from dflash_compiler.weights import WeightSet, check_drafter_weights, has_safetensors

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def cfg() -> DrafterConfig:
    return load_drafter_config(EXAMPLES / "tiny-dflash")


def bf16_weights(cfg: DrafterConfig, seed: int = 0) -> dict[str, np.ndarray]:
    return {k: v.astype(BF16) for k, v in random_drafter_weights(cfg, seed).items()}


def save(directory: Path, tensors: dict[str, np.ndarray], name: str = "model.safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / name))
    return directory


def problems_of(err: pytest.ExceptionInfo[WeightsError]) -> list[str]:
    return [p.render() for p in err.value.problems]


# ------------------------------------------------------------------------------------------- WeightSet


def test_single_file_names_info_and_values(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensors = {"a": a.astype(BF16), "b": a, "c": np.arange(5, dtype=np.int32), "d": a.astype(np.float16)}
    ws = WeightSet(save(tmp_path, tensors))
    assert ws.names() == ["a", "b", "c", "d"]
    assert "a" in ws and "z" not in ws and len(ws) == 4
    assert ws.info("a") == ("BF16", (3, 4))
    assert ws.info("c") == ("I32", (5,))
    assert ws.info("d") == ("F16", (3, 4))
    assert ws.get("a").dtype == BF16 and ws.get("d").dtype == np.float16
    np.testing.assert_array_equal(ws.get_f32("a"), a)
    np.testing.assert_array_equal(ws.get("b"), a)
    np.testing.assert_array_equal(ws.get("c"), np.arange(5))
    assert ws.get_f32("d").dtype == np.float32
    assert ws.total_bytes == 24 + 48 + 20 + 24


def test_get_f32_of_tensors_spanning_many_row_blocks_is_the_stored_values_in_float32(tmp_path):
    """get_f32 converts from the file's pages a block of rows at a time on every core: the values must be
    numpy's conversion of the stored tensor, whatever the block boundaries (ragged rows, 1-D, 3-D)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2500, 1001), dtype=np.float32)
    tensors = {
        "bf16": x.astype(BF16),
        "f16": x[:700].astype(np.float16),
        "f32": x[:1500],
        "vec": x[0].astype(BF16),
        "cube": x[:600].reshape(3, 200, 1001).astype(BF16),
        "scalar": np.array(2.5, dtype=BF16),
    }
    ws = WeightSet(save(tmp_path, tensors))
    for name, stored in tensors.items():
        got = ws.get_f32(name)
        assert got.dtype == np.float32 and got.shape == stored.shape and got.flags.writeable, name
        np.testing.assert_array_equal(got, stored.astype(np.float32), err_msg=name)


def test_get_f32_of_a_file_cut_short_after_opening_names_the_tensor(tmp_path):
    ws = WeightSet(save(tmp_path, {"w": np.ones((64, 64), np.float32)}))
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=r"bytes for tensor w"):
        ws.get_f32("w")


def test_get_mapped_is_the_stored_tensor_read_only_and_a_gather_reads_its_rows(tmp_path):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((300, 64), dtype=np.float32).astype(BF16)
    ws = WeightSet(save(tmp_path, {"table": table, "f32": table.astype(np.float32)[:7]}))
    mapped = ws.get_mapped("table")
    assert mapped.dtype == BF16 and mapped.shape == table.shape and not mapped.flags.writeable
    np.testing.assert_array_equal(mapped.view(np.uint16), table.view(np.uint16))
    ids = np.array([299, 0, 17, 17])
    np.testing.assert_array_equal(mapped[ids].astype(np.float32), ws.get_f32("table")[ids])
    np.testing.assert_array_equal(ws.get_mapped("f32"), table.astype(np.float32)[:7])
    cut = WeightSet(save(tmp_path / "cut", {"w": np.ones((64, 64), np.float32)}))
    file = tmp_path / "cut" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=r"bytes for tensor w"):
        cut.get_mapped("w")


def test_any_safetensors_name_and_a_file_path(tmp_path):
    save(tmp_path, {"x": np.ones(3, np.float32)}, name="pytorch_weights.safetensors")
    assert has_safetensors(tmp_path)
    assert WeightSet(tmp_path).names() == ["x"]
    assert WeightSet(tmp_path / "pytorch_weights.safetensors").info("x") == ("F32", (3,))


def test_several_files_without_an_index_are_merged(tmp_path):
    save(tmp_path, {"x": np.ones(3, np.float32)}, name="a.safetensors")
    save(tmp_path, {"y": np.zeros(2, np.float32)}, name="b.safetensors")
    assert WeightSet(tmp_path).names() == ["x", "y"]


def test_same_tensor_in_two_files_is_refused(tmp_path):
    save(tmp_path, {"x": np.ones(3, np.float32)}, name="a.safetensors")
    save(tmp_path, {"x": np.ones(3, np.float32)}, name="b.safetensors")
    with pytest.raises(WeightsError, match=r"x: found stored in both a.safetensors and b.safetensors"):
        WeightSet(tmp_path)


def test_values_are_read_on_get_not_on_open(tmp_path):
    path = save(tmp_path, {"x": np.zeros(4, np.float32)}) / "model.safetensors"
    ws = WeightSet(tmp_path)
    data = bytearray(path.read_bytes())
    data[-16:] = np.full(4, 7.0, np.float32).tobytes()  # overwrite x's bytes after opening
    path.write_bytes(bytes(data))
    np.testing.assert_array_equal(ws.get("x"), np.full(4, 7.0))


def test_sharded_checkpoint_via_index(tmp_path):
    save(tmp_path, {"a": np.ones(2, np.float32)}, name="model-00001-of-00002.safetensors")
    save(tmp_path, {"b": np.full(3, 2.0, np.float32)}, name="model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ws = WeightSet(tmp_path)
    assert ws.names() == ["a", "b"] and ws.index_path is not None and len(ws.files) == 2
    np.testing.assert_array_equal(ws.get("b"), np.full(3, 2.0))


def test_no_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not has_safetensors(tmp_path)
    with pytest.raises(WeightsError, match=r"found no \*\.safetensors file; expected a directory with model"):
        WeightSet(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    save(tmp_path, {"a": np.ones(2, np.float32)}, name="model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError) as err:
        WeightSet(tmp_path)
    (msg,) = problems_of(err)
    assert "model-00002-of-00002.safetensors: found no such file (the index assigns it 1 tensor(s), e.g. b)" in msg
    assert "download the missing shard" in msg


def test_index_pointing_at_a_tensor_absent_from_its_shard(tmp_path):
    save(tmp_path, {"a": np.ones(2, np.float32)}, name="shard.safetensors")
    index = {"weight_map": {"a": "shard.safetensors", "ghost": "shard.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"tensor ghost: found absent from shard.safetensors"):
        WeightSet(tmp_path)


def test_index_without_weight_map(tmp_path):
    save(tmp_path, {"a": np.ones(2, np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(WeightsError, match=r'expected an object with "weight_map"'):
        WeightSet(tmp_path)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\x01\x02", r"found a 2-byte file; expected an 8-byte header length"),
        ((1 << 40).to_bytes(8, "little") + b"{}", r"found a header length of 1099511627776 in a 10-byte file"),
        ((4).to_bytes(8, "little") + b"nope", r"found a header that is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", r"found a JSON list header"),
    ],
)
def test_corrupt_headers(tmp_path, blob, message):
    (tmp_path / "model.safetensors").write_bytes(blob)
    with pytest.raises(WeightsError, match=message):
        WeightSet(tmp_path)


def _raw_file(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_offsets_past_the_end_and_wrong_byte_counts(tmp_path):
    header = {
        "past_end": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "short": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]},
        "bad": {"dtype": "F32", "shape": "3"},
    }
    _raw_file(tmp_path / "model.safetensors", header, b"\0" * 8)
    with pytest.raises(WeightsError) as err:
        WeightSet(tmp_path)
    msgs = problems_of(err)
    assert len(msgs) == 3
    assert "tensor 'past_end' at bytes [0, 16) of a 8-byte data section; expected offsets inside the file" in msgs[0]
    assert "tensor 'short' (F32 [3]) spanning 8 bytes; expected 12 bytes" in msgs[1]
    assert "header entry 'bad'" in msgs[2] and "dtype, shape and data_offsets" in msgs[2]


def test_unknown_tensor_name_suggests_close_ones(tmp_path):
    ws = WeightSet(save(tmp_path, {"fc.weight": np.ones(2, np.float32)}))
    with pytest.raises(WeightsError, match=r"tensor fc.weights: found no such tensor.*did you mean fc.weight"):
        ws.get("fc.weights")


def test_chunked_reads_and_nonfinite_counts(tmp_path):
    x = np.arange(1000, dtype=np.float32)
    x[[3, 500, 999]] = np.nan
    x[10] = -np.inf
    ws = WeightSet(save(tmp_path, {"x": x.astype(BF16), "i": np.arange(4, dtype=np.int64)}))
    chunks = list(ws.iter_chunks("x", chunk_bytes=300))
    assert [c.size for c in chunks] == [150] * 6 + [100]
    np.testing.assert_array_equal(np.concatenate(chunks).astype(np.float32), x.astype(BF16).astype(np.float32))
    assert ws.nonfinite_count("x") == (3, 1)
    assert ws.nonfinite_count("i") == (0, 0)


# ----------------------------------------------------------------------------------- drafter check


def test_valid_drafter_passes_with_a_full_report(tmp_path, cfg):
    weights = bf16_weights(cfg)
    report = check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    assert report.num_tensors == len(expected_drafter_tensors(cfg)) == 3 + 11 * cfg.num_layers
    assert report.parameter_count == parameter_count(cfg)
    assert report.total_bytes == 2 * parameter_count(cfg)
    assert report.dtypes == {"BF16": report.num_tensors}
    assert report.stored_names["fc.weight"] == "fc.weight"
    assert report.own_heads == () and report.values_checked
    assert ("weight values", "all finite") in report.rows()


def test_model_prefixed_names_are_accepted(tmp_path, cfg):
    weights = {f"model.{k}": v for k, v in bf16_weights(cfg).items()}
    report = check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    assert report.stored_names["layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert any("'model.' prefix" in note for note in report.notes)


def test_mixed_float_dtypes_are_accepted(tmp_path, cfg):
    weights = random_drafter_weights(cfg, 0)  # fp32
    weights["norm.weight"] = weights["norm.weight"].astype(np.float16)
    report = check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    assert report.dtypes == {"F16": 1, "F32": report.num_tensors - 1}


def test_drafter_shipping_embed_and_lm_head_is_recorded(tmp_path, cfg):
    weights = bf16_weights(cfg)
    head = np.zeros((cfg.vocab_size, cfg.hidden_size), BF16)
    weights |= {"embed_tokens.weight": head, "model.lm_head.weight": head}
    report = check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    assert report.own_heads == ("embed_tokens.weight", "model.lm_head.weight")
    assert any("drafter ships its own embed/lm_head" in note for note in report.notes)


def test_shipped_embed_with_the_wrong_shape_is_refused(tmp_path, cfg):
    weights = bf16_weights(cfg) | {"embed_tokens.weight": np.zeros((10, cfg.hidden_size), BF16)}
    with pytest.raises(WeightsError, match=r"embed_tokens.weight: found shape \[10, 64\]; expected shape \[512, 64\]"):
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))


def test_missing_tensor(tmp_path, cfg):
    weights = bf16_weights(cfg)
    del weights["layers.2.mlp.down_proj.weight"]
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    (msg,) = problems_of(err)
    assert msg.startswith("layers.2.mlp.down_proj.weight: found no such tensor in the checkpoint")
    assert "expected a [64, 128] tensor required by config.json" in msg


def test_unexpected_tensor(tmp_path, cfg):
    weights = bf16_weights(cfg) | {"layers.3.input_layernorm.weight": np.ones(64, BF16)}
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    (msg,) = problems_of(err)
    assert "layers.3.input_layernorm.weight: found an unexpected tensor [64]" in msg
    assert "a layer past num_hidden_layers" in msg


def test_wrongly_prefixed_tensor_gets_a_rename_hint(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["draft.fc.weight"] = weights.pop("fc.weight")
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    missing, unexpected = problems_of(err)
    assert "re-save without the 'draft.' prefix" in missing
    assert "re-save it as 'fc.weight'" in unexpected


def test_wrong_shape(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["fc.weight"] = np.zeros((64, 128), BF16)  # config taps 3 layers: [64, 192]
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    (msg,) = problems_of(err)
    assert "fc.weight: found shape [64, 128]; expected shape [64, 192]" in msg
    assert "[hidden_size, len(target_layer_ids) * target_hidden_size]" in msg


def test_integer_dtype(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["norm.weight"] = np.ones(64, np.int32)
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    (msg,) = problems_of(err)
    assert "norm.weight: found dtype I32; expected one of BF16, F16, F32" in msg


def test_nan_values_are_counted(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["layers.1.self_attn.k_proj.weight"][0, :5] = np.nan
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    (msg,) = problems_of(err)
    assert "layers.1.self_attn.k_proj.weight: found 5 NaN and 0 Inf value(s) among 2048" in msg


def test_inf_values_are_counted(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["hidden_norm.weight"][[1, 2]] = [np.inf, -np.inf]
    with pytest.raises(WeightsError, match=r"hidden_norm.weight: found 0 NaN and 2 Inf value\(s\) among 64"):
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))


def test_values_are_not_read_without_check_values(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["norm.weight"][0] = np.nan
    report = check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)), check_values=False)
    assert not report.values_checked
    assert ("weight values", "not scanned for NaN/Inf") in report.rows()


def test_several_problems_reported_together(tmp_path, cfg):
    weights = bf16_weights(cfg)
    del weights["layers.0.self_attn.q_norm.weight"]
    weights["extra.weight"] = np.ones(3, BF16)
    weights["layers.1.mlp.up_proj.weight"] = np.zeros((64, 64), BF16)
    weights["norm.weight"] = np.ones(64, np.int8)
    weights["fc.weight"][0, 0] = np.nan
    with pytest.raises(WeightsError) as err:
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
    assert err.value.subject == f"drafter checkpoint {tmp_path}"
    assert str(err.value).startswith(f"drafter checkpoint {tmp_path}: 5 problem(s)")
    wheres = [p.where for p in err.value.problems]
    assert wheres == [
        "layers.0.self_attn.q_norm.weight",
        "extra.weight",
        "layers.1.mlp.up_proj.weight",
        "norm.weight",
        "fc.weight",
    ]


def test_duplicate_prefixed_and_unprefixed_copies(tmp_path, cfg):
    weights = bf16_weights(cfg)
    weights["model.norm.weight"] = weights["norm.weight"]
    with pytest.raises(
        WeightsError, match=r"norm.weight: found both 'model.norm.weight' and 'norm.weight'; expected one copy"
    ):
        check_drafter_weights(cfg, WeightSet(save(tmp_path, weights)))
