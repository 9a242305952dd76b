"""What ``advise`` reads: the lookup path's figures over a window, from a Prometheus HTTP API.

Every figure is one instant query evaluated now over ``[window]`` (``increase``, ``max_over_time``,
``histogram_quantile`` of increased buckets), summed over every series the selector matches (instances,
engines). Metric names come from :mod:`mooncake_lookout.metrics.catalogue`; vLLM's own names from
:data:`VLLM_SERIES` (vLLM 0.33, ``vllm/v1/metrics/loggers.py``; a test checks them against vLLM's source).
Errors are :class:`AdviseError` with a one-line message: Prometheus unreachable or refusing us (authentication,
TLS: :mod:`.prom_http` reaches it), a query it rejects, no lookup series under the selector.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from mooncake_lookout.connector.cli.prom_http import Access, PrometheusError, PromHTTP
from mooncake_lookout.metrics import catalogue as cat
from mooncake_lookout.metrics.catalogue import MetricSpec

# vLLM 0.33's own histograms advise reads when they are there (inside vLLM, not standalone).
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_QUEUE = "vllm:request_queue_time_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram: one observation per engine step
VLLM_SERIES: tuple[str, ...] = (VLLM_TTFT, VLLM_QUEUE, VLLM_ITL, VLLM_ITERATION_TOKENS)

_WINDOW = re.compile(r"^(\d+)(ms|s|m|h|d|w)$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class AdviseError(Exception):
    """Why ``advise`` cannot say anything; ``code`` is the exit code (the message is one line)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def window_seconds(text: str) -> float:
    """Seconds in a Prometheus duration of one unit (``90s``, ``15m``, ``1h``, ``2d``); ValueError otherwise."""
    m = _WINDOW.match(text)
    if m is None or int(m.group(1)) == 0:
        raise ValueError(f"--window must be a Prometheus duration such as 30s, 15m, 1h or 1d, got {text!r}")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def selector_matchers(text: str) -> str:
    """The matchers inside a ``{...}`` selector (braces optional; empty for none)."""
    inner = text.strip()
    if inner.startswith("{"):
        if not inner.endswith("}"):
            raise ValueError(f"--selector must look like '{{namespace=\"prod\",model_name=\"m\"}}', got {text!r}")
        inner = inner[1:-1].strip()
    return inner.rstrip(",")


class PrometheusAPI:
    """Instant queries against a Prometheus' ``/api/v1/query`` (reached as :class:`~.prom_http.Access` says: URL,
    credentials, TLS, headers); every failure is an :class:`AdviseError`."""

    def __init__(self, access: Access | str, timeout_s: float = 10.0) -> None:
        access = access if isinstance(access, Access) else Access(access)
        try:
            self.http = PromHTTP(access, timeout_s)
        except PrometheusError as e:
            raise AdviseError(str(e), e.code) from None
        self.url = self.http.url

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """The vector ``expr`` evaluates to now: (labels, value) pairs; NaN values are left out."""
        try:
            body = self.http.get_json("/api/v1/query", {"query": expr})
        except PrometheusError as e:
            raise AdviseError(str(e), e.code) from None
        if isinstance(body, dict) and body.get("status") == "error":
            raise AdviseError(f"Prometheus at {self.url} rejected a query ({body.get('error')}); "
                              f"check --selector: {expr}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise AdviseError(f"Prometheus at {self.url} answered without success: {str(body)[:200]}")
        out = []
        for item in body["data"]["result"]:
            value = float(item["value"][1])
            if not math.isnan(value):
                out.append((item["metric"], value))
        return out

    def scalar(self, expr: str) -> float | None:
        """The single value of ``expr`` (summed by the caller's expression), ``None`` when empty."""
        result = self.query(expr)
        return result[0][1] if result else None


@dataclass(frozen=True)
class VllmFigures:
    """vLLM's own step and latency figures over the window (seconds), when vLLM exports them."""

    ttft_p50_s: float | None
    ttft_p90_s: float | None
    queue_p50_s: float | None
    itl_p50_s: float | None
    engine_steps: float | None


@dataclass
class Figures:
    """Everything advise decides from, over ``window`` under ``selector`` (seconds, counts)."""

    url: str
    selector: str
    window: str
    window_s: float
    configs: list[dict[str, str]]  # info label sets in force now (one per distinct configuration)
    configs_in_window: int  # distinct configurations seen over the window
    outcomes: dict[str, float] = field(default_factory=dict)
    steps: float = 0.0
    step_mean_s: float | None = None
    step_p50_s: float | None = None
    blocked_s: float = 0.0
    blocked_calls: float = 0.0
    blocked_call_p99_s: float | None = None
    rpc_buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count), ascending
    rpc_count: float = 0.0  # every sent lookup that ended, timeouts included
    delay_p50_s: float | None = None
    delay_p90_s: float | None = None
    deferred_count: float = 0.0
    deferred_sum: float = 0.0
    deferred_p90: float | None = None
    pending_peak: float | None = None
    max_pending: float | None = None
    held_peak: float | None = None
    max_held: float | None = None
    dropped: dict[str, float] = field(default_factory=dict)
    breaker_opened: bool = False
    budget_now_s: float | None = None
    budget_max_s: float | None = None
    late_replies: float = 0.0
    vllm: VllmFigures | None = None

    @property
    def lookups(self) -> float:
        """Lookups that ended with an answer for the scheduler (every outcome but ``discarded``)."""
        return sum(n for o, n in self.outcomes.items() if o != "discarded")


