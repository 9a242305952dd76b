"""What the chart's docs tell a user to act on: every values key they name exists, every example value set is
described, the PodDisruptionBudget is not said to protect a rollout, and docs/helm.md says what is verified here
and what only a real cluster shows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = Path(__file__).resolve().parents[1]
DOCS = {name: ROOT / "docs" / name for name in ("helm.md", "runbook.md", "dashboards.md")}
TOP_KEYS = tuple(chart.load_values())
# A backticked dotted name starting with a top-level values key, e.g. `monitoring.prometheusRule.runbookBaseUrl`.
KEY = re.compile(r"`((?:{})(?:\.[A-Za-z0-9_]+)+)(?:=[^`]*)?`".format("|".join(TOP_KEYS + ("alerts",))))


def values_has(values: dict[str, Any], dotted: str) -> bool:
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def named_keys(text: str) -> set[str]:
    return {k for k in KEY.findall(text) if not re.search(r"\.(ya?ml|json|md|py|txt)$", k)}


def pdb_claims_without_scope(text: str) -> list[str]:
    """Sentences that say what a PodDisruptionBudget does without saying it is about voluntary evictions."""
    sentences = re.split(r"(?<=[.;])\s+", re.sub(r"\s+", " ", text))
    return [s for s in sentences if re.search(r"PodDisruptionBudget|\bPDB\b", s)
            and re.search(r"\b(keeps?|protects?|guards?|limits?|ensures?|prevents?|holds?)\b", s)
            and "voluntary" not in s]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_values_key_the_docs_name_exists(doc):
    values = chart.load_values()
    text = DOCS[doc].read_text()
    keys = named_keys(text)
    missing = sorted(k for k in keys if not values_has(values, k))
    assert not missing, f"docs/{doc} names values keys the chart does not have: {missing}"


def test_the_key_check_catches_a_wrong_name():
    assert named_keys("replaced with `alerts.runbookBaseUrl`, set `master.ha.enabled=true`") == {
        "alerts.runbookBaseUrl", "master.ha.enabled"}
    assert not values_has(chart.load_values(), "alerts.runbookBaseUrl")


def test_runbook_names_the_real_runbook_key():
    text = DOCS["runbook.md"].read_text()
    assert "`monitoring.prometheusRule.runbookBaseUrl`" in text


def test_no_doc_says_a_disruption_budget_protects_an_upgrade():
    """A PDB limits voluntary evictions (drains); a rollout is paced by the Deployment's strategy alone."""
    for doc in DOCS.values():
        assert pdb_claims_without_scope(doc.read_text()) == [], doc.name
    text = DOCS["helm.md"].read_text()
    upgrade = re.sub(r"\s+", " ", text.split("## 3. Upgrade", 1)[1].split("\n## ", 1)[0])
    assert "voluntary evictions" in upgrade and "does not protect a rollout" in upgrade
    # What the upgrade section used to say is caught.
    old = ("The engine pods roll when their arguments or `mooncake.json` change (a checksum annotation covers the "
           "latter); the engine PodDisruptionBudget keeps all but `engine.pdb.maxUnavailable` serving.")
    assert pdb_claims_without_scope(old)


def test_every_example_value_set_is_described():
    text = DOCS["helm.md"].read_text()
    for path in chart.ci_value_sets().values():
        assert f"| `{path.name}` |" in text, f"docs/helm.md does not describe ci/{path.name}"


def test_helm_doc_says_what_is_verified_here_and_what_only_a_cluster_shows():
    text = DOCS["helm.md"].read_text()
    section = text.split("## What is verified here, and what only a real cluster can show", 1)[1].split("\n## ", 1)[0]
    for claim in ("helm lint --strict", "1.29 and 1.32", "promtool", "real Prometheus", "Alertmanager",
                  "Master failover, for real", "tests/test_ha_failover.py", "tests/test_helm_worker_start.py"):
        assert claim in section, claim
    only_cluster = section.split("Not verified here, only on a real cluster:", 1)[1]
    for gap in ("images build", "NetworkPolicies", "etcd StatefulSet", "k8s Lease", "helm test", "RDMA"):
        assert gap in only_cluster, gap


def test_the_grafana_folder_needs_both_sidecar_settings_and_the_docs_name_both():
    """The sidecar puts a dashboard in a folder only with folderAnnotation set to the chart's annotation key, and
    Grafana makes folders of them only with provider.foldersFromFilesStructure: the docs named the first only."""
    grafana = DOCS["helm.md"].read_text().split("## 8. Grafana", 1)[1].split("\n## ", 1)[0]
    assert "folderAnnotation: grafana_folder" in grafana and "foldersFromFilesStructure: true" in grafana
    values_text = (chart.CHART / "values.yaml").read_text()
    described = values_text.split("folder: \"\"", 1)[0].rsplit("labelValue:", 1)[1]
    assert "folderAnnotation" in described and "foldersFromFilesStructure" in described
    assert chart.load_values()["grafana"]["dashboards"]["folderAnnotation"] == "grafana_folder"
