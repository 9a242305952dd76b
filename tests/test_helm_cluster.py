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


# -- probes and shutdown ---------------------------------------------------------------------------------------------

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


# -- memory ----------------------------------------------------------------------------------------------------------

GIB = 1 << 30


def memory_message(sets: dict[str, str], values_files=()) -> str:
    with pytest.raises(chart.HelmError) as failed:
        chart.template(values_files, sets=sets)
    return str(failed.value)


def test_every_value_set_holds_its_ranks_segments_and_shm_in_the_memory_limit():
    """Each value set renders, so each passed the check; pipelined (2 ranks x (16 + 4) GB) had to grow to 64Gi."""
    for name, path in {"default": None, **chart.ci_value_sets()}.items():
        objects = chart.template([path] if path else [])
        assert chart.find(objects, "Deployment", "-engine"), name
    pipelined = container(chart.template([chart.ci_value_sets()["pipelined"]]))
    assert pipelined["resources"]["limits"]["memory"] == "64Gi"
    assert pipelined["args"][pipelined["args"].index("--tensor-parallel-size") + 1] == "2"


def test_an_engine_limit_that_cannot_hold_the_store_clients_is_refused_naming_every_size():
    """What ci/pipelined-values.yaml asked before: two ranks of 16 GB + 4 GB, /dev/shm 8Gi, in a 32Gi limit."""
    message = memory_message({"engine.tensorParallelSize": "2", "engine.mooncake.globalSegmentSize": '"16GB"',
                              "engine.resources.limits.nvidia\\.com/gpu": "2"})
    for part in ("engine.resources.limits.memory 32Gi (32.0 GiB)", "2 rank(s)", "engine.tensorParallelSize 2",
                 "engine.mooncake.globalSegmentSize 16GB", "engine.mooncake.localBufferSize 4GB", "= 40.0 GiB",
                 "/dev/shm 8Gi", "engine.memoryHeadroom 8Gi", "56.0 GiB", "Raise engine.resources.limits.memory"):
        assert part in message, (part, message)


@pytest.mark.parametrize("sets, fits", [
    # 8 + 8 + 8 = 24 GiB in 32Gi.
    ({}, True),
    # Exactly the limit fits: 2 x 8 + 8 + 8 = 32 GiB.
    ({"engine.tensorParallelSize": "2", "engine.resources.limits.nvidia\\.com/gpu": "2"}, True),
    # One byte over: 24 GiB + 8 GiB + 1 B in 32Gi.
    ({"engine.memoryHeadroom": '"17179869185"'}, False),
    # /dev/shm off frees its 8Gi.
    ({"engine.memoryHeadroom": '"16Gi"', "engine.shm.enabled": "false"}, True),
    # standalone-store lends no segment: 4 x 4 + 8 + 8 = 32 GiB.
    ({"engine.mooncake.mode": '"standalone-store"', "engine.dataParallelSize": "4",
      "engine.resources.limits.nvidia\\.com/gpu": "4"}, True),
    # ...embedded, the same pod needs 4 x 8 + 16 = 48 GiB.
    ({"engine.dataParallelSize": "4", "engine.resources.limits.nvidia\\.com/gpu": "4"}, False),
    # Units as Kubernetes writes them: 32000Mi is 31.25 GiB.
    ({"engine.resources.limits.memory": '"32000Mi"', "engine.tensorParallelSize": "2",
      "engine.resources.limits.nvidia\\.com/gpu": "2"}, False),
    # No memory limit: nothing is OOM-killed at a limit, nothing to check.
    ({"engine.resources.limits.memory": "null", "engine.resources.limits.nvidia\\.com/gpu": "8",
      "engine.tensorParallelSize": "8"}, True),
])
def test_the_memory_check_adds_what_the_pod_takes(sets, fits):
    if fits:
        assert chart.template(sets=sets)
    else:
        assert "cannot hold what the engine pod takes" in memory_message(sets)