class Reader:
    """Builds the window's queries for one selector and reads them into :class:`Figures`."""

    def __init__(self, api: PrometheusAPI, selector: str, window: str) -> None:
        self.api = api
        self.matchers = selector_matchers(selector)
        self.selector = "{" + self.matchers + "}"
        self.window = window
        self.window_s = window_seconds(window)

    def sel(self, name: str, *extra: str) -> str:
        """``name{selector matchers, extra}``."""
        parts = [p for p in (self.matchers, *extra) if p]
        return name + "{" + ", ".join(parts) + "}"

    def increase(self, series: str, by: str = "") -> str:
        """``sum [by (labels)] (increase(series{sel}[window]))``."""
        return f"sum{f' by ({by})' if by else ''} (increase({self.sel(series)}[{self.window}]))"

    def quantile(self, spec_or_name: MetricSpec | str, q: float) -> float | None:
        """A quantile of a histogram's observations within the window."""
        name = spec_or_name.name if isinstance(spec_or_name, MetricSpec) else spec_or_name
        return self.api.scalar(f"histogram_quantile({q}, {self.increase(name + '_bucket', 'le')})")

    def buckets(self, spec: MetricSpec) -> list[tuple[float, float]]:
        """A histogram's cumulative bucket counts over the window: (upper bound, count), ascending."""
        rows = self.api.query(self.increase(spec.name + "_bucket", "le"))
        return sorted((float(labels["le"]), value) for labels, value in rows)

    def total(self, series: str) -> float:
        """A counter's (or a histogram part's) increase over the window, summed; 0 when absent."""
        return self.api.scalar(self.increase(series)) or 0.0

    def over_time(self, agg: str, spec: MetricSpec, outer: str = "max") -> float | None:
        """``outer(agg_over_time(gauge{sel}[window]))``."""
        return self.api.scalar(f"{outer}({agg}_over_time({self.sel(spec.name)}[{self.window}]))")

    def by_label(self, series: str, label: str) -> dict[str, float]:
        """A counter's increase over the window, by one label."""
        return {labels.get(label, ""): v for labels, v in self.api.query(self.increase(series, label))}

    def read(self) -> Figures:
        """Query every figure; :class:`AdviseError` (code 3) when no lookup series matches the selector."""
        requests = cat.REQUESTS.sample_names[0]
        self._require_series(requests)
        info_by = ", ".join(cat.INFO.labels)
        now = [labels for labels, _ in self.api.query(f"max by ({info_by}) ({self.sel(cat.INFO.name)})")]
        seen = self.api.query(f"max by ({info_by}) (max_over_time({self.sel(cat.INFO.name)}[{self.window}]))")
        f = Figures(self.api.url, self.selector, self.window, self.window_s, now, len(seen))
        f.outcomes = self.by_label(requests, "outcome")
        step, blocked, rpc = cat.STEP_INTERVAL_SECONDS, cat.SCHEDULER_BLOCKED_SECONDS, cat.RPC_SECONDS
        f.steps = self.total(step.name + "_count")
        f.step_mean_s = _ratio(self.total(step.name + "_sum"), f.steps)
        f.step_p50_s = self.quantile(step, 0.5)
        f.blocked_s = self.total(blocked.name + "_sum")
        f.blocked_calls = self.total(blocked.name + "_count")
        f.blocked_call_p99_s = self.quantile(blocked, 0.99)
        f.rpc_buckets = self.buckets(rpc)
        f.rpc_count = self.total(rpc.name + "_count")
        f.delay_p50_s, f.delay_p90_s = (self.quantile(cat.SECONDS, q) for q in (0.5, 0.9))
        f.deferred_count = self.total(cat.DEFERRED_STEPS.name + "_count")
        f.deferred_sum = self.total(cat.DEFERRED_STEPS.name + "_sum")
        f.deferred_p90 = self.quantile(cat.DEFERRED_STEPS, 0.9)
        f.pending_peak = self.over_time("max", cat.PENDING)
        f.max_pending = self.over_time("min", cat.MAX_PENDING, "min")
        f.held_peak = self.over_time("max", cat.HELD)
        f.max_held = self.over_time("min", cat.MAX_HELD, "min")
        f.dropped = self.by_label(cat.ANSWERS_DROPPED.sample_names[0], "reason")
        f.breaker_opened = (self.over_time("max", cat.BREAKER_OPEN) or 0.0) > 0
        f.budget_now_s = self.over_time("last", cat.WAIT_BUDGET_SECONDS, "avg")
        f.budget_max_s = self.over_time("max", cat.WAIT_BUDGET_SECONDS)
        f.late_replies = self.total(cat.LATE_REPLIES.sample_names[0])
        f.vllm = self._vllm()
        return f

    def _require_series(self, requests: str) -> None:
        if self.api.query(f"count(last_over_time({self.sel(requests)}[{self.window}]))"):
            return
        elsewhere = self.api.query(f"count by (job, namespace, model_name) ({requests})")
        hint = "; ".join(", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) or "(no labels)"
                         for labels, _ in elsewhere[:5])
        raise AdviseError(f"no lookup series ({requests}) under {self.selector} in the last {self.window}"
                          + (f"; Prometheus has them under: {hint}" if hint else
                             "; Prometheus has none at all: is it scraping vLLM's /metrics?"), code=3)

    def _vllm(self) -> VllmFigures | None:
        steps = self.total(VLLM_ITERATION_TOKENS + "_count")
        ttft = self.quantile(VLLM_TTFT, 0.5)
        if not steps and ttft is None:
            return None
        return VllmFigures(ttft, self.quantile(VLLM_TTFT, 0.9), self.quantile(VLLM_QUEUE, 0.5),
                           self.quantile(VLLM_ITL, 0.5), steps or None)


