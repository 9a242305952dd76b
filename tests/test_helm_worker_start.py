"""Every value set of the chart starts the engine's lookup path: render it, then run the worker's lookup-server
start path with the rendered config, as the engine pod's user, in a filesystem laid out like the pod's.

For each of the default values, every ``ci/*-values.yaml`` and the default values with the pipelined transport
(which is about to become the default), a child process running as the pod's ``runAsUser`` (when the test runs as
root, as CI does) does what vLLM's worker and scheduler do with the rendered ``--kv-transfer-config``:

- the worker starts upstream's real ``LookupKeyServer`` where vLLM binds it and, with ``lookup_transport:
  pipelined``, our ``LookupServer`` beside it (``serve_pipelined``, at the address our config derives);
- the scheduler builds its ``LookupClient`` from the same config (``LookupClient.from_vllm_config``) and must get
  a full hit for a prefix stored in a real Mooncake master.

The pod's filesystem is modelled under a folder of its own: the image's ``/tmp`` (1777, root's), each volume
the chart mounts into the engine as Kubernetes creates it (emptyDir 0777, group fsGroup), every absolute path
of the rendered environment and lookup address moved under that folder, and the hostname the longest name
Kubernetes gives a pod of the rendered Deployment (IPC paths name the host, and a socket path holds at most
107 characters), shortened by the length of that folder so that every path the host names has its length in the
pod. An ``ipc://`` path under ``/tmp`` (what
ci/pipelined-values.yaml once set) is refused there exactly as in a pod: the last set shows it. A Secret volume
(CURVE keys, ci/curve-values.yaml) gets real zmq.auth key files as its items name them, with the volume's mode
and the pod's fsGroup; a TCP lookup address is moved to a free loopback port (tests stay on loopback), and the
worker's server and the scheduler's client must then meet over CURVE. Run as a
non-root user (or with an interpreter the pod's uid may not execute, e.g. one under a private home), the test
cannot switch uid and runs as itself; the /tmp refusal and the private folder still show.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.curve import create_key_files

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

BLOCK = 16
CHILD_BOUND_S = 240  # a cold vLLM import in the child takes ~10 s; each set's lookups are bounded below
VALUE_SETS = {"default": ([], {}),
              # A long release name: pods of up to 63 characters name the IPC paths.
              "long-release-pipelined": ([], {"engine.connector.lookup.lookup_transport": '"pipelined"',
                                              "fullnameOverride": '"' + "l" * 56 + '"'}),
              **{name: ([path], {}) for name, path in chart.ci_value_sets().items()},
              "default-pipelined": ([], {"engine.connector.lookup.lookup_transport": '"pipelined"'}),
              # What ci/pipelined-values.yaml set before: a socket directly in /tmp. The worker must refuse it.
              "ipc-in-shared-tmp": ([], {"engine.connector.lookup.lookup_transport": '"pipelined"',
                                         "engine.connector.lookup.lookup_server_address":
                                             '"ipc:///tmp/mooncake-lookout-lookup.sock"'})}
REFUSED = {"ipc-in-shared-tmp"}

# The worker's and the scheduler's start path, per value set (jobs as JSON on stdin, results on stdout).
CHILD = r"""
import json, os, socket, sys, tempfile, time, uuid
jobs = json.load(sys.stdin)
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer, lookup_vllm_config
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.connector.server.worker_backend import serve_pipelined
store = open_writer_store(jobs.pop("__master__"))
block = 16
out = {}
for name, job in jobs.items():
    for key in job["unset"]:
        os.environ.pop(key, None)
    os.environ.update(job["env"])
    tempfile.tempdir = None  # read TMPDIR again, as a fresh pod would
    socket.gethostname = lambda name=job["hostname"]: name  # a pod's hostname is its name
    index = PrefixIndex(store, block, namespace="w-" + uuid.uuid4().hex[:8])
    hashes = unique_hashes(4, seed=7)
    index.store_prefixes([hashes])
    stops = []
    try:
        cfg = lookup_vllm_config(extra_config=job["extra"])
        config = LookupConfig.from_extra_config(cfg.kv_transfer_config.kv_connector_extra_config)
        upstream = UpstreamLookupServer(index, cfg).start()  # what the worker's rank 0 always runs
        stops.append(upstream.stop)
        upstream.worker.lookup_server = upstream.server
        result = {"ok": True, "transport": config.lookup_transport, "upstream": upstream.address}
        if config.lookup_transport == "pipelined":
            ours = serve_pipelined(cfg, config, upstream.worker)
            stops.append(ours.close)
            result["ours"] = ours.address
            result["curve"] = ours.curve is not None
        client = LookupClient.from_vllm_config(cfg)  # what the scheduler builds from the same config
        stops.append(client.close)
        deadline, n, hit = time.monotonic() + 10.0, 0, 0
        while hit != len(hashes) * block and time.monotonic() < deadline:
            n += 1
            hit = client.lookup(f"r{n}", len(hashes) * block + 1, hashes).hit_length
        result["hit"] = hit
        result["uid"] = os.getuid()
        out[name] = result
    except Exception as exc:
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for stop in reversed(stops):
            stop()
        index.remove_all(force=True)
