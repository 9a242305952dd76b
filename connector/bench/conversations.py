"""Multi-turn conversations as token prompts for vLLM's scheduler, and what the store holds as they go.

Why: a chat, an agent or RAG over one document re-sends its whole prompt every turn, grown by the last
answer and the next question, so a lookup re-asks thousands of blocks that were found a moment ago. These
prompts are tokens (vLLM's scheduler hashes them itself, chained, so turn ``t + 1``'s first blocks hash as
turn ``t``'s did), made deterministically from a seed; a shape's defaults are the example of the issue that
asked for them: a 32k-token context and 20 turns of 256 tokens.

What the store holds follows what vLLM's worker would save: the context before the first turn (a document,
or history saved earlier), then each turn's prompt once that turn is answered. A turn therefore finds the
previous turn's prompt in the store, not its own new blocks. :class:`IndexSaver` writes blocks as the
bench's prefix index keys them, :class:`LayoutSaver` with upstream's own save-path key code (vLLM's layout).
:class:`ConversationStream` feeds the same conversations to :func:`~.sched.run_mode` (the demo).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from mooncake_lookout.connector.bench.rig import BLOCK_SIZE

VOCAB = 50_000  # token ids 1..VOCAB: inside the tiny model's vocabulary
PUT_CHUNK = 512  # keys per upsert_batch when saving in vLLM's layout


@dataclass(frozen=True)
class Shape:
    """Conversations of ``turns`` turns: a ``context_blocks`` context, then ``blocks_per_turn`` new blocks a turn.

    Turn ``t`` (from 0) has ``context_blocks + t * blocks_per_turn`` full blocks and one token more (a partial
    block: the first token of what comes next), so every full block can count toward a hit.
    """

    context_blocks: int = 2048
    turns: int = 20
    blocks_per_turn: int = 16
    conversations: int = 4

    def __post_init__(self) -> None:
        if self.context_blocks < 1 or self.turns < 1 or self.blocks_per_turn < 1 or self.conversations < 1:
            raise ValueError(f"every count of a conversation shape must be >= 1, got {self}")

    def blocks(self, turn: int) -> int:
        """Full blocks of turn ``turn``'s prompt (turns count from 0)."""
        return self.context_blocks + turn * self.blocks_per_turn

    @property
    def max_blocks(self) -> int:
        """Full blocks of the last turn's prompt."""
        return self.blocks(self.turns - 1)

    @property
    def max_model_len(self) -> int:
        """Tokens the scheduler must take: the longest prompt and the tokens generated."""
        return max(2048, (self.max_blocks + 1) * BLOCK_SIZE + 64)

    def num_blocks(self, in_flight: int) -> int:
        """KV blocks for ``in_flight`` requests at once, twice over (vLLM keeps finished turns in its own cache)."""
        return max(16_384, 2 * in_flight * (self.max_blocks + 2))

    def as_dict(self) -> dict[str, int]:
        """The shape, for JSON."""
        return asdict(self)


def conversation_tokens(shape: Shape, conversation: int, seed: int) -> list[int]:
    """Conversation ``conversation``'s whole token stream: its last turn's prompt (every turn is a prefix of it).

    Each block's tokens come from a digest of (seed, conversation, block): streams of other seeds or
    conversations share no block.
    """
    tokens: list[int] = []
    for block in range(shape.max_blocks + 1):
        digest = hashlib.sha256(f"{seed}/{conversation}/{block}".encode()).digest()
        tokens.extend(int.from_bytes(digest[2 * i:2 * i + 2], "little") % VOCAB + 1 for i in range(BLOCK_SIZE))
    return tokens


def turn_prompt(tokens: Sequence[int], shape: Shape, turn: int) -> list[int]:
    """Turn ``turn``'s prompt: its full blocks and one token of the next."""
    return list(tokens[:shape.blocks(turn) * BLOCK_SIZE + 1])


class Saver(Protocol):
    """Writes blocks ``[start, end)`` of a chain of vLLM block hashes into the store, as vLLM's worker would."""

    def save(self, hashes: Sequence[bytes], start: int, end: int) -> int: ...