def bucket_quantile(buckets: list[tuple[float, float]], q: float, upto: float = math.inf) -> float | None:
    """The ``q`` quantile of the observations in buckets up to ``upto`` (linear within a bucket, as PromQL's
    ``histogram_quantile``); ``None`` without observations."""
    kept = [(le, n) for le, n in buckets if le <= upto]
    if not kept or kept[-1][1] <= 0:
        return None
    rank = q * kept[-1][1]
    lower, below = 0.0, 0.0
    for le, n in kept:
        if n >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
        lower, below = le, n
    return kept[-1][0]


def count_upto(buckets: list[tuple[float, float]], upto: float) -> float:
    """Observations in buckets whose upper bound is at most ``upto``."""
    counts = [n for le, n in buckets if le <= upto]
    return counts[-1] if counts else 0.0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def read_figures(access: Access | str, selector: str, window: str, timeout_s: float = 10.0) -> Figures:
    """Every figure advise needs, from the Prometheus ``access`` reaches (or at a plain URL)."""
    return Reader(PrometheusAPI(access, timeout_s), selector, window).read()


__all__ = ["AdviseError", "Figures", "PrometheusAPI", "Reader", "VLLM_SERIES", "VllmFigures", "bucket_quantile",
           "count_upto", "read_figures", "selector_matchers", "window_seconds"]
