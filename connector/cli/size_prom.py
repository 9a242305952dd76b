"""What ``size --prometheus`` reads: a deployment's engines, their lookups, and what its master was asked.

Every figure is one instant query over ``[window]``: the engines (our connector's ``info`` series under the
selector, one per engine), their lookups a second (``requests_total``, every outcome but ``discarded``), the
blocks a lookup could count (the prefix cache's ``query_blocks``, else the tokens asked / the block size), and
the master's own counters of existence checks under ``--master-selector`` (calls and keys a second, the
single-key checks counted as one of each). Errors are :class:`~.advise_prom.AdviseError` (exit 2: Prometheus;
3: no series; 4: too little traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lookout.connector.bench.fleet import COUNTERS
from mooncake_lookout.connector.cli.advise_prom import AdviseError, PrometheusAPI, Reader
from mooncake_lookout.connector.cli.prom_http import Access
from mooncake_lookout.metrics import catalogue as cat

MIN_LOOKUPS = 100  # in the window: fewer say little about a rate


@dataclass(frozen=True)
class Live:
    """A deployment's lookups and its master's existence checks, a second, over the window."""

    engines: int
    lookups_per_s: float
    blocks_per_lookup: float
    master_calls_per_s: float
    master_keys_per_s: float
    window_s: float

    @property
    def rate(self) -> float:
        """New requests a second, per engine."""
        return self.lookups_per_s / self.engines

    @property
    def keys_per_lookup(self) -> float:
        """Keys the master was asked per lookup of these engines (all its traffic put on them)."""
        return self.master_keys_per_s / self.lookups_per_s

    @property
    def calls_per_lookup(self) -> float:
        """Existence checks the master answered per lookup of these engines."""
        return self.master_calls_per_s / self.lookups_per_s


def _scalar(api: PrometheusAPI, expr: str) -> float | None:
    found = api.query(expr)
    return sum(v for _, v in found) if found else None


def read_live(access: Access | str, selector: str, master_selector: str, window: str, *, block_size: int = 16,
              timeout_s: float = 10.0) -> Live:
    """The live figures (see the module docstring), from the Prometheus ``access`` reaches (or at a plain URL)."""
    api = PrometheusAPI(access, timeout_s)
    ours = Reader(api, selector, window)
    master = Reader(api, master_selector, window)
    engines = _scalar(api, f"count({ours.sel(cat.INFO.name)})")
    if not engines:
        raise AdviseError(f"no {cat.INFO.name} series under {ours.selector}: no engine runs our connector there "
                          "(check --selector)", code=3)
    requests = cat.REQUESTS.sample_names[0]
    answered, store_answered_outcomes = 'outcome!="discarded"', 'outcome=~"hit|miss"'
    lookups = _scalar(api, f"sum(increase({ours.sel(requests, answered)}[{window}]))") or 0.0
    if lookups < MIN_LOOKUPS:
        raise AdviseError(f"only {lookups:.0f} lookups in the last {window} under {ours.selector}; at least "
                          f"{MIN_LOOKUPS} are needed (a longer --window?)", code=4)
    blocks = _scalar(api, ours.increase(cat.PREFIX_CACHE_QUERY_BLOCKS.sample_names[0])) or 0.0
    if not blocks:
        store_answered = _scalar(api, f"sum(increase({ours.sel(requests, store_answered_outcomes)}[{window}]))")
        tokens = _scalar(api, ours.increase(cat.QUERIED_TOKENS.sample_names[0])) or 0.0
        blocks = tokens / block_size * lookups / store_answered if store_answered else 0.0
    counts = {name: _scalar(api, master.increase(series)) for name, series in COUNTERS.items()}
    if counts["calls"] is None:
        raise AdviseError(f"no {COUNTERS['calls']} series under {master.selector}: is the Mooncake master scraped "
                          "(its /metrics), and does --master-selector pick it?", code=3)
    single = counts["single_calls"] or 0.0
    window_s = ours.window_s
    return Live(int(engines), lookups / window_s, blocks / lookups, (counts["calls"] + single) / window_s,
                ((counts["keys"] or 0.0) + single) / window_s, window_s)


__all__ = ["Live", "MIN_LOOKUPS", "read_live"]
