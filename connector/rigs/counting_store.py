"""A store client that counts the existence checks it forwards: how many keys a lookup really sent.

Why: the prefix cache's promise is that a long prompt's lookup asks the store only for its new blocks. A
claim about keys sent is judged by counting them where they leave for the master, in the lookup server's
process, around the real client's ``batch_is_exist`` (and ``is_exist``): not by what a client meant to ask.
Every call is forwarded unchanged; everything else passes through to the wrapped client.
"""

from __future__ import annotations

import threading
from typing import Any


class CountingStore:
    """The real store client, with a count of existence-check calls and of the keys they asked.

    Thread-safe: one server process runs vLLM's lookup server and ours on two threads over one client.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.calls = 0
        self.keys = 0

    def batch_is_exist(self, keys: list[str]) -> Any:
        """Mooncake's ``batch_is_exist``, counted."""
        with self._lock:
            self.calls += 1
            self.keys += len(keys)
        return self._store.batch_is_exist(keys)

    def is_exist(self, key: str) -> Any:
        """Mooncake's ``is_exist`` of one key, counted."""
        with self._lock:
            self.calls += 1
            self.keys += 1
        return self._store.is_exist(key)

    def counts(self) -> tuple[int, int]:
        """``(calls, keys)`` so far."""
        with self._lock:
            return self.calls, self.keys

    def __getattr__(self, name: str) -> Any:  # upsert_batch, remove, close, ... of the wrapped client
        return getattr(self._store, name)


__all__ = ["CountingStore"]
