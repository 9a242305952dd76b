"""PromQL building blocks shared by the dashboards and the alert rules.

Every expression is built from a catalogue spec (``MetricSpec``) or a known external name, never from a
hand-typed metric name, so a renamed metric changes every panel and rule with it. Selectors carry the
dashboard variables; alert rules pass ``filters=None`` and get plain selectors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mooncake_lookout.metrics.catalogue import MetricSpec

# Dashboard variables every lookup query filters on. Regex matchers so that the include-all value ``.*``
# also matches series that lack the label (standalone server and demo export no model_name / engine; a
# static scrape config adds no namespace / pod).
LOOKUP_VARS: tuple[str, ...] = ("namespace", "job", "pod", "instance", "model_name", "engine")
# The Mooncake master is its own scrape job: its panels filter on their own pair of variables.
MASTER_VARS: tuple[str, ...] = ("master_job", "master_instance")
MASTER_LABEL_OF: dict[str, str] = {"master_job": "job", "master_instance": "instance"}
RATE = "$__rate_interval"
# Labels an alert keeps: one alert per serving engine, with the namespace and pod Alertmanager routes,
# groups and inhibits by (kube-prometheus-stack's convention).
ALERT_BY: tuple[str, ...] = ("namespace", "pod", "job", "instance", "model_name", "engine")


def series(spec: MetricSpec, suffix: str = "") -> str:
    """The stored series name of ``spec`` (``_total`` for counters; ``_bucket``/``_sum``/``_count`` for histograms)."""
    name = spec.name + ("_total" if spec.kind == "counter" else suffix)
    assert name in spec.sample_names, f"{name} is not a series of {spec.name}"
    return name


def matchers(variables: Sequence[str] | None, extra: Iterable[str] = ()) -> str:
    """A ``{...}`` label matcher: ``label=~"$var"`` for each dashboard variable, then ``extra`` matchers."""
    parts: list[str] = []
    for var in variables or ():
        label = MASTER_LABEL_OF.get(var, var)
        parts.append(f'{label}=~"${var}"')
    parts.extend(extra)
    return "{" + ", ".join(parts) + "}" if parts else ""


def sel(name: str, variables: Sequence[str] | None = LOOKUP_VARS, extra: Iterable[str] = ()) -> str:
    """A series selector with the dashboard filters."""
    return name + matchers(variables, extra)


def by(labels: Sequence[str]) -> str:
    """A ``by (...)`` clause; empty for no labels."""
    return f" by ({', '.join(labels)})" if labels else ""


def rate_sum(name: str, labels: Sequence[str] = (), *, variables: Sequence[str] | None = LOOKUP_VARS,
             extra: Iterable[str] = (), window: str = RATE) -> str:
    """``sum by (labels) (rate(name{filters}[window]))``."""
    return f"sum{by(labels)} (rate({sel(name, variables, extra)}[{window}]))"


def counter_rate(spec: MetricSpec, labels: Sequence[str] = (), *,
                 variables: Sequence[str] | None = LOOKUP_VARS, extra: Iterable[str] = (), window: str = RATE) -> str:
    """Per-second rate of a catalogue counter, summed by ``labels``."""
    return rate_sum(series(spec), labels, variables=variables, extra=extra, window=window)


def ratio(num: str, den: str) -> str:
    """``num / (den > 0)``: no division by zero, no value at all while nothing happened."""
    return f"({num})\n/\n({den} > 0)"


def quantile(spec: MetricSpec, q: float, labels: Sequence[str] = (), *,
             variables: Sequence[str] | None = LOOKUP_VARS, window: str = RATE) -> str:
    """``histogram_quantile`` of a catalogue histogram, by ``labels``."""
    inner = rate_sum(series(spec, "_bucket"), ("le", *labels), variables=variables, window=window)
    return f"histogram_quantile({q}, {inner})"


def mean(spec: MetricSpec, labels: Sequence[str] = (), *, variables: Sequence[str] | None = LOOKUP_VARS,
         window: str = RATE) -> str:
    """Mean of a catalogue histogram over the window: rate of ``_sum`` over rate of ``_count`` (guarded)."""
    return ratio(rate_sum(series(spec, "_sum"), labels, variables=variables, window=window),
                 rate_sum(series(spec, "_count"), labels, variables=variables, window=window))


def name_quantile(name: str, q: float, labels: Sequence[str] = (), *,
                  variables: Sequence[str] | None = LOOKUP_VARS, window: str = RATE) -> str:
    """``histogram_quantile`` of a histogram that is not ours, by its family name."""
    return f"histogram_quantile({q}, {rate_sum(name + '_bucket', ('le', *labels), variables=variables, window=window)})"


def gauge(name: str, agg: str = "sum", labels: Sequence[str] = (), *,
          variables: Sequence[str] | None = LOOKUP_VARS, extra: Iterable[str] = ()) -> str:
    """An aggregated gauge: ``agg by (labels) (name{filters})``."""
    return f"{agg}{by(labels)} ({sel(name, variables, extra)})"


__all__ = [
    "ALERT_BY", "LOOKUP_VARS", "MASTER_LABEL_OF", "MASTER_VARS", "RATE", "by", "counter_rate", "gauge",
    "matchers", "mean", "name_quantile", "quantile", "rate_sum", "ratio", "sel", "series",
]
