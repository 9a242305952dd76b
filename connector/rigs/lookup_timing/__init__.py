"""A measuring hook for bench scenario (i): put this folder on an engine's ``PYTHONPATH`` (its ``sitecustomize``).

Why: scenario (i) compares the time vLLM's engine-core thread spends inside the scheduler-side connector's lookup
calls, per step, for ours and for upstream's connector. Ours exports it (``scheduler_blocked_seconds``); upstream's
does not. The same hook times both, so the two figures come from one measurement (ours' own figure is shown
beside it as a check). It only measures: each call runs unchanged, between two ``perf_counter`` reads.
"""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent  # what goes on PYTHONPATH
ENV = "LOOKOUT_LOOKUP_TIMING"  # the folder the engine core writes <pid>.json to

__all__ = ["ENV", "FOLDER"]
