"""One lookup, as the only object it makes: what was asked, its times, its answer, and what the client knows of it.

Why one object: on the scheduler's thread every object and every attribute copied costs time that vLLM's
``schedule()`` pays (a cold object costs 2-4x a warm one after a model step). A :class:`Lookup` is at once
the record observers read (``LookupRecord`` is its name there), the job a transport carries, and the result
vLLM reads (it has ``hit_length`` and ``tail_key_boundaries``, as vLLM's ``MooncakeLookupResult``).

Threads: the scheduler's thread creates it and writes every field but two. A transport's own thread may read
what was asked (``num_tokens``, ``block_hashes``, ``num_hashes``, ``known``, ``epoch``, ``deadline``) once the
lookup was handed to it; it writes only its wire id (``lookup_id``) and, for the ``upstream`` transport, when
it sent it (``t_start``, ``deadline``). Answers come back to the scheduler's thread, which applies them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_lookout.connector.job import TailKeyBoundary


class Outcome(str, enum.Enum):
    """How a lookup ended; the values are the ``outcome`` label of ``requests_total``."""

    HIT = "hit"
    MISS = "miss"
    ERROR = "error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    BREAKER_OPEN = "breaker_open"
    DISCARDED = "discarded"


HIT, MISS, ERROR, TIMEOUT = Outcome.HIT, Outcome.MISS, Outcome.ERROR, Outcome.TIMEOUT
_NO_TAILS: tuple[TailKeyBoundary, ...] = ()


class Lookup:
    """One request's lookup. Times are ``time.perf_counter()`` seconds, ``None`` until reached."""

    __slots__ = (
        # what was asked
        "req_id", "num_tokens", "block_hashes", "num_hashes", "last_hash", "generation", "transport",
        "trace_headers",
        # when
        "t_submit", "t_queued", "t_start", "t_answer", "t_consume", "timeout_s", "latest", "deadline",
        # the answer (outcome None until it came)
        "outcome", "hit_length", "tail_key_boundaries", "error", "local", "refused",
        # what the client knows of it
        "lookup_id", "deferrals", "known", "known_until", "epoch", "countable_blocks", "known_blocks", "from_cache",
        "valid_until", "probe", "held", "cancelled", "sampled", "adopted",
    )

    def __init__(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes], transport: str,
                 generation: int, t_submit: float, timeout_s: float = 0.0,
                 trace_headers: Mapping[str, str] | None = None) -> None:
        self.req_id = req_id
        self.num_tokens = num_tokens
        self.block_hashes = block_hashes
        n = self.num_hashes = len(block_hashes)
        # vLLM's block hashes are chained: the last one stands for the whole prefix (what the answer is for).
        self.last_hash = block_hashes[n - 1] if n else b""
        self.generation = generation
        self.transport = transport
        self.trace_headers = trace_headers
        self.t_submit = t_submit
        self.t_queued: float | None = None
        self.t_start: float | None = None
        self.t_answer: float | None = None
        self.t_consume: float | None = None
        self.timeout_s = timeout_s
        self.latest: float | None = None  # a blocking caller's own bound on the deadline
        self.deadline: float | None = None
        self.outcome: Outcome | None = None
        self.hit_length = 0
        self.tail_key_boundaries = _NO_TAILS
        self.error: str | None = None
        self.local = False  # made by the client without a word from the server: never fed to the breaker
        self.refused = False  # turned away by the server without asking the store (busy, bad_request)
        self.lookup_id = 0
        self.deferrals = 0
        self.known = 0  # leading blocks the client knows present: the server asks the store only for the rest
        self.known_until = float("inf")  # until when those are trusted (prefix_cache.py)
        self.epoch = 0  # the store's epoch they were found in
        self.countable_blocks = 0
        self.known_blocks = 0
        self.from_cache = False
        self.valid_until: float | None = None  # until when the answer may be served
        self.probe = False  # the breaker's half-open probe
        self.held = False  # answered to the scheduler and kept until the request is allocated
        self.cancelled = False  # nobody wants the answer any more: an unsent lookup is never sent
        self.sampled = False  # traced (tracing on, and the request or the sampler says so)
        self.adopted = True  # the client's (False while a lookup sent at arrival waits for admission: arrivals.py)

    # -- the answer -------------------------------------------------------------------------------------------
    def finish(self, outcome: Outcome, now: float, hit_length: int = 0,
               tails: tuple[TailKeyBoundary, ...] = _NO_TAILS, error: str | None = None, *,
               local: bool = False, refused: bool = False) -> bool:
        """Record the answer, once (later calls change nothing); True if this call recorded it."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.t_answer = now
        self.hit_length = hit_length
        self.tail_key_boundaries = tails
        self.error = error
        self.local = local
        self.refused = refused
        return True

    def sent(self, now: float) -> None:
        """On the wire from ``now``: its deadline starts (time queued in the client is not the server's)."""
        deadline = now + self.timeout_s
        latest = self.latest
        self.deadline = deadline if latest is None or latest > deadline else latest
        self.t_start = now  # last: a reader that sees it sent sees its deadline

    def asks_for(self, num_tokens: int, block_hashes: Sequence[bytes], generation: int) -> bool:
        """Is this still the lookup for a request with this prompt, in this generation (a reset bumps it)?"""
        n = len(block_hashes)
        return (self.num_tokens == num_tokens and self.num_hashes == n and self.generation == generation
                and (not n or self.last_hash == block_hashes[n - 1]))

    def expired(self, now: float) -> bool:
        """True once sent and past its deadline without an answer."""
        deadline = self.deadline
        return self.outcome is None and deadline is not None and now >= deadline

    @property
    def failed(self) -> bool:
        """The server was asked and failed (timed out, or the store erred): what counts against the breaker."""
        return (self.outcome is ERROR or self.outcome is TIMEOUT) and not (self.local or self.refused)

    @property
    def evidence(self) -> bool:
        """The answer says something of the store (hit, miss or failure): not made up here, not a refusal."""
        return self.outcome is not None and not (self.local or self.refused)

    @property
    def kept(self) -> bool:
        """An answer worth holding until the request is allocated: the store's own hit or miss."""
        return self.outcome is HIT or self.outcome is MISS

    # -- what observers read ------------------------------------------------------------------------------------
    @property
    def hit_tokens(self) -> int:
        """Tokens served as a hit (0 unless the store found some): ``hit_length`` under the name records use."""
        return self.hit_length

    @hit_tokens.setter
    def hit_tokens(self, value: int) -> None:
        self.hit_length = value

    @property
    def sent_to_server(self) -> bool:
        """True once the lookup left for the server (``t_start`` is when)."""
        return self.t_start is not None

    @property
    def store_answered(self) -> bool:
        """True when the store itself answered (a hit or a miss): only then were its tokens really queried."""
        return self.outcome is HIT or self.outcome is MISS

    @property
    def queue_seconds(self) -> float | None:
        """Time from submit until the lookup was sent (``None`` if it never was)."""
        return None if self.t_start is None else self.t_start - self.t_submit

    @property
    def rpc_seconds(self) -> float | None:
        """Round trip to the lookup server (``None`` unless it was sent and answered)."""
        if self.t_start is None or self.t_answer is None:
            return None
        return self.t_answer - self.t_start

    @property
    def total_seconds(self) -> float | None:
        """From submit until the caller used the answer (``None`` for lookups refused without being sent)."""
        if self.t_consume is None or self.t_start is None:
            return None
        return self.t_consume - self.t_submit

    def __repr__(self) -> str:
        state = self.outcome.value if self.outcome is not None else ("sent" if self.t_start else "unsent")
        return f"Lookup({self.req_id!r}, {self.num_tokens} tokens, {self.num_hashes} blocks, {state}, " \
               f"hit={self.hit_length})"

    def __reduce__(self) -> Any:  # pragma: no cover - a lookup is never pickled; say so clearly if someone tries
        raise TypeError("a Lookup lives on one scheduler's thread; copy the fields you need")


__all__ = ["ERROR", "HIT", "Lookup", "MISS", "Outcome", "TIMEOUT"]
