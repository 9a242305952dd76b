"""``mooncake-lookout serve --vllm-layout``: a standalone server that answers for the keys vLLM itself writes.

Keys are written into a real Mooncake master by upstream's own save-path key code (``saved_keys`` over vLLM's real
``MooncakeStoreWorker``, built from a vLLM config made independently of the server's, as the engine would), then
``serve`` runs as a separate process with the settings an operator copies from the deployment (the model name,
the engine's ``--kv-transfer-config``, its ``mooncake.json``, the parallel layout), and a pipelined client asks it:
stored prompts hit, others miss. The control: ``serve`` without ``--vllm-layout`` (the prefix index's own key
layout) misses every one of those prompts, which is what the flag fixes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.cli.serve_vllm_layout import LayoutError, read_layout
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.processes import ChildProcess
from mooncake_lookout.connector.rigs.scheduler_driver import make_kv_cache_config, make_vllm_config, tiny_model_dir
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server.vllm_store_worker import lookup_worker, saved_keys
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

BLOCK = 16
BLOCKS = 8
START_BOUND_S = 120  # a cold vLLM import in the server takes ~10 s, more on a loaded machine
SERVE = [str(Path(sys.executable).parent / "mooncake-lookout"), "serve"]  # the console script


def engine_worker(store: Any, cache_prefix: str, *, tp_rank: int = 0, tp_size: int = 1) -> Any:
    """vLLM's store worker of one engine rank, as the engine builds it (no GPU): what writes the keys."""
    config = make_vllm_config({"cache_prefix": cache_prefix}, kv_role="kv_both")
    return lookup_worker(config, make_kv_cache_config(1024), store, tp_rank=tp_rank, tp_size=tp_size)


def save(worker: Any, hashes: list[bytes], blocks: int) -> list[str]:
    """Write the keys upstream's save path writes for the first ``blocks`` blocks; returns them."""
    keys = saved_keys(worker, blocks * BLOCK, hashes)
    assert worker.store.upsert_batch(keys, [b"\x01"] * len(keys)) == 0
    return keys


def start_serve(args: list[str], tmp_path: Path) -> ChildProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MC_LOG_LEVEL": "ERROR", "VLLM_LOGGING_LEVEL": "ERROR"}
    env.pop("MOONCAKE_CONFIG_PATH", None)
    child = ChildProcess([*SERVE, "--tcp-port", "0", "--log-level", "WARNING", *args], env=env, name="serve")
    child.address = child.wait_line("listening on ", START_BOUND_S, "serve").removeprefix("listening on ").strip()
    return child


def address_of(child: ChildProcess) -> str:
    return child.address


def hits(address: str, prompts: dict[str, list[bytes]]) -> dict[str, int]:
    """Each prompt's hit, asked through a pipelined client (blocking lookups, bounded by the client's deadline)."""
    config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=5000, lookup_breaker_failures=1000)
    counter = OutcomeCounter()
    client = LookupClient(config, PipelinedTransport(address, timeout_s=config.timeout_s), observer=counter)
    try:
        out = {name: client.lookup(name, BLOCKS * BLOCK + 1, hashes).hit_length for name, hashes in prompts.items()}
    finally:
        client.close()
    assert {o for o, n in counter.outcomes.items() if n} <= {Outcome.HIT, Outcome.MISS}, counter.outcomes  # no errors
    return out


