"""The embedded Mooncake master and its clients, against the real binary on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from mooncake_lookout.connector.rigs.master import EmbeddedMaster, MasterError, find_master_binary, free_port
from mooncake_lookout.connector.server.store import open_store, open_writer_store

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    """Poll until no process ``pid`` exists (zombies count as gone)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.01)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_master_starts_healthy_and_stops_by_pid() -> None:
    master = EmbeddedMaster()
    assert not master.running
    with master:
        assert master.running and master.healthy()
        assert master.rpc_address == f"127.0.0.1:{master.rpc_port}"
        assert master.start_seconds is not None and master.start_seconds > 0
        with urllib.request.urlopen(f"{master.metrics_url}/health", timeout=2) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        with urllib.request.urlopen(f"{master.metrics_url}/metrics", timeout=2) as resp:
            assert b"master_key_count" in resp.read()
        pid = master.pid
    assert not master.running
    assert _gone(pid)
    assert not master.healthy(timeout_s=0.2)
    master.stop()  # idempotent


def test_session_master_serves_a_lookup_only_client(mooncake_master: EmbeddedMaster, store) -> None:
    reader = open_store(mooncake_master.rpc_address)
    try:
        key = f"master-test/{os.getpid()}/{time.monotonic_ns()}"
        assert reader.batch_is_exist([key]) == [0]
        assert store.upsert_batch([key], [b"1"]) == 0
        assert reader.batch_is_exist([key]) == [1]
        # A lookup-only client has no buffer to stage a put: Mooncake refuses it.
        assert reader.upsert_batch([key + "x"], [b"1"]) < 0
        assert store.remove(key, True) == 0
    finally:
        reader.close()


def test_restart_keeps_ports_and_loses_keys(private_master: EmbeddedMaster) -> None:
    writer = open_writer_store(private_master.rpc_address, rpc_timeout_ms=2000)
    try:
        assert writer.upsert_batch(["k"], [b"1"]) == 0
        assert writer.batch_is_exist(["k"]) == [1]
        rpc, metrics, old_pid = private_master.rpc_address, private_master.metrics_url, private_master.pid
        private_master.restart()
        assert (private_master.rpc_address, private_master.metrics_url) == (rpc, metrics)
        assert private_master.pid != old_pid and _gone(old_pid)
        # The client reconnects on its own; the master's index was in memory, so the key is gone.
        deadline = time.perf_counter() + 20
        answer = None
        while time.perf_counter() < deadline:
            answer = writer.batch_is_exist(["k"])
            if answer == [0]:
                break
            time.sleep(0.05)
        assert answer == [0]
    finally:
        writer.close()


def test_pause_and_resume(private_master: EmbeddedMaster) -> None:
    private_master.pause()
    assert _state(private_master.pid) == "T"
    assert not private_master.healthy(timeout_s=0.2)
    private_master.resume()
    assert _state(private_master.pid) != "T"
    assert private_master.healthy(timeout_s=2)


def test_missing_binary_says_how_to_install(tmp_path) -> None:
    with pytest.raises(MasterError, match="pip install mooncake-transfer-engine-non-cuda"):
        EmbeddedMaster(binary=tmp_path / "nowhere" / "mooncake_master")


def test_binary_from_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER_BIN", str(tmp_path / "absent"))
    with pytest.raises(MasterError, match="absent"):
        find_master_binary()
    monkeypatch.delenv("MOONCAKE_MASTER_BIN")
    assert os.access(find_master_binary(), os.X_OK)


def test_early_exit_reports_the_masters_last_words() -> None:
    with pytest.raises(MasterError, match="exited early(.|\n)*no_such_flag"):
        EmbeddedMaster(extra_args=("--no_such_flag=1",)).start()


def test_open_store_without_master_fails_clearly() -> None:
    # Nothing listens on this port; one setup attempt (~4.5 s) instead of Mooncake's ~90 s default.
    with pytest.raises(MasterError, match="is the master running"):
        open_store(f"127.0.0.1:{free_port()}", setup_retries=1)
    with pytest.raises(ValueError, match="setup_retries"):
        open_store("127.0.0.1:1", setup_retries=0)


def test_master_dies_with_a_killed_parent() -> None:
    # A CLI or test process killed outright (no atexit) must not leave its master behind.
    code = ("from mooncake_lookout.connector.rigs.master import EmbeddedMaster\n"
            "import sys, time\n"
            "m = EmbeddedMaster().start(); print(m.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        line = parent.stdout.readline()
        assert line, "the parent exited before starting its master"
        master_pid = int(line)
        assert not _gone(master_pid, timeout_s=0)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    assert _gone(master_pid, timeout_s=10)