def test_parallel_sizes_are_values_the_check_can_see_and_need_their_gpus():
    for flag in ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size=2", "--data-parallel-size"):
        message = memory_message({"engine.extraArgs": json.dumps([flag, "2"])})
        assert "engine.extraArgs sets" in message and "instead" in message, message
    assert "vLLM needs a GPU per rank" in memory_message({"engine.pipelineParallelSize": "2"})
    limits = '{"memory": "64Gi", "nvidia.com/gpu": 4}'
    args = container(chart.template(sets={"engine.pipelineParallelSize": "2", "engine.dataParallelSize": "2",
                                          "engine.resources.limits": limits}))["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "2" and "--tensor-parallel-size" not in args
    assert args[args.index("--data-parallel-size") + 1] == "2"


def test_a_store_pod_limit_must_hold_its_segment():
    sets = {"store.enabled": "true", "store.globalSegmentSize": '"17GB"'}  # 17 GiB + 64 MiB + 1 GiB > 18Gi
    message = memory_message(sets)
    assert "store.resources.limits.memory 18Gi (18.0 GiB) cannot hold a store pod" in message
    assert "store.globalSegmentSize 17GB + store.localBufferSize 64MB + store.memoryHeadroom 1Gi" in message
    assert chart.template(sets={"store.enabled": "true", "store.globalSegmentSize": '"16GB"'})


def test_standalone_store_engines_lend_no_segment():
    objects = chart.template(sets={"engine.mooncake.mode": '"standalone-store"'})
    config = json.loads(chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
    assert config["mode"] == "standalone-store" and config["global_segment_size"] == 0
    default = json.loads(chart.one(chart.template(), "ConfigMap", "-engine")["data"]["mooncake.json"])
    assert default["mode"] == "embedded" and default["global_segment_size"] == "4GB"


# -- RDMA ------------------------------------------------------------------------------------------------------------

def test_rdma_pods_get_the_device_plugin_resource_and_ipc_lock_not_a_host_path():
    objects = chart.template([chart.ci_value_sets()["pipelined"]], sets={"store.enabled": "true",
                                                                          "store.protocol": '"rdma"'})
    for suffix in ("-engine", "-store"):
        spec = pod_spec(objects, "Deployment", suffix)
        (c,) = spec["containers"]
        for part in ("requests", "limits"):
            assert c["resources"][part]["rdma/hca_shared_devices_a"] == 1, (suffix, part)
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"], suffix
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert "hostNetwork" not in spec
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], suffix
    # The master does no RDMA; TCP pods get none of it.
    assert "add" not in container(objects, suffix="-master")["securityContext"]["capabilities"]
    tcp = container(chart.template())
    assert "add" not in tcp["securityContext"]["capabilities"] and "rdma/hca_shared_devices_a" not in tcp["resources"][
        "limits"]


def test_no_value_set_mounts_devices_by_host_path():
    """A hostPath of /dev/infiniband adds no device to the container's device cgroup (what pipelined once did)."""
    for name, path in chart.ci_value_sets().items():
        for o in chart.template([path]):
            if o["kind"] in ("Deployment", "StatefulSet"):
                volumes = o["spec"]["template"]["spec"].get("volumes", [])
                assert not [v for v in volumes if v.get("hostPath", {}).get("path", "").startswith("/dev")], name


def test_rdma_on_the_host_network_keeps_cluster_dns_and_privileged_drops_the_escalation_guard():
    objects = chart.template([chart.ci_value_sets()["pipelined"]],
                             sets={"rdma.hostNetwork": "true", "rdma.privileged": "true", "rdma.resourceName": '""'})
    spec = pod_spec(objects, "Deployment", "-engine")
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    (c,) = spec["containers"]
    assert c["securityContext"]["privileged"] is True and "allowPrivilegeEscalation" not in c["securityContext"]
    assert not [k for k in c["resources"]["limits"] if k.startswith("rdma/")]
    assert "hostNetwork" not in pod_spec(objects, "Deployment", "-master")


def test_notes_warn_when_ipc_lock_cannot_reach_a_non_root_engine():
    notes = chart.render_notes([chart.ci_value_sets()["pipelined"]])
    assert "WARNING: the engine pods use RDMA with IPC_LOCK but run as uid 1000" in notes
    assert "WARNING" not in chart.render_notes()  # TCP
    root = {"engine.podSecurityContext.runAsUser": "0", "engine.podSecurityContext.runAsNonRoot": "false"}
    assert "WARNING" not in chart.render_notes([chart.ci_value_sets()["pipelined"]], sets=root)


# -- smaller things a cluster refuses --------------------------------------------------------------------------------

def test_no_value_set_asks_for_a_system_priority_class_outside_kube_system():
    """system-cluster-critical and system-node-critical are often admitted only in kube-system (ci/ha-values.yaml
    used the first); NOTES warns whoever sets them elsewhere."""
    for name, path in {"default": None, **chart.ci_value_sets()}.items():
        for o in chart.template([path] if path else []):
            if o["kind"] in ("Deployment", "StatefulSet"):
                assert not o["spec"]["template"]["spec"].get("priorityClassName", "").startswith("system-"), name
    notes = chart.render_notes(sets={"master.priorityClassName": '"system-cluster-critical"'})
    assert "WARNING: master.priorityClassName is system-cluster-critical" in notes
    assert "priorityClassName" not in chart.render_notes([chart.ci_value_sets()["ha"]])


def test_the_k8s_lease_backend_with_the_default_image_is_refused_naming_the_image():
    """Its master exits at start (tests/test_ha_failover.py shows it); only the docs said so."""
    sets = {"master.replicas": "2", "master.ha.enabled": "true", "master.ha.backend": '"k8s"'}
    with pytest.raises(chart.HelmError, match="master.ha.backend k8s needs a mooncake_master built with Mooncake's "
                                              "k8s lease support.*master.image.repository ghcr.io/mooncake-lookout"):
        chart.template(sets=sets)
    assert chart.template([chart.ci_value_sets()["ha-k8s"]])  # a build of one's own renders
    template = (chart.CHART / "templates" / "_helpers.tpl").read_text()
    default = chart.load_values()["master"]["image"]["repository"]
    assert f'define "lookout.defaultMasterRepository" -}}}}\n{default}\n' in template


def test_the_operation_log_is_offered_with_the_etcd_backend_only():
    objects = chart.template([chart.ci_value_sets()["ha"]], sets={"master.ha.oplog": "true"})
    assert "--enable_oplog=true" in container(objects, suffix="-master")["args"]
    assert "--enable_oplog=true" not in container(chart.template([chart.ci_value_sets()["ha"]]),
                                                  suffix="-master")["args"]
    with pytest.raises(chart.HelmError, match="master.ha.oplog needs master.ha.backend etcd"):
        chart.template([chart.ci_value_sets()["ha-k8s"]], sets={"master.ha.oplog": "true"})


# -- etcd ------------------------------------------------------------------------------------------------------------

def test_the_charts_etcd_keeps_its_quorum_through_drains_spreads_and_bounds_its_size():
    objects = chart.template([chart.ci_value_sets()["ha"]])
    etcd = chart.one(objects, "StatefulSet", "-etcd")
    spec = etcd["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert "--auto-compaction-mode=periodic" in args and "--auto-compaction-retention=10m" in args
    assert f"--quota-backend-bytes={4 << 30}" in args
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    pdb = chart.one(objects, "PodDisruptionBudget", "-etcd")["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"] == etcd["spec"]["selector"]
    # One member: no budget (it would block every drain).
    assert not chart.find(chart.template([chart.ci_value_sets()["ha"]], sets={"master.ha.etcd.replicas": "1"}),
                          "PodDisruptionBudget", "-etcd")
    hard = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app.kubernetes.io/component":
                                                                                    "etcd"}}}]}}
    objects = chart.template([chart.ci_value_sets()["ha"]], sets={"master.ha.etcd.affinity": json.dumps(hard)})
    assert pod_spec(objects, "StatefulSet", "-etcd")["affinity"] == hard