@pytest.fixture(scope="module")
def deployment(mooncake_master: Any, _session_writer: Any, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Any]]:
    """A master holding keys written by vLLM's key code for one model and cache prefix, and the deployment's
    configuration files as an operator would copy them."""
    prefix = f"serve{time.monotonic_ns()}"
    worker = engine_worker(_session_writer, prefix)
    prompts = {f"p{i}": unique_hashes(BLOCKS, seed=9100 + i) for i in range(4)}
    keys = {name: save(worker, hashes, blocks) for (name, hashes), blocks in zip(prompts.items(), (8, 5, 1, 0))}
    # Two ranks of a TP-2 engine: "both" was saved by both ranks, "rank0" only by rank 0.
    tp_prefix = prefix + "tp"
    tp_prompts = {"both": unique_hashes(BLOCKS, seed=9200), "rank0": unique_hashes(BLOCKS, seed=9201)}
    for rank in (0, 1):
        rank_worker = engine_worker(_session_writer, tp_prefix, tp_rank=rank, tp_size=2)
        save(rank_worker, tp_prompts["both"], BLOCKS)
        if rank == 0:
            save(rank_worker, tp_prompts["rank0"], BLOCKS)
    folder = tmp_path_factory.mktemp("deployment")
    mooncake_json = folder / "mooncake.json"
    mooncake_json.write_text(json.dumps({"master_server_address": mooncake_master.rpc_address,
                                         "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}))
    yield {"prefix": prefix, "tp_prefix": tp_prefix, "prompts": prompts, "tp_prompts": tp_prompts, "keys": keys,
           "mooncake_json": mooncake_json, "model": "some-org/" + Path(tiny_model_dir()).name}


def transfer_config(prefix: str) -> str:
    return json.dumps({"kv_connector": "LookoutMooncakeStoreConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"cache_prefix": prefix, "lookup_async": True}})


def test_the_keys_are_vllms_layout(deployment: dict[str, Any]) -> None:
    """What the engine wrote is vLLM's documented key layout, not the prefix index's ``<namespace>/<hex>``."""
    model = Path(tiny_model_dir()).name
    key = deployment["keys"]["p0"][0]
    assert key.startswith(f"{deployment['prefix']}@{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"), key
    assert key.endswith(deployment["prompts"]["p0"][0].hex())


def test_serve_with_vllms_layout_finds_what_vllm_stored(deployment: dict[str, Any], tmp_path: Path) -> None:
    with start_serve(["--vllm-layout", "--model", deployment["model"],
                      "--kv-transfer-config", transfer_config(deployment["prefix"]),
                      "--mooncake-config", str(deployment["mooncake_json"])], tmp_path) as child:
        got = hits(address_of(child), {**deployment["prompts"], "never-stored": unique_hashes(BLOCKS, seed=9999)})
    assert got == {"p0": 8 * BLOCK, "p1": 5 * BLOCK, "p2": 1 * BLOCK, "p3": 0, "never-stored": 0}


def test_serve_with_vllms_layout_follows_the_tensor_parallel_ranks(deployment: dict[str, Any], mooncake_master: Any,
                                                                   tmp_path: Path) -> None:
    """A TP-2 engine's block counts only when both ranks saved it (the tiny model's 4 KV heads: 2 distinct shards)."""
    with start_serve(["--vllm-layout", "--model", deployment["model"], "--master", mooncake_master.rpc_address,
                      "--kv-transfer-config", "@" + str(_write(tmp_path / "kv.json",
                                                               transfer_config(deployment["tp_prefix"]))),
                      "--tensor-parallel-size", "2", "--num-kv-heads", "4"], tmp_path) as child:
        got = hits(address_of(child), deployment["tp_prompts"])
    assert got == {"both": 8 * BLOCK, "rank0": 0}


def test_serve_without_the_layout_misses_vllms_keys(deployment: dict[str, Any], mooncake_master: Any,
                                                    tmp_path: Path) -> None:
    """The control: the prefix index's own layout never sees a prefix vLLM stored."""
    with start_serve(["--master", mooncake_master.rpc_address], tmp_path) as child:
        got = hits(address_of(child), deployment["prompts"])
    assert got == {"p0": 0, "p1": 0, "p2": 0, "p3": 0}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("args,message", [
    (["--vllm-layout"], "--vllm-layout needs --model"),
    (["--vllm-layout", "--model", "m", "--kv-transfer-config", "{not json"], "--kv-transfer-config: cannot read"),
    (["--vllm-layout", "--model", "m", "--tensor-parallel-size", "2"], "needs --num-kv-heads"),
    (["--vllm-layout", "--model", "../m"], "'..' are not part of a model name"),
    (["--vllm-layout", "--model", "m"], "give --master HOST:PORT or --embedded-master"),
    ([], "give --master HOST:PORT or --embedded-master"),
])
def test_bad_layout_settings_fail_in_one_line(args: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    child = ChildProcess([*SERVE, *args], env=env, name="serve")
    try:
        assert child.wait_exit(60) == 2
    finally:
        child.stop()
    lines = [x for x in child.lines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("mooncake-lookout serve: ") and message in lines[0], lines


def _layout_args(**kw: Any) -> argparse.Namespace:
    base = dict(model="org/m", kv_transfer_config="{}", mooncake_config=None, tensor_parallel_size=1,
                pipeline_parallel_size=1, num_kv_heads=None, block_size=16)
    return argparse.Namespace(**{**base, **kw})


def test_the_layout_reads_the_master_and_tenant_from_mooncake_json(tmp_path: Path, monkeypatch) -> None:
    path = _write(tmp_path / "mooncake.json", json.dumps({"master_server_address": "etcd://e:2379",
                                                          "tenant_id": " team-a "}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))  # where vLLM's worker reads it from
    layout = read_layout(_layout_args(kv_transfer_config=transfer_config("cp")))
    assert (layout.master, layout.tenant_id, layout.kv_role) == ("etcd://e:2379", "team-a", "kv_both")
    assert layout.extra_config["cache_prefix"] == "cp"
    _write(path, json.dumps({"master_server_address": "m:1", "tenant_id": "default"}))
    assert read_layout(_layout_args()).tenant_id is None  # Mooncake's default tenant: nothing to pass
    with pytest.raises(LayoutError, match="must be a JSON object"):
        read_layout(_layout_args(mooncake_config=str(_write(tmp_path / "list.json", "[]"))))
