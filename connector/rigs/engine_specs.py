"""What ``demo --engine`` and bench scenario (i) run in real engines: a connector and its settings, by label.

Why: both compare upstream's ``MooncakeStoreConnector`` with ours inside real ``vllm serve`` engines
(:class:`~.engine.Engine`), engine by engine, each mode an engine of its own (vLLM reads
``kv_connector_extra_config`` once, at start-up). Here, once: the label a table shows, the connector named by its
plugin name, its settings, and the engine built for them: ``embedded`` mode (each engine lends the store a segment:
the run needs no restart), keys apart per engine (``cache_prefix``), and vLLM's own prefix cache off
(``--no-enable-prefix-caching``), so that a repeated prefix is asked of the store, as when the engine's own cache
has evicted it or another engine computed it: the path under test.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.rigs.engine import LOOKOUT, UPSTREAM, Engine, engine_python

BLOCK_SIZE = 32  # the engines' --block-size (rigs.engine.SERVE_ARGS)
START_TIMEOUT_S = 480.0  # a loaded 2-core host has taken 235 s to bring up three at once


@dataclass(frozen=True)
class EngineSpec:
    """One engine's label, connector (plugin name) and ``kv_connector_extra_config``."""

    label: str
    connector: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ours(self) -> bool:
        """True when the engine runs this project's connector."""
        return self.connector == LOOKOUT

    @property
    def slug(self) -> str:
        """The label as a file name (``ours-auto``)."""
        return self.label.replace(" ", "-")


def build(spec: EngineSpec, model: Path, master_address: str, namespace: str,
          env: dict[str, str] | None = None) -> Engine:
    """The engine of ``spec`` (not started), its keys under ``namespace``."""
    return Engine(model, connector=spec.connector, master_address=master_address,
                  extra_config={**spec.extra, "cache_prefix": namespace}, mode="embedded", name=spec.slug,
                  extra_args=("--no-enable-prefix-caching",), env=env, start_timeout_s=START_TIMEOUT_S)


def make_model(out: Path, timeout_s: float = 300.0) -> Path:
    """The tiny model and tokenizer (:mod:`.tiny_model`) in ``out``, made by the engine venv's python."""
    done = subprocess.run([str(engine_python()), "-m", "mooncake_lookout.connector.rigs.tiny_model", str(out)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"could not make the tiny model: {done.stderr.strip()[-500:]}")
    return out


__all__ = ["BLOCK_SIZE", "LOOKOUT", "START_TIMEOUT_S", "UPSTREAM", "EngineSpec", "build", "make_model"]
