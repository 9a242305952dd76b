"""A prefix-cache index over a real Mooncake store, for lookups outside a GPU worker.

In vLLM the lookup server asks the store worker, whose keys embed model, rank and layout. The demo,
the bench, the standalone server and the tests need the same question answered without a GPU worker:
"how many leading blocks of this prompt are in the store?". :class:`PrefixIndex` answers it with one
``batch_is_exist`` call per lookup, or per *batch* of lookups (:meth:`PrefixIndex.lookup_many`), on
keys of its own: ``<namespace>/<hex of block hash>``. Several indexes share one store without seeing
each other's keys as long as their namespaces differ.

Two rules the upstream worker does not keep:

* a negative code from ``batch_is_exist`` is a store *error*: :class:`StoreError` is raised (or
  returned, in ``lookup_many``), never counted as a miss;
* a hit covering the whole prompt is cut to ``((num_tokens - 1) // block_size) * block_size`` so at
  least one token is computed (vLLM #55113); only the keys that can count are asked for.

Thread-safety: concurrent calls are fine. The Mooncake client is used from several threads by vLLM
itself and releases the GIL during the call; the only shared state here, ``store_calls``, is guarded
by a lock.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Union

from mooncake_lookout.connector.job import MISS, HashBlob, LookupResult

DEFAULT_NAMESPACE = "lookout"
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_:-]{1,64}$")  # no regex metacharacters: used in remove_by_regex
PUT_CHUNK = 512  # keys per upsert_batch call when filling the store
VALUE = b"\x01"  # what a filled key holds; only its existence matters


class StoreError(RuntimeError):
    """The Mooncake store failed (a negative code, or the call raised); not a miss.

    ``code`` is Mooncake's error code (e.g. -900 RPC failed, -901 RPC timeout) or None when the call
    itself raised; ``op`` names the store call.
    """

    def __init__(self, code: int | None, op: str, detail: str = "") -> None:
        self.code = code
        self.op = op
        text = f"Mooncake {op} failed" + (f" with code {code}" if code is not None else "")
        super().__init__(text + (f": {detail}" if detail else ""))


# (num_tokens, block_hashes), or (num_tokens, block_hashes, known): the first ``known`` blocks are present
Request = Union[tuple[int, Sequence[bytes]], tuple[int, Sequence[bytes], int]]


class PrefixIndex:
    """Consecutive-prefix hit counting over a real ``MooncakeDistributedStore``.

    ``store`` is an open client (lookups need no segment; :meth:`store_prefixes` needs a writer, see
    ``mooncake_master.open_writer_store``). ``block_size`` is tokens per block hash.
    """

    def __init__(self, store: Any, block_size: int, namespace: str = DEFAULT_NAMESPACE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace must match {NAMESPACE_RE.pattern}, got {namespace!r}")
        self.store = store
        self.block_size = block_size
        self.namespace = namespace
        self.store_calls = 0  # batch_is_exist calls made, so tests can see coalescing
        self._lock = threading.Lock()

    def key(self, block_hash: bytes | memoryview) -> str:
        """The store key of one block hash."""
        return f"{self.namespace}/{block_hash.hex()}"

    def keys(self, block_hashes: Sequence[bytes], count: int, start: int = 0) -> list[str]:
        """The store keys of the hashes from ``start`` up to ``count`` (one ``hex`` for a :class:`HashBlob`)."""
        if isinstance(block_hashes, HashBlob):
            prefix = self.namespace + "/"
            return [prefix + digits for digits in block_hashes.hex(count, start)]
        return [self.key(h) for h in block_hashes[start:count]]

    def marker_key(self, name: str) -> str:
        """A key of this namespace that is not a block's: wiping the namespace removes it too."""
        return f"{self.namespace}/marker-{name}"

    def put_marker(self, key: str) -> bool:
        """Store ``key`` (its existence is all that matters); False if the store refused it."""
        try:
            return self.store.upsert_batch([key], [VALUE]) == 0
        except Exception:
            return False

    def countable_blocks(self, num_tokens: int, num_hashes: int) -> int:
        """How many leading blocks can count toward a hit: never the whole prompt (one token is computed)."""
        if num_tokens <= 0:
            return 0
        return max(0, min(num_hashes, (num_tokens - 1) // self.block_size))

    # -- lookups -----------------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> list[int]:
        with self._lock:
            self.store_calls += 1
        try:
            codes = self.store.batch_is_exist(keys)
        except Exception as exc:  # the binding raising is a store failure too
            raise StoreError(None, "batch_is_exist", repr(exc)) from exc
        if len(codes) != len(keys):
            raise StoreError(None, "batch_is_exist", f"{len(codes)} answers for {len(keys)} keys")
        return list(codes)

    def _hit(self, keys: Sequence[str], codes: dict[str, int], known: int = 0) -> LookupResult:
        present = known  # the client already knows these lead the prompt, each within its lease
        counting = True  # still inside the consecutive present prefix
        for key in keys:
            code = codes[key]
            if code < 0:
                raise StoreError(code, "batch_is_exist", f"key {key}")
            if counting and code == 1:
                present += 1
            else:
                counting = False
        hit = present * self.block_size
        return LookupResult(hit) if hit else MISS

    def lookup(self, num_tokens: int, block_hashes: Sequence[bytes]) -> LookupResult:
        """Tokens of the prompt's prefix found in the store, with one ``batch_is_exist``.

        Raises :class:`StoreError` if the store reports an error for any key asked (even past the
        first absent block: the store is then not to be trusted for this answer).
        """
        n = self.countable_blocks(num_tokens, len(block_hashes))
        if n == 0:
            return MISS
        keys = self.keys(block_hashes, n)
        codes = self._exists(keys)
        return self._hit(keys, dict(zip(keys, codes)))

    def lookup_many(self, requests: Sequence[Request], extra_keys: Sequence[str] = ()) -> list[Any]:
        """Answer many lookups with ONE ``batch_is_exist`` over their deduplicated keys.

        A request is ``(num_tokens, hashes)`` or ``(num_tokens, hashes, known)``: its first ``known``
        blocks are taken as present (the client knows them) and only the rest are asked. Each entry of the
        result is the lookup's result, or the :class:`StoreError` that lookup met (a failed call fails
        every entry), followed by the codes of ``extra_keys`` asked in the same call.
        """
        per_request: list[tuple[int, list[str]]] = []
        unique: dict[str, None] = dict.fromkeys(extra_keys)
        for request in requests:
            num_tokens, hashes, known = _unpack(request)
            n = self.countable_blocks(num_tokens, len(hashes))
            known = min(known, n)
            keys = self.keys(hashes, n, known)
            per_request.append((known, keys))
            unique.update(dict.fromkeys(keys))
        codes: dict[str, int] = {}
        if unique:
            all_keys = list(unique)
            try:
                codes = dict(zip(all_keys, self._exists(all_keys)))
            except StoreError as err:
                return [err if keys or known else MISS for known, keys in per_request] + [err] * len(extra_keys)
        out: list[Any] = []
        for known, keys in per_request:
            try:
                out.append(self._hit(keys, codes, known))
            except StoreError as err:
                out.append(err)
        return out + [codes[k] for k in extra_keys]

    # -- filling and wiping ------------------------------------------------------------------
    def store_prefixes(self, block_hash_lists: Iterable[Sequence[bytes]]) -> int:
        """Put every block of every list (deduplicated; existing keys are overwritten); returns keys written."""
        keys = list(dict.fromkeys(self.key(h) for hashes in block_hash_lists for h in hashes))
        for start in range(0, len(keys), PUT_CHUNK):
            chunk = keys[start:start + PUT_CHUNK]
            try:
                code = self.store.upsert_batch(chunk, [VALUE] * len(chunk))
            except Exception as exc:
                raise StoreError(None, "upsert_batch", repr(exc)) from exc
            if code < 0:
                hint = " (a lookup-only client cannot put: open a writer)" if code == -600 else ""
                raise StoreError(code, "upsert_batch", f"{len(chunk)} keys{hint}")
        return len(keys)

    def remove_all(self, force: bool = True) -> int:
        """Remove this namespace's keys (not the whole store); returns how many were removed.

        ``force`` skips Mooncake's lease check: an existence check leases a key for the master's
        ``default_kv_lease_ttl``, and a non-forced remove skips leased keys.
        """
        try:
            code = self.store.remove_by_regex(f"^{self.namespace}/.*", force)
        except Exception as exc:
            raise StoreError(None, "remove_by_regex", repr(exc)) from exc
        if code < 0:
            raise StoreError(code, "remove_by_regex", f"namespace {self.namespace}")
        return int(code)

    def reset(self) -> bool:
        """vLLM's ``reset``: wipe this namespace; True on success, False on a store error."""
        try:
            self.remove_all(force=True)
        except StoreError:
            return False
        return True

    def __repr__(self) -> str:
        return f"PrefixIndex(namespace={self.namespace!r}, block_size={self.block_size})"


def _unpack(request: Request) -> tuple[int, Sequence[bytes], int]:
    num_tokens, hashes, *rest = request
    return num_tokens, hashes, (rest[0] if rest else 0)


__all__ = ["DEFAULT_NAMESPACE", "PrefixIndex", "Request", "StoreError"]
