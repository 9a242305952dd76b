"""Which leading blocks of a prompt the store holds, remembered for as long as the master's lease guarantees it.

Why: a long prompt's lookup checks every block's key, and multi-turn chat, agents and RAG re-send prompts
whose first thousands of blocks were checked a moment ago. Mooncake leases every key it finds (for its
``--default_kv_lease_ttl``): a key found present cannot be evicted before the lease ends; only a forced
remove (a reset) or a master restart loses it. So a block found present may be taken as present until
``lookup_answer_ttl_ms`` after the lookup that found it was *sent* (before the store looked), with the rest of
the lease left for the load, and only the blocks after it need asking.

The rule this module keeps (docs/reliability.md, "No stale hit"): every block counted in a hit is trusted
only until ``lookup_answer_ttl_ms`` after the send of the store check that last found it. A lookup that
skips known blocks carries their trust's end (``job.known_until``) from planning to its answer: the blocks
it finds are trusted no longer than the known ones before them, and its answer is served no later. Known
blocks whose trust would end before the lookup's deadline (or within half the window) are asked again.

vLLM's block hashes are chained: a block's hash stands for the whole prefix up to it. Each block's expiry is
written capped by the trust of the run before it (a prefix lives as long as its oldest lease), so an entry
valid now vouches for every block before it. So the cache keeps one block in every :data:`STRIDE` of a found
run, and every block of its last, partial stride, not every block: an entry per block cost the scheduler's
thread 75.6 us for a 512-block prompt's first hit and 877 us for 4,096 blocks with the cache full (8.1 and 38 now).
:meth:`known` finds the longest such run with a binary search over the kept multiples, then one within the
stride after the last found (about as many lookups as a binary search over every block); a block missing from
the cache only shortens the answer. Bounded in entries, least recently used first out. Used from the scheduler's
thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.lookup import Lookup

# What the prefix cache is doing (the ``state`` label of prefix_cache_state, metrics/catalogue.py).
ON, OFF, UNPROVEN = "on", "off", "unproven"
STRIDE = 16  # a found run keeps the hash of every 16th block, and of every block of its last, partial stride


class PrefixCache:
    """Block hash -> time (``time.perf_counter()``) until which the block, and every block before it, is known to
    be in the store; kept for every :data:`STRIDE`-th block of a found run and every block of its last stride."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def __bool__(self) -> bool:  # an empty cache is still a cache (``client.cache or ()`` reads its size)
        return True

    def known(self, hashes: Sequence[bytes], count: int, now: float, *, touch: bool = True) -> tuple[int, float]:
        """The longest run of the first ``count`` blocks known present at ``now``, and until when it is known.

        Returns ``(blocks, until)``; ``(0, now)`` when none is. ``touch=False``: read only (from another thread:
        each read is one dict look-up, atomic; the scheduler's thread may change the cache meanwhile, which only
        shortens the answer).
        """
        until = self._until
        if count <= 0:
            return 0, now
        expiry = until.get(hashes[count - 1])  # the whole prompt known (a run that ended there): one lookup
        if expiry is not None and expiry > now:
            lo = count
        else:
            # [0, lo) known, [hi, ...) not (a hole only shortens the answer: safe): first over the kept multiples of
            # STRIDE, then over the stride after the last one found (a run keeps every block of its last stride).
            lo, hi = 0, (count - 1) // STRIDE
            while lo < hi:
                mid = (lo + hi + 1) // 2
                expiry = until.get(hashes[mid * STRIDE - 1])
                if expiry is not None and expiry > now:
                    lo = mid
                else:
                    hi = mid - 1
            lo *= STRIDE
            hi = min(count - 1, lo + STRIDE - 1)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                expiry = until.get(hashes[mid - 1])
                if expiry is not None and expiry > now:
                    lo = mid
                else:
                    hi = mid - 1
        if lo == 0:
            return 0, now
        last = hashes[lo - 1]
        if touch:
            until.move_to_end(last)
            return lo, until[last]
        expiry = until.get(last)
        return (lo, expiry) if expiry is not None and expiry > now else (0, now)

    def add(self, hashes: Sequence[bytes], start: int, end: int, until: float) -> None:
        """Blocks ``[start, end)`` were found present (with blocks before ``start`` known until ``until``): keep every
        :data:`STRIDE`-th of them and every one of the run's last, partial stride."""
        table = self._until
        tail = max(start, end // STRIDE * STRIDE)  # blocks [tail, end) are the last stride's: all kept
        first = (start // STRIDE + 1) * STRIDE  # the first kept multiple past ``start`` (1-based)
        for h in (*hashes[first - 1:tail:STRIDE], *hashes[tail:end]):
            old = table.get(h)
            if old is None or old < until:
                table[h] = until
            table.move_to_end(h)
        while len(table) > self.max_blocks:
            table.popitem(last=False)

    def clear(self) -> int:
        """Forget everything; returns how many blocks were forgotten."""
        n = len(self._until)
        self._until.clear()
        return n


class StoreView:
    """The scheduler's view of the store: the store's epoch as answers name it, and the prefix cache under it.

    A new epoch means the store was wiped (server/epoch.py): the cache is cleared and answers from before are
    stale (:attr:`stale_before`). A store error may hide a wipe (a master restart), so it does the same; a timeout
    only clears the cache. A refusal (``busy``, ``bad_request``) says nothing of the store and changes nothing.
    Epoch 0 means the server keeps none: nothing is cached. Without a cache (off, or a layout where a hash is
    not one block) the epoch still marks held answers stale.

    Threads: the epoch and the cache are one snapshot (:attr:`known_in`, an ``(epoch, cache)`` tuple): a cache
    object holds blocks found in its epoch only, and a new epoch swaps in a new tuple with a new cache (one
    attribute store, atomic), then clears the old one. vLLM's input thread (arrivals.py) reads the tuple once, so
    the known blocks it sends carry the epoch they were found in, whatever the scheduler's thread heard meanwhile
    (it clearing the old cache only shortens what is read); the server trusts them only in that epoch. Reading
    the cache and the epoch apart let a lookup carry blocks of the old epoch stamped with the new one, and the
    server served them as a hit after another instance's wipe. Everything else runs on the scheduler's thread.
    """

    def __init__(self, config: LookupConfig, on_clear: Callable[[str, int], None],
                 on_state: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.block_size = 0
        # (epoch, cache): None until an answer names an epoch; the cache None while off. Replaced whole, never
        # changed in place (but the cache's contents, on the scheduler's thread).
        self.known_in: tuple[int | None, PrefixCache | None] = (None, None)
        self.confirmed_at = float("-inf")  # when the request of the latest answer naming the epoch was sent
        self.stale_before = float("-inf")  # answers that came before this are not served (a wipe, or a doubt)
        self._on_clear = on_clear
        self._on_state = on_state
        self.state = OFF  # ON, OFF or UNPROVEN (:meth:`_changed`)
        self._ttl_s = config.answer_ttl_s
        # Known blocks are skipped only while they stay trusted this long after the send: up to the lookup's
        # deadline, or half the trust window if that is shorter (an answer that outlives them is asked again).
        self._horizon_s = min(config.timeout_s, config.answer_ttl_s / 2)

    @property
    def epoch(self) -> int | None:
        """The store's epoch as the latest answer named it (None before any; 0: the server vouches for none)."""
        return self.known_in[0]

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache of the current epoch, when on."""
        return self.known_in[1]

    @property
    def proven(self) -> bool:
        """True while the latest answer named a store epoch: the server keeps one only once the master's lease is
        known to cover ``lookup_answer_ttl_ms`` (server/lease.py). Until then no hit is held (answers.py)."""
        return bool(self.known_in[0])

    def _changed(self) -> None:
        """Tell ``on_state`` when the state changes: off (no cache), on (an epoch), unproven (a cache, no epoch)."""
        epoch, cache = self.known_in
        state = OFF if cache is None else ON if epoch else UNPROVEN
        if state != self.state:
            self.state = state
            if self._on_state is not None:
                self._on_state(state)

    def enable(self, block_size: int) -> bool:
        """Cache found blocks (``lookup_prefix_cache_blocks`` of them) of ``block_size`` tokens each."""
        if self.config.lookup_prefix_cache_blocks > 0 and block_size > 0:
            self.block_size = block_size  # before the cache is published: a reader that sees it sees this
            self.known_in = (self.known_in[0], PrefixCache(self.config.lookup_prefix_cache_blocks))
            self._changed()
        return self.cache is not None

    def heard(self, epoch: int, sent_at: float, received: float) -> None:
        """An answer to a request sent at ``sent_at``, received at ``received``, named the store's epoch (before its
        lookups finish: they were answered in it).

        From 0 (none kept) to a first epoch is not a wipe, only trust beginning. From an epoch to 0 is a doubt
        (the server could not confirm its marker): nothing is cached until an epoch is named again."""
        old, cache = self.known_in
        if epoch != old:
            if old:
                self.stale_before = max(self.stale_before, received)  # what came before is stale, not this
            # One store: a reader sees the old epoch with the old cache, or the new one with an empty one.
            self.known_in = (epoch, PrefixCache(cache.max_blocks) if cache is not None else None)
            if old and cache is not None and len(cache):
                self._on_clear("epoch", cache.clear())
            self.confirmed_at = sent_at
            if not old or not epoch:
                self._changed()
        elif sent_at > self.confirmed_at:
            self.confirmed_at = sent_at

    def failed(self, store_error: bool, at: float) -> None:
        """A lookup really failed (its answer came ``at``): the master may have restarted, so the cache is cleared.
        A store error (the store said it failed: unreachable, restarting) also makes every answer that came
        before it stale; a timeout alone does not (a slow server loses nothing, and dropping answers under
        overload would add load)."""
        if store_error:
            self.stale_before = max(self.stale_before, at)
        self.clear("failure")

    def clear(self, reason: str) -> None:
        """Forget every cached block (``reason`` is exported: reset, epoch, failure). The epoch stays: a reader
        of the snapshot on the other thread reads fewer blocks, still stamped with the epoch they were found in."""
        cache = self.known_in[1]
        if cache is not None and len(cache):
            self._on_clear(reason, cache.clear())

    def plan(self, job: Lookup, num_tokens: int, now: float, *, touch: bool = True) -> tuple[int, float] | None:
        """Mark the leading blocks of ``job`` the cache knows (the server skips them). Returns ``(hit tokens,
        valid until)`` when every block that can count is known and the epoch was confirmed within
        ``lookup_prefix_cache_confirm_ms``: the lookup needs no round trip. ``touch=False``: from vLLM's input
        thread (arrivals.py), reading the cache only; planned as it is sent, its known blocks need no recheck."""
        known_in = self.known_in  # one read: the epoch and the cache of one moment (the class's docstring)
        if known_in[1] is None:
            return None
        countable = min(job.num_hashes, (num_tokens - 1) // self.block_size) if num_tokens > 0 else 0
        job.countable_blocks = countable
        if countable <= 0 or not known_in[0]:  # no epoch from the server yet (or it keeps none): nothing known
            return None
        known = self._know(job, now, touch, known_in)
        confirm_s = self.config.lookup_prefix_cache_confirm_ms / 1000
        if known < countable or not confirm_s or now - self.confirmed_at > confirm_s:
            return None
        return known * self.block_size, job.known_until

    def recheck(self, job: Lookup, now: float) -> None:
        """``job`` is about to be sent: its known blocks must still be trusted then (see ``_horizon_s``), in this
        epoch."""
        if job.known and (job.known_until < now + self._horizon_s or job.epoch != self.known_in[0]):
            self._know(job, now, True, self.known_in)

    def _know(self, job: Lookup, now: float, touch: bool,
              known_in: tuple[int | None, PrefixCache | None]) -> int:
        """The known run of ``job`` that stays trusted until a lookup sent ``now`` is due, stamped with the epoch
        of the snapshot ``known_in`` it was read from."""
        epoch, cache = known_in
        known, until = (0, now) if cache is None or not epoch else cache.known(
            job.block_hashes, job.countable_blocks, now + self._horizon_s, touch=touch)
        job.known_blocks = job.known = known
        job.known_until = until if known else float("inf")
        job.epoch = epoch or 0
        return known

    def valid_until(self, job: Lookup) -> float:
        """Until when the store's answer to ``job`` may be served: the trust of the oldest check behind any
        block it counts (its own send, or the known blocks the server skipped)."""
        assert job.t_start is not None
        until = job.t_start + self._ttl_s
        if job.known and job.epoch == self.known_in[0]:  # the server skipped them: they count on their old checks
            until = min(until, job.known_until)
        return until

    def untrusted(self, rec: Lookup, now: float) -> str | None:
        """Why an answer may not be served now (``wiped``, ``expired``), or None. The one place the rule of
        docs/reliability.md ("No stale hit") is checked: a hit is served only while every block it counts is
        trusted (``rec.valid_until``: the oldest store check behind it plus ``lookup_answer_ttl_ms``), and never
        after a wipe or a store error heard since it was answered."""
        if rec.t_answer is not None and rec.t_answer < self.stale_before:
            return "wiped"
        if rec.valid_until is not None and now > rec.valid_until:
            return "expired"
        return None

    def remember(self, job: Lookup, hit_tokens: int) -> None:
        """The store answered ``job`` (sent in the current epoch) with ``hit_tokens``: cache its new blocks."""
        epoch, cache = self.known_in
        if cache is None or not epoch or hit_tokens <= 0 or job.t_start is None:
            return
        found = hit_tokens // self.block_size
        known = job.known if job.epoch == epoch else 0  # known in an older epoch: the server asked all
        if found > known:
            cache.add(job.block_hashes, known, found, self.valid_until(job))


__all__ = ["OFF", "ON", "PrefixCache", "STRIDE", "StoreView", "UNPROVEN"]
