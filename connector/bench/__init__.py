"""``mooncake-lookout bench``: upstream's lookup path against ours, in one process, on one real master.

* :mod:`.run`: :func:`~.run.run_bench` runs every scenario and writes ``bench.json``, ``bench.txt`` and
  the figures; :func:`~.run.targets` judges each target, :func:`~.run.format_report` prints them;
* :mod:`.rig`: :class:`~.rig.Rig`, a real master, a filled index, both lookup servers in a child process
  and the floor's child process;
* one module per scenario: the floors :mod:`.floors`, (a) :mod:`.call`, (a4) :mod:`.per_step`, (b)
  :mod:`.burst`, (c) :mod:`.sched`, (d) :mod:`.overhead`, (e) :mod:`.fault`, (f) :mod:`.long_prompts`,
  (g) :mod:`.multi_turn` (over the conversations of :mod:`.conversations`); :mod:`.plots` draws the figures;
* :mod:`.remote`: ``bench --master`` / ``--server``, read-only figures of a user's own store or server.

The demo (``mooncake-lookout demo``) stands on the same rig and scenario (c), with either workload.
Modules are imported on use: the scenarios pull in vLLM and matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"FULL": "run", "QUICK": "run", "Rig": "rig", "format_report": "run", "run_bench": "run", "targets": "run"}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562), so importing the package stays cheap."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
