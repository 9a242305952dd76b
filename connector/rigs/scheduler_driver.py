"""Drive vLLM's real V1 ``Scheduler`` on a CPU host, with no model: for tests, ``demo`` and ``bench``.

A folder holding only a tiny OPT ``config.json`` serves ``ModelConfig`` (no download); the KV cache is a
single full-attention group; each step's model output is made up (one sampled token per scheduled
request), which is all the scheduler needs to move requests along. Block hashes are vLLM's own.
The tiny model takes positions up to :data:`MAX_POSITIONS` (prompts of 4,096 blocks of 16 tokens fit),
so ``max_model_len`` can be raised for long-prompt runs.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 16
# What stands in for the model's forward pass after each step. Never zero by default: a real step waits on
# the GPU with the GIL released, and a driver that never releases it leaves every other thread of the
# process (the in-process lookup servers of tests, say) a turn only once per 5 ms switch interval.
MODEL_STEP_S = 0.0005
MAX_POSITIONS = 131_072  # the longest prompt the tiny model takes (4,096 blocks of 16 tokens, with room)
TINY_OPT = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "ffn_dim": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50272, "max_position_embeddings": MAX_POSITIONS,
    "word_embed_proj_dim": 64, "do_layer_norm_before": True, "torch_dtype": "float32",
}


def tiny_model_dir(root: str | None = None) -> str:
    """A model folder with only a tiny ``config.json``: enough for ``ModelConfig``, nothing to download.

    The default folder's name carries a digest of the config, so a folder written by an older config
    (a shorter ``max_position_embeddings``, say) is never read for this one.
    """
    if root is None:
        digest = hashlib.sha256(json.dumps(TINY_OPT, sort_keys=True).encode()).hexdigest()[:10]
        root = os.path.join(tempfile.gettempdir(), f"mooncake-lookout-model-{os.getuid()}-{digest}")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "config.json")
    if not os.path.exists(path):
        tmp = path + f".{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(TINY_OPT, f)
        os.replace(tmp, path)
    return root


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"vllm-cache-{os.getuid()}"))


def make_vllm_config(extra_config: dict[str, Any], *, connector: str = "LookoutMooncakeStoreConnector",
                     module_path: str | None = "mooncake_lookout.connector.vllm_connector",
                     max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int = 2048,
                     kv_role: str = "kv_consumer", model_name: str | None = None,
                     block_size: int = BLOCK_SIZE) -> Any:
    """A real ``VllmConfig`` for the CPU scheduler with the given connector and extra config.

    ``kv_role`` defaults to ``kv_consumer`` and ``load_async`` to false: with no worker here, nothing would
    ever report a save or an asynchronous load done, and upstream's scheduler would keep their requests
    and blocks parked forever. ``model_name``: the tiny model's folder takes that name (what vLLM's store
    keys embed: the last part of the model's name or path), e.g. ``Llama-3.1-8B``.
    """
    _offline_env()
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    path = tiny_model_dir()
    if model_name is not None:
        path = tiny_model_dir(os.path.join(path, "named", model_name.rstrip("/").split("/")[-1]))
    model = ModelConfig(model=path, skip_tokenizer_init=True, max_model_len=max_model_len,
                        dtype="float32", seed=0)
    kv = KVTransferConfig(kv_connector=connector, kv_role=kv_role, kv_connector_module_path=module_path,
                          kv_connector_extra_config={"load_async": False, **extra_config})
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len, is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv,
    )


def make_kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> Any:
    """One full-attention KV cache group of ``num_blocks`` blocks (no tensors: the scheduler only counts)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])


@dataclass
class StepStats:
    """What one run of the scheduler looked like."""

    steps: int = 0
    step_seconds: list[float] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    computed_at_admission: dict[str, int] = field(default_factory=dict)  # req_id -> num_computed_tokens
    first_scheduled_step: dict[str, int] = field(default_factory=dict)
    added_step: dict[str, int] = field(default_factory=dict)


def freeze_startup_heap() -> None:
    """What vLLM's EngineCore does once started (``freeze_gc_heap``): the objects alive now are left out of
    garbage collection. Without it, a full collection here scans vLLM's and torch's whole heap (measured up
    to 270 ms) and lands in whichever lookup call triggers it; vLLM's engine never pays that. ``gc.freeze``
    alone (vLLM collects first, which costs a second per call here and changes nothing for the pauses)."""
    gc.freeze()


