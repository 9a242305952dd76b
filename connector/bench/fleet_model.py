"""The sizing model: how much of a Mooncake master's CPU a fleet's lookups take, ours vs upstream's.

Why: a master serves every engine of a deployment; what one lookup costs it is known from scenario (h), where
the master's own CPU was read from ``/proc`` with the engines' and servers' CPU kept out. The model is the
simplest that fits those measurements:

* a lookup costs the master ``calls x per_call + keys x per_key`` of CPU, where ``calls`` and ``keys`` are the
  store calls and keys per lookup its own counters showed;
* each workload and client's figures per lookup (master CPU, keys, calls) are the mean over (h)'s fleets of
  more than one engine but :data:`CHECK_N`, each size weighing the same. One engine's lookups leave the master
  idle between calls, and each call wakes it: it cost up to half again as much per lookup, a load too small to
  size for. Between the larger fleets the cost per lookup moved by up to a fifth (on the bench's 2-core machine
  the fleet's own processes compete with the master for the cores);
* ``per_key`` is one figure: where the two clients of a workload make the same store calls per lookup and ask
  very different numbers of keys (multi-turn: one call a lookup each, over 2,000 keys against a few hundred),
  the difference of their costs over the difference of their keys (:func:`key_cost`); each workload and
  client then keeps its own ``per_call``, what is left of its cost per lookup once its keys are paid, divided
  by its calls. What a call costs depends on how the calls come: one that finds the master's threads asleep
  wakes them, so a lone call costs more than one of a burst (vLLM's client sends a step's lookups one by one,
  our server a step's lookups in one call);
* keys per lookup grow with the prompt: each workload and client keeps the share of a prompt's blocks it asked
  (``keys per block``) and its store calls per lookup (ours answers the lookups a step sends together with one
  call);
* the load adds up over engines: ``engines x rate x cost per lookup``. The check (:func:`check_against`): the
  model's answer for the bench's own setting at N = :data:`CHECK_N` engines, a fleet size it was not fitted
  to, against what the master used there.

Several committed runs give one model: the median of each figure over the runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

CLIENTS = ("upstream", "ours")
CHECK_N = 4  # the fleet size the model is checked against


@dataclass(frozen=True)
class Shape:
    """How one client asks the master for one workload: keys per block of the prompt, store calls per lookup, and
    what one of its calls costs the master (microseconds of its CPU)."""

    keys_per_block: float
    calls_per_lookup: float
    per_call_us: float


@dataclass(frozen=True)
class Model:
    """The master's cost per key (microseconds of its CPU; and the one fitted per call, for traffic of no known
    workload), each (workload, client)'s shape, and the bench's setting for each workload (blocks per prompt,
    rate and burst per engine)."""

    per_call_us: float
    per_key_us: float
    shapes: dict[str, dict[str, Shape]]
    settings: dict[str, dict[str, float]]
    runs: int

    def per_lookup_us(self, workload: str, client: str, blocks: float) -> float:
        """The master's CPU for one lookup of a prompt of ``blocks`` blocks."""
        shape = self.shapes[workload][client]
        return shape.calls_per_lookup * shape.per_call_us + shape.keys_per_block * blocks * self.per_key_us

    def as_dict(self) -> dict[str, Any]:
        """The model, for JSON."""
        return {"per_call_us": self.per_call_us, "per_key_us": self.per_key_us, "runs": self.runs,
                "shapes": {w: {c: asdict(s) for c, s in by.items()} for w, by in self.shapes.items()},
                "settings": self.settings}


@dataclass(frozen=True)
class Load:
    """What a fleet's lookups ask of the master, for one client: per second, and the master's CPU for them."""

    client: str
    lookups_per_s: float
    calls_per_s: float
    keys_per_s: float
    master_cores: float  # CPU seconds a second
    per_lookup_us: float

    def engines_per_core(self, engines: int) -> float | None:
        """Engines like these that one core of the master serves, for their lookups alone."""
        return engines / self.master_cores if self.master_cores > 0 else None


