"""The GPU environment's pin file (launch/gpu-constraints.txt) against the code, offline: every pin is exact, the
CUDA packages share one CUDA major, setup.py's requirements and the SGLang test tier admit the pins, and the
pinned Transformer Engine, cuDNN and megatron-core pass the checks the code and the CPU suite make.
That the pins resolve together from the package index is tests/integration/test_gpu_pins_resolve.py."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PINS = REPO / "launch" / "gpu-constraints.txt"
REQUIRED = {"torch", "torchvision", "triton", "cuda-toolkit", "nvidia-cudnn-cu13", "megatron-core", "sglang", "transformer-engine",
            "transformer-engine-cu13", "transformer-engine-torch", "flash-attn-4"}


def pins() -> dict[str, Version]:
    out = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one specifier
        assert spec.operator == "==" and not req.extras and req.marker is None, f"not an exact pin: {line}"
        out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def setup_requirements() -> list[Requirement]:
    """install_requires and every extra of setup.py, read without running it."""
    found = []
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg in ("install_requires", "extras_require"):
            value = ast.literal_eval(node.value)
            found += [r for extra in value.values() for r in extra] if isinstance(value, dict) else value
    return [Requirement(r) for r in found]


def test_every_line_is_an_exact_pin_and_the_gpu_set_is_complete():
    assert REQUIRED <= pins().keys()


def test_the_cuda_packages_share_one_cuda_major():
    """The CUDA toolkit release of torch's wheels, the TE core library and cuDNN must agree: a cu12 TE core under a
    cu13 torch loads a second CUDA runtime."""
    p = pins()
    majors = {int(m.group(1)) for name in p if (m := re.search(r"-cu(\d+)$", name))}
    assert majors == {p["cuda-toolkit"].major}


def test_transformer_engine_packages_have_one_version():
    p = pins()
    assert p["transformer-engine"] == p["transformer-engine-cu13"] == p["transformer-engine-torch"]


def test_setup_py_requirements_admit_the_pins():
    p = pins()
    refused = [f"{req} refuses {p[name]}" for req in setup_requirements()
               if (name := canonicalize_name(req.name)) in p and not req.specifier.contains(p[name], prereleases=True)]
    assert refused == []


def test_the_sglang_test_tier_runs_the_pinned_sglang_and_megatron_core():
    """The CPU integration tier (tests/integration/sglang/) is where the rollout adapter meets real SGLang: it must be
    the pinned release, with the pinned megatron-core beside it."""
    p = pins()
    tier = REPO / "tests" / "integration" / "sglang"
    (sglang,) = re.findall(r'^SGLANG_SPEC="sglang==(\S+)"', (tier / "setup.sh").read_text(), re.MULTILINE)
    (megatron,) = re.findall(r"^megatron-core==(\S+)", (tier / "requirements-project.txt").read_text(), re.MULTILINE)
    assert (Version(sglang), Version(megatron)) == (p["sglang"], p["megatron-core"])


def test_megatron_core_is_the_release_the_cpu_suite_runs():
    """The CPU compatibility layer cites one release's line numbers and the CPU suite runs it; the GPU set pins the
    same one, so that what CI tests is what a GPU job imports."""
    if sys.version_info >= (3, 12):
        pytest.skip("Python >= 3.12 resolves a newer megatron-core for the CPU suite; compared on Python 3.11")
    assert Version(importlib.metadata.version("megatron-core")) == pins()["megatron-core"]


def test_the_pinned_transformer_engine_and_cudnn_train_attention_sinks():
    """models/gpt.py refuses gpt-oss's sinks on the TE spec below TE 2.12 or cuDNN 9.18 (and for head widths other
    than 64, 128 and 256 below cuDNN 9.26). cuDNN's version number is major * 10000 + minor * 100 + patch."""
    from megatron_rl.models.gpt import te_sink_attention_problem

    p = pins()
    major, minor, patch = p["nvidia-cudnn-cu13"].release[:3]
    cudnn = major * 10000 + minor * 100 + patch
    assert te_sink_attention_problem(str(p["transformer-engine"]), cudnn, head_dim=64) is None


def test_flash_attn_2_is_not_pinned_beside_flash_attn_4():
    """flash-attn 2.x installs an older copy of flash-attn-4's modules (flash_attn/cute/) and, as published, cannot
    be built against torch 2.14 (C++17); setup_env.sh adds one only from a wheel (FLASH_ATTN_WHEEL) and then
    restores flash-attn-4's files."""
    assert "flash-attn" not in pins()


def test_torchvision_is_the_release_of_the_pinned_torch():
    """torchvision 0.N is built against torch 2.(N - 15); its requirement (torch >= 2.(N - 15)) would also admit a
    newer torch, so the resolve alone does not catch a mismatch."""
    p = pins()
    assert p["torchvision"].release[:2] == (0, p["torch"].release[1] + 15)
