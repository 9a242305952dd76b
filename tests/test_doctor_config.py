"""``doctor --config`` checks what users paste (a whole ``--kv-transfer-config`` as docs/deploy.md shows it, or its
``kv_connector_extra_config``), with messages that say what each key accepts; ``doctor --server`` names an
``ipc://`` socket that is not there. The console script, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.cli.doctor import check_config
from mooncake_lookout.connector.config import KEYS, Key

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "mooncake-lookout"


def _doctor(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), "doctor", *argv], capture_output=True, text=True, timeout=60)


def _deploy_md_transfer_config() -> str:
    """The ``--kv-transfer-config '...'`` of docs/deploy.md's ``vllm serve`` command, as a user copies it."""
    text = (ROOT / "docs/deploy.md").read_text()
    found = re.search(r"--kv-transfer-config '(\{.*?\})'", text, re.S)
    assert found, "docs/deploy.md shows no --kv-transfer-config"
    return found.group(1)


def test_the_issue_paste_is_refused_naming_the_inner_key_and_what_it_accepts() -> None:
    done = _doctor("--config", '{"kv_connector_extra_config": {"lookup_async": true, "lookup_wait_us": "fast"}}')
    assert done.returncode == 1, done.stdout
    assert "FAIL  config: kv_connector_extra_config['lookup_wait_us'] must be an integer 0..100000 or auto, got " \
           "'fast'" in done.stdout, done.stdout


def test_deploy_mds_kv_transfer_config_is_valid_and_read_inside(tmp_path: Path) -> None:
    pasted = _deploy_md_transfer_config()
    inner = json.loads(pasted)["kv_connector_extra_config"]
    for given in (pasted, f"--kv-transfer-config '{pasted}'"):
        finding, config = check_config(given)
        assert finding.ok and config is not None, finding.detail
        assert "--kv-transfer-config's kv_connector_extra_config: valid" in finding.detail
        assert config.lookup_async is inner["lookup_async"] and config.lookup_wait_us == inner["lookup_wait_us"]
    (tmp_path / "transfer.json").write_text(pasted)
    done = _doctor("--config", f"@{tmp_path / 'transfer.json'}")
    assert done.returncode == 0 and "ok    config:" in done.stdout, done.stdout


@pytest.mark.parametrize("whole,words", [
    ({"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {"lookup_async": True}},
     "kv_connector is 'MooncakeStoreConnector'"),
    ({"kv_connector": "LookoutMooncakeStoreConnector", "kv_connector_module_path": "my.module"},
     "kv_connector_module_path is 'my.module'"),
    ({"kv_connector": "LookoutMooncakeStoreConnector", "kv_connector_extra_config": [1]},
     "kv_connector_extra_config must be a JSON object"),
    ({"kv_role": "kv_both", "kv_connector_extra_config": {"lookup_timeout_ms": "100"}},
     "['lookup_timeout_ms'] must be a number > 0 and <= 60000, got '100'"),
])
def test_a_whole_config_that_would_not_load_ours_is_named(whole: dict[str, object], words: str) -> None:
    finding, config = check_config(json.dumps(whole))
    assert not finding.ok and config is None
    assert words in finding.detail, finding.detail


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_every_keys_message_says_what_it_accepts(key: Key) -> None:
    """Generated from the KEYS table: a value of the wrong type (a list) names the key and what it accepts."""
    finding, _ = check_config(json.dumps({key.name: []}))
    assert not finding.ok
    assert finding.detail == f"kv_connector_extra_config[{key.name!r}] must be {key.accepts}, got []"
    assert key.accepts.startswith(("an integer", "a number", "true or false")) or key.accepts == key.rule


def test_an_ipc_socket_that_is_not_there_is_named(tmp_path: Path) -> None:
    absent = tmp_path / "lookup_1_dp0.sock"
    done = _doctor("--server", f"ipc://{absent}", "--samples", "1", "--timeout-ms", "50")
    assert done.returncode == 1
    assert f"FAIL  server address: the socket {absent} does not exist" in done.stdout, done.stdout
    done = _doctor("--server", f"ipc://{tmp_path / 'nofolder' / 'x.sock'}")
    assert f"the socket's folder {tmp_path / 'nofolder'} does not exist" in done.stdout, done.stdout
    # docs/deploy.md's loop passes the shell's pattern on when no socket matched it
    done = _doctor("--server", f"ipc://{tmp_path}/lookup_*.sock", "--wire", "pipelined")
    assert "is a shell pattern that matched no socket" in done.stdout, done.stdout
    assert not os.listdir(tmp_path)