def fit(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(per_call, per_key)`` minimising the relative error of ``calls x per_call + keys x per_key`` against the
    measured cost, over ``(calls, keys, measured)`` points (no intercept: a lookup with no call costs nothing)."""
    rows = [(c / m, k / m) for c, k, m in points if m > 0]
    if len(rows) < 2:
        raise ValueError(f"the model needs at least two measured (calls, keys, cost) points, got {len(rows)}")
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-18:
        raise ValueError("the measured points cannot separate the cost of a call from the cost of a key")
    return (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det


def fitted_phases(h: dict[str, Any]) -> list[dict[str, Any]]:
    """The phases the model is fitted to: every fleet size but the smallest and :data:`CHECK_N` (fewer exclusions
    when that would leave none)."""
    usable = [p for p in h["phases"] if p["lookups"] and p["master"]["per_1000_ms"] is not None]
    smallest = min((p["n"] for p in usable), default=0)
    return ([p for p in usable if p["n"] not in (smallest, CHECK_N)] or [p for p in usable if p["n"] != CHECK_N]
            or usable)


def _blocks(h: dict[str, Any], workload: str) -> float:
    w = next(x for x in h["workloads"] if x["kind"] == workload)
    return float(w.get("mean_blocks", w.get("prompt_blocks", 0)))


def _means(phases: list[dict[str, Any]]) -> tuple[float, float, float]:
    """``(calls, keys, cost in us)`` per lookup, the mean over the phases (one a fleet size)."""
    m = [p["master"] for p in phases]
    return (statistics.fmean(x["calls_per_lookup"] for x in m), statistics.fmean(x["keys_per_lookup"] for x in m),
            statistics.fmean(x["per_1000_ms"] for x in m))  # ms per 1,000 lookups = us per lookup


def key_cost(means: dict[tuple[str, str], tuple[float, float, float]]) -> float | None:
    """The master's CPU per key from the workload whose two clients make the same store calls per lookup (within
    10%) and ask the most different numbers of keys: the difference of their costs over that of their keys."""
    best: tuple[float, float] | None = None  # (keys apart, cost per key)
    for workload in {w for w, _ in means}:
        if not all((workload, c) in means for c in CLIENTS):
            continue
        (c1, k1, m1), (c2, k2, m2) = (means[(workload, c)] for c in CLIENTS)
        if abs(c1 - c2) > 0.1 * max(c1, c2) or k1 == k2:
            continue
        apart = abs(k1 - k2)
        if best is None or apart > best[0]:
            best = (apart, (m1 - m2) / (k1 - k2))
    return best[1] if best is not None and best[1] > 0 else None


def from_run(h: dict[str, Any]) -> Model:
    """The model of one run's scenario (h)."""
    phases = fitted_phases(h)
    means = {(w["kind"], c): _means([p for p in phases if p["workload"] == w["kind"] and p["client"] == c])
             for w in h["workloads"] for c in CLIENTS
             if any(p["workload"] == w["kind"] and p["client"] == c for p in phases)}
    per_call, per_key = fit(list(means.values()))
    per_key = key_cost(means) or per_key
    shapes: dict[str, dict[str, Shape]] = {}
    settings: dict[str, dict[str, float]] = {}
    for w in h["workloads"]:
        blocks = _blocks(h, w["kind"])
        settings[w["kind"]] = {"blocks": blocks, "rate": w["rate"], "burst": w["burst"]}
        for client in CLIENTS:
            if (w["kind"], client) not in means:
                continue
            calls, keys, cost_us = means[(w["kind"], client)]
            call_us = max(0.0, cost_us - keys * per_key) / calls if calls else per_call
            shapes.setdefault(w["kind"], {})[client] = Shape(keys / blocks, calls, call_us)
    return Model(per_call, per_key, shapes, settings, 1)


def from_runs(hs: Sequence[dict[str, Any]]) -> Model:
    """One model from several runs' scenario (h): the median of every figure."""
    models = [from_run(h) for h in hs]
    if not models:
        raise ValueError("no committed run measured scenario (h)")
    med = statistics.median
    shapes = {w: {c: Shape(med(m.shapes[w][c].keys_per_block for m in models),
                           med(m.shapes[w][c].calls_per_lookup for m in models),
                           med(m.shapes[w][c].per_call_us for m in models))
                  for c in models[0].shapes[w]} for w in models[0].shapes}
    settings = {w: {k: med(m.settings[w][k] for m in models) for k in s} for w, s in models[0].settings.items()}
    return Model(med(m.per_call_us for m in models), med(m.per_key_us for m in models), shapes, settings,
                 len(models))


def project(model: Model, workload: str, *, engines: int, rate: float, blocks: float) -> dict[str, Load]:
    """Each client's load on the master: ``engines`` engines, ``rate`` new requests a second each, prompts of
    ``blocks`` blocks, the bench's ``workload``."""
    if workload not in model.shapes:
        raise ValueError(f"no measured workload {workload!r}: the committed runs have {', '.join(model.shapes)}")
    if engines < 1 or rate <= 0 or blocks < 1:
        raise ValueError(f"engines must be >= 1, rate > 0 and blocks >= 1, got {engines}, {rate} and {blocks}")
    out = {}
    for client in CLIENTS:
        shape = model.shapes[workload][client]
        lookups = engines * rate
        per_lookup = model.per_lookup_us(workload, client, blocks)
        out[client] = Load(client, lookups, lookups * shape.calls_per_lookup, lookups * shape.keys_per_block * blocks,
                           lookups * per_lookup / 1e6, per_lookup)
    return out


def measured_cores(h: dict[str, Any], workload: str, client: str, n: int = CHECK_N) -> float | None:
    """The master's CPU (net of its idle rate) a second of scenario (h)'s phase at ``n`` engines."""
    phase = next((p for p in h["phases"] if p["n"] == n and p["workload"] == workload and p["client"] == client),
                 None)
    if phase is None:
        return None
    return phase["master"]["net_ms"] / 1e3 / h["seconds"]


def check_against(model: Model, h: dict[str, Any], n: int = CHECK_N) -> list[dict[str, Any]]:
    """The model's answer for the bench's own setting at ``n`` engines beside what (h) measured there: per
    workload and client, projected and measured master cores and their ratio."""
    out = []
    for workload, setting in model.settings.items():
        loads = project(model, workload, engines=n, rate=setting["rate"], blocks=setting["blocks"])
        for client in CLIENTS:
            measured = measured_cores(h, workload, client, n)
            projected = loads[client].master_cores
            out.append({"workload": workload, "client": client, "engines": n, "projected_cores": projected,
                        "measured_cores": measured,
                        "ratio": projected / measured if measured else None})
    return out


__all__ = ["CHECK_N", "CLIENTS", "Load", "Model", "Shape", "check_against", "fit", "fitted_phases", "from_run",
           "from_runs", "key_cost", "measured_cores", "project"]
