"""Burst benchmark: how long a scheduler waits for the answers to N requests that arrive together.

Why: vLLM's lookup channel carries one lookup at a time, so a burst of N new requests needs about N round
trips before the last answer, while one ``batch_is_exist`` of all their keys takes a few milliseconds.
This measures the scheduler's view: every request is asked once (``non_block=True``) in the first step,
then each pending one is asked again once per ``step_s`` until all have an answer. Any client with vLLM's
``lookup(req_id, num_tokens, block_hashes, non_block)`` call fits (ours, or vLLM's ``LookupKeyClient``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from mooncake_lookout.connector.workload import WorkloadRequest, shared_prefix_workload


class PollingClient(Protocol):
    """vLLM's lookup client calls, as the scheduler uses them."""

    def lookup(self, req_id: str, num_tokens: int, block_hashes: list[bytes], non_block: bool = False) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BurstResult:
    """What one burst took: wall time until the last answer, scheduler steps, answers and total hit tokens."""

    n: int
    seconds: float
    steps: int
    hit_tokens: int


def burst(client_factory: Callable[[], PollingClient], n: int = 256, step_s: float = 0.001, *,
          requests: Sequence[WorkloadRequest] | None = None, timeout_s: float = 30.0) -> BurstResult:
    """Ask ``n`` lookups in one step, then poll the pending ones once per ``step_s``; time until all answered.

    ``requests`` defaults to ``n`` requests of 8 blocks with 4 shared ones (``shared_prefix_workload``).
    """
    reqs = list(requests) if requests is not None else shared_prefix_workload(n)
    client = client_factory()
    try:
        pending = {r.req_id: r for r in reqs}
        hit_tokens = 0
        steps = 0
        t0 = time.perf_counter()
        while pending:
            for req_id, r in list(pending.items()):
                result = client.lookup(req_id, r.num_tokens, list(r.block_hashes), non_block=True)
                if result is not None:
                    hit_tokens += result.hit_length
                    del pending[req_id]
            if not pending:
                break
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{len(pending)} of {len(reqs)} lookups unanswered after {timeout_s} s")
            steps += 1
            time.sleep(step_s)
        return BurstResult(len(reqs), time.perf_counter() - t0, steps, hit_tokens)
    finally:
        client.close()


__all__ = ["BurstResult", "PollingClient", "burst"]
