"""The hook on vLLM's input thread (connector/input_thread.py), on vLLM's real ``EngineCore.preprocess_add_request``.

A whole ``EngineCore`` cannot start here (it needs a model executor, and this machine has no GPU), so the real
method runs on an engine core holding only the fields it reads (and, for routing, its scheduler); everything else
is vLLM's own: the request it builds, with its block hashes, is what the listener gets. Two engine cores in one
process (offline ``LLM`` objects, RLHF and eval harnesses) each hear their own requests only: first with two
stand-in connectors, then with two of vLLM's real schedulers, each with our connector, client and lookup server.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Iterator
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_lookout.connector import input_thread
from mooncake_lookout.connector.rigs.scheduler_driver import BLOCK_SIZE, prompt_block_hashes

_ports = itertools.count(3000)


class _Connector:
    """What an engine core's scheduler holds as its KV connector: here only its identity matters."""


def _stand_in(connector: Any) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return SimpleNamespace(mm_receiver_cache=None, structured_output_manager=None,
                           request_block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
                           scheduler=SimpleNamespace(connector=connector))


@pytest.fixture
def engine() -> tuple[Any, Any, Any]:
    """vLLM's EngineCore class (hooked once a listener is installed), a stand-in engine for its method, and the
    connector its scheduler holds."""
    from vllm.v1.engine.core import EngineCore

    connector = _Connector()
    return EngineCore, _stand_in(connector), connector


def _core_request(req_id: str, prompt: list[int], max_tokens: int = 1) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(req_id, prompt, None, SamplingParams(max_tokens=max_tokens), None, time.time(), None,
                             None, None)


def test_each_request_vllm_builds_reaches_the_listener_with_its_block_hashes(engine) -> None:
    EngineCore, stand_in, connector = engine
    heard: list[Any] = []
    assert input_thread.listen(connector, heard.append)
    prompt = list(range(1, 3 * BLOCK_SIZE + 5))
    built, wave = EngineCore.preprocess_add_request(stand_in, _core_request("r1", prompt))
    assert wave == 0 and heard == [built]
    assert built.request_id == "r1" and [bytes(h) for h in built.block_hashes] == prompt_block_hashes(prompt)
    input_thread.stop(connector, heard.append)


def test_a_failing_listener_loses_no_request_and_a_stopped_one_hears_nothing(engine, caplog) -> None:
    EngineCore, stand_in, connector = engine

    def broken(request: Any) -> None:
        raise RuntimeError("boom")

    assert input_thread.listen(connector, broken)
    built, _ = EngineCore.preprocess_add_request(stand_in, _core_request("r2", list(range(1, 40))))
    assert built.request_id == "r2"  # vLLM still gets its request
    assert "starts at admission instead" in caplog.text
    heard: list[Any] = []
    input_thread.listen(connector, heard.append)
    input_thread.stop(connector, broken)  # not the one listening: changes nothing
    input_thread.stop(connector, heard.append)
    EngineCore.preprocess_add_request(stand_in, _core_request("r3", list(range(1, 40))))
    assert heard == []


def test_two_engine_cores_each_hear_their_own_requests_and_one_closing_leaves_the_other(engine) -> None:
    """Request ids collide across engines (each counts from 0): only the engine core a request was built by
    names the listener. One connector stopping, or being collected, leaves the other's listener in place."""
    EngineCore, core_a, connector_a = engine
    connector_b = _Connector()
    core_b = _stand_in(connector_b)
    heard_a: list[Any] = []
    heard_b: list[Any] = []
    before = input_thread.listening()
    assert input_thread.listen(connector_a, heard_a.append) and input_thread.listen(connector_b, heard_b.append)
    a0, _ = EngineCore.preprocess_add_request(core_a, _core_request("0", list(range(1, 40))))
    b0, _ = EngineCore.preprocess_add_request(core_b, _core_request("0", list(range(100, 140))))
    assert heard_a == [a0] and heard_b == [b0]
    input_thread.stop(connector_b, heard_b.append)  # engine B closes
    a1, _ = EngineCore.preprocess_add_request(core_a, _core_request("1", list(range(1, 40))))
    EngineCore.preprocess_add_request(core_b, _core_request("1", list(range(100, 140))))
    assert heard_a == [a0, a1] and heard_b == [b0]
    other = _Connector()  # a connector collected without closing leaves no listener behind
    input_thread.listen(other, heard_b.append)
    assert input_thread.listening() == before + 2
    del other
    gc.collect()
    assert input_thread.listening() == before + 1
    input_thread.stop(connector_a, heard_a.append)
    assert input_thread.listening() == before


