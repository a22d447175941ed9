"""A corrupt or mismatched HF checkpoint fails with a message naming the file and the mismatch (a shard
missing, truncated or zeroed, an unreadable index: found from the headers, before any tensor is read)."""

import dataclasses
import json

import pytest

from megatron_rl.checkpoint.hf import read_tensors, stage_tensors
from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.hf import build_hf_model

ARCH = ModelConfig(family="qwen2", num_layers=2)


@pytest.fixture()
def sharded(tmp_path):
    build_hf_model(ARCH, seed=0).save_pretrained(tmp_path, max_shard_size="100KB")
    return tmp_path


def _all(path, arch=ARCH):
    return stage_tensors(path, arch, range(arch.num_layers), True, True)


def test_a_good_checkpoint_loads(sharded):
    assert "model.layers.1.mlp.down_proj.weight" in _all(sharded)


def test_wrong_family(sharded):
    with pytest.raises(ValueError, match=r"config.json: model_type='qwen2', but model.family=llama"):
        _all(sharded, dataclasses.replace(ARCH, family="llama"))


def test_missing_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (sharded / victim).unlink()
    with pytest.raises(ValueError, match=rf"{victim}: shard listed in .*index.json is missing"):
        _all(sharded)


def _last_shard(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / sorted(set(index["weight_map"].values()))[-1]


@pytest.mark.parametrize("cut, damage", [
    (0.5, r"is truncated: (\d+) bytes, its header declares (\d+)"),  # tensor data cut short
    (20, r"is truncated or not safetensors: 20 bytes, its first 8 bytes declare a \d+-byte header"),  # the header
    (None, r"is not safetensors \(zeroed or overwritten\?\): its header does not parse"),  # zeroed
])
def test_damaged_shard_is_named(sharded, cut, damage):
    shard = _last_shard(sharded)
    data = shard.read_bytes()
    shard.write_bytes(bytes(len(data)) if cut is None else data[: int(len(data) * cut) if cut < 1 else cut])
    with pytest.raises(ValueError, match=rf"{shard.name}: shard listed in .*index.json {damage}") as info:
        _all(sharded)
    if cut == 0.5:  # the sizes: the file's, and 8 + header + the data its offsets end at (safetensors' layout)
        header_length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8: 8 + header_length])
        declared = 8 + header_length + max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
        assert f"{len(data) // 2} bytes, its header declares {declared}" in str(info.value)
        assert declared == len(data)


def test_truncated_single_file_is_named(tmp_path):
    build_hf_model(ARCH, seed=0).save_pretrained(tmp_path)
    single = tmp_path / "model.safetensors"
    single.write_bytes(single.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"model.safetensors: truncated: \d+ bytes, its header declares \d+"):
        _all(tmp_path)


def test_unreadable_index_is_named(sharded):
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: unreadable index \(JSONDecodeError"):
        _all(sharded)


def test_wrong_vocab_size(sharded):
    with pytest.raises(ValueError, match=r"model-\d+-of-\d+.safetensors: tensor 'model.embed_tokens.weight' "
                                         r"has shape \(128, 128\), the configured architecture needs \(256, 128\)"):
        _all(sharded, dataclasses.replace(ARCH, vocab_size=256))


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    build_hf_model(ARCH, seed=0).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.1.self_attn.k_proj.bias'"):
        _all(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"config.json does not exist"):
        _all(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no model.safetensors"):
        read_tensors(tmp_path)
