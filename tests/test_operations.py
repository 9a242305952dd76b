"""What docs/operations.md tells an operator to do, done here with the real parts.

* Roll back to vLLM's own connector: the chart rendered with ``engine.connector.name=MooncakeStoreConnector`` gives
  a ``--kv-transfer-config`` that vLLM's connector factory loads as upstream's connector and scheduler.
* Switch lookups off: with ``enable_lookup: false`` (rendered by the chart from ``engine.connector.extraConfig``)
  vLLM's real scheduler with our connector starts no lookup and schedules every request; the control (the same
  without the switch) does start them.
* Logs: inside vLLM (its logging configured as the engine core does), our WARNING lines reach stderr bare and INFO
  is dropped; with docs/vllm-logging.json both come with time, level and logger name.
* ``doctor`` in a pod: the documented command finds and probes the lookup server at the address the worker derives.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import OutcomeCounter
from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_kv_cache_config, make_vllm_config

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"
BLOCK = 16


def rendered_transfer_config(sets: dict[str, str]) -> dict[str, Any]:
    objects = chart.template([], sets=sets)
    (container,) = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"]
    return json.loads(container["args"][container["args"].index("--kv-transfer-config") + 1])


# -- switch off, roll back ---------------------------------------------------------------------------------------

def test_the_rollback_name_loads_vllms_own_connector_and_scheduler() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import MooncakeStoreScheduler

    from mooncake_lookout.connector.scheduler_adapter import retire_upstream_client

    transfer = rendered_transfer_config({"engine.connector.name": '"MooncakeStoreConnector"',
                                         "engine.connector.lookup.lookup_async": "true"})
    assert transfer["kv_connector"] == "MooncakeStoreConnector" and "kv_connector_module_path" not in transfer
    extra = transfer["kv_connector_extra_config"]
    assert any(k.startswith("lookup_") and k != "lookup_async" for k in extra)  # ours stay, upstream ignores them
    vllm_config = make_vllm_config(extra, connector=transfer["kv_connector"], module_path=None,
                                   kv_role=transfer["kv_role"])
    assert KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config) is MooncakeStoreConnector
    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(64))
    try:
        assert type(connector) is MooncakeStoreConnector
        assert type(connector.connector_scheduler) is MooncakeStoreScheduler
        assert connector.connector_scheduler.lookup_async is True  # upstream's own key, same meaning
    finally:
        retire_upstream_client(connector.connector_scheduler.client)


def _run_scheduler(extra: dict[str, Any], requests: int = 6) -> tuple[OutcomeCounter, Any]:
    driver = SchedulerDriver(make_vllm_config(extra), num_blocks=512)
    counter = OutcomeCounter()
    driver.connector.lookup_client.observers.add(counter)
    try:
        for i in range(requests):
            driver.add(driver.make_request(f"r{i}", [i + 1] * (4 * BLOCK + 1)))
        stats = driver.run_until_idle(max_steps=2000)
    finally:
        driver.close()
    return counter, stats


def test_enable_lookup_false_starts_no_lookup_and_serves_every_request() -> None:
    transfer = rendered_transfer_config({"engine.connector.extraConfig": '{"enable_lookup": false}'})
    extra = transfer["kv_connector_extra_config"]
    assert extra["enable_lookup"] is False
    # No lookup server anywhere: any lookup started would end as a timeout (the control below shows it).
    extra = {**extra, "lookup_async": True, "lookup_timeout_ms": 50,
             "lookup_server_address": f"ipc://{tempfile.mkdtemp(prefix='no-server-')}/none.sock"}
    counter, stats = _run_scheduler(extra)
    assert sum(counter.outcomes.values()) == 0 and counter.records == []
    assert sorted(stats.finished) == [f"r{i}" for i in range(6)]
    assert set(stats.computed_at_admission.values()) == {0}
    control, control_stats = _run_scheduler({**extra, "enable_lookup": True})
    assert sum(control.outcomes.values()) == 6  # the same settings with lookups on: each request asks
    assert sorted(control_stats.finished) == [f"r{i}" for i in range(6)]


# -- logs --------------------------------------------------------------------------------------------------------

LOGS = r"""
import logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())  # what vLLM's engine core and workers do at start-up
from mooncake_lookout.connector.breaker import CircuitBreaker
CircuitBreaker(failures=1, cooldown_s=5.0, probe_timeout_s=1.0).failed(0.0, 0.1, timeout=False)  # a real transition
logging.getLogger("mooncake_lookout.connector.server.loop").info("an info line of ours")
init_logger("vllm.lookout_test").info("a line of vllm's")
"""
OPEN = "lookup circuit breaker OPEN: 1 failure events in a row"


def _logs(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    return subprocess.run([sys.executable, "-c", LOGS], capture_output=True, text=True, timeout=180,
                          env={**base, **env})


def test_inside_vllm_our_warnings_reach_stderr_bare_and_info_is_dropped() -> None:
    done = _logs({})
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.startswith(OPEN) for line in done.stderr.splitlines()), done.stderr[-2000:]
    assert "an info line of ours" not in done.stdout + done.stderr
    assert "a line of vllm's" in done.stdout  # vLLM's own logger is configured (stdout)


def test_the_documented_logging_config_shows_our_lines_with_their_logger() -> None:
    done = _logs({"VLLM_LOGGING_CONFIG_PATH": str(ROOT / "docs" / "vllm-logging.json")})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(" WARNING " in x and f"[mooncake_lookout.connector.breaker] {OPEN}" in x for x in lines), lines
    assert any(" INFO " in x and "[mooncake_lookout.connector.server.loop] an info line of ours" in x
               for x in lines), lines
    assert any("a line of vllm's" in x for x in lines)  # vLLM's own logger kept
    assert OPEN not in done.stderr


# -- doctor in a pod ---------------------------------------------------------------------------------------------

def documented_pod_command() -> list[str]:
    """The ``kubectl exec ... -- sh -c '...'`` command of docs/operations.md section 4, split like a shell would."""
    text = OPERATIONS.read_text().replace("\\\n", " ")
    (line,) = [x for x in text.split("```bash\n") if x.startswith("kubectl -n serving exec")]
    return shlex.split(line.split("```", 1)[0])


def test_the_pod_command_names_the_charts_engine_deployment_and_container() -> None:
    argv = documented_pod_command()
    objects = chart.template([])
    deployment = chart.one(objects, "Deployment", "-engine")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert argv[argv.index("exec") + 1] == "deploy/" + deployment["metadata"]["name"]
    assert argv[argv.index("-c") + 1] == container["name"]
    assert argv[argv.index("-n") + 1] == deployment["metadata"]["namespace"]


def test_the_pod_command_finds_and_probes_the_lookup_server(prefix_index, lookup_vllm_config, request,
                                                             monkeypatch) -> None:
    """The worker's server at the address it derives in a pod (temp dir = $TMPDIR, no VLLM_RPC_BASE_PATH), then
    the documented ``sh -c`` part, as the container's user would run it."""
    from mooncake_lookout.connector.addresses import pipelined_lookup_address
    from mooncake_lookout.connector.server import LookupServer

    pod_tmp = Path(tempfile.mkdtemp(prefix="op", dir="/tmp"))  # short: a socket path holds 107 characters
    request.addfinalizer(lambda: shutil.rmtree(pod_tmp, ignore_errors=True))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(pod_tmp))
    address = pipelined_lookup_address(lookup_vllm_config, LookupConfig(lookup_transport="pipelined"))
    assert address.startswith(f"ipc://{pod_tmp}/mooncake-lookout-{os.getuid()}/lookup_")
    argv = documented_pod_command()
    shell = argv[argv.index("--") + 1:]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    env.update(TMPDIR=str(pod_tmp), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    with LookupServer(prefix_index, address):
        done = subprocess.run(shell, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok    server pipelined wire: 20/20 answered" in done.stdout and "1 ok, 0 failed" in done.stdout
    # Without the server, the same command fails, and says why: the glob matched no socket (doctor names the
    # pattern instead of probing a path that is not there).
    failed = subprocess.run(shell, capture_output=True, text=True, timeout=120, env=env)
    assert failed.returncode != 0 and "FAIL  server address" in failed.stdout, failed.stdout
    assert "shell pattern that matched no socket" in failed.stdout, failed.stdout
