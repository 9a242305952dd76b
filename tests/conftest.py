"""Shared fixtures: a real Mooncake master, real store clients, prefix indexes, vLLM's lookup server.

Everything here is real and local: ``mooncake_master`` on 127.0.0.1, Mooncake clients, ZMQ over
``ipc://`` in a private 0700 folder. vLLM is imported lazily, only by tests that ask for a vLLM
fixture (a cold ``import vllm`` costs 8-10 s).

Costs measured here, which shape the scopes: a master starts in ~0.1 s and stops in ~1 s; a client
sets up in 0.03-0.15 s but closes in ~1 s. So the master and one writer client live for the session,
and each test gets isolation from a fresh key namespace instead of a fresh store.

Fixtures
--------
mooncake_master      session  the shared EmbeddedMaster; never pause or kill it (use private_master)
store                function the session's writer client (64 MiB segment); shared, do not close it
prefix_index         function PrefixIndex over ``store``, block size 16, a namespace of its own
private_master       function a fresh EmbeddedMaster for fault tests (pause, kill, restart); killed after
rpc_base_path        session  VLLM_RPC_BASE_PATH set to a private 0700 folder for the session
lookup_vllm_config   function a minimal real VllmConfig with a lookup_rpc_port unique to the test
upstream_lookup_server function vLLM's real LookupKeyServer over ``prefix_index`` (the harness object)
upstream_server      function its ``ipc://`` address
make_workload        function ``workload.shared_prefix_workload`` (deterministic shared-prefix requests)
make_hashes          function ``workload.unique_hashes`` (one cold chain of block hashes)
require_tool         session  ``require_tool(name)``: a binary's path, or a test FAILURE naming the fix (never a skip)
promtool             session  Debian's promtool with the checks several files share (rules, metrics text)
prometheus_binary    session  the path of Debian's ``prometheus`` (fails the test when missing)
tiny_model           session  a tiny Llama and tokenizer made with a fixed seed in the engine venv (rigs/tiny_model)
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload, unique_hashes
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.metrics.catalogue import PREFIX

# dashboards/ and helm/tools/ are folders of scripts, not packages: their tests import them by module name, as they
# import the tests' own helpers (tests/otlp_receiver.py).
_ROOT = Path(__file__).resolve().parents[1]
for _scripts in (_ROOT / "dashboards", _ROOT / "helm" / "tools", _ROOT / "tests"):
    if str(_scripts) not in sys.path:
        sys.path.insert(0, str(_scripts))

# Property tests draw the same examples on every run (a failure is then a failure every time, never one run in
# twenty); HYPOTHESIS_PROFILE=explore draws new ones, to look for more (then pin what it finds with @example).
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

BLOCK_SIZE = 16  # tokens per block in every index the fixtures build
SESSION_RPC_TIMEOUT_MS = 5000  # bounds any call on the shared client, should the shared master stall

_lookup_ports = itertools.count(1)


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[EmbeddedMaster]:
    """The session's real Mooncake master on 127.0.0.1 (short 500 ms key lease)."""
    with EmbeddedMaster(kv_lease_ttl_ms=500) as master:
        yield master


@pytest.fixture(scope="session")
def _session_writer(mooncake_master: EmbeddedMaster) -> Iterator[Any]:
    client = open_writer_store(mooncake_master.rpc_address, rpc_timeout_ms=SESSION_RPC_TIMEOUT_MS)
    yield client
    client.close()


@pytest.fixture
def store(_session_writer: Any, mooncake_master: EmbeddedMaster) -> Any:
    """A real writer client on the session master (shared across tests: do not close or reconfigure it)."""
    assert mooncake_master.running, "a test stopped the shared master; use private_master for faults"
    return _session_writer


@pytest.fixture
def prefix_index(store: Any) -> Iterator[PrefixIndex]:
    """A PrefixIndex on the shared store, in a namespace no other test uses; its keys are removed after."""
    index = PrefixIndex(store, BLOCK_SIZE, namespace=f"t-{uuid.uuid4().hex[:12]}")
    yield index
    index.remove_all(force=True)


@pytest.fixture
def index(prefix_index: PrefixIndex) -> PrefixIndex:
    """A lookup server's backend: ``prefix_index`` under the name server tests read best."""
    return prefix_index


@pytest.fixture
def filler(prefix_index: PrefixIndex) -> PrefixIndex:
    """Writes the keys lookups should find: ``prefix_index`` again (one namespace)."""
    return prefix_index


@pytest.fixture
def private_master() -> Iterator[EmbeddedMaster]:
    """A fresh master of the test's own, free to pause, kill or restart; killed by pid afterwards."""
    master = EmbeddedMaster(kv_lease_ttl_ms=500).start()
    yield master
    master.kill()


