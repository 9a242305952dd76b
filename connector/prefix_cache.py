"""Which leading blocks of a prompt the store holds, remembered for as long as the master's lease guarantees it.

Why: a long prompt's lookup checks every block's key, and multi-turn chat, agents and RAG re-send prompts
whose first thousands of blocks were checked a moment ago. Mooncake leases every key it finds (for its
``--default_kv_lease_ttl``): a key found present cannot be evicted before the lease ends; only a forced
remove (a reset) or a master restart loses it. So a block found present may be taken as present until
``valid_for`` after the lookup that found it was *sent* (before the store looked), with ``valid_for`` at most
half the lease (the same rule as held answers), and only the blocks after it need asking.

vLLM's block hashes are chained: a block's hash stands for the whole prefix up to it, so a block cached as
present means its prefix was present too. Each block's expiry is capped by the one before it (a prefix
lives as long as its oldest lease), which makes "cached and unexpired" true from the first block up to
some point: :meth:`known` finds that point with a binary search (a dozen lookups for 4,096 blocks).
Bounded in entries, least recently used first out. Used from the scheduler's thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.job import LookupJob


class PrefixCache:
    """Block hash -> time (``time.perf_counter()``) until which the block is known to be in the store."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def __bool__(self) -> bool:  # an empty cache is still a cache (``client.cache or ()`` reads its size)
        return True

    def known(self, hashes: Sequence[bytes], count: int, now: float) -> tuple[int, float]:
        """The longest run of the first ``count`` blocks known present at ``now``, and until when it is known.

        Returns ``(blocks, until)``; ``(0, now)`` when none is.
        """
        until = self._until
        lo, hi = 0, count  # blocks [0, lo) known; [hi, count) not (a hole only shortens the answer: safe)
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
        until.move_to_end(last)
        return lo, until[last]

    def add(self, hashes: Sequence[bytes], start: int, end: int, until: float) -> None:
        """Blocks ``[start, end)`` were found present (with blocks before ``start`` known until ``until``)."""
        table = self._until
        for i in range(start, end):
            h = hashes[i]
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
    """The scheduler's view of the store: the store's epoch as replies name it, and the prefix cache under it.

    A new epoch means the store was wiped (server/epoch.py): the cache is cleared and answers from before are
    stale (:attr:`wiped_at`). Epoch 0 means the server keeps none: nothing is cached. Without a cache (off, or
    a layout where a hash is not one block) the epoch still marks held answers stale.
    """

    def __init__(self, config: LookupConfig, on_clear: Callable[[str, int], None]) -> None:
        self.config = config
        self.cache: PrefixCache | None = None
        self.block_size = 0
        self.epoch: int | None = None
        self.confirmed_at = float("-inf")  # when the request of the latest reply naming the epoch was sent
        self.wiped_at = float("-inf")  # when a wipe was last heard of: answers from before it are stale
        self._on_clear = on_clear

    def enable(self, block_size: int) -> bool:
        """Cache found blocks (``lookup_prefix_cache_blocks`` of them) of ``block_size`` tokens each."""
        if self.config.lookup_prefix_cache_blocks > 0 and block_size > 0:
            self.cache = PrefixCache(self.config.lookup_prefix_cache_blocks)
            self.block_size = block_size
        return self.cache is not None

    def heard(self, epoch: int, sent_at: float) -> None:
        """A reply to a request sent at ``sent_at`` named the store's epoch (before its lookups finish).

        From 0 (none kept) to a first epoch is not a wipe, only trust beginning."""
        if epoch != self.epoch:
            if self.epoch:
                self.wiped_at = time.perf_counter()
                self.clear("epoch")
            self.epoch = epoch
            self.confirmed_at = sent_at
        elif sent_at > self.confirmed_at:
            self.confirmed_at = sent_at

    def clear(self, reason: str) -> None:
        """Forget every cached block (``reason`` is exported: reset, epoch, failure)."""
        if self.cache is not None and len(self.cache):
            self._on_clear(reason, self.cache.clear())

    def plan(self, job: LookupJob, num_tokens: int, now: float) -> tuple[int, float] | None:
        """Mark the leading blocks of ``job`` the cache knows (the server skips them). Returns ``(hit tokens,
        valid until)`` when every block that can count is known and the epoch was confirmed within
        ``lookup_prefix_cache_confirm_ms``: the lookup needs no round trip."""
        cache, rec, hashes = self.cache, job.rec, job.block_hashes
        if cache is None:
            return None
        countable = min(len(hashes), (num_tokens - 1) // self.block_size) if num_tokens > 0 else 0
        rec.countable_blocks = countable
        if countable <= 0 or not self.epoch:  # no epoch from the server yet (or it keeps none): nothing known
            return None
        known, until = cache.known(hashes, countable, now)
        rec.known_blocks = job.known = known
        job.epoch = self.epoch
        confirm_s = self.config.lookup_prefix_cache_confirm_ms / 1000
        if known < countable or not confirm_s or now - self.confirmed_at > confirm_s:
            return None
        return known * self.block_size, until

    def remember(self, job: LookupJob, hit_tokens: int) -> None:
        """The store answered ``job`` (sent in the current epoch) with ``hit_tokens``: cache its new blocks."""
        cache = self.cache
        if cache is None or not self.epoch or hit_tokens <= 0 or job.sent_at is None:
            return
        found = hit_tokens // self.block_size
        known = job.known if job.epoch == self.epoch else 0  # known in an older epoch: the server asked all
        until = job.sent_at + self.config.answer_ttl_s  # leased from when the store looked, after the send
        if known:
            until = min(until, cache.known(job.block_hashes, known, job.sent_at)[1])
        if found > known:
            cache.add(job.block_hashes, known, found, until)


__all__ = ["PrefixCache", "StoreView"]