def test_an_etcd_quota_the_disk_cannot_hold_is_refused():
    with pytest.raises(chart.HelmError, match="master.ha.etcd.quotaBackendBytes 8Gi must be below "
                                              "master.ha.etcd.persistence.size 8Gi"):
        chart.template([chart.ci_value_sets()["ha"]], sets={"master.ha.etcd.quotaBackendBytes": '"8Gi"'})
    # Without persistence there is no claim to compare with.
    assert chart.template([chart.ci_value_sets()["ha"]], sets={"master.ha.etcd.quotaBackendBytes": '"8Gi"',
                                                                "master.ha.etcd.persistence.enabled": "false"})


# -- the model cache -------------------------------------------------------------------------------------------------

def test_the_model_cache_is_not_re_owned_on_every_start():
    objects = chart.template(sets={"engine.modelCache.enabled": "true"})
    assert pod_spec(objects, "Deployment", "-engine")["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


@pytest.mark.parametrize("sets", [
    {"engine.replicas": "2"},
    {"engine.modelCache.accessModes": '["ReadWriteOncePod"]', "engine.replicas": "3"},
    {"engine.strategy.rollingUpdate.maxSurge": "1"},
])
def test_a_one_node_claim_for_more_than_one_engine_pod_is_refused(sets):
    with pytest.raises(chart.HelmError, match=r"engine.modelCache.accessModes \[ReadWrite.*mount the claim on one "
                                              r"node.*Set engine.modelCache.accessModes \[ReadWriteMany\]"):
        chart.template(sets={"engine.modelCache.enabled": "true", **sets})


def test_a_shared_claim_or_one_engine_pod_renders():
    assert chart.template(sets={"engine.modelCache.enabled": "true"})  # one pod, no surge
    assert chart.template([chart.ci_value_sets()["async-budget"]])  # two pods, ReadWriteMany
    assert chart.template(sets={"engine.modelCache.enabled": "true", "engine.replicas": "2",
                                "engine.modelCache.existingClaim": '"models"'})  # its access modes are its own


# -- block hashes ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--prefix-caching-hash-algo", "xxhash"], ["--prefix-caching-hash-algo=xxhash_cbor"]])
def test_xxhash_block_hashes_without_a_shared_seed_are_refused(args):
    """vLLM 0.33 draws a random NONE_HASH seed per process for xxhash unless PYTHONHASHSEED is set: engines would
    never find each other's keys."""
    with pytest.raises(chart.HelmError, match="--prefix-caching-hash-algo xxhash.*Set engine.hashSeed.secretName"):
        chart.template(sets={"engine.extraArgs": json.dumps(args)})


def test_the_hash_seed_comes_from_a_secret():
    sets = {"engine.extraArgs": json.dumps(["--prefix-caching-hash-algo", "xxhash"]),
            "engine.hashSeed.secretName": '"lookout-hash-seed"'}
    env = {e["name"]: e for e in container(chart.template(sets=sets))["env"]}
    assert env["PYTHONHASHSEED"]["valueFrom"] == {"secretKeyRef": {"name": "lookout-hash-seed", "key": "seed"}}
    assert "PYTHONHASHSEED" not in {e["name"] for e in container(chart.template())["env"]}  # sha256: none needed
    own = {"engine.extraArgs": sets["engine.extraArgs"], "engine.env": '[{"name": "PYTHONHASHSEED", "value": "7"}]'}
    assert chart.template(sets=own)  # set by hand in engine.env: accepted


def test_notes_say_what_a_failover_does_to_the_cache():
    assert "A failover empties the cache" in chart.render_notes([chart.ci_value_sets()["ha"]])
    on = chart.render_notes([chart.ci_value_sets()["ha"]], sets={"master.ha.oplog": "true"})
    assert "a failover keeps the cache" in on and "quota 4Gi" in on
