"""The set-up's prerequisite step (``scripts/prereqs.sh``) in a clean Debian root, as on a stock image.

A fresh Debian root is built with debootstrap (minbase plus ``python3``: a Debian image with Python, without
``python3-venv`` or ``npm``) on a tmpfs in a mount namespace of its own (``unshare --mount``: the root and its
/proc and /dev mounts vanish with the namespace), and the prerequisite step runs inside it through ``chroot``.
In that root the step

* names what is missing with ``--dry-run`` (``python3-venv`` and ``npm`` among them) and installs nothing;
* refuses to install as a non-root user, naming the command to run as root;
* installs them as root with apt, after which ``python3 -m venv`` gives a venv with pip and ``npm`` runs, which
  is what ``scripts/setup.sh`` goes on to use;
* finds nothing left to install on a second run.

What this does not show: the rest of the set-up in that root (the venv's ~2 GB of vLLM's CPU recipe, helm), which
the rest of the suite exercises on this machine. It needs root (chroot, mounts) and the Debian mirror over the
network (``LOOKOUT_DEBIAN_MIRROR``, default deb.debian.org); the suite is ``LOOKOUT_CLEAN_ROOT_SUITE`` (default
trixie, the release whose image the issue names). Downloaded packages are kept in ``.tools/debcache`` (debootstrap's
``--cache-dir``, and apt's archive folder inside the root is that folder), so a second run downloads nothing; what
is installed and configured is done afresh each time.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = os.environ.get("LOOKOUT_CLEAN_ROOT_SUITE", "trixie")
MIRROR = os.environ.get("LOOKOUT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE = Path(os.environ.get("LOOKOUT_TOOLS", ROOT / ".tools")).resolve() / "debcache" / SUITE


# Runs as root in a mount namespace of its own: the clean root lives on a tmpfs there (no disk writes, nothing to
# delete: the namespace and its mounts end with this script), built by debootstrap, then each phase runs in it
# through chroot with a clean environment. Each phase's stdout, stderr and exit code go to files in $OUT.
SCRIPT = r"""
set -u
R=$1 OUT=$2 CACHE=$3 SUITE=$4 MIRROR=$5 STEP=$6
mount -t tmpfs -o size=6g,mode=0755 lookout-clean-root "$R" || exit 3
timeout 900 debootstrap --variant=minbase --include=python3 --cache-dir="$CACHE" "$SUITE" "$R" "$MIRROR" \
  >"$OUT/debootstrap.out" 2>&1
echo $? >"$OUT/debootstrap.rc"
[ "$(cat "$OUT/debootstrap.rc")" = 0 ] || exit 0
cp /etc/resolv.conf "$R/etc/resolv.conf"               # apt inside reaches the mirror
mkdir -p "$R/opt/lookout" && cp "$STEP" "$R/opt/lookout/prereqs.sh"
mount -t proc proc "$R/proc" && mount --rbind /dev "$R/dev" && mount --bind "$CACHE" "$R/var/cache/apt/archives" \
  || exit 4
phase() {  # name, user ('' = root), seconds, command
  timeout "$3" chroot ${2:+--userspec=$2} "$R" \
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive sh -c "$4" >"$OUT/$1.out" 2>"$OUT/$1.err"
  echo $? >"$OUT/$1.rc"
}
step="bash /opt/lookout/prereqs.sh"
phase image '' 60 "python3 -V; python3 -c 'import ensurepip' && echo ensurepip; command -v npm || echo no-npm"
phase dry_run '' 60 "$step --dry-run"
phase not_root 65534:65534 60 "$step"
phase npm_after_not_root '' 60 "command -v npm || echo no-npm"
phase install '' 900 "$step"
phase use '' 300 "python3 -m venv /tmp/v && /tmp/v/bin/python -m pip --version && npm --version"
phase second_dry_run '' 120 "$step --dry-run"
"""
PHASES = ("image", "dry_run", "not_root", "npm_after_not_root", "install", "use", "second_dry_run")


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory, require_tool: Any) -> dict[str, subprocess.CompletedProcess]:
    """Build the clean root and run the prerequisite step in it, phase by phase; every phase's result by name."""
    assert os.getuid() == 0, "this test builds a Debian root and chroots into it: run it as root (CI does)"
    for tool in ("debootstrap", "unshare", "chroot", "mount", "timeout"):
        require_tool(tool)
    work = tmp_path_factory.mktemp("clean-root")
    root, out = work / "root", work / "out"
    root.mkdir()
    out.mkdir()
    (CACHE / "partial").mkdir(parents=True, exist_ok=True)
    namespace = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child"]
    args = [str(root), str(out), str(CACHE), SUITE, MIRROR, str(ROOT / "scripts" / "prereqs.sh")]
    done = subprocess.run([*namespace, "bash", "-c", SCRIPT, "bash", *args], capture_output=True, text=True,
                          timeout=1700)
    assert done.returncode == 0, f"the clean-root script failed ({done.returncode}): {done.stderr[-2000:]}"
    built = (out / "debootstrap.rc").read_text().strip()
    assert built == "0", f"debootstrap {SUITE} failed:\n{(out / 'debootstrap.out').read_text()[-3000:]}"
    assert not any(root.iterdir()), "the clean root's tmpfs outlived its namespace"
    return {name: subprocess.CompletedProcess(name, int((out / f"{name}.rc").read_text()),
                                              (out / f"{name}.out").read_text(), (out / f"{name}.err").read_text())
            for name in PHASES}


@pytest.mark.timeout(1800)
def test_the_clean_root_is_a_debian_python_image_without_venv_or_npm(phases: dict[str, Any]) -> None:
    image = phases["image"]
    assert image.returncode == 0, image.stderr
    assert image.stdout.startswith("Python 3.")
    assert "ensurepip" not in image.stdout and "no-npm" in image.stdout


@pytest.mark.timeout(1800)
def test_the_dry_run_prints_the_apt_command_with_python3_venv_and_npm(phases: dict[str, Any]) -> None:
    dry = phases["dry_run"]
    assert dry.returncode == 0, dry.stderr
    (line,) = dry.stdout.splitlines()
    assert line.startswith("apt-get update && apt-get install -y --no-install-recommends ")
    packages = line.split("--no-install-recommends ", 1)[1].split()
    assert {"python3-venv", "npm", "libibverbs1"} <= set(packages), packages


@pytest.mark.timeout(1800)
def test_a_non_root_user_is_told_the_command_and_nothing_is_installed(phases: dict[str, Any]) -> None:
    refused = phases["not_root"]
    assert refused.returncode == 1
    assert "Run the set-up as root" in refused.stderr and "python3-venv" in refused.stderr
    assert "apt-get install -y --no-install-recommends" in refused.stderr
    assert "no-npm" in phases["npm_after_not_root"].stdout


@pytest.mark.timeout(1800)
def test_as_root_it_installs_them_and_the_set_up_can_make_its_venv_and_run_npm(phases: dict[str, Any]) -> None:
    install = phases["install"]
    assert install.returncode == 0, install.stderr[-3000:]
    assert "[setup] apt:" in install.stderr
    use = phases["use"]
    assert use.returncode == 0, use.stderr[-3000:]
    pip_line, npm_line = use.stdout.splitlines()[-2:]
    assert pip_line.startswith("pip ") and "/tmp/v/" in pip_line
    assert npm_line.split(".")[0].isdigit()


@pytest.mark.timeout(1800)
def test_a_second_run_has_nothing_to_install(phases: dict[str, Any]) -> None:
    again = phases["second_dry_run"]
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "nothing to install"
