"""The set-up's prerequisite step (``scripts/prereqs.sh``) in a clean Debian root, as on a stock image, offline.

The set-up (``scripts/clean-root.sh``, a step of ``scripts/setup.sh``) downloads, once, everything this needs: a
clean Debian root (debootstrap minbase plus ``python3``: a Debian image with Python, without ``python3-venv`` or
``npm``; package lists and downloaded .debs cleared, as a stock image ships) packed as a tarball, and a local apt
repository of the .deb files ``prereqs.sh`` installs in that root, resolved by apt in that root, indexed by
apt-ftparchive. Here the root is unpacked on a tmpfs in namespaces of its own (``unshare --mount --net --pid``:
the root and its mounts vanish with them), its apt sources are replaced by that repository alone
(``deb [trusted=yes] file:...``, mounted read-only), and the prerequisite step runs inside it through ``chroot``.
In that root

* the network has no interface but loopback (down) and no route out (read from ``/proc/net``), and ``apt-get
  update`` against the mirror the image names fails even with this machine's resolver configured (for that check
  only): any download would fail, so a pass shows nothing was fetched;

and the step

* names what is missing with ``--dry-run`` (``python3-venv`` and ``npm`` among them) and installs nothing;
  with ``--demo`` (what ``scripts/demo.sh`` runs) it names only what the demo needs: ``python3-venv`` and
  ``libibverbs1``, none of the test tools;
* refuses to install as a non-root user, naming the command to run as root;
* installs them as root with ``apt-get update`` and ``apt-get install``, as on a real machine, the local
  repository in the mirror's place; after it ``python3 -m venv`` gives a venv with pip and ``npm`` runs, which is
  what ``scripts/setup.sh`` goes on to use, and apt knows no source but the local one;
* finds nothing left to install on a second run.

What this does not show: the rest of the set-up in that root (the venv's ~2 GB of vLLM's CPU recipe, helm), which
the rest of the suite exercises on this machine, nor the mirror's side of apt (the set-up's download shows it
works). It needs root (chroot, mounts, namespaces). Without the set-up's download, or with one older than
``prereqs.sh``, every test here fails naming the command to run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "clean-root.sh"
LOCAL_SOURCE = "deb [trusted=yes] file:/opt/lookout/repo ./"


# Runs as root in mount, network and pid namespaces of their own: the clean root lives on a tmpfs there (no disk
# writes, nothing to delete: the namespaces and their mounts end with this script), unpacked from the set-up's
# tarball, then each phase runs in it through chroot with a clean environment. Each phase's stdout, stderr and exit
# code go to files in $OUT.
SCRIPT = r"""
set -u
R=$1 OUT=$2 CACHE=$3 STEP=$4 SOURCE=$5
mount -t tmpfs -o size=4g,mode=0755 lookout-clean-root "$R" || exit 3
tar -C "$R" --numeric-owner -xzpf "$CACHE/root.tar.gz" >"$OUT/unpack.out" 2>&1
echo $? >"$OUT/unpack.rc"
[ "$(cat "$OUT/unpack.rc")" = 0 ] || exit 0
mkdir -p "$R/opt/lookout/repo" && cp "$STEP" "$R/opt/lookout/prereqs.sh"
mount -t proc proc "$R/proc" && mount --rbind /dev "$R/dev" && mount --bind "$CACHE/repo" "$R/opt/lookout/repo" \
  && mount -o remount,bind,ro "$R/opt/lookout/repo" || exit 4
