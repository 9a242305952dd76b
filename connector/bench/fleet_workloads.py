"""The two workloads of scenario (h), as block hashes: what each engine of a fleet asks, and what the store holds.

Why: the fleet scenario drives lookup paths (no scheduler), so its requests are vLLM-shaped block hashes made
here, deterministically, by every process that needs them (the coordinator fills the store, each engine builds
its own requests from the same arguments):

* **shared-prefix**, scenario (c)'s: prompts of 8 blocks, the first 4 shared with a quarter of the others (4
  prefixes), from a pool of 4,096 prompts; the store holds every other prompt whole and the rest up to their
  prefix. Engine ``e`` starts at its own place in the pool.
* **multi-turn**, scenario (g)'s: conversations with a 2,048-block context and 20 turns of 16 blocks, 4 in
  progress per engine, a request being the next turn of one of them. The store holds every block of every
  conversation before the first request (the engines' saves are kept out of the master's figures): a turn finds
  its own new blocks too, so our prefix cache asks only for the blocks a turn adds (in a deployment that saves a
  turn's blocks after its lookup, about twice that: scenario g). Every engine runs through the same
  conversations.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mooncake_lookout.connector.rigs.workload import WorkloadRequest, chain_hashes, shared_prefix_workload

BLOCK_SIZE = 16
SHARED_PREFIX, MULTI_TURN = "shared-prefix", "multi-turn"
KINDS = (SHARED_PREFIX, MULTI_TURN)
POOL = 4096  # shared-prefix prompts, as scenario (c)'s store fill
PREFIX_BLOCKS, UNIQUE_BLOCKS, PREFIXES = 4, 4, 4
CONTEXT_BLOCKS, TURNS, TURN_BLOCKS, ACTIVE = 2048, 20, 16, 4
SEED = 27


@dataclass(frozen=True)
class FleetWorkload:
    """One workload of the fleet: its kind, new requests a second per engine, requests arriving together."""

    kind: str
    rate: float
    burst: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fleet workload kind must be one of {KINDS}, got {self.kind!r}")
        if self.rate <= 0 or self.burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {self.rate} and {self.burst}")

    @property
    def blocks(self) -> int:
        """Full blocks of a prompt (the longest turn's for multi-turn)."""
        if self.kind == SHARED_PREFIX:
            return PREFIX_BLOCKS + UNIQUE_BLOCKS
        return CONTEXT_BLOCKS + (TURNS - 1) * TURN_BLOCKS

    def mean_blocks(self) -> float:
        """Full blocks of a prompt, on average over the workload's requests."""
        if self.kind == SHARED_PREFIX:
            return float(self.blocks)
        return CONTEXT_BLOCKS + (TURNS - 1) * TURN_BLOCKS / 2

    def requests_in(self, seconds: float) -> int:
        """Requests one engine asks in ``seconds`` at this rate: whole bursts, at least one."""
        return self.burst * max(1, round(self.rate * seconds / self.burst))

    def conversations(self, requests_per_engine: int) -> int:
        """Conversations an engine goes through in ``requests_per_engine`` requests (multi-turn)."""
        return ACTIVE * math.ceil(requests_per_engine / (ACTIVE * TURNS))

    def requests(self, count: int, engine: int, tag: str) -> list[WorkloadRequest]:
        """Engine ``engine``'s first ``count`` requests, their ids prefixed with ``tag``."""
        if self.kind == SHARED_PREFIX:
            pool = _pool()
            start = engine * POOL // 8
            picked = [pool[(start + k) % POOL] for k in range(count)]
            return [WorkloadRequest(f"{tag}-e{engine}-{k}", r.num_tokens, r.block_hashes) for k, r in enumerate(picked)]
        out = []
        for k in range(count):
            slot = k % ACTIVE
            generation, turn = divmod(k // ACTIVE, TURNS)
            blocks = CONTEXT_BLOCKS + turn * TURN_BLOCKS
            hashes = _conversation(generation * ACTIVE + slot)[:blocks]
            out.append(WorkloadRequest(f"{tag}-e{engine}-c{generation * ACTIVE + slot}-t{turn}",
                                       blocks * BLOCK_SIZE + 1, hashes))
        return out

    def stored(self, requests_per_engine: int) -> list[Sequence[bytes]]:
        """What the store holds before the first request: lists of block hashes (see the module docstring)."""
        if self.kind == SHARED_PREFIX:
            return [r.block_hashes if i % 2 == 0 else r.block_hashes[:PREFIX_BLOCKS] for i, r in enumerate(_pool())]
        return [_conversation(c) for c in range(self.conversations(requests_per_engine))]

    def as_dict(self) -> dict[str, object]:
        """The workload and its shape, for JSON."""
        shape = ({"prompt_blocks": self.blocks, "prefix_blocks": PREFIX_BLOCKS, "prefixes": PREFIXES, "pool": POOL}
                 if self.kind == SHARED_PREFIX else
                 {"context_blocks": CONTEXT_BLOCKS, "turns": TURNS, "blocks_per_turn": TURN_BLOCKS,
                  "active_per_engine": ACTIVE, "mean_blocks": self.mean_blocks()})
        return {**asdict(self), **shape}


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[WorkloadRequest, ...]:
    return tuple(shared_prefix_workload(POOL, block_size=BLOCK_SIZE, prefix_blocks=PREFIX_BLOCKS,
                                        unique_blocks=UNIQUE_BLOCKS, num_prefixes=PREFIXES, seed=SEED))


@functools.lru_cache(maxsize=256)
def _conversation(conversation: int) -> tuple[bytes, ...]:
    """Every block hash of one conversation's last turn (each turn's prompt is a prefix of it)."""
    blocks = CONTEXT_BLOCKS + (TURNS - 1) * TURN_BLOCKS
    return tuple(chain_hashes(f"{SEED}/conversation/{conversation}/{b}".encode() for b in range(blocks)))


__all__ = ["ACTIVE", "BLOCK_SIZE", "CONTEXT_BLOCKS", "FleetWorkload", "KINDS", "MULTI_TURN", "POOL", "SHARED_PREFIX",
           "TURNS", "TURN_BLOCKS"]
