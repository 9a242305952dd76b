"""The alert rules load in promtool, fire and stay silent on the right series, each pointing to its runbook section."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from mooncake_lookout.connector.config import KEYS_BY_NAME
from mooncake_lookout.metrics.catalogue import MAX_PENDING, all_series_names

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "alerts.rules.yaml"
UNIT_TESTS = DASHBOARDS / "alerts.test.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"

import alerts  # noqa: E402
import known_metrics as km  # noqa: E402
import lint  # noqa: E402
import queries as q  # noqa: E402

REQUIRED = {"MooncakeLookupTimeouts", "MooncakeLookupErrorRatioHigh", "MooncakeLookupBreakerOpen",
            "MooncakeLookupPendingNearBound", "MooncakeLookupDeferredStepsHigh", "MooncakeLookupServerDown",
            "MooncakeMasterUnreachable", "MooncakeMasterNearCapacity"}


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_check_rules_passes(promtool):
    assert f"SUCCESS: {len(_rules())} rules found" in promtool.check_rules(RULES)


def test_promtool_unit_tests_pass(promtool):
    run = promtool.run("test", "rules", str(UNIT_TESTS), cwd=DASHBOARDS)
    assert run.returncode == 0, run.stdout + run.stderr


# Each mutation breaks one rule the way a plausible bug would: (alert, text in its expr, replacement).
MUTATIONS = {
    "error threshold tripled": ("MooncakeLookupErrorRatioHigh", f"> {alerts.ERROR_RATIO}",
                                f"> {alerts.ERROR_RATIO * 3}"),
    "pending compared with the default bound, not the gauge": (
        "MooncakeLookupPendingNearBound", f"({q.gauge(MAX_PENDING.name, 'max', q.ALERT_BY, variables=None)} > 0)",
        str(KEYS_BY_NAME["lookup_max_pending"].default)),
    "rejections no longer alert": ("MooncakeLookupPendingNearBound", "\nor\n", "\nunless\n"),
}


@pytest.mark.parametrize("mutation", [None, *sorted(MUTATIONS)])
def test_unit_tests_fail_when_a_rule_is_off(promtool, tmp_path, mutation):
    """The unit tests are not vacuous: each mutation of the rules makes them fail on the mutated alert.

    ``None`` is the control: the same copy-and-rewrite with no mutation passes.
    """
    doc = yaml.safe_load(RULES.read_text())
    if mutation is not None:
        alert, old, new = MUTATIONS[mutation]
        [rule] = [r for g in doc["groups"] for r in g["rules"] if r["alert"] == alert]
        assert old in rule["expr"], f"mutation {mutation!r} no longer applies to {alert}"
        rule["expr"] = rule["expr"].replace(old, new)
    (tmp_path / "alerts.rules.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp_path / "alerts.test.yaml")
    run = promtool.run("test", "rules", "alerts.test.yaml", cwd=tmp_path)
    if mutation is None:
        assert run.returncode == 0, run.stdout + run.stderr
    else:
        assert run.returncode != 0 and alert in run.stdout + run.stderr


def test_a_missing_promtool_fails_the_test_instead_of_skipping_it(require_tool, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="promtool not found on PATH: install Debian's prometheus"):
        require_tool("promtool")


def test_required_alerts_exist_with_severity_and_annotations():
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert REQUIRED <= set(names) and len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        assert ann["runbook_url"] == f"{alerts.RUNBOOK_BASE}#{r['alert'].lower()}"


def _github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_runbook_url_has_a_section_that_says_what_to_check_and_change():
    text = RUNBOOK.read_text()
    sections = {_github_anchor(m.group(1)): m.end() for m in re.finditer(r"^## (.+)$", text, re.M)}
    for r in _rules():
        anchor = r["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in sections, f"docs/runbook.md has no section #{anchor}"
        start = sections[anchor]
        nxt = text.find("\n## ", start)
        body = text[start:nxt if nxt > 0 else None]
        assert "Check" in body and "Change" in body, f"#{anchor} must say what to check and what to change"


def test_rule_expressions_use_only_known_metrics_and_guard_divisions():
    allowed = all_series_names() | km.MASTER_SERIES | km.PROMETHEUS_SERIES
    for r in _rules():
        expr = r["expr"]
        names = {m for m, _ in lint.selectors(expr)} | set(lint.bare_names(expr))
        assert names and names <= allowed, (r["alert"], names - allowed)
        assert lint.unguarded_divisions(expr) == [], r["alert"]


def test_unit_tests_cover_every_alert_firing_and_silent():
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    fired, silent = set(), set()
    allowed = all_series_names() | km.MASTER_SERIES | km.PROMETHEUS_SERIES
    for test in doc["tests"]:
        for s in test["input_series"]:
            assert s["series"].split("{")[0] in allowed, s["series"]
        for case in test["alert_rule_test"]:
            (fired if case["exp_alerts"] else silent).add(case["alertname"])
    names = {r["alert"] for r in _rules()}
    assert fired == names, f"never shown firing: {names - fired}"
    # Silence is shown by an empty case or by a neighbour series that is absent from a firing case.
    assert len(silent) >= 5
