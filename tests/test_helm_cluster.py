"""What a real cluster needs of the chart beyond rendering: probes and a preStop pause that survive a loaded engine,
memory limits that hold what Mooncake and /dev/shm take, RDMA that can open the NIC, an etcd that keeps its
quorum and its size, and refusals, naming the values to change, of what would fail only on the cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)


def pod_spec(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    return chart.one(objects, kind, suffix)["spec"]["template"]["spec"]


def container(objects: list[dict[str, Any]], kind: str = "Deployment", suffix: str = "-engine") -> dict[str, Any]:
    (only,) = pod_spec(objects, kind, suffix)["containers"]
    return only


# -- probes and shutdown -------------------------------------------------------------------------------------------

def test_engine_probes_allow_a_loaded_engine_five_seconds_and_a_prestop_pause_covers_endpoint_removal():
    values = chart.load_values()["engine"]
    engine = container(chart.template())
    for probe, key in (("startupProbe", "startup"), ("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        assert engine[probe]["timeoutSeconds"] == values["probes"][key]["timeoutSeconds"] == 5, probe
    assert engine["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    # Both are values (the schema used to refuse them), passed through as set.
    objects = chart.template(sets={"engine.probes.liveness.timeoutSeconds": "20", "engine.preStopSleepSeconds": "30",
                                   "engine.lifecycle": '{"postStart": {"exec": {"command": ["true"]}}}'})
    engine = container(objects)
    assert engine["livenessProbe"]["timeoutSeconds"] == 20
    assert engine["lifecycle"] == {"postStart": {"exec": {"command": ["true"]}},
                                   "preStop": {"exec": {"command": ["sleep", "30"]}}}
    # A preStop of one's own replaces the pause (helm would merge two handlers into one invalid hook otherwise).
    own = {"preStop": {"sleep": {"seconds": 15}}}
    assert container(chart.template(sets={"engine.lifecycle": json.dumps(own)}))["lifecycle"] == own
    assert "lifecycle" not in container(chart.template(sets={"engine.preStopSleepSeconds": "0"}))
    master = container(chart.template(sets={"master.probes.readiness.timeoutSeconds": "7"}), suffix="-master")
    assert master["readinessProbe"]["timeoutSeconds"] == 7 and master["livenessProbe"]["timeoutSeconds"] == 3


def test_a_pause_that_takes_the_whole_grace_period_is_refused():
    with pytest.raises(chart.HelmError, match="engine.preStopSleepSeconds 60 must be below "
                                              "engine.terminationGracePeriodSeconds 60"):
        chart.template(sets={"engine.preStopSleepSeconds": "60"})


@pytest.mark.parametrize("key", ["engine.probes.readiness.timeoutSeconds", "master.probes.liveness.timeoutSeconds"])
def test_a_probe_timeout_must_be_a_positive_number_of_seconds(key):
    with pytest.raises(chart.HelmError, match=key.rsplit(".", 1)[0]):
        chart.template(sets={key: "0"})
