"""``serve --vllm-layout``: the standalone lookup server, answering for the keys a vLLM deployment writes.

Why: ``serve``'s own backend (the prefix index) keys a block ``<namespace>/<hex>``; vLLM's Mooncake store
connector keys it ``<cache_prefix>@<model>@tp_rank:R@pcp0@dcp0@pp_rank:P@group:G@<hex>``, by rules only its
worker knows (rank namespaces, replicated heads, store layouts). Over a deployment's master the prefix index would
never find a prefix vLLM stored. With ``--vllm-layout`` the server's backend is the one our in-worker server uses:
upstream's own ``MooncakeStoreWorker``, built for lookups only, without a GPU
(:func:`~mooncake_lookout.connector.server.vllm_store_worker.lookup_worker`), behind
:class:`~mooncake_lookout.connector.server.worker_backend.WorkerBackend`. Its keys are computed by upstream's code
from the settings the deployment runs with:

* ``--model``: ``vllm serve``'s model argument (vLLM puts its last path component in every key);
* ``--kv-transfer-config``: the engine's ``--kv-transfer-config`` JSON (or ``@file``): ``kv_role`` and
  ``kv_connector_extra_config`` (``cache_prefix``, ``store_tp_size``, ...);
* ``--mooncake-config``: the engine's ``mooncake.json`` (default ``$MOONCAKE_CONFIG_PATH``): the master's address
  (unless ``--master`` is given) and ``tenant_id``;
* ``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--num-kv-heads`` and ``--block-size``: the engine's
  parallel layout and KV block size.

The model's folder is not needed: vLLM's config is built over a stand-in ``config.json`` under a temporary path
that ends with ``--model``, so vLLM derives the same name from it. One full-attention KV cache group is built
(decoder models with one attention type); the groups of hybrid models (sliding window, Mamba) are not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"  # where vLLM's worker reads mooncake.json from
DEFAULT_TENANT = "default"  # Mooncake's tenant when mooncake.json names none


class LayoutError(ValueError):
    """A ``--vllm-layout`` setting that cannot be used; the message names the flag or file."""


@dataclass(frozen=True)
class VllmLayout:
    """What decides the keys of a vLLM deployment's store, read from its own configuration."""

    model: str
    kv_role: str = "kv_both"
    extra_config: dict[str, Any] = field(default_factory=dict)
    master: str | None = None  # from mooncake.json
    tenant_id: str | None = None  # None: Mooncake's default tenant
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_kv_heads: int = 1
    block_size: int = 16


