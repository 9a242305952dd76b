"""The closing table of ``demo --engine``: one row per connector and mode, read from each engine's ``/metrics``.

Why its own module: the demo's other table reads the rig's own records; this one reads real engines'
``/metrics`` pages, and a test checks each column against its legend as for the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.http_load import total

PROMPT_TOKENS = "vllm:prompt_tokens_total"

COLUMNS: tuple[tuple[str, str], ...] = (
    ("requests", "requests: completed during the measured load (after the warm-up)"),
    ("TTFT p50", "TTFT p50, p99: time to first token, from sending a streaming completion to its first chunk (ms)"),
    ("p99", ""),
    ("store hits", "store hits: prompt tokens served from the store (vllm:external_prefix_cache_hits_total) / prompt "
                   "tokens in all"),
    ("deferrals", "deferrals: times the scheduler was told to ask again later (ours counts them; upstream's client "
                  "does not: -)"),
    ("lookups", "lookups: ours by outcome (vllm:mooncake_lookup_requests_total); upstream's client exports none: -"),
)


def _ms(value: float | None) -> str:
    return f"{'-':>8}" if value is None or not math.isfinite(value) else f"{value:8.1f}"


def _count(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.0f}"


def _lookups(found: dict[str, float] | None) -> str:
    if found is None:
        return "-"
    return " ".join(f"{k} {v:.0f}" for k, v in sorted(found.items()) if v) or "none"


def format_engine_table(runs: Sequence[Any]) -> str:
    """Header, one row per run, the legend, then where each engine's ``/metrics`` was."""
    lines = [f"{'mode':15} {'requests':>8} {'TTFT p50':>8} {'p99':>8} {'store hits':>17} {'deferrals':>9}  lookups",
             f"{'':15} {'':>8} {'(ms)':>8} {'(ms)':>8} {'(tokens)':>17} {'':>9}"]
    for r in runs:
        hits, prompt = r.hits(), total(r.counts, PROMPT_TOKENS)
        share = f"{_count(hits, 7)} / {_count(prompt, 7)}"
        lines.append(f"{r.spec.label:15} {r.load.requests:8d} {_ms(r.load.percentile_ms(50))} "
                     f"{_ms(r.load.percentile_ms(99))} {share:>17} {_count(r.deferrals(), 9)}  {_lookups(r.lookups())}")
        if r.load.failures:
            lines.append(f"{'':15} {len(r.load.failures)} requests failed: {r.load.failures[0]}")
    lines += [legend for _, legend in COLUMNS if legend]
    lines.append("each engine's own /metrics, while it ran: " + "; ".join(f"{r.spec.label} {r.metrics_url}"
                                                                         for r in runs))
    return "\n".join(lines)


__all__ = ["COLUMNS", "format_engine_table"]
