"""Engine venv only, bench scenario (i) only: time the connector's lookup calls on vLLM's engine-core thread.

Loaded by Python at start-up when this folder is on ``PYTHONPATH`` and ``LOOKOUT_LOOKUP_TIMING`` names a folder.
When vLLM's V1 scheduler module is imported, its ``Scheduler.__init__`` is wrapped: once built, the scheduler's
connector has its ``get_num_new_matched_tokens`` and ``on_new_request`` (the lookup calls: ask, and start at
admission) timed, and ``schedule`` counted. Calls on the thread that runs ``schedule`` add to ``lookup_s``;
calls on any other thread (none expected) to ``off_thread_s``. A daemon thread writes the totals to
``<folder>/<pid>.json`` every 0.2 s. Nothing is changed: each call runs as it would, its result returned.
"""

import importlib.abc
import json
import os
import sys
import threading
import time

_FOLDER = os.environ.get("LOOKOUT_LOOKUP_TIMING")
_TARGET = "vllm.v1.core.sched.scheduler"
_TOTALS = {"steps": 0, "lookup_s": 0.0, "lookup_calls": 0, "off_thread_s": 0.0, "off_thread_calls": 0}
_STATE = {"thread": None}


def _timed(call):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            if threading.get_ident() == _STATE["thread"]:
                _TOTALS["lookup_s"] += spent
                _TOTALS["lookup_calls"] += 1
            else:
                _TOTALS["off_thread_s"] += spent
                _TOTALS["off_thread_calls"] += 1
    return wrapper


def _writer():
    path = os.path.join(_FOLDER, f"{os.getpid()}.json")
    while True:
        time.sleep(0.2)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_TOTALS, f)
        os.replace(tmp, path)


def _patch(module):
    cls = module.Scheduler
    init, schedule = cls.__init__, cls.schedule

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _STATE["thread"] = threading.get_ident()  # the engine core builds its scheduler on the thread that runs it
        connector = getattr(self, "connector", None)
        if connector is not None:
            for name in ("get_num_new_matched_tokens", "on_new_request"):
                if hasattr(connector, name):
                    setattr(connector, name, _timed(getattr(connector, name)))
        threading.Thread(target=_writer, daemon=True, name="lookout-lookup-timing").start()

    def patched_schedule(self, *args, **kwargs):
        _STATE["thread"] = threading.get_ident()
        _TOTALS["steps"] += 1
        return schedule(self, *args, **kwargs)

    cls.__init__, cls.schedule = patched_init, patched_schedule


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if _FOLDER:
    sys.meta_path.insert(0, _Finder())
