"""``bench --master`` / ``--server``: a user's own store measured read-only, in vLLM's key layout.

The store is a real master (a private one, so its key count is this test's alone) holding keys written by
vLLM's own save-path key code (:func:`saved_keys` over upstream's ``MooncakeStoreWorker``). The bench must
find those prefixes through every client, and leave the store exactly as it was: same keys, same count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.vllm_layout import Layout, ReadOnlyStore, layout_worker
from mooncake_lookout.connector.server.store import open_store, open_writer_store
from mooncake_lookout.connector.server.vllm_store_worker import saved_keys

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
LAYOUT = Layout("some-org/Tiny-Chat-1B", cache_prefix="prod", block_size=16)
STORED_BLOCKS = [2, 3, 5, 8, 1, 6]  # prompt i (8 blocks) has its first STORED_BLOCKS[i] blocks in the store


def _all_keys(master: EmbeddedMaster) -> set[str]:
    with urllib.request.urlopen(master.metrics_url + "/get_all_keys", timeout=10) as resp:
        return {line.strip() for line in resp.read().decode().splitlines() if line.strip()}


@pytest.fixture
def vllm_store(private_master: EmbeddedMaster, make_hashes: Any, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The private master holding prompts stored the way vLLM's save path keys them; yields (prompts file, keys)."""
    writer = open_writer_store(private_master.rpc_address)
    try:
        worker = layout_worker(writer, LAYOUT)
        lines, written = [], 0
        for i, blocks in enumerate(STORED_BLOCKS):
            hashes = make_hashes(8, seed=700 + i)
            keys = saved_keys(worker, blocks * LAYOUT.block_size, hashes)
            assert len(keys) == blocks and all(k.startswith("prod@Tiny-Chat-1B@") for k in keys)
            assert writer.upsert_batch(keys, [b"\x01"] * len(keys)) == 0
            written += len(keys)
            lines.append(" ".join(h.hex() for h in hashes))
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("# one prompt a line\n" + "\n".join(lines) + "\n")
        yield prompts, written
    finally:
        writer.close()


@pytest.mark.slow
def test_bench_master_finds_vllm_stored_prefixes_and_writes_nothing(private_master: EmbeddedMaster,
                                                                    vllm_store: tuple[Path, int],
                                                                    tmp_path: Path) -> None:
    prompts, written = vllm_store
    before = _all_keys(private_master)
    assert len(before) == written
    out = tmp_path / "remote"
    proc = subprocess.run([str(SCRIPT), "bench", "--quick", "--master", private_master.rpc_address,
                           "--master-http", private_master.metrics_url, "--model", LAYOUT.model,
                           "--cache-prefix", LAYOUT.cache_prefix, "--prompts", str(prompts), "--sample-keys", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # Nothing written, nothing wiped: the very same keys, and the master's own count agrees.
    assert _all_keys(private_master) == before
    results = json.loads((out / "bench.json").read_text())
    remote = results["remote"]
    assert remote["key_count_before"] == remote["key_count_after"] == written
    assert remote["key_prefix"] == "prod@Tiny-Chat-1B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"

    # Every client finds each stored prefix to the block, through vLLM's layout; sampled blocks are found too.
    stored = [b * LAYOUT.block_size for b in STORED_BLOCKS]
    assert remote["sampled_keys"] == 4
    assert set(results["found"]["clients"]) == {"upstream", "ours/upstream-wire", "ours/pipelined"}
    for name, v in results["found"]["clients"].items():
        assert v["answers"][:len(stored)] == stored, name
        assert v["as_expected"] == v["expected"] == 4, name

    # What a read-only run can measure: the server side per backend, both floors, the clients and their targets.
    backends = results["backends"]
    assert set(backends) == {"8", "64", "512"} and backends["8"]["keys"] == 8
    assert results["floors"]["round_trip_us"]["n"] > 0 and results["floors"]["touch_us"]["n"] > 0
    assert results["floors"]["split_us"]["n"] > 0
    assert {"upstream", "ours/pipelined"} <= set(results["a"]) and results["b"]["ours/pipelined"]["hit_tokens"] == 0
    assert [t["id"] for t in results["targets"]] == ["a", "a4", "a2", "b"]
    table = (out / "bench.txt").read_text()
    assert "read-only" in table and f"master_key_count {written} before, {written} after" in table


@pytest.mark.slow
def test_bench_server_measures_a_running_lookup_server(private_master: EmbeddedMaster, vllm_store: tuple[Path, int],
                                                       tmp_path: Path) -> None:
    """``--server``: our client against a server someone else runs (here: ours over vLLM's worker)."""
    from mooncake_lookout.connector.bench.remote import run_remote
    from mooncake_lookout.connector.server import LookupServer
    from mooncake_lookout.connector.server.worker_backend import WorkerBackend

    prompts, written = vllm_store
    store = open_store(private_master.rpc_address)
    try:
        backend = WorkerBackend(layout_worker(ReadOnlyStore(store), LAYOUT))
        with LookupServer(backend, "tcp://127.0.0.1:0", marker=False) as server:  # someone else's server
            results = run_remote(str(tmp_path / "out"), LAYOUT, master=private_master.rpc_address,
                                 server=server.address, master_http=private_master.metrics_url,
                                 prompts_file=str(prompts), quick=True, log=lambda _: None)
    finally:
        store.close()
    assert set(results["found"]["clients"]) == {"ours/pipelined"}
    assert results["found"]["clients"]["ours/pipelined"]["answers"] == [b * LAYOUT.block_size for b in STORED_BLOCKS]
    assert "upstream" not in results["a"] and results["a"]["ours/pipelined"]["sync_call_us"]["n"] > 0
    # No upstream beside it: no target is judged (the floors are reported, not targeted).
    assert results["targets"] == []
    assert all(results["floors"][k]["n"] > 0 for k in ("round_trip_us", "touch_us", "split_us"))
    assert results["remote"]["key_count_before"] == results["remote"]["key_count_after"] == written


def test_a_read_only_store_lets_only_existence_checks_through(store: Any, prefix_index: Any) -> None:
    key = prefix_index.key(b"\x07" * 32)
    guarded = ReadOnlyStore(store)
    for call, args in (("upsert_batch", ([key], [b"\x01"])), ("put", (key, b"\x01")), ("remove", (key,)),
                       ("remove_all", (True,)), ("remove_by_regex", ("^.*", True))):
        with pytest.raises(PermissionError, match=call):
            getattr(guarded, call)(*args)
    assert guarded.batch_is_exist([key]) == [0] and guarded.calls == 1
    assert store.is_exist(key) == 0  # nothing got through


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "--master", "127.0.0.1:1"], "--model is required"),
    (["bench", "--model", "x"], "--model only go with --master or --server"),
    (["bench", "--master", "127.0.0.1:1", "--model", ".."], "model name"),
    (["bench", "--master", "127.0.0.1:1", "--model", "m", "--sample-keys", "3"], "--master-http"),
    (["bench", "--master", "127.0.0.1:1", "--model", "m", "--quick"], "is the master running and reachable?"),
])
def test_bench_remote_refuses_what_it_cannot_do(argv: list[str], says: str, tmp_path: Path) -> None:
    proc = subprocess.run([str(SCRIPT), *argv, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert says in proc.stderr, proc.stderr[-2000:]
