"""Bench scenario (j)'s wiring, quickly (not a speed test: the figures are the bench's, `bench --only j`).

* the CPU hogs keep every core busy while they run and are gone, by pid, after;
* a lookup server started with ``gil_busy`` burns CPU on its busy thread and still answers lookups (real master,
  real server process, our client over the pipelined transport);
* one variant driven for a few steps reports what the targets read; the targets (j1..j8) are judged from the
  figures a run records and the report renders them.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from mooncake_lookout.connector.bench import contention
from mooncake_lookout.connector.bench.report import j_block
from mooncake_lookout.connector.bench.rig import ClientMaker
from mooncake_lookout.connector.bench.targets import TARGET_IDS, targets
from mooncake_lookout.connector.rigs.cpu import tick_cpu_s
from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.processes import process_state
from mooncake_lookout.connector.rigs.server_process import ServerProcess
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport.names import PIPELINED


def _burns(pid: int, at_least_s: float, bound_s: float = 20.0) -> bool:
    """True once ``pid`` has used ``at_least_s`` more CPU seconds than now (polled, bounded)."""
    start = tick_cpu_s(pid)
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if tick_cpu_s(pid) - start >= at_least_s:
            return True
        time.sleep(0.05)
    return False


def test_the_hogs_keep_every_core_busy_and_are_gone_after() -> None:
    with contention.CpuHogs() as hogs:
        pids = hogs.pids
        assert len(pids) >= 1
        assert all(_burns(pid, 0.1) for pid in pids)
    assert all(process_state(pid) is None for pid in pids)


class _Maker(ClientMaker):
    def __init__(self, servers: ServerProcess) -> None:
        self.servers = servers

    @property
    def addresses(self) -> dict[str, str]:
        return dict(self.servers.addresses)


def test_a_gil_busy_server_burns_cpu_and_still_answers(private_master: EmbeddedMaster, tmp_path: Any) -> None:
    from mooncake_lookout.connector.server.store import open_writer_store

    writer = open_writer_store(private_master.rpc_address)
    try:
        reqs = shared_prefix_workload(8, prefix_blocks=4, unique_blocks=4, num_prefixes=2, seed=5)
        PrefixIndex(writer, 16, "j-test").store_prefixes([r.block_hashes for r in reqs])
        with ServerProcess(PIPELINED, private_master.rpc_address, namespace="j-test", standby=False,
                           gil_busy=True) as servers:
            assert _burns(servers.pid, 0.2), "the busy thread does not run"
            row = contention.drive(_Maker(servers), "ours async", "ours", True, {}, reqs, steps=5)
    finally:
        writer.close()
    assert row["lookups"] == 5 * contention.ARRIVALS and row["unanswered"] == 0
    assert row["hit_tokens"] > 0 and row["failed"] == sum(row["outcomes"].get(o.value, 0) for o in contention.FAILED)
    assert set(row) >= {"failed_share", "breaker_opened", "late_replies", "answered_rpc_us"}
    assert row["timeout_ms"] == 2000.0  # auto, async


def _variant(label: str, client: str, lookups: int, failed: int, hits: int) -> dict[str, Any]:
    row: dict[str, Any] = {"label": label, "client": client, "lookup_async": "async" in label, "lookups": lookups,
                           "answered": lookups, "unanswered": 0, "hit_tokens": hits,
                           "call_us": {"p99": 10.0, "max": 20.0}}
    if client == "ours":
        row.update(failed=failed, failed_share=failed / lookups, breaker_opened=False, late_replies=failed,
                   timeout_ms=100.0, answered_rpc_us={"p99": 900.0, "max": 5000.0}, answered_rpc_p999_us=2000.0,
                   outcomes={"hit": lookups - failed, "timeout": failed})
    return row


@pytest.mark.parametrize("failed, hits", [(0, 1000), (6, 1000), (0, 980)])
def test_the_targets_read_the_runs_figures(failed: int, hits: int) -> None:
    """6 of 1000 lookups without the store's answer is 0.6% (> 0.5%); 980 of 1000 hit tokens is 0.98x (< 0.99)."""
    def variant(label: str, client: str) -> dict[str, Any]:
        at_defaults = client == "ours" and "," not in label
        return _variant(label, client, 1000, failed if at_defaults else 0, hits if at_defaults else 1000)

    variants = [variant(label, client) for label, client, _, _ in contention.VARIANTS]
    run = {"j": {"steps": 250, "arrivals_per_step": 4, "model_step_ms": 10.0, "cores": 2,
                 "conditions": {c: {"variants": variants} for c in contention.CONDITIONS}}}
    found = {t["id"]: t for t in targets(run)}
    assert set(found) == {f"j{i}" for i in range(1, 9)} and all(i in TARGET_IDS for i in found)
    no_answer, hit_tokens = ("j1", "j3", "j5", "j7"), ("j2", "j4", "j6", "j8")
    assert all(found[i]["met"] is (failed == 0) for i in no_answer)
    assert all(found[i]["met"] is (hits >= 990) for i in hit_tokens)
    assert found["j2"]["upstream_hit_tokens"] == 1000
    text = "\n".join(j_block(run))
    assert "cpu hogs" in text and "gil loop" in text and "ours async, no deadline" in text
