"""The design card's layout installs under one import name, editable and as a wheel, with no stray top-level names."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, mooncake_lookout.connector.config as c, mooncake_lookout.metrics.catalogue as m;"
    "print(c.__file__); print(m.__file__);"
    "print(importlib.util.find_spec('connector'), importlib.util.find_spec('metrics'))"
)


def _probe(python: str, cwd: Path) -> list[str]:
    out = subprocess.run([python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_editable_install_imports_under_the_package_name(tmp_path: Path) -> None:
    connector_file, metrics_file, stray = _probe(sys.executable, tmp_path)
    assert Path(connector_file).resolve() == ROOT / "connector" / "config.py"
    assert Path(metrics_file).resolve() == ROOT / "metrics" / "catalogue.py"
    assert stray == "None None", "a top-level 'connector' or 'metrics' module is importable"


def test_wheel_install_imports_under_the_package_name(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("mooncake_lookout-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300,
                   capture_output=True)
    connector_file, metrics_file, stray = _probe(python, tmp_path)
    assert "site-packages/mooncake_lookout/connector/config.py" in connector_file
    assert "site-packages/mooncake_lookout/metrics/catalogue.py" in metrics_file
    assert stray == "None None"
    entry_points = subprocess.run(
        [python, "-c", "from importlib.metadata import entry_points as e;"
                       "print([x.value for x in e(group='vllm.general_plugins')]);"
                       "print([x.value for x in e(group='console_scripts') if x.name == 'mooncake-lookout'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    assert entry_points == ["['mooncake_lookout.connector.plugin:register']",
                            "['mooncake_lookout.connector.cli:main']"]
