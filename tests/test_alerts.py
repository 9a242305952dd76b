"""The alert rules load in promtool, fire and stay silent on the right series, keep namespace, and each points to
its runbook section; the inhibit rules that go with them mute what they should in a real Alertmanager."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
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
INHIBIT = DASHBOARDS / "alertmanager-inhibit.yaml"

import alerts  # noqa: E402
import known_metrics as km  # noqa: E402
import lint  # noqa: E402
import queries as q  # noqa: E402

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

REQUIRED = {"MooncakeLookupTimeouts", "MooncakeLookupErrorRatioHigh", "MooncakeLookupBreakerOpen",
            "MooncakeLookupPendingNearBound", "MooncakeLookupDeferredStepsHigh", "MooncakeLookupServerDown",
            "MooncakeLookupMetricsAbsent", "MooncakeMasterUnreachable", "MooncakeMasterReplaced",
            "MooncakeMasterNearCapacity", "MooncakeMasterNeverScraped", "MooncakeLookupPrefixCacheOff"}
# Severity by reasoning (docs/runbook.md, "Severities and inhibitions"): only the master, whose loss empties the
# store for every engine and blocks the worker's store calls, pages; every lookup failure is a miss.
CRITICAL = {"MooncakeMasterUnreachable"}


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_check_rules_passes(promtool):
    assert f"SUCCESS: {len(_rules())} rules found" in promtool.check_rules(RULES)


def unit_tests_with_runbooks(rules_doc: dict) -> str:
    """alerts.test.yaml with each expected alert's ``runbook`` annotation added: that text is docs/runbook.md's
    section, the same in every firing (tests of it: test_required_alerts_exist_with_severity_and_annotations), so
    the hand-written expectations leave it out and promtool, which compares every annotation, gets it here."""
    runbooks = {r["alert"]: r["annotations"]["runbook"] for g in rules_doc["groups"] for r in g["rules"]}
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            for expected in case.get("exp_alerts") or []:
                expected.setdefault("exp_annotations", {})["runbook"] = runbooks[case["alertname"]]
    return yaml.safe_dump(doc, sort_keys=False, width=1_000_000)


def test_promtool_unit_tests_pass(promtool, tmp_path):
    shutil.copy(RULES, tmp_path / "alerts.rules.yaml")
    (tmp_path / "alerts.test.yaml").write_text(unit_tests_with_runbooks(yaml.safe_load(RULES.read_text())))
    run = promtool.run("test", "rules", "alerts.test.yaml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


# Each mutation breaks one rule the way a plausible bug would: (alert, text in its expr, replacement).
MUTATIONS = {
    "error threshold tripled": ("MooncakeLookupErrorRatioHigh", f"> {alerts.ERROR_RATIO}",
                                f"> {alerts.ERROR_RATIO * 3}"),
    "pending compared with the default bound, not the gauge": (
        "MooncakeLookupPendingNearBound", f"({q.gauge(MAX_PENDING.name, 'max', q.ALERT_BY, variables=None)} > 0)",
        str(KEYS_BY_NAME["lookup_max_pending"].default)),
    "rejections no longer alert": ("MooncakeLookupPendingNearBound", "\nor\n", "\nunless\n"),
    "namespace dropped from the grouping": ("MooncakeLookupErrorRatioHigh", "namespace, pod, job", "pod, job"),
    "capacity at a fixed share, not the watermark": (
        "MooncakeMasterNearCapacity", f"{alerts.WATERMARK_SHARE} * {alerts.EVICTION_WATERMARK}", "0.9"),
    "a vanished master goes unnoticed": ("MooncakeMasterUnreachable", "\nor\n", "\nand\n"),
    "a crash-looping master goes unnoticed": (
        "MooncakeMasterUnreachable", f"avg_over_time(up[{alerts.WINDOW}]) < {alerts.UP_SHARE}", "up == 0"),
    "a lost index is taken for a quiet store": (
        "MooncakeMasterReplaced", f"< {alerts.INDEX_LOST_SHARE} *", "< 0.001 *"),
    "engines without the plugin go unnoticed": ("MooncakeLookupMetricsAbsent", "(up == 1)", "(up == 2)"),
    "a master that answers no scrape goes unnoticed": ("MooncakeMasterNeverScraped", "\n== 0", "\n== 1"),
    "a prefix cache off by choice pages": ("MooncakeLookupPrefixCacheOff", 'state="unproven"', 'state!="on"'),
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
    (tmp_path / "alerts.test.yaml").write_text(unit_tests_with_runbooks(doc))
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
        assert r["labels"]["severity"] == ("critical" if r["alert"] in CRITICAL else "warning"), r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        # The runbook travels in the alert (the project has no public home to link to); the chart adds a
        # runbook_url only where monitoring.prometheusRule.runbookBaseUrl says the team hosts it.
        assert "runbook_url" not in ann and ann["runbook"] == alerts.runbook_steps(r["alert"]), r["alert"]


def _github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_alert_has_a_runbook_section_that_says_what_to_check_and_change():
    text = RUNBOOK.read_text()
    sections = {_github_anchor(m.group(1)): m.end() for m in re.finditer(r"^## (.+)$", text, re.M)}
    for r in _rules():
        anchor = r["alert"].lower()  # the chart's runbook_url anchor
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


def test_every_alert_expression_keeps_namespace():
    """Every grouping (by / on) names namespace, nothing drops labels wholesale, and the unit tests show it kept."""
    for r in _rules():
        expr = r["expr"]
        assert not re.search(r"\b(without|ignoring)\s*\(", expr), r["alert"]
        groupings = re.findall(r"\b(by|on)\s*\(([^)]*)\)", expr)
        assert groupings, r["alert"]
        for _, labels in groupings:
            assert "namespace" in [x.strip() for x in labels.split(",")], (r["alert"], labels)
        # An aggregation without a grouping keeps no labels at all.
        assert not re.search(r"\b(sum|max|min|avg|count|group)\s*\(", expr.replace("histogram_quantile(", "")), (
            r["alert"], "aggregation without by (...)")
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    with_namespace = set()
    for test in doc["tests"]:
        for case in test["alert_rule_test"]:
            for alert in case["exp_alerts"]:
                if "namespace" in alert["exp_labels"]:
                    with_namespace.add(case["alertname"])
    assert with_namespace == {r["alert"] for r in _rules()}


def test_capacity_alert_carries_the_watermark_marker_the_chart_replaces():
    [rule] = [r for r in _rules() if r["alert"] == "MooncakeMasterNearCapacity"]
    assert rule["expr"].endswith(f"> {alerts.WATERMARK_SHARE} * {alerts.EVICTION_WATERMARK} {alerts.WATERMARK_MARKER}")
    assert RULES.read_text().count(alerts.WATERMARK_MARKER) == 2  # the rule and the header that explains it


# -- Inhibitions, in a real Alertmanager -------------------------------------------------------------------

def test_inhibit_rules_file_is_generated_and_names_only_real_alerts():
    doc = yaml.safe_load(INHIBIT.read_text())
    names = {r["alert"] for r in _rules()}
    assert len(doc["inhibit_rules"]) == len(alerts.INHIBITIONS)
    for rule in doc["inhibit_rules"]:
        assert "namespace" in rule["equal"]
        for key in ("source_matchers", "target_matchers"):
            (matcher,) = rule[key]
            listed = set(re.fullmatch(r'alertname=~"(.*)"', matcher).group(1).split("|"))
            assert listed and listed <= names, listed - names
    text = RUNBOOK.read_text()
    for inh in alerts.INHIBITIONS:
        assert inh.why in text, f"docs/runbook.md does not explain the inhibition: {inh.why}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _am(url: str, path: str, body: list | None = None) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=5) as reply:
        raw = reply.read()
    return json.loads(raw) if raw else None


def test_inhibit_rules_mute_symptoms_in_the_same_namespace_only(require_tool, tmp_path):
    """A firing MooncakeMasterUnreachable mutes lookup timeouts of its namespace, not of another one."""
    binary = require_tool("prometheus-alertmanager")
    inhibit = yaml.safe_load(INHIBIT.read_text())["inhibit_rules"]
    config = {"route": {"receiver": "null", "group_by": ["namespace"]}, "receivers": [{"name": "null"}],
              "inhibit_rules": inhibit}
    (tmp_path / "am.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([shutil.which("amtool") or binary.replace("prometheus-alertmanager", "amtool"),
                            "check-config", str(tmp_path / "am.yml")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = _free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # poll until the API answers (bounded)
            try:
                _am(url, "/api/v2/status")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "alertmanager did not start within 30 s"
                time.sleep(0.1)
        now = datetime.now(timezone.utc)
        window = {"startsAt": now.isoformat(), "endsAt": (now + timedelta(minutes=10)).isoformat()}

        def alert(name: str, namespace: str, severity: str) -> dict:
            return {"labels": {"alertname": name, "namespace": namespace, "severity": severity, "job": "x"},
                    **window}

        _am(url, "/api/v2/alerts", [alert("MooncakeMasterUnreachable", "serving", "critical"),
                                    alert("MooncakeLookupTimeouts", "serving", "warning"),
                                    alert("MooncakeLookupTimeouts", "other", "warning"),
                                    alert("MooncakeMasterNearCapacity", "serving", "warning")])
        deadline = time.monotonic() + 30
        while True:  # inhibition is evaluated as alerts are listed; poll until all four are there (bounded)
            listed = _am(url, "/api/v2/alerts")
            state = {(a["labels"]["alertname"], a["labels"]["namespace"]): a["status"] for a in listed}
            if len(state) == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        muted = {key for key, status in state.items() if status["inhibitedBy"]}
        assert muted == {("MooncakeLookupTimeouts", "serving"), ("MooncakeMasterNearCapacity", "serving")}, state
        assert state[("MooncakeLookupTimeouts", "other")]["state"] == "active"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
