"""Where and what a measurement ran on: recorded in ``bench.json`` and the soak's JSON, printed beside their figures.

Why: the docs' measured figures are generated from committed runs; a figure means little without the load
on the machine (other work on the cores shows up in every latency), the date, the code measured and the
versions of vLLM and Mooncake.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.rigs.cpu import CLOCK_TICKS

VERSIONED = ("vllm", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-lookout")
CHECKOUT = Path(__file__).resolve().parents[2]  # the repository (an editable install imports from it)
DIRTY = "+dirty"  # a commit's mark when tracked files had local changes: the code measured is not that commit's


def machine() -> dict[str, Any]:
    """The machine and the code at the start of a run; add ``loadavg_at_end`` (:func:`load_average`) at its end."""
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "loadavg_at_start": load_average(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "versions": versions(), "commit": commit()}


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return list(os.getloadavg())


def cpu_stolen_s(stat: str = "/proc/stat") -> float | None:
    """CPU seconds the hypervisor has given to others while this VM's vCPUs wanted to run, all vCPUs together
    (Linux's ``steal``); None where the kernel does not say.

    Why: on a shared host a scenario can lose CPU in bursts that the load average does not show; a figure
    measured while much was stolen is the host's, not the code's.
    """
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / CLOCK_TICKS


def versions() -> dict[str, str]:
    """The installed versions of the packages a figure depends on (those installed)."""
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def commit(root: Path = CHECKOUT) -> str | None:
    """The checkout's commit (``+dirty`` with local changes to tracked files), or None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (DIRTY if dirty.returncode == 0 and dirty.stdout.strip() else "")


__all__ = ["DIRTY", "VERSIONED", "commit", "cpu_stolen_s", "load_average", "machine", "versions"]
