"""Run the real helm v3 on the chart and hand back the rendered objects (used by the tests and by hand).

helm is looked up in LOOKOUT_HELM, then the project's .tools/helm (installed by scripts/setup.sh), then PATH.
A missing helm is an error with a clear message, never a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "mooncake-lookout"
CI_VALUES = CHART / "ci"
# What a cluster with the Prometheus Operator's CRDs serves, as helm's .Capabilities lists it (the group/version and
# each kind): with monitoring.enabled=auto (the default) the chart renders each monitoring kind only when the cluster
# serves it (helm template: --api-versions).
MONITORING_GROUP = "monitoring.coreos.com/v1"
MONITORING_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
MONITORING_APIS = (MONITORING_GROUP, *(f"{MONITORING_GROUP}/{kind}" for kind in MONITORING_KINDS))


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""


def helm_binary() -> str:
    """Path of a helm v3 binary, or a RuntimeError saying how to get one."""
    chosen = os.environ.get("LOOKOUT_HELM", "")
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise RuntimeError(f"LOOKOUT_HELM={chosen} is not an executable helm v3 binary")
        return chosen
    for candidate in (str(ROOT / ".tools" / "helm"), shutil.which("helm") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        "helm v3 not found (looked at $LOOKOUT_HELM, .tools/helm and PATH): run scripts/setup.sh, "
        "which installs it into .tools/helm, or point LOOKOUT_HELM at a helm v3 binary"
    )


def run_helm(*args: str, timeout: float = 60) -> str:
    """Run helm with args; return stdout or raise HelmError with stderr (symlink notices filtered out)."""
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        noise = "found symbolic link in path"
        stderr = "\n".join(line for line in proc.stderr.splitlines() if noise not in line)
        raise HelmError(f"helm {' '.join(args[:2])} failed:\n{stderr}")
    return proc.stdout


def template(values_files: Iterable[Path | str] = (), sets: dict[str, str] | None = None,
             kube_version: str = "1.32.0", release: str = "lookout", namespace: str = "serving",
             api_versions: Iterable[str] = ()) -> list[dict[str, Any]]:
    """``helm template`` the chart (hooks and tests included) and parse every rendered object.

    ``api_versions`` are the extra APIs the pretend cluster serves (e.g. :data:`MONITORING_APIS`)."""
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", kube_version]
    for api in api_versions:
        args += ["--api-versions", api]
    for path in values_files:
        args += ["--values", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set-json", f"{key}={value}"]
    text = run_helm(*args)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_notes(values_files: Iterable[Path | str] = (), release: str = "lookout",
                 namespace: str = "serving", workdir: Path | None = None,
                 sets: dict[str, str] | None = None, api_versions: Iterable[str] = ()) -> str:
    """NOTES.txt as helm would print it. ``helm install --dry-run`` needs a cluster and ``helm template`` skips
    NOTES, so render a copy of the chart in which a ConfigMap carries ``tpl`` of NOTES.txt."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        copy = Path(tmp) / CHART.name
        shutil.copytree(CHART, copy, symlinks=False)
        (copy / "notes-src").mkdir()
        (copy / "templates" / "NOTES.txt").rename(copy / "notes-src" / "NOTES.txt")
        (copy / "templates" / "notes-as-configmap.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
            '  notes: {{ tpl (.Files.Get "notes-src/NOTES.txt") $ | toJson }}\n')
        args = ["template", release, str(copy), "--namespace", namespace,
                "--show-only", "templates/notes-as-configmap.yaml"]
        for api in api_versions:
            args += ["--api-versions", api]
        for path in values_files:
            args += ["--values", str(path)]
        for key, value in (sets or {}).items():
            args += ["--set-json", f"{key}={value}"]
        text = run_helm(*args)
    return yaml.safe_load(text)["data"]["notes"]


CRD_SCHEMAS = Path(__file__).with_name("prometheus-operator-crds.json")


def _strict(node: Any) -> Any:
    """A CRD's structural schema as the API server applies it with field validation Strict: an object with
    properties admits no other field (unless x-kubernetes-preserve-unknown-fields), int-or-string takes either."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k == "properties" else _strict(v)) for k, v in node.items()}
    if "properties" in node:
        out["properties"] = {name: _strict(sub) for name, sub in node["properties"].items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("type") == "object" and "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def validate_monitoring(obj: dict[str, Any]) -> None:
    """Check a monitoring.coreos.com/v1 object against its CRD's schema (prometheus-operator's, see
    prometheus-operator-crds.json's "source"), strictly; kubernetes-validate has none. Raises ValueError."""
    import json

    import jsonschema

    schemas = json.loads(CRD_SCHEMAS.read_text())["schemas"]
    if obj.get("apiVersion") != MONITORING_GROUP or obj.get("kind") not in schemas:
        raise ValueError(f"{obj.get('apiVersion')}/{obj.get('kind')} is not a Prometheus Operator kind this knows")
    meta = obj["metadata"]
    if set(meta) - {"name", "namespace", "labels", "annotations"} or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in {**meta.get("labels", {}),
                                                                  **meta.get("annotations", {})}.items()):
        raise ValueError(f"{obj['kind']} {meta.get('name')}: bad metadata {meta}")
    errors = sorted(jsonschema.Draft7Validator(_strict(schemas[obj["kind"]])).iter_errors(obj), key=str)
    if errors:
        raise ValueError(f"{obj['kind']} {meta['name']}: {errors[0].message} at {list(errors[0].path)}")


def ci_value_sets() -> dict[str, Path]:
    """The chart's ci/*-values.yaml files by short name (``async-budget``, ...)."""
    return {p.name.removesuffix("-values.yaml"): p for p in sorted(CI_VALUES.glob("*-values.yaml"))}


def find(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    """Objects of one kind whose name ends with name_suffix."""
    return [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    """The single object of that kind and name suffix (AssertionError otherwise)."""
    found = find(objects, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def load_values() -> dict[str, Any]:
    """The chart's default values."""
    return yaml.safe_load((CHART / "values.yaml").read_text())


__all__ = ["CHART", "CI_VALUES", "CRD_SCHEMAS", "MONITORING_APIS", "MONITORING_GROUP", "MONITORING_KINDS", "ROOT",
           "HelmError", "ci_value_sets", "find", "helm_binary", "load_values", "one", "render_notes", "run_helm",
           "template", "validate_monitoring"]