def prompt_block_hashes(prompt: list[int]) -> list[bytes]:
    """vLLM's block hashes of a prompt, as :meth:`SchedulerDriver.block_hashes` gives them, with no scheduler
    (to fill the store for a scheduler that runs in another process)."""
    _offline_env()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request("hash-only", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    return [bytes(h) for h in request.block_hashes]


class SchedulerDriver:
    """vLLM's real ``Scheduler`` with a KV connector, stepped by hand."""

    def __init__(self, vllm_config: Any, *, num_blocks: int = 4096, model_step_s: float = MODEL_STEP_S) -> None:
        _offline_env()
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.vllm_config = vllm_config
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=make_kv_cache_config(num_blocks),
            structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE,
            log_stats=True,
        )
        # Stands in for the model's forward pass between steps (the time async lookups get to finish).
        self.model_step_s = model_step_s
        self.stats = StepStats()
        self.kv_connector_stats: list[Any] = []
        freeze_startup_heap()

    @property
    def connector(self) -> Any:
        """The scheduler's KV connector instance."""
        return self.scheduler.connector

    def make_request(self, req_id: str, prompt: list[int], *, max_tokens: int = 4) -> Any:
        """A request with vLLM's own block hashes (sha256, chained), as the engine would build it."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(req_id, prompt, params, None, block_hasher=self._hasher)

    def block_hashes(self, prompt: list[int]) -> list[bytes]:
        """vLLM's block hashes of a prompt (what the store is keyed by)."""
        return [bytes(h) for h in self.make_request("hash-only", prompt).block_hashes]

    def add(self, request: Any) -> None:
        """Admit a request (calls the connector's ``on_new_request``)."""
        self.stats.added_step[request.request_id] = self.stats.steps
        self.scheduler.add_request(request)

    def abort(self, req_ids: Iterable[str]) -> None:
        """Abort requests, as a client disconnect would."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def arrive(self, request: Any) -> None:
        """``request`` reaches the engine: vLLM's input thread has built it (our connector may send its lookup
        now, :mod:`~mooncake_lookout.connector.input_thread`); :meth:`add` admits it at a step's start. Routed as
        the hook routes it: to the listener of the connector this scheduler holds. (:meth:`engine_core` builds
        the request with vLLM's own method instead.)"""
        from mooncake_lookout.connector import input_thread

        input_thread.request_built(self.scheduler.connector, request)

    def engine_core(self) -> Any:
        """vLLM's own ``EngineCore`` class holding this driver's scheduler, not started (an engine core needs a
        model executor: none here): only the fields ``preprocess_add_request`` reads are set, so that its
        ``preprocess_add_request(EngineCoreRequest)`` is vLLM's real method, wrapped by our input-thread hook,
        building the request as vLLM's input thread would. :meth:`add` then admits what it returns."""
        from vllm.v1.engine.core import EngineCore

        core = EngineCore.__new__(EngineCore)
        core.scheduler = self.scheduler
        core.mm_receiver_cache = None
        core.structured_output_manager = self.scheduler.structured_output_manager
        core.request_block_hasher = self._hasher
        return core

    def step(self, during_model: Sequence[tuple[float, Callable[[], None]]] = ()) -> Any:
        """One scheduling step plus a made-up model output of one token per scheduled request. ``during_model``:
        ``(seconds, call)`` pairs in time order, each ``call`` made that far into the model step (as vLLM's input
        thread takes in requests while the model runs)."""
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.stats.step_seconds.append(t1 - t0)
        for new in out.scheduled_new_reqs:
            self.stats.first_scheduled_step.setdefault(new.req_id, self.stats.steps)
            self.stats.computed_at_admission.setdefault(new.req_id, new.num_computed_tokens)
        if during_model:
            for offset, call in during_model:
                time.sleep(max(0.0, t1 + offset - time.perf_counter()))
                call()
            time.sleep(max(0.0, t1 + self.model_step_s - time.perf_counter()))
        elif self.model_step_s > 0:
            time.sleep(self.model_step_s)
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[1] for _ in req_ids],
        )
        engine_outputs = self.scheduler.update_from_output(out, runner)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.stats.finished.append(o.request_id)
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.kv_connector_stats.append(eco.scheduler_stats.kv_connector_stats)
        self.stats.steps += 1
        return out

    def run_until_idle(self, max_steps: int = 10_000) -> StepStats:
        """Step until no request is waiting or running (bounded)."""
        for _ in range(max_steps):
            if self.scheduler.get_num_unfinished_requests() == 0:
                break
            self.step()
        return self.stats

    def close(self) -> None:
        """Shut the scheduler's connector down (its lookup client and transport)."""
        self.scheduler.shutdown()


__all__ = ["BLOCK_SIZE", "MAX_POSITIONS", "MODEL_STEP_S", "SchedulerDriver", "StepStats", "freeze_startup_heap",
           "make_kv_cache_config", "make_vllm_config", "prompt_block_hashes", "tiny_model_dir"]
