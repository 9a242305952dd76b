"""Panel builders with the house conventions, on top of grafana-foundation-sdk.

One :class:`Panels` per dashboard hands out unique panel ids, points every panel and query at the
``$datasource`` variable, and ends every description with the metric names its queries read (taken
from the expressions themselves, so the text cannot drift from the query).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, text, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import text as tm

from mooncake_lookout.metrics.catalogue import all_series_names

import known_metrics as km

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
KNOWN_SERIES: frozenset[str] = frozenset(all_series_names()) | km.MASTER_SERIES | km.VLLM_SERIES


def metric_names(expr: str) -> list[str]:
    """The known metric series an expression reads, in order of first use."""
    seen: list[str] = []
    for token in _NAME.findall(expr):
        if token in KNOWN_SERIES and token not in seen:
            seen.append(token)
    return seen


def family(series_name: str) -> str:
    """The family a series belongs to (``_bucket``/``_sum``/``_count`` dropped for our histograms)."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = series_name.removesuffix(suffix)
        if base != series_name and base + "_bucket" in KNOWN_SERIES:
            return base
    return series_name


@dataclass(frozen=True)
class Query:
    """One query of a panel: a PromQL expression and its legend."""

    expr: str
    legend: str = "__auto"
    instant: bool = False


class Panels:
    """Builds panels for one dashboard; ids are unique and stable across runs."""

    def __init__(self) -> None:
        self._next_id = 1

    def _id(self) -> int:
        pid = self._next_id
        self._next_id += 1
        return pid

    def row(self, title: str) -> db.Row:
        """A row header; a row that holds panels itself is collapsed (see ``db.Row.with_panel``)."""
        return db.Row(title).id(self._id())

    @staticmethod
    def _targets(queries: Sequence[Query]) -> list[prometheus.Dataquery]:
        out = []
        for i, q in enumerate(queries):
            t = (prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
                 .datasource(DATASOURCE))
            out.append(t.instant() if q.instant else t.range())
        return out

    @staticmethod
    def _describe(description: str, queries: Sequence[Query]) -> str:
        names: list[str] = []
        for q in queries:
            for n in metric_names(q.expr):
                if family(n) not in names:
                    names.append(family(n))
        return f"{description} Metrics: {', '.join(names)}." if names else description

    def _common(self, panel, title: str, description: str, queries: Sequence[Query], unit: str,
                width: int, height: int):
        return (panel.id(self._id()).title(title).description(self._describe(description, queries))
                .datasource(DATASOURCE).targets(self._targets(queries)).unit(unit).span(width).height(height))

    def timeseries(self, title: str, description: str, queries: Sequence[Query], unit: str, *,
                   width: int = 12, height: int = 8, stacked: bool = False, min_zero: bool = True,
                   step: bool = False) -> timeseries.Panel:
        """A time series panel with a table legend (mean, max, last)."""
        p = self._common(timeseries.Panel(), title, description, queries, unit, width, height)
        p = p.legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE)
                     .placement(cm.LegendPlacement.BOTTOM).show_legend(True).calcs(["mean", "max", "lastNotNull"]))
        p = p.fill_opacity(15 if stacked else 5).line_width(1)
        if stacked:
            p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        if min_zero:
            p = p.min(0)
        if step:
            p = p.line_interpolation(cm.LineInterpolation.STEP_AFTER)
        return p

    def stat(self, title: str, description: str, queries: Sequence[Query], unit: str, *,
             width: int = 4, height: int = 4, thresholds: Sequence[tuple[float | None, str]] = (),
             mappings: Sequence[dm.ValueMapping] = ()) -> stat.Panel:
        """A single big number with a sparkline; ``thresholds`` are (from value, colour) pairs."""
        p = self._common(stat.Panel(), title, description, queries, unit, width, height)
        p = p.graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
        p = p.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        if thresholds:
            steps = [dm.Threshold(value=v, color=c) for v, c in thresholds]
            p = p.thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps))
        if mappings:
            p = p.mappings(list(mappings))
        return p

    def state(self, title: str, description: str, queries: Sequence[Query], *, width: int = 12,
              height: int = 6, mappings: Sequence[dm.ValueMapping] = (),
              thresholds: Sequence[tuple[float | None, str]] = ()) -> statetimeline.Panel:
        """A state timeline (for 0/1 gauges such as the breaker)."""
        p = self._common(statetimeline.Panel(), title, description, queries, "none", width, height)
        p = p.mappings(list(mappings)).show_value(cm.VisibilityMode.NEVER)
        if thresholds:
            steps = [dm.Threshold(value=v, color=c) for v, c in thresholds]
            p = p.thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps))
        return p

    def table(self, title: str, description: str, queries: Sequence[Query], *, width: int = 24,
              height: int = 5) -> table.Panel:
        """A table of instant query results (labels as columns)."""
        p = self._common(table.Panel(), title, description, queries, "none", width, height)
        return p.with_transformation(dm.DataTransformerConfig(id_val="labelsToFields", options={"mode": "columns"}))

    def note(self, title: str, markdown: str, *, width: int = 24, height: int = 5) -> text.Panel:
        """A markdown text panel (no query)."""
        return (text.Panel().id(self._id()).title(title).mode(tm.TextMode.MARKDOWN).content(markdown)
                .span(width).height(height))


def value_text(mapping: dict[str, tuple[str, str]]) -> dm.ValueMap:
    """A value-to-text mapping: ``{"0": ("closed", "green")}``."""
    return dm.ValueMap(options={k: dm.ValueMappingResult(text=t, color=c, index=i)
                                for i, (k, (t, c)) in enumerate(mapping.items())})


__all__ = ["DATASOURCE", "KNOWN_SERIES", "Panels", "Query", "family", "metric_names", "value_text"]
