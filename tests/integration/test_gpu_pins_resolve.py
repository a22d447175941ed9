"""The GPU environment's pins (launch/gpu-constraints.txt) resolve from the package index together with the project's
requirements ([sglang,dev] and Transformer Engine's torch extension's), for this interpreter on Linux x86_64:
`pip install --dry-run --report` reads package metadata only (HTTP range requests into the wheels), so nothing of
the ~4 GB of CUDA wheels is downloaded (30-90 s on the CI box, by its load). The source-only
transformer-engine-torch cannot take part in a resolve without building: its requirements stand in for it, and
the index must list its pinned version. Skipped, naming why, without a reachable index."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                 reason="the pinned CUDA wheels are for Linux x86_64"),
              pytest.mark.skipif(sys.version_info < (3, 11), reason="sglang 0.5.23 needs Python >= 3.11")]

REPO = Path(__file__).resolve().parents[2]
PINS = REPO / "launch" / "gpu-constraints.txt"
SOURCE_ONLY = {"transformer-engine-torch"}
# transformer-engine-torch's runtime requirements (its sdist's build_tools/pytorch.py: install_requirements), which
# its build adds; the core library it also requires is pinned.
TE_TORCH_REQUIREMENTS = ["einops", "onnxscript", "onnx", "packaging", "pydantic", "nvdlfw-inspect",
                         "nvidia-cudnn-frontend>=1.29.0"]
# pip reads a wheel's metadata without downloading it from 25.3 on (fast-deps: range requests; older releases
# download every wheel in --dry-run where the index serves no separate metadata file).
PIP_FOR_RESOLVE = "26.3"
UNREACHABLE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                         r"Name or service not known|Connection (refused|reset)|timed out|Network is unreachable|"
                         r"Could not fetch URL|ProxyError|SSLError")


def _env() -> dict[str, str]:
    # The machine's own pip constraints (a site-wide constraints file) are no part of what is checked.
    return {**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_DEFAULT_TIMEOUT": "30"}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _skip_if_unreachable(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0 and UNREACHABLE.search(result.stderr):
        line = next(line for line in result.stderr.splitlines() if UNREACHABLE.search(line))
        pytest.skip(f"no package index reachable ({what}): {line.strip()[:240]}")


@pytest.fixture(scope="module")
def pip(tmp_path_factory) -> list[str]:
    """A pip command that resolves from metadata: this interpreter's pip when new enough, else pip PIP_FOR_RESOLVE
    run from its wheel (downloaded, ~2 MB)."""
    if Version(importlib.metadata.version("pip")) >= Version("25.3"):
        return [sys.executable, "-m", "pip"]
    folder = tmp_path_factory.mktemp("pip")
    got = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder),
                f"pip=={PIP_FOR_RESOLVE}"], timeout=120)
    _skip_if_unreachable(got, f"downloading pip {PIP_FOR_RESOLVE}")
    assert got.returncode == 0, got.stderr[-2000:]
    (wheel,) = folder.glob("pip-*.whl")
    return [sys.executable, str(wheel / "pip")]


def _pins() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in PINS.read_text().splitlines()]
    return {canonicalize_name(Requirement(line).name): line.split("==")[1] for line in lines if line}


def _project_requirements() -> list[str]:
    """setup.py's install_requires and its sglang and dev extras (setup_env.sh --gpu installs [sglang,dev])."""
    found = []
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            found += ast.literal_eval(node.value)
        elif isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
            found += extras["sglang"] + extras["dev"]
    return found


def test_the_pinned_gpu_set_resolves_with_the_projects_requirements(pip, tmp_path):
    report = tmp_path / "report.json"
    wheels = [name for name in _pins() if name not in SOURCE_ONLY]
    result = _run([*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--use-feature=fast-deps",
                   "--report", str(report), "-c", str(PINS), *wheels, *TE_TORCH_REQUIREMENTS,
                   *_project_requirements()], timeout=540)
    _skip_if_unreachable(result, "resolving")
    assert result.returncode == 0, result.stderr[-3000:]
    installed = {canonicalize_name(item["metadata"]["name"]): item["metadata"]
                 for item in json.loads(report.read_text())["install"]}
    assert {name: Version(installed[name]["version"]) for name in wheels} == {name: Version(_pins()[name])
                                                                             for name in wheels}
    # The CUDA major of torch's wheels (its cuda-toolkit requirement) is the one the pinned CUDA packages name.
    torch_needs = [Requirement(r) for r in installed["torch"].get("requires_dist", [])]
    (toolkit,) = [r for r in torch_needs if r.name == "cuda-toolkit"]
    cuda_major = str(next(iter(toolkit.specifier)).version).split(".")[0]
    assert {re.search(r"-cu(\d+)$", name).group(1) for name in _pins() if re.search(r"-cu\d+$", name)} == {cuda_major}
    # sglang's own torch pin is the pinned torch (the resolve would fail otherwise; this names it).
    sglang_torch = [str(r.specifier) for r in map(Requirement, installed["sglang"]["requires_dist"])
                    if r.name == "torch" and not r.marker]
    assert sglang_torch == [f"=={_pins()['torch']}"]


@pytest.mark.parametrize("name", sorted(SOURCE_ONLY))
def test_the_index_lists_the_pinned_source_only_package(pip, name):
    result = _run([*pip, "index", "versions", name], timeout=120)
    _skip_if_unreachable(result, f"listing {name}")
    assert result.returncode == 0, result.stderr[-2000:]
    listed = re.search(r"Available versions: (.*)", result.stdout).group(1).split(", ")
    assert _pins()[name] in listed
