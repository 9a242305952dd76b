"""Deterministic shared-prefix workloads: block hashes for requests, without a tokenizer or a model.

vLLM keys a prefix cache by chained block hashes: each full block's hash folds in its parent's, so two
requests share a block hash exactly when they share every token up to the end of that block. The
hashes here are chained the same way (SHA-256 of parent hash + block content, 32 bytes like vLLM's
``BlockHash``), so a workload built from a few prefixes reproduces the sharing pattern of a real one.
Tests, the demo and the bench build their requests here; the same arguments give the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

HASH_BYTES = 32
ROOT_HASH = bytes(HASH_BYTES)  # parent of every first block


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: its id, prompt length in tokens and its full blocks' hashes."""

    req_id: str
    num_tokens: int
    block_hashes: tuple[bytes, ...]


def chain_hashes(contents: Iterable[bytes], parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chain-hash block contents: ``h[i] = sha256(h[i-1] + content[i])``, starting from ``parent``."""
    out: list[bytes] = []
    for content in contents:
        parent = hashlib.sha256(parent + content).digest()
        out.append(parent)
    return out


def _content(seed: int, kind: str, owner: int, index: int) -> bytes:
    return f"{seed}/{kind}/{owner}/{index}".encode()


def shared_prefix_workload(num_requests: int, *, block_size: int = 16, prefix_blocks: int = 4,
                           unique_blocks: int = 4, num_prefixes: int = 1, extra_tokens: int = 1,
                           seed: int = 0) -> list[WorkloadRequest]:
    """``num_requests`` requests; request ``i`` starts with prefix ``i % num_prefixes``.

    Each prompt has ``prefix_blocks`` shared blocks, then ``unique_blocks`` blocks of its own, then
    ``extra_tokens`` tokens of a partial last block (vLLM hashes full blocks only), so
    ``num_tokens = (prefix_blocks + unique_blocks) * block_size + extra_tokens``.
    """
    if num_requests < 0 or prefix_blocks < 0 or unique_blocks < 0 or extra_tokens < 0:
        raise ValueError("counts must be >= 0")
    if block_size <= 0 or num_prefixes <= 0:
        raise ValueError("block_size and num_prefixes must be > 0")
    prefixes = [chain_hashes(_content(seed, "prefix", p, b) for b in range(prefix_blocks))
                for p in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        shared = prefixes[i % num_prefixes]
        parent = shared[-1] if shared else ROOT_HASH
        own = chain_hashes((_content(seed, "request", i, b) for b in range(unique_blocks)), parent)
        hashes = tuple(shared) + tuple(own)
        requests.append(WorkloadRequest(f"req-{seed}-{i}", len(hashes) * block_size + extra_tokens, hashes))
    return requests


def unique_hashes(num_blocks: int, *, seed: int = 0) -> list[bytes]:
    """One chain of ``num_blocks`` hashes owned by no shared prefix (a cold request)."""
    return chain_hashes(_content(seed, "cold", 0, b) for b in range(num_blocks))


def multi_turn_workload(conversations: int, *, context_blocks: int = 2048, turns: int = 20,
                        blocks_per_turn: int = 16, block_size: int = 16, seed: int = 0) -> list[list[WorkloadRequest]]:
    """Conversations whose prompt grows turn by turn: ``[conversation][turn]`` requests.

    Turn 0 is a ``context_blocks`` context (a long document, an agent's history); each later turn re-sends
    the previous prompt plus ``blocks_per_turn`` new blocks (the last answer and the next question), so
    ``(context_blocks + turn * blocks_per_turn) * block_size + 1`` tokens. The defaults are the issue's
    example: a 32k-token context and 20 turns of 256 tokens.
    """
    out = []
    for c in range(conversations):
        hashes = chain_hashes(_content(seed, f"context{c}", 0, b) for b in range(context_blocks))
        conversation = []
        for turn in range(turns):
            if turn:
                hashes += chain_hashes((_content(seed, f"turn{c}", turn, b) for b in range(blocks_per_turn)),
                                       hashes[-1])
            conversation.append(WorkloadRequest(f"conv-{seed}-{c}-turn{turn}", len(hashes) * block_size + 1,
                                                tuple(hashes)))
        out.append(conversation)
    return out


__all__ = ["HASH_BYTES", "ROOT_HASH", "WorkloadRequest", "chain_hashes", "multi_turn_workload",
           "shared_prefix_workload", "unique_hashes"]
