"""The design card's layout installs under one import name, editable and as a wheel, with no stray top-level names;
the documented source installs (a built wheel, a git URL) work in a fresh venv without vLLM's dependency tree; the
wheel ships the license.

The fresh venvs install offline (``--no-index``) from ``.tools/wheels``, the wheels of this package's own
dependencies that ``scripts/setup.sh`` downloads: a requirement on vLLM (or anything outside that list) would make
the install fail, so a passing install shows the wheel pulls nothing of vLLM's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, mooncake_lookout.connector.config as c, mooncake_lookout.metrics.catalogue as m;"
    "print(c.__file__); print(m.__file__);"
    "print(importlib.util.find_spec('connector'), importlib.util.find_spec('metrics'))"
)
# SHA-256 of the Apache License 2.0 as the Apache Software Foundation publishes it (LICENSE-2.0.txt; Debian ships
# the same file as /usr/share/common-licenses/Apache-2.0).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
# What a dependency of vLLM's own would bring; none of these may land in a venv that installed only our wheel.
VLLM_TREE = ("vllm", "torch", "transformers", "xgrammar")


def _probe(python: str, cwd: Path) -> list[str]:
    out = subprocess.run([python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _dependency_wheels() -> Path:
    wheels = Path(os.environ.get("LOOKOUT_TOOLS", ROOT / ".tools")) / "wheels"
    assert any(wheels.glob("pyzmq-*.whl")), f"no dependency wheels in {wheels}: run bash scripts/setup.sh"
    return wheels


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout built into a wheel, as the README's source install does (``pip wheel --no-deps``)."""
    out = tmp_path_factory.mktemp("wheels")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT))
    (built,) = out.glob("mooncake_lookout-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv with nothing but pip."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    yield env_dir


def test_editable_install_imports_under_the_package_name(tmp_path: Path) -> None:
    connector_file, metrics_file, stray = _probe(sys.executable, tmp_path)
    assert Path(connector_file).resolve() == ROOT / "connector" / "config.py"
    assert Path(metrics_file).resolve() == ROOT / "metrics" / "catalogue.py"
    assert stray == "None None", "a top-level 'connector' or 'metrics' module is importable"


def test_license_is_the_apache_2_text_pyproject_declares() -> None:
    assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


def test_the_wheel_ships_the_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(license_name) == (ROOT / "LICENSE").read_bytes()
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    assert not any(line.startswith("Requires-Dist: vllm") and "extra ==" not in line for line in metadata.splitlines())


def test_wheel_installs_offline_with_its_own_dependencies_only_and_its_commands_run(wheel: Path,
                                                                                    fresh_venv: Path) -> None:
    """README's source install: ``pip install dist/mooncake_lookout-*.whl`` resolves our dependencies, not vLLM's."""
    python = str(fresh_venv / "bin" / "python")
    _run(python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(_dependency_wheels()), str(wheel))
    connector_file, metrics_file, stray = _probe(python, wheel.parent)
    assert "site-packages/mooncake_lookout/connector/config.py" in connector_file
    assert "site-packages/mooncake_lookout/metrics/catalogue.py" in metrics_file
    assert stray == "None None"
    installed = _run(python, "-m", "pip", "list", "--format=freeze").stdout.lower()
    assert not [name for name in VLLM_TREE if f"\n{name}==" in "\n" + installed], installed
    entry_points = _run(
        python, "-c", "from importlib.metadata import entry_points as e;"
                      "print([x.value for x in e(group='vllm.general_plugins')]);"
                      "print([x.value for x in e(group='console_scripts') if x.name == 'mooncake-lookout'])"
    ).stdout.splitlines()
    assert entry_points == ["['mooncake_lookout.connector.plugin:register']",
                            "['mooncake_lookout.connector.cli:main']"]
    command = str(fresh_venv / "bin" / "mooncake-lookout")
    assert _run(command, "--help").stdout.startswith("usage: mooncake-lookout")
    for sub in ("demo", "bench", "serve", "doctor", "advise"):
        assert _run(command, sub, "--help").stdout.startswith(f"usage: mooncake-lookout {sub}")


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the wheel installed (and its dependencies, offline)."""
    env_dir = tmp_path_factory.mktemp("wheel-venv")
    venv.create(env_dir, with_pip=True)
    _run(str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
         str(_dependency_wheels()), str(wheel))
    return env_dir


def test_size_answers_from_the_wheel_with_the_committed_runs_model(wheel_venv: Path, tmp_path: Path) -> None:
    """``size`` from an installed wheel, away from any checkout, answers with the model of the committed runs
    (docs/bench/run-N.json): the same figures as the checkout's ``size --runs docs/bench``."""
    argv = ["size", "--engines", "8", "--rate", "2", "--blocks", "64", "--workload", "multi-turn", "--json"]
    shipped = subprocess.run([str(wheel_venv / "bin" / "mooncake-lookout"), *argv], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    assert shipped.returncode == 0, shipped.stderr
    checkout = _run(str(Path(sys.executable).parent / "mooncake-lookout"), *argv, "--runs", str(ROOT / "docs/bench"))
    from_wheel, from_runs = json.loads(shipped.stdout), json.loads(checkout.stdout)
    assert from_wheel["model"] == from_runs["model"] and from_wheel["loads"] == from_runs["loads"]
    assert from_wheel["sources"] == [str(Path(s).relative_to(ROOT)) for s in from_runs["sources"]]


def test_git_url_install_builds_and_runs(fresh_venv: Path, tmp_path: Path) -> None:
    """README's ``pip install git+https://.../mooncake-lookout@TAG``: pip's git path, here on this checkout's own
    repository (``git+file://``: what is committed, cloned and built by pip), offline."""
    python = str(fresh_venv / "bin" / "python")
    wheels = str(_dependency_wheels())
    _run(python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels, "setuptools>=77", "wheel")
    _run(python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels, "--no-build-isolation",
         "--force-reinstall", f"git+file://{ROOT}")
    direct = next((fresh_venv / "lib").glob("python*/site-packages/mooncake_lookout-*.dist-info/direct_url.json"))
    assert json.loads(direct.read_text())["vcs_info"]["vcs"] == "git"
    command = str(fresh_venv / "bin" / "mooncake-lookout")
    assert _run(command, "serve", "--help").stdout.startswith("usage: mooncake-lookout serve")
