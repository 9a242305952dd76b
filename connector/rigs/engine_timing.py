"""A measuring hook for bench scenario (i): the folder :data:`FOLDER` goes on an engine's ``PYTHONPATH``.

Why: scenario (i) compares the time vLLM's engine-core thread spends inside the scheduler-side connector's lookup
calls, per step, for ours and for upstream's connector. Ours exports it (``scheduler_blocked_seconds``); upstream's
does not. The same hook times both, so the two figures come from one measurement (ours' own figure is shown
beside it as a check). The folder holds only a ``sitecustomize`` (``engine_timing_hook/sitecustomize.py``), which
Python loads at start-up; it does nothing unless :data:`ENV` names a folder for its figures. It only measures:
each call runs unchanged, between two ``perf_counter`` reads. Not a package (nothing imports it): a checkout's
tool, like the bench.
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "engine_timing_hook"  # what goes on PYTHONPATH
ENV = "LOOKOUT_LOOKUP_TIMING"  # the folder the engine core writes <pid>.json to


def read_totals(folder: Path) -> dict[str, float]:
    """The hook's totals (steps, lookup_s, ...), summed over the files its processes wrote (the engine core's)."""
    out: dict[str, float] = {}
    for path in folder.glob("*.json"):
        try:
            for k, v in json.loads(path.read_text()).items():
                out[k] = out.get(k, 0.0) + v
        except (OSError, ValueError):
            continue
    return out


__all__ = ["ENV", "FOLDER", "read_totals"]