# -- two of vLLM's real schedulers, each with our connector, in one process ----------------------------------------
class _Engine:
    """vLLM's real V1 scheduler with our connector (async lookups over ``pipelined``), its own lookup server over
    ``index``, and vLLM's ``EngineCore.preprocess_add_request`` building its requests."""

    def __init__(self, index: Any, exit_stack: ExitStack) -> None:
        from mooncake_lookout.connector.events import OutcomeCounter
        from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config
        from mooncake_lookout.connector.server import LookupServer

        self.server = exit_stack.enter_context(LookupServer(index, "tcp://127.0.0.1:0"))
        config = make_vllm_config({"lookup_transport": "pipelined", "lookup_server_address": self.server.address,
                                   "lookup_rpc_port": next(_ports), "lookup_async": True,
                                   "lookup_timeout_ms": 5000})
        self.driver = SchedulerDriver(config)
        self.closed = False
        exit_stack.callback(self.close)
        self.client = self.driver.connector.lookup_client
        self.counter = OutcomeCounter()
        self.client.observers.add(self.counter)
        self.core = self.driver.engine_core()

    def answered(self) -> int:
        """Lookups its lookup server answered."""
        return self.server.stats.answered_by_status["ok"]

    def arrive(self, req_id: str, prompt: list[int]) -> Any:
        """vLLM's input thread builds the request (the hook runs); the engine admits it at its next step."""
        request, _ = self.core.preprocess_add_request(_core_request(req_id, prompt, max_tokens=2))
        return request

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.driver.close()


def _until(cond: Any, bound_s: float = 5.0) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, "not within the bound"
        time.sleep(0.001)


@pytest.fixture
def two_engines(prefix_index, rpc_base_path) -> Iterator[tuple[_Engine, _Engine]]:
    with ExitStack() as stack:
        yield _Engine(prefix_index, stack), _Engine(prefix_index, stack)


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 50000 + 1 for i in range(blocks * BLOCK_SIZE + 3)]


@pytest.mark.timed  # waits for real replies, each bounded
def test_two_real_engines_in_one_process_each_get_their_own_arrivals_even_after_the_other_closes(
        two_engines, prefix_index) -> None:
    """Engine A's requests are looked up by A's client on A's server as they arrive, B's by B's, with the same
    request ids; each is scheduled with its own prompt's hit in its first step (the answer came at arrival, no
    deferral); and after B closes, A's arrivals still reach A."""
    a, b = two_engines
    prompt_a, prompt_b, later_a = _prompt(1, 6), _prompt(2, 6), _prompt(3, 6)
    prefix_index.store_prefixes([a.driver.block_hashes(prompt_a)[:4], b.driver.block_hashes(prompt_b)[:2],
                                 a.driver.block_hashes(later_a)[:3]])

    def serve(engine: _Engine, req_id: str, prompt: list[int], other: _Engine | None) -> None:
        mine, theirs = engine.answered(), other.answered() if other is not None else 0
        request = engine.arrive(req_id, prompt)
        _until(lambda: engine.answered() == mine + 1)  # its own server answered it, as it arrived
        _until(lambda: bool(engine.client.transport.news))
        assert other is None or other.answered() == theirs  # and the other's heard nothing
        engine.driver.add(request)
        added_at = engine.driver.stats.steps
        engine.driver.run_until_idle(200)
        assert engine.driver.stats.first_scheduled_step[req_id] == added_at  # not deferred: the answer was in

    serve(a, "0", prompt_a, b)
    serve(b, "0", prompt_b, a)  # the same request id, in the other engine
    assert a.driver.stats.computed_at_admission["0"] == 4 * BLOCK_SIZE
    assert b.driver.stats.computed_at_admission["0"] == 2 * BLOCK_SIZE
    b.close()
    serve(a, "1", later_a, None)
    assert a.driver.stats.computed_at_admission["1"] == 3 * BLOCK_SIZE
    assert a.counter.deferrals == 0 and b.counter.deferrals == 0
    assert a.client.pending == 0 and len(a.client.arrivals) == 0
