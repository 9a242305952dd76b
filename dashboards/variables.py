"""Dashboard variables and cross-links shared by both dashboards.

Variables chain (each narrows the next), take several values and offer "All" as ``.*``: with a regex
matcher, ``.*`` also matches series that lack the label, so a standalone lookup server (no model_name,
no engine) stays visible until someone picks a specific model or engine.

Variable queries stay cheap: they read two small gauges by exact name (:data:`VARIABLE_SOURCES`), one series per
lookup client and lookup server, never a regex over every series name (Prometheus looks a literal alternation
up name by name).
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from mooncake_lookout.metrics import catalogue as c

import known_metrics as km
from panels import DATASOURCE
from queries import MASTER_LABEL_OF

ALL = ".*"
# One series per lookup client (the info gauge) and per lookup server (its queue gauge), in vLLM or standalone.
VARIABLE_SOURCES: tuple[str, ...] = (c.INFO.name, c.SERVER_QUEUE_DEPTH.name)
OURS = f'__name__=~"{"|".join(VARIABLE_SOURCES)}"'
LOOKUP_CHAIN: tuple[tuple[str, str], ...] = (
    ("namespace", "Namespace"), ("job", "Job"), ("pod", "Pod"), ("instance", "Instance"), ("model_name", "Model"),
    ("engine", "Engine"),
)
MASTER_CHAIN: tuple[tuple[str, str], ...] = (("master_job", "Master job"), ("master_instance", "Master instance"))


def label_values_query(metric_selector: str, label: str) -> str:
    """Grafana's ``label_values(selector, label)`` variable query."""
    return f"label_values({metric_selector}, {label})"


def _query_var(name: str, label: str, query: str, description: str) -> db.QueryVariable:
    return (db.QueryVariable(name).label(label).description(description).query(query).datasource(DATASOURCE)
            .multi(True).include_all(True).all_value(ALL)
            .current(dm.VariableOption(selected=True, text="All", value="$__all"))
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC))


def variables() -> list[Any]:
    """datasource, namespace -> job -> pod -> instance -> model_name -> engine, then master_job -> master_instance."""
    out: list[Any] = [db.DatasourceVariable("datasource").label("Data source").type("prometheus")
                 .description("The Prometheus that scrapes vLLM, the lookup servers and the Mooncake master.")]
    done: list[str] = []
    for name, label in LOOKUP_CHAIN:
        matchers = ", ".join([OURS, *(f'{d}=~"${d}"' for d in done)])
        out.append(_query_var(name, label, label_values_query("{" + matchers + "}", name),
                              f"Filters every lookup query on the `{name}` label; All also matches series "
                              f"without it."))
        done.append(name)
    done = []
    for name, label in MASTER_CHAIN:
        target = MASTER_LABEL_OF[name]
        matchers = ", ".join(f'{MASTER_LABEL_OF[d]}=~"${d}"' for d in done)
        sel = km.MASTER_KEY_COUNT + ("{" + matchers + "}" if matchers else "")
        out.append(_query_var(name, label, label_values_query(sel, target),
                              f"Filters the Mooncake master panels on `{target}`."))
        done.append(name)
    return out


TAGS = ["mooncake-lookout", "vllm", "mooncake"]


def new_dashboard(title: str, uid: str, description: str, link: db.DashboardLink) -> db.Dashboard:
    """An empty dashboard with what both of ours share: tags, time range, refresh, crosshair, variables."""
    return (db.Dashboard(title).uid(uid).tags(TAGS).editable().time("now-1h", "now").refresh("30s")
            .tooltip(dm.DashboardCursorSync.CROSSHAIR).timezone("browser").description(description)
            .variables(variables()).link(link))


def link_to(title: str, uid: str, tooltip: str) -> db.DashboardLink:
    """A link to another dashboard that keeps the time range and the variables."""
    return (db.DashboardLink(title).type(dm.DashboardLinkType.LINK).url(f"/d/{uid}").tooltip(tooltip)
            .icon("dashboard").include_vars(True).keep_time(True).target_blank(False))


__all__ = ["ALL", "LOOKUP_CHAIN", "MASTER_CHAIN", "TAGS", "VARIABLE_SOURCES", "label_values_query", "link_to",
           "new_dashboard", "variables"]
