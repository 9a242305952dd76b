"""The hook on vLLM's input thread (connector/input_thread.py), on vLLM's real ``EngineCore.preprocess_add_request``.

A whole ``EngineCore`` cannot start here (it needs a model executor, and this machine has no GPU), so the real
method runs on a stand-in holding the three fields it reads; everything else is vLLM's own: the request it
builds, with its block hashes, is what the listener gets.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_lookout.connector import input_thread
from mooncake_lookout.connector.rigs.scheduler_driver import BLOCK_SIZE, prompt_block_hashes


@pytest.fixture
def engine() -> tuple[Any, Any]:
    """vLLM's EngineCore class (hooked once a listener is installed) and a stand-in engine for its method."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine.core import EngineCore

    init_none_hash(sha256)
    stand_in = SimpleNamespace(mm_receiver_cache=None, structured_output_manager=None,
                               request_block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    return EngineCore, stand_in


def _core_request(req_id: str, prompt: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(req_id, prompt, None, SamplingParams(max_tokens=1), None, time.time(), None, None, None)


def test_each_request_vllm_builds_reaches_the_listener_with_its_block_hashes(engine) -> None:
    EngineCore, stand_in = engine
    heard: list[Any] = []
    assert input_thread.listen(heard.append)
    prompt = list(range(1, 3 * BLOCK_SIZE + 5))
    built, wave = EngineCore.preprocess_add_request(stand_in, _core_request("r1", prompt))
    assert wave == 0 and heard == [built]
    assert built.request_id == "r1" and [bytes(h) for h in built.block_hashes] == prompt_block_hashes(prompt)
    input_thread.stop(heard.append)


def test_a_failing_listener_loses_no_request_and_a_stopped_one_hears_nothing(engine, caplog) -> None:
    EngineCore, stand_in = engine

    def broken(request: Any) -> None:
        raise RuntimeError("boom")

    assert input_thread.listen(broken)
    built, _ = EngineCore.preprocess_add_request(stand_in, _core_request("r2", list(range(1, 40))))
    assert built.request_id == "r2"  # vLLM still gets its request
    assert "starts at admission instead" in caplog.text
    heard: list[Any] = []
    input_thread.listen(heard.append)
    input_thread.stop(broken)  # not the one listening: changes nothing
    input_thread.stop(heard.append)
    EngineCore.preprocess_add_request(stand_in, _core_request("r3", list(range(1, 40))))
    assert heard == []
