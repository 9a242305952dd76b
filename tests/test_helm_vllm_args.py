"""The engine's command line and mooncake.json, as the chart renders them, read by vLLM 0.33's own code:
the `vllm serve` argument parser and the Mooncake store's MooncakeStoreConfig.from_file.

Catches flags vLLM does not know, a kv-transfer-config its KVTransferConfig rejects, a mooncake.json its
loader rejects, and values that reach vLLM differently from how they were set. One subprocess reads every
value set (importing vLLM takes ~10 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

ROOT = Path(__file__).resolve().parents[1]

# Runs in a child process: argv lists on stdin (JSON), the parsed fields on stdout (JSON).
PARSE = r"""
import dataclasses, json, sys, tempfile
from vllm.distributed.mooncake_store import MooncakeStoreConfig
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
out = {}
for name, (argv, mooncake_json) in json.load(sys.stdin).items():
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(mooncake_json)
        f.flush()
        mooncake = dataclasses.asdict(MooncakeStoreConfig.from_file(f.name))
    args = parser.parse_args(argv)
    kv = args.kv_transfer_config
    out[name] = {
        "model_tag": args.model_tag, "host": args.host, "port": args.port,
        "served_model_name": args.served_model_name, "otlp_traces_endpoint": args.otlp_traces_endpoint,
        "kv_connector": kv.kv_connector, "kv_role": kv.kv_role,
        "kv_connector_extra_config": kv.kv_connector_extra_config,
        "max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization,
        "mooncake": mooncake,
    }
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins
load_general_plugins()  # the installed package's vllm.general_plugins entry point registers the connector
out["__registered__"] = sorted(KVConnectorFactory._registry)
print("RESULT " + json.dumps(out))
"""


VALUE_SETS = {"default": None, **chart.ci_value_sets()}


def engine_argv(objects) -> list[str]:
    (container,) = chart.one(objects, "Deployment", "-engine")["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["vllm", "serve"]
    return container["args"]


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict]:
    argvs = {}
    for name, path in VALUE_SETS.items():
        objects = chart.template([path] if path else [])
        argvs[name] = (engine_argv(objects), chart.one(objects, "ConfigMap", "-engine")["data"]["mooncake.json"])
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run([sys.executable, "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          env=env, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"vllm serve rejected the chart's arguments:\n{done.stderr[-3000:]}"
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_vllm_serve_parses_the_engine_command_line(parsed, name):
    values = chart.load_values()["engine"]
    got = parsed[name]
    assert got["host"] == "0.0.0.0" and got["port"] == values["port"]
    assert got["kv_connector"] == "LookoutMooncakeStoreConnector" and got["kv_role"] == "kv_both"
    extra = got["kv_connector_extra_config"]
    assert set(values["connector"]["lookup"]) <= set(extra)


def test_the_connector_name_resolves_through_the_plugin_entry_point(parsed):
    for name in VALUE_SETS:
        assert parsed[name]["kv_connector"] in parsed["__registered__"], name


def test_values_reach_vllm_as_set(parsed):
    got = parsed["async-budget"]
    assert got["model_tag"] == chart.load_values()["engine"]["model"]
    assert got["served_model_name"] == ["qwen-small"]
    assert got["otlp_traces_endpoint"] == "http://otel-collector.monitoring:4318/v1/traces"
    assert got["max_model_len"] == 8192 and got["gpu_memory_utilization"] == 0.85
    extra = got["kv_connector_extra_config"]
    assert extra["lookup_async"] is True and extra["lookup_wait_us"] == 200 and extra["lookup_timeout_ms"] == 25.5
    assert parsed["default"]["otlp_traces_endpoint"] is None
    assert parsed["pipelined"]["kv_connector_extra_config"]["lookup_transport"] == "pipelined"


def test_mooncake_json_is_read_by_vllms_loader_as_set(parsed):
    default = parsed["default"]["mooncake"]
    assert default["protocol"] == "tcp" and default["metadata_server"] == "P2PHANDSHAKE"
    assert default["global_segment_size"] == 4 * 1024**3 and default["local_buffer_size"] == 4 * 1024**3
    assert default["master_server_address"].endswith("-master.serving.svc:50051")
    pipelined = parsed["pipelined"]["mooncake"]
    assert pipelined["protocol"] == "rdma" and pipelined["device_name"] == "mlx5_0"
    assert pipelined["global_segment_size"] == 16 * 1024**3
    external = parsed["external-master"]["mooncake"]
    assert external["master_server_address"] == "mooncake-master.store.svc.cluster.local:50051"
    # HA masters: vLLM hands Mooncake the etcd:// form as it is (Mooncake's client resolves the leader from it).
    assert parsed["ha"]["mooncake"]["master_server_address"].startswith("etcd://")
    assert parsed["external-ha-master"]["mooncake"]["master_server_address"].startswith("etcd://")