@pytest.fixture
def make_workload() -> Any:
    """Build deterministic shared-prefix requests: ``make_workload(n, prefix_blocks=..., ...)``."""
    return shared_prefix_workload


@pytest.fixture
def make_hashes() -> Any:
    """Build one chain of block hashes shared with nothing: ``make_hashes(num_blocks, seed=...)``."""
    return unique_hashes


@pytest.fixture(scope="session")
def rpc_base_path() -> Iterator[str]:
    """VLLM_RPC_BASE_PATH for the session: a private 0700 folder, removed at the end."""
    from mooncake_lookout.connector.rigs.rpc_base_path import private_rpc_base_path

    with private_rpc_base_path() as path:
        yield path


@pytest.fixture
def lookup_vllm_config(rpc_base_path: str) -> Any:
    """A minimal real VllmConfig whose lookup IPC path (in ``rpc_base_path``) no other test uses."""
    from mooncake_lookout.connector.rigs.vllm_lookup_server import lookup_vllm_config as build

    return build(next(_lookup_ports))


@pytest.fixture
def upstream_lookup_server(prefix_index: PrefixIndex, lookup_vllm_config: Any) -> Iterator[Any]:
    """vLLM's real LookupKeyServer answering from ``prefix_index``; stopped cleanly (thread joined) after."""
    from mooncake_lookout.connector.rigs.vllm_lookup_server import UpstreamLookupServer

    server = UpstreamLookupServer(prefix_index, lookup_vllm_config).start()
    yield server
    assert server.stop(), "LookupKeyServer thread did not stop"


@pytest.fixture
def upstream_server(upstream_lookup_server: Any) -> str:
    """The ``ipc://`` address of vLLM's real LookupKeyServer over ``prefix_index``."""
    return upstream_lookup_server.address


# -- Prometheus tools ---------------------------------------------------------------------------------------
# The project's checks on rules, metrics text and dashboards need real Prometheus tools. scripts/setup.sh
# installs them, so a missing tool is a broken set-up: the test fails and says how to fix it.

TOOL_HINT = "install Debian's prometheus package (scripts/setup.sh does: apt-get install -y prometheus)"
COLON_FINDING = "metric names should not contain ':'"


def _require_tool(name: str) -> str:
    """The path of ``name`` on PATH; fails the calling test (never skips it) when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: {TOOL_HINT}", pytrace=False)
    return path


class Promtool:
    """Debian's ``promtool``, with the checks that several test files share."""

    def __init__(self, path: str) -> None:
        self.path = path

    def run(self, *args: str, cwd: Path | None = None, text_input: str | None = None,
            timeout_s: float = 120) -> subprocess.CompletedProcess:
        """Run ``promtool *args`` (output captured as text); the caller judges the result."""
        return subprocess.run([self.path, *args], input=text_input, capture_output=True, text=True, cwd=cwd,
                              timeout=timeout_s)

    def check_rules(self, path: Path) -> str:
        """``promtool check rules path`` must pass; returns its output (it names the rule count)."""
        done = self.run("check", "rules", str(path))
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def assert_metrics_clean(self, text: str) -> None:
        """``promtool check metrics`` finds nothing in ``text`` but the colon of vLLM's ``vllm:`` prefix.

        promtool's linter reserves colons for recording rules, so it flags every vLLM metric (vLLM's own
        ``vllm:num_requests_running`` too). The prefix is fixed by DESIGN to sit beside vLLM's metrics, so
        that one finding is expected; with the colon swapped out, promtool must pass outright.
        """
        raw = self.run("check", "metrics", text_input=text, timeout_s=60)
        problems = [line for line in (raw.stdout + raw.stderr).splitlines()
                    if line.strip() and COLON_FINDING not in line]
        assert problems == []
        swapped = self.run("check", "metrics", text_input=text.replace(PREFIX, PREFIX.replace(":", "_")),
                           timeout_s=60)
        assert swapped.returncode == 0, swapped.stdout + swapped.stderr


@pytest.fixture(scope="session")
def require_tool() -> Callable[[str], str]:
    """``require_tool(name)``: a binary's path, or a test failure that says how to install it."""
    return _require_tool


@pytest.fixture(scope="session")
def promtool() -> Promtool:
    """Debian's promtool (a missing one fails the test)."""
    return Promtool(_require_tool("promtool"))


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """The path of Debian's ``prometheus`` server (a missing one fails the test)."""
    return _require_tool("prometheus")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, made once per session by the engine venv's python (torch, transformers)."""
    from mooncake_lookout.connector.rigs.engine import engine_python

    out = tmp_path_factory.mktemp("tiny-model")
    done = subprocess.run([str(engine_python()), "-m", "mooncake_lookout.connector.rigs.tiny_model", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out