def add_vllm_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--vllm-layout`` flags of ``serve``."""
    g = parser.add_argument_group("vLLM key layout", "answer for the keys a vLLM deployment writes (see "
                                  "docs/protocol.md); --block-size is then vLLM's --block-size")
    g.add_argument("--vllm-layout", action="store_true",
                   help="look up keys as vLLM's Mooncake store connector writes them (upstream's key code)")
    g.add_argument("--model", metavar="NAME", help="vllm serve's model argument, e.g. Qwen/Qwen2.5-7B-Instruct")
    g.add_argument("--kv-transfer-config", metavar="JSON", default="{}",
                   help="the engine's --kv-transfer-config (JSON text, or @file): kv_role, cache_prefix, ...")
    g.add_argument("--mooncake-config", metavar="PATH", default=None,
                   help=f"the engine's mooncake.json (default ${MOONCAKE_CONFIG_ENV}): master address, tenant_id")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="the engine's TP size (default 1)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="the engine's PP size (default 1)")
    g.add_argument("--num-kv-heads", type=int, default=None, metavar="N",
                   help="the model's KV heads (its config's num_key_value_heads); needed when TP > 1")


def _read_json(text: str, what: str) -> Any:
    try:
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        return json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise LayoutError(f"{what}: cannot read it as JSON ({e})") from None


def read_layout(args: argparse.Namespace) -> VllmLayout:
    """The layout ``args`` describe, checked; :class:`LayoutError` names what is wrong."""
    model = (args.model or "").strip()
    if not model:
        raise LayoutError("--vllm-layout needs --model: vllm serve's model argument (it names every key)")
    if any(part in (".", "..") for part in model.split("/")):
        raise LayoutError(f"--model {model!r}: '.' and '..' are not part of a model name")
    transfer = _read_json(args.kv_transfer_config, "--kv-transfer-config")
    if not isinstance(transfer, dict) or not isinstance(transfer.get("kv_connector_extra_config", {}), dict):
        raise LayoutError("--kv-transfer-config must be a JSON object like vllm serve's, with "
                          "kv_connector_extra_config an object")
    config_path = args.mooncake_config or os.environ.get(MOONCAKE_CONFIG_ENV)
    mooncake: dict[str, Any] = {}
    if config_path:
        mooncake = _read_json("@" + config_path, f"--mooncake-config {config_path}")
        if not isinstance(mooncake, dict):
            raise LayoutError(f"--mooncake-config {config_path}: must be a JSON object")
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise LayoutError("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
    if tp > 1 and args.num_kv_heads is None:
        raise LayoutError("--tensor-parallel-size > 1 needs --num-kv-heads (the model's num_key_value_heads): "
                          "it decides which ranks' keys hold distinct data")
    heads = args.num_kv_heads if args.num_kv_heads is not None else 1
    if heads < 1 or args.block_size < 1:
        raise LayoutError("--num-kv-heads and --block-size must be at least 1")
    tenant = str(mooncake.get("tenant_id") or "").strip()
    return VllmLayout(model=model, kv_role=str(transfer.get("kv_role") or "kv_both"),
                      extra_config=dict(transfer.get("kv_connector_extra_config", {})),
                      master=mooncake.get("master_server_address") or None,
                      tenant_id=tenant if tenant and tenant != DEFAULT_TENANT else None,
                      tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_heads=heads,
                      block_size=args.block_size)


def layout_vllm_config(layout: VllmLayout, model_root: str) -> tuple[Any, Any]:
    """vLLM's config and KV cache config for ``layout``, over a stand-in model folder under ``model_root``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"vllm-cache-{os.getuid()}"))
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from mooncake_lookout.connector.rigs.scheduler_driver import TINY_OPT

    folder = os.path.join(model_root, layout.model.lstrip("/"))
    os.makedirs(folder, exist_ok=True)
    heads = layout.num_kv_heads  # the stand-in is an OPT config: its KV heads are its attention heads
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**TINY_OPT, "num_attention_heads": heads, "hidden_size": 16 * heads,
                   "word_embed_proj_dim": 16 * heads}, f)
    # The path ends as --model does, and vLLM names the keys by that ending.
    model = ModelConfig(model=folder, skip_tokenizer_init=True, max_model_len=2048, dtype="float32", seed=0)
    transfer = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role=layout.kv_role,
                                kv_connector_extra_config=dict(layout.extra_config))
    vllm_config = VllmConfig(model_config=model,
                             cache_config=CacheConfig(block_size=layout.block_size, enable_prefix_caching=True),
                             parallel_config=ParallelConfig(pipeline_parallel_size=layout.pipeline_parallel_size),
                             device_config=DeviceConfig("cpu"), kv_transfer_config=transfer)
    spec = FullAttentionSpec(block_size=layout.block_size, num_kv_heads=heads, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=1024, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return vllm_config, kv_cache_config


def vllm_layout_backend(layout: VllmLayout, store: Any, stack: contextlib.ExitStack) -> Any:
    """A :class:`WorkerBackend` over upstream's store worker for ``layout``, looking up through ``store``."""
    from mooncake_lookout.connector.server.vllm_store_worker import lookup_worker
    from mooncake_lookout.connector.server.worker_backend import WorkerBackend
    from mooncake_lookout.connector.vllm_version import require_supported_vllm

    require_supported_vllm()  # upstream's private worker attributes are read below
    model_root = stack.enter_context(tempfile.TemporaryDirectory(prefix="mooncake-lookout-layout-"))
    vllm_config, kv_cache_config = layout_vllm_config(layout, model_root)
    worker = lookup_worker(vllm_config, kv_cache_config, store, tp_rank=0, tp_size=layout.tensor_parallel_size)
    return WorkerBackend(worker)


__all__ = ["LayoutError", "MOONCAKE_CONFIG_ENV", "VllmLayout", "add_vllm_layout_arguments", "layout_vllm_config",
           "read_layout", "vllm_layout_backend"]
