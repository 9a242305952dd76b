"""The doc blocks drawn from the committed soaks (``docs/bench/soak-T.json``, one per transport).

Why: the reliability figures a user reads (calls over the bound, wrong and stale hits, memory, recovery)
come from a soak anyone can rerun; ``python -m mooncake_lookout.connector.cli.docs`` renders them, beside
each soak's settings, load average, date and commit, and ``--check`` fails when a doc drifts from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lookout.connector.bench.records import MISSING, Soak, num

Cell = Callable[[dict[str, Any]], str]


def _calls_over(r: dict[str, Any]) -> str:
    bound = r["timeout_ms"] + r.get("slack_ms", 5)  # soaks recorded before slack_ms used 5 ms
    return (f"**{r['calls_over_bound']:,}** over {num(bound, 0)} ms in {r['lookups']:,} lookups "
            f"(max {num(r.get('max_call_ms'), 1)} ms)")


def _blocking(r: dict[str, Any]) -> str:
    b = r.get("blocking_call_ms", {})
    return (f"p50 {num(b.get('p50'), 3)} ms, p99 {num(b.get('p99'), 1)} ms, p99.9 {num(b.get('p99.9'), 1)} ms, "
            f"max {num(b.get('max'), 1)} ms (n = {b.get('n', 0):,})")


def _outcomes(r: dict[str, Any]) -> str:
    return ", ".join(f"{n:,} {o}" for o, n in r.get("outcomes", {}).items())


def _faults(r: dict[str, Any]) -> str:
    faults = r.get("faults", {})
    return f"{sum(faults.values())} (" + ", ".join(f"{n} {f.replace('_', ' ')}" for f, n in faults.items()) + ")"


def _prefix_cache(r: dict[str, Any]) -> str:
    c = r.get("prefix_cache")
    if not c:
        return "not recorded (soak from before the cache ran in it)"
    if not c.get("known_blocks"):
        return "off (vLLM's server names no store epoch)"
    clears = ", ".join(f"{n:,} {reason}" for reason, n in c.get("clears", {}).items()) or "none"
    share = c["known_blocks"] / max(1, c.get("countable_blocks", 0))
    return f"on: knew {share:.0%} of {c.get('countable_blocks', 0):,} countable blocks; cleared {clears}"


def _verdict(r: dict[str, Any]) -> str:
    return "every guarantee held" if r.get("ok") else "**a guarantee broke** (the soak exited 1)"


ROWS: tuple[tuple[str, Cell], ...] = (
    ("lookups / wall time", lambda r: f"{r['lookups']:,} / {num(r.get('seconds'), 1)} s"),
    ("faults injected", _faults),
    ("outcomes", _outcomes),
    ("wrong / stale hits", lambda r: f"**{r.get('wrong_hits')} / {r.get('stale_hits')}**"),
    ("prefix cache", _prefix_cache),
    ("`lookup()` calls over the deadline + the slack", _calls_over),
    ("blocking calls (sync mode)", _blocking),
    ("how late an answer came after its deadline (max)", lambda r: f"{num(r.get('max_late_ms'), 1)} ms"),
    ("rounds ending with pending lookups", lambda r: f"{r.get('pending_left_rounds')}"),
    ("memory growth (RSS, after warm-up to the end)", lambda r: f"{num(r.get('rss_growth_mb'), 2)} MB"),
    ("slowest recovery after a fault; recoveries that failed",
     lambda r: f"{num(r.get('max_recovery_s'), 2)} s; {r.get('recoveries_failed')}"),
    ("verdict", _verdict),
)
def soaks_note(soaks: Sequence[Soak]) -> str:
    """Which soaks, with which settings, when, on what code and how loaded."""
    parts = []
    for s in soaks:
        r, m = s.results, s.results.get("machine", {})
        settings = r.get("settings", {})
        parts.append(f"`{s.transport}` (`{s.path}`: {num(r.get('lookups'), 0)} lookups, fault rate "
                     f"{settings.get('fault_rate', MISSING)}, at most {settings.get('master_kills', MISSING)} master "
                     f"kills, seed {settings.get('seed', MISSING)}, deadline {num(r.get('timeout_ms'), 0)} ms; "
                     f"{str(m.get('date', MISSING))[:10]}, commit `{m.get('commit', MISSING)}`, load average "
                     f"{s.load_text})")
    return ("Printed by `python -m mooncake_lookout.connector.rigs.soak --json` (breaker 20 failures / 0.2 s, "
            "not the defaults; load average: 1 minute, at start -> at end): " + "; ".join(parts) + ".")


def render_soak_table(soaks: Sequence[Soak], rows: Sequence[str] | None = None) -> str:
    """A row per figure (all of :data:`ROWS`, or those named in ``rows``), a column per transport."""
    chosen = [(name, cell) for name, cell in ROWS if rows is None or name in rows]
    lines = ["| figure | " + " | ".join(s.transport for s in soaks) + " |", "|" + " --- |" * (len(soaks) + 1)]
    lines += [f"| {name} | " + " | ".join(cell(s.results) for s in soaks) + " |" for name, cell in chosen]
    return "\n".join(lines + ["", soaks_note(soaks)]) + "\n"


def soak_command(s: Soak) -> str:
    """The command that reproduces soak ``s``: its transport and the settings it recorded."""
    r, given = s.results, s.results.get("settings", {})
    return (f"python -m mooncake_lookout.connector.rigs.soak --transport {s.transport} --lookups {r['lookups']} "
            f"--fault-rate {given.get('fault_rate', MISSING)} --master-kills {given.get('master_kills', MISSING)} "
            f"--seed {given.get('seed', MISSING)} --timeout-ms {num(r.get('timeout_ms'), 0)} --json")


def render_soak_commands(soaks: Sequence[Soak]) -> str:
    """Each committed soak's command, fenced: what "run it yourself" runs to get the table above again."""
    return "```bash\n" + "\n".join(soak_command(s) for s in soaks) + "\n```\n"


__all__ = ["ROWS", "render_soak_commands", "render_soak_table", "soak_command", "soaks_note"]
