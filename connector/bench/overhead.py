"""Bench scenario (d): what metrics and spans add to one lookup, end to end.

Why: telemetry that slows the path it watches gets turned off. Four of our clients (pipelined) run
side by side against the same server: bare, metrics only (Prometheus sink), spans only (OTel tracer),
both. They take turns in small blocks, in a rotating order, so drift on a shared 2-core machine hits
all alike. The figure is submit-to-answer time of a blocking lookup, median and mean.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.call import make_client, time_sync
from mooncake_lookout.connector.bench.rig import Rig, summary_us
from mooncake_lookout.connector.rigs.workload import WorkloadRequest

VARIANTS = {"off": dict(telemetry=False), "metrics": dict(spans=False), "spans": dict(metrics=False),
            "on": dict()}


def run(rig: Rig, requests: Sequence[WorkloadRequest], *, rounds: int = 12, block: int = 25) -> dict[str, Any]:
    """Scenario (d): ``rounds`` rotations of ``block`` lookups per variant of :data:`VARIANTS`."""
    clients = {name: make_client(rig, "ours/pipelined", **kw) for name, kw in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    try:
        for name, (client, _) in clients.items():
            time_sync(client, requests[:20], f"warm-{name}")
        for i in range(rounds):
            chunk = [requests[(i * block + j) % len(requests)] for j in range(block)]
            for k in range(len(names)):
                name = names[(i + k) % len(names)]
                times[name] += time_sync(clients[name][0], chunk, f"{name}{i}")
    finally:
        for _, close in clients.values():
            close()
    off_med, off_mean = statistics.median(times["off"]), statistics.fmean(times["off"])
    out: dict[str, Any] = {f"{name}_us": summary_us(t) for name, t in times.items()}
    for name in ("metrics", "spans", "on"):
        out[f"{name}_median_overhead"] = statistics.median(times[name]) / off_med - 1.0
        out[f"{name}_mean_overhead"] = statistics.fmean(times[name]) / off_mean - 1.0
    out["median_overhead"], out["mean_overhead"] = out["on_median_overhead"], out["on_mean_overhead"]
    return out


__all__ = ["VARIANTS", "run"]
