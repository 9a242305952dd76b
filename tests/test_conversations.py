"""Multi-turn conversations (bench scenario g, ``demo --workload multi-turn``): prompts that grow turn by turn,
and what a real store holds when each turn arrives (the previous turn saved, not this one's new blocks)."""

from __future__ import annotations

import pytest

from mooncake_lookout.connector.bench.conversations import (
    ConversationStream,
    Shape,
    conversation_tokens,
    turn_prompt,
)
from mooncake_lookout.connector.rigs.workload import chain_hashes
from mooncake_lookout.connector.server.prefix_index import PrefixIndex

BLOCK = 16


def hash_of(tokens: list[int]) -> list[bytes]:
    """Chained hashes of full blocks, as vLLM's are (a block's hash stands for its whole prefix)."""
    return chain_hashes(repr(tokens[i:i + BLOCK]).encode() for i in range(0, len(tokens) // BLOCK * BLOCK, BLOCK))


def test_each_turn_re_sends_the_previous_prompt_and_adds_its_own_blocks() -> None:
    shape = Shape(context_blocks=8, turns=4, blocks_per_turn=2, conversations=2)
    tokens = conversation_tokens(shape, 0, seed=3)
    prompts = [turn_prompt(tokens, shape, t) for t in range(shape.turns)]
    assert [len(p) for p in prompts] == [(8 + 2 * t) * BLOCK + 1 for t in range(4)]
    for before, after in zip(prompts, prompts[1:]):
        assert after[:len(before) - 1] == before[:-1]  # every full block of a turn leads the next turn
    assert conversation_tokens(shape, 0, seed=3) == tokens  # deterministic
    other = [conversation_tokens(shape, 1, seed=3), conversation_tokens(shape, 0, seed=4)]
    assert all(o[:BLOCK] != tokens[:BLOCK] for o in other)  # no first block shared across conversations or seeds
    assert shape.max_model_len >= len(prompts[-1]) and shape.num_blocks(2) >= 2 * (shape.max_blocks + 1)
    with pytest.raises(ValueError, match=">= 1"):
        Shape(context_blocks=0)


class _Rig:
    """What the stream needs of a rig: its prefix index (a real one, over the real store)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index


def present(index: PrefixIndex, hashes: list[bytes]) -> int:
    """Leading blocks of ``hashes`` the real store holds."""
    return index.lookup(len(hashes) * BLOCK + 1, hashes).hit_length // BLOCK


def test_a_turn_finds_the_previous_turn_saved_in_the_store(prefix_index: PrefixIndex) -> None:
    shape = Shape(context_blocks=6, turns=4, blocks_per_turn=2, conversations=2)
    stream = ConversationStream(shape, active=2, seed=9)
    with pytest.raises(RuntimeError, match="fill_store"):
        stream.request(0)
    stream.fill_store(_Rig(prefix_index), hash_of)
    seen = []
    for k in range(2 * shape.turns + 1):  # both conversations' turns, then the first turn of a third
        req_id, prompt = stream.request(k)
        hashes = hash_of(prompt)
        seen.append((req_id, len(hashes), present(prefix_index, hashes)))
    # Conversation 0: its context, then each turn finds the turn before it (the first turn: the context).
    assert seen[0::2][:4] == [("mt1-c0-t0", 6, 6), ("mt1-c0-t1", 8, 6), ("mt1-c0-t2", 10, 8), ("mt1-c0-t3", 12, 10)]
    assert [s[0] for s in seen[1::2]] == ["mt1-c1-t0", "mt1-c1-t1", "mt1-c1-t2", "mt1-c1-t3"]
    assert seen[8] == ("mt1-c2-t0", 6, 6)  # a new conversation takes the finished one's place
    assert stream.saved_keys == 3 * 6 + 2 * (2 + 2)  # three contexts; turns 1 and 2 of two conversations
    stream.fill_store(_Rig(prefix_index), hash_of)  # a new run: conversations of its own, nothing found yet
    req_id, prompt = stream.request(2)
    assert req_id == "mt2-c0-t1" and present(prefix_index, hash_of(prompt)) == 0