class IndexSaver:
    """Saves blocks under the keys of the bench's prefix index (what its lookup servers answer from)."""

    def __init__(self, index: Any) -> None:
        self.index = index

    def save(self, hashes: Sequence[bytes], start: int, end: int) -> int:
        """Write blocks ``[start, end)``; returns keys written."""
        return self.index.store_prefixes([hashes[start:end]]) if end > start else 0


class LayoutSaver:
    """Saves blocks under vLLM's own keys: upstream's save-path key code of ``worker``, put through ``writer``."""

    def __init__(self, worker: Any, writer: Any) -> None:
        self.worker = worker
        self.writer = writer

    def save(self, hashes: Sequence[bytes], start: int, end: int) -> int:
        """Write blocks ``[start, end)``; returns keys written."""
        from mooncake_lookout.connector.server.vllm_store_worker import saved_keys

        if end <= start:
            return 0
        keys = saved_keys(self.worker, end * BLOCK_SIZE, list(hashes[:end]))[start:]
        for i in range(0, len(keys), PUT_CHUNK):
            chunk = keys[i:i + PUT_CHUNK]
            code = self.writer.upsert_batch(chunk, [b"\x01"] * len(chunk))
            if code != 0:
                raise RuntimeError(f"saving {len(chunk)} keys in vLLM's layout failed with code {code}")
        return len(keys)


class ConversationStream:
    """Multi-turn conversations for :func:`~.sched.run_mode`: request ``k`` is the next turn of one of ``active``
    conversations, taken in turn; a conversation past its last turn is followed by a new one.

    Each run (each :meth:`fill_store`) starts conversations of its own, so no run finds what another saved.
    When turn ``t`` arrives, turn ``t - 1`` is taken as answered and saved (the arrivals of the other
    conversations stand between them); a conversation's context is saved when it starts.
    """

    def __init__(self, shape: Shape, *, active: int = 8, seed: int = 0) -> None:
        if active < 1:
            raise ValueError(f"active conversations must be >= 1, got {active}")
        self.shape = shape
        self.active = active
        self.seed = seed
        self.runs = 0
        self.saved_keys = 0
        self._saver: Saver | None = None
        self._hash_of: Callable[[list[int]], list[bytes]] | None = None
        self._current: dict[int, tuple[int, list[int], list[bytes]]] = {}  # slot -> (conversation, tokens, hashes)

    def fill_store(self, rig: Any, hash_of: Callable[[list[int]], list[bytes]]) -> int:
        """A run starts: new conversations from here, saved through ``rig``'s index, hashed by ``hash_of``."""
        self.runs += 1
        self._saver = IndexSaver(rig.index)
        self._hash_of = hash_of
        self._current = {}
        return 0

    def request(self, k: int) -> tuple[str, list[int]]:
        """Request number ``k`` of this run: ``(req_id, prompt)``; saves what the store holds by then."""
        if self._saver is None or self._hash_of is None:
            raise RuntimeError("fill_store() must be called before the first request of a run")
        shape = self.shape
        slot = k % self.active
        generation, turn = divmod(k // self.active, shape.turns)
        conversation = generation * self.active + slot
        current = self._current.get(slot)
        if current is None or current[0] != conversation:
            tokens = conversation_tokens(shape, conversation, self.seed * 1000 + self.runs)
            hashes = self._hash_of(tokens[:shape.max_blocks * BLOCK_SIZE])
            current = self._current[slot] = (conversation, tokens, hashes)
        _, tokens, hashes = current
        if turn == 0:  # the context: a document, or the conversation's history saved earlier
            self.saved_keys += self._saver.save(hashes, 0, shape.context_blocks)
        elif turn >= 2:  # the turn before the last one was answered: its new blocks are saved
            self.saved_keys += self._saver.save(hashes, shape.blocks(turn - 2), shape.blocks(turn - 1))
        return f"mt{self.runs}-c{conversation}-t{turn}", turn_prompt(tokens, shape, turn)


__all__ = ["ConversationStream", "IndexSaver", "LayoutSaver", "Saver", "Shape", "conversation_tokens",
           "turn_prompt"]