phase() {  # name, user ('' = root), seconds, command
  timeout "$3" chroot ${2:+--userspec=$2} "$R" \
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive sh -c "$4" >"$OUT/$1.out" 2>"$OUT/$1.err"
  echo $? >"$OUT/$1.rc"
}
step="bash /opt/lookout/prereqs.sh"
phase network '' 30 "for f in dev route ipv6_route; do echo \"== \$f\"; cat /proc/net/\$f 2>/dev/null; done"
# The control: apt with the image's own sources and this machine's resolver, so that only the namespace stops it.
cp /etc/resolv.conf "$R/etc/resolv.conf"
phase mirror '' 60 "grep -c ^nameserver /etc/resolv.conf; apt-get -o Acquire::Retries=0 update; ls /var/lib/apt/lists"
rm -f "$R/etc/resolv.conf" "$R/etc/apt/sources.list" "$R"/etc/apt/sources.list.d/*  # the local source alone
echo "$SOURCE" >"$R/etc/apt/sources.list.d/lookout-local.list"
phase image '' 60 "python3 -V; python3 -c 'import ensurepip' && echo ensurepip; command -v npm || echo no-npm"
phase dry_run '' 60 "$step --dry-run"
phase demo_dry_run '' 60 "$step --demo --dry-run"
phase not_root 65534:65534 60 "$step"
phase npm_after_not_root '' 60 "command -v npm || echo no-npm"
phase install '' 300 "$step"
phase sources '' 60 "apt-cache policy"
phase use '' 120 "python3 -m venv /tmp/v && /tmp/v/bin/python -m pip --version && npm --version"
phase second_dry_run '' 60 "$step --dry-run"
"""
PHASES = ("network", "mirror", "image", "dry_run", "demo_dry_run", "not_root", "npm_after_not_root", "install",
          "sources", "use", "second_dry_run")


class Phases:
    """Every phase's result by name; without the set-up's download, the line that says what to run instead, with
    which each test that asks for a phase fails (a failure of the test, not an error of the fixture, nor a skip)."""

    def __init__(self, results: dict[str, subprocess.CompletedProcess], missing: str = "") -> None:
        self.results, self.missing = results, missing

    def __getitem__(self, name: str) -> subprocess.CompletedProcess:
        if self.missing:
            pytest.fail(self.missing, pytrace=False)
        return self.results[name]


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory, require_tool: Any) -> Phases:
    """Unpack the clean root and run the prerequisite step in it, phase by phase."""
    assert os.getuid() == 0, "this test unpacks a Debian root and chroots into it: run it as root (CI does)"
    for tool in ("unshare", "chroot", "mount", "tar", "timeout"):
        require_tool(tool)
    check = subprocess.run(["bash", str(BUILD), "--check"], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        return Phases({}, missing=check.stdout.strip() or check.stderr.strip())
    cache = subprocess.run(["bash", str(BUILD), "--path"], capture_output=True, text=True, timeout=60,
                           check=True).stdout.strip()
    work = tmp_path_factory.mktemp("clean-root")
    root, out = work / "root", work / "out"
    root.mkdir()
    out.mkdir()
    namespace = ["unshare", "--mount", "--propagation", "private", "--net", "--pid", "--fork", "--kill-child"]
    args = [str(root), str(out), cache, str(ROOT / "scripts" / "prereqs.sh"), LOCAL_SOURCE]
    done = subprocess.run([*namespace, "bash", "-c", SCRIPT, "bash", *args], capture_output=True, text=True,
                          timeout=1000)
    assert done.returncode == 0, f"the clean-root script failed ({done.returncode}): {done.stderr[-2000:]}"
    unpacked = (out / "unpack.rc").read_text().strip()
    assert unpacked == "0", f"unpacking {cache}/root.tar.gz failed:\n{(out / 'unpack.out').read_text()[-3000:]}"
    assert not any(root.iterdir()), "the clean root's tmpfs outlived its namespace"
    return Phases({name: subprocess.CompletedProcess(name, int((out / f"{name}.rc").read_text()),
                                                     (out / f"{name}.out").read_text(),
                                                     (out / f"{name}.err").read_text())
                   for name in PHASES})


def proc_net(text: str) -> dict[str, list[str]]:
    """The network phase's output by file: ``== dev``, ``== route``, ``== ipv6_route`` each open a section."""
    sections: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("== "):
            sections[line[3:]] = []
        elif line.strip():
            sections[next(reversed(sections))].append(line)
    return sections


@pytest.mark.timeout(1100)
def test_the_root_runs_with_loopback_only_and_no_route_out(phases: Phases) -> None:
    network = proc_net(phases["network"].stdout)
    interfaces = [line.split(":")[0].strip() for line in network["dev"][2:]]  # two header lines
    assert interfaces == ["lo"], network
    assert network["route"][1:] == [], network  # no IPv4 route (the file's one header line only)
    # IPv6: only the kernel's null entries, which reject (RTF_REJECT, 0x0200 in the flags field): no way out.
    assert all(int(line.split()[8], 16) & 0x0200 for line in network["ipv6_route"]), network


@pytest.mark.timeout(1100)
def test_the_mirror_the_image_names_cannot_be_reached(phases: Phases) -> None:
    mirror = phases["mirror"]
    assert int(mirror.stdout.split()[0]) >= 1, mirror  # a resolver was configured: the namespace stopped apt
    assert "Failed to fetch" in mirror.stdout + mirror.stderr, mirror
    assert not [name for name in mirror.stdout.split() if name.endswith("_Packages")], mirror.stdout


@pytest.mark.timeout(1100)
def test_the_clean_root_is_a_debian_python_image_without_venv_or_npm(phases: Phases) -> None:
    image = phases["image"]
    assert image.returncode == 0, image.stderr
    assert image.stdout.startswith("Python 3.")
    assert "ensurepip" not in image.stdout and "no-npm" in image.stdout


@pytest.mark.timeout(1100)
def test_the_dry_run_prints_the_apt_command_with_python3_venv_and_npm(phases: Phases) -> None:
    dry = phases["dry_run"]
    assert dry.returncode == 0, dry.stderr
    (line,) = dry.stdout.splitlines()
    assert line.startswith("apt-get update && apt-get install -y --no-install-recommends ")
    packages = line.split("--no-install-recommends ", 1)[1].split()
    assert {"python3-venv", "npm", "libibverbs1"} <= set(packages), packages


@pytest.mark.timeout(1100)
def test_the_demos_dry_run_names_only_what_the_demo_needs(phases: Phases) -> None:
    dry = phases["demo_dry_run"]
    assert dry.returncode == 0, dry.stderr
    (line,) = dry.stdout.splitlines()
    assert line == "apt-get update && apt-get install -y --no-install-recommends python3-venv libibverbs1", line


@pytest.mark.timeout(1100)
def test_a_non_root_user_is_told_the_command_and_nothing_is_installed(phases: Phases) -> None:
    refused = phases["not_root"]
    assert refused.returncode == 1
    assert "Run the set-up as root" in refused.stderr and "python3-venv" in refused.stderr
    assert "apt-get install -y --no-install-recommends" in refused.stderr
    assert "no-npm" in phases["npm_after_not_root"].stdout


@pytest.mark.timeout(1100)
def test_as_root_it_installs_them_and_the_set_up_can_make_its_venv_and_run_npm(phases: Phases) -> None:
    install = phases["install"]
    assert install.returncode == 0, install.stderr[-3000:]
    assert "[setup] apt:" in install.stderr
    use = phases["use"]
    assert use.returncode == 0, use.stderr[-3000:]
    pip_line, npm_line = use.stdout.splitlines()[-2:]
    assert pip_line.startswith("pip ") and "/tmp/v/" in pip_line
    assert npm_line.split(".")[0].isdigit()


@pytest.mark.timeout(1100)
def test_apt_installed_from_the_local_repository_alone(phases: Phases) -> None:
    policy = phases["sources"]
    assert policy.returncode == 0, policy.stderr
    # "apt-cache policy" lists each package index apt uses as "PRIORITY URI SUITE/COMPONENT ARCH Packages".
    indexes = [line.split()[1] for line in policy.stdout.splitlines() if line.rstrip().endswith(" Packages")]
    assert indexes and all(uri.startswith("file:/opt/lookout/repo") for uri in indexes), policy.stdout


@pytest.mark.timeout(1100)
def test_a_second_run_has_nothing_to_install(phases: Phases) -> None:
    again = phases["second_dry_run"]
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "nothing to install"