store.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def engine_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]


def build_pod_root(root: Path, pod: dict[str, Any], gid: int | None, keys: Path) -> None:
    """Lay out the engine pod's filesystem under ``root``: the image's /tmp and every volume as Kubernetes mounts it
    (a Secret's items from the files of the same names in ``keys``)."""
    as_root = os.getuid() == 0
    root.mkdir(mode=0o755)
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)  # the image's /tmp: anyone may enter, so no private socket folder
    volumes = {v["name"]: v for v in pod["volumes"]}
    (container,) = pod["containers"]
    for mount in container["volumeMounts"]:
        path = root / mount["mountPath"].lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "emptyDir" in volume or "persistentVolumeClaim" in volume:
            mode = 0o777 if "emptyDir" in volume else 0o775
            if gid is not None and as_root:  # fsGroup: group-owned, setgid, group-writable
                os.chown(path, 0, gid)
                mode |= stat.S_ISGID
            os.chmod(path, mode)
        elif "secret" in volume:  # the kubelet writes each item with the volume's mode, group fsGroup
            secret = volume["secret"]
            for item in secret["items"]:
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(keys / item["key"], target)
                if gid is not None and as_root:
                    os.chown(target, 0, gid)
                os.chmod(target, secret.get("defaultMode", 0o644))
            for folder in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
                os.chmod(folder, 0o755)
        else:  # configMap, hostPath: not the engine's to write
            os.chmod(path, 0o755)


def inside(root: Path, value: str) -> str:
    """A path of the pod (or an ipc:// address) moved under ``root``."""
    if value.startswith("ipc:///"):
        return "ipc://" + str(root) + value.removeprefix("ipc://")
    return str(root) + value if value.startswith("/") else value


def job_for(name: str, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the child needs for one value set, and the pod spec it came from."""
    files, sets = VALUE_SETS[name]
    objects = chart.template(files, sets=sets)
    pod = engine_pod(objects)
    (container,) = pod["containers"]
    args = container["args"]
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    if extra.get("lookup_server_address", "").startswith("tcp://"):  # tests stay on loopback
        from mooncake_lookout.connector.rigs.master import free_port

        extra["lookup_server_address"] = f"tcp://127.0.0.1:{free_port()}"
    elif extra.get("lookup_server_address"):
        extra["lookup_server_address"] = inside(root, extra["lookup_server_address"])
    for key in [k for k in extra if k.startswith("lookup_curve_") and extra[k]]:
        extra[key] = inside(root, extra[key])
    env = {e["name"]: inside(root, e["value"]) for e in container["env"] if "value" in e}
    env["TMPDIR"] = str(root / "tmp")  # the image sets none: Python's temp dir is /tmp
    env.setdefault("VLLM_CACHE_ROOT", env["HOME"] + "/.cache/vllm")
    unset = [k for k in ("VLLM_RPC_BASE_PATH", "TMPDIR") if k not in env]  # nothing of this test session leaks in
    return {"extra": extra, "env": env, "unset": unset, "hostname": pod_hostname(objects)}, pod


def pod_hostname(objects: list[dict[str, Any]]) -> str:
    """The longest hostname a pod of the engine Deployment gets: <deployment>-<pod-template-hash>-<5 chars>, its
    name, cut at 63 characters (Kubernetes: the hash takes up to 10 characters)."""
    name = chart.one(objects, "Deployment", "-engine")["metadata"]["name"]
    return f"{name}-5d8f7c9b6d-x7k2p"[:63]


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, mooncake_master: Any) -> dict[str, Any]:
    """Run the child once for every value set; returns its results, the pod roots and the uid used."""
    # A short folder: a socket path holds at most 107 characters, and the pod's own paths must fit, not ours.
    base = Path(tempfile.mkdtemp(prefix="lw", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    os.chmod(base, 0o755)
    jobs: dict[str, Any] = {"__master__": mooncake_master.rpc_address}
    roots: dict[str, Path] = {}
    user = None
    keys = base / "keys"  # what a CURVE Secret holds (ci/curve-values.yaml): real zmq.auth certificates
    create_key_files(str(keys), "server")
    create_key_files(str(keys), "client")
    for i, name in enumerate(VALUE_SETS):
        roots[name] = base / str(i)
        job, pod = job_for(name, roots[name])
        security = pod.get("securityContext", {})
        user = (security["runAsUser"], security["runAsGroup"], security.get("fsGroup"))
        build_pod_root(roots[name], pod, user[2], keys)
        jobs[name] = job
    uid, gid, fs_group = user

    def drop_privileges() -> None:  # the engine container's uid and groups (only root can switch)
        os.setgroups([fs_group] if fs_group is not None else [])
        os.setgid(gid)
        os.setuid(uid)

    switch = os.getuid() == 0 and _runs_as(drop_privileges)
    run_uid = uid if switch else os.getuid()
    for name, root in roots.items():
        # Paths under the pod root are longer by its own length (and by a uid written with more digits than the
        # pod's): take that off the hostname they contain, so each path has the length it has in the pod.
        extra_chars = len(str(root)) + len(str(run_uid)) - len(str(uid))
        jobs[name]["hostname"] = jobs[name]["hostname"][:len(jobs[name]["hostname"]) - extra_chars]
    if switch:  # the pod's user must own what it creates in emptyDirs: give the roots' volumes the pod's view
        for root in roots.values():
            os.chown(root / "tmp", 0, 0)

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_RPC_BASE_PATH", "TMPDIR")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR", MC_LOG_LEVEL="ERROR",
               HOME=str(base), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(jobs), capture_output=True, text=True,
                          env=env, timeout=CHILD_BOUND_S, preexec_fn=drop_privileges if switch else None, cwd=base)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the start path failed outright:\n{done.stderr[-4000:]}"
    return {"results": json.loads(lines[0].removeprefix("RESULT ")), "roots": roots, "uid": run_uid}


def _runs_as(preexec: Any) -> bool:
    """True if this interpreter starts under the pod's uid (it may sit in a folder only root can enter)."""
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=preexec, check=True, timeout=60,
                       capture_output=True)
    except (PermissionError, subprocess.CalledProcessError):
        print(f"note: {sys.executable} cannot run as the pod's uid here; the start path runs as uid {os.getuid()}")
        return False
    return True


@pytest.mark.parametrize("name", sorted(set(VALUE_SETS) - REFUSED))
def test_value_set_starts_the_engines_lookup_path(started, name):
    result = started["results"][name]
    assert result["ok"], f"{name}: the worker's lookup server did not start: {result.get('error')}"
    assert result["uid"] == started["uid"]
    assert result["hit"] == 4 * BLOCK, f"{name}: the scheduler's client got {result['hit']} tokens, not a full hit"
    root = started["roots"][name]
    assert result["upstream"].startswith(f"ipc://{root}/tmp/")  # vLLM's channel in the pod's temp dir
    if result.get("ours", "").startswith("tcp://"):  # a TCP channel: only with CURVE (the hit came over it)
        assert result["curve"] and result["ours"].startswith("tcp://127.0.0.1:"), result
    elif result["transport"] == "pipelined":
        # Ours: a socket in a private folder of the engine's uid (0700), derived alike by worker and scheduler.
        path = Path(result["ours"].removeprefix("ipc://"))
        folder = path.parent
        assert folder == root / "tmp" / f"mooncake-lookout-{started['uid']}", result["ours"]
        st = folder.stat()
        assert st.st_uid == started["uid"] and stat.S_IMODE(st.st_mode) == 0o700


def test_every_file_of_ci_is_a_value_set_this_test_starts():
    """A value set is found by its name (``*-values.yaml``): a file of ci/ named otherwise would go unstarted."""
    files = {p.name for p in chart.CI_VALUES.iterdir() if p.is_file()}
    assert files == {p.name for p in chart.ci_value_sets().values()}
    assert set(chart.ci_value_sets()) <= set(VALUE_SETS)


def test_every_pipelined_set_is_covered():
    """The sets that select the pipelined transport, including the default values once it is the default."""
    pipelined = set()
    for name, (files, sets) in VALUE_SETS.items():
        objects = chart.template(files, sets=sets)
        (container,) = engine_pod(objects)["containers"]
        extra = json.loads(container["args"][container["args"].index("--kv-transfer-config") + 1])[
            "kv_connector_extra_config"]
        if extra["lookup_transport"] == "pipelined":
            pipelined.add(name)
    assert {"pipelined", "ha", "default-pipelined"} <= pipelined


def test_an_ipc_path_in_the_shared_tmp_is_refused_at_start(started):
    """The control: the address ci/pipelined-values.yaml used to set fails the worker's start, naming the fix."""
    result = started["results"]["ipc-in-shared-tmp"]
    assert not result["ok"]
    assert "PermissionError" in result["error"] and "0700" in result["error"], result["error"]
