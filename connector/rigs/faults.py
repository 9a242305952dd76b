"""Faults for the lookup path that cannot be produced for real on demand, injected and labelled as such.

Fault tests and the soak break *real* parts the way production breaks them: a lookup server process is
killed (SIGKILL) or hung (SIGSTOP), the Mooncake master is paused or crashed
(:mod:`.server_process`, :mod:`.master`). The one fake is :class:`InjectedDelayBackend`: a store that is
*slow but healthy* cannot be produced for real on demand, so a fixed delay is injected in front of the
real store call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.job import LookupResult


class InjectedDelayBackend:
    """INJECTED FAULT: a lookup backend that sleeps ``delay_s`` before each real store call.

    Wraps a real backend (a :class:`PrefixIndex`); everything else passes through. ``enabled`` switches
    the delay at run time (the child process flips it on SIGUSR1/SIGUSR2). ``reset_delay_s`` injects a
    slow wipe (``reset`` and ``remove_all``).
    """

    def __init__(self, backend: Any, delay_s: float, enabled: bool = True, reset_delay_s: float = 0.0) -> None:
        self.backend = backend
        self.delay_s = delay_s
        self.enabled = enabled
        self.reset_delay_s = reset_delay_s  # a slow wipe (upstream's server first drains in-flight puts)
        self.delayed_calls = 0

    def _delay(self) -> None:
        if self.enabled and self.delay_s > 0:
            self.delayed_calls += 1
            time.sleep(self.delay_s)  # the injected fault itself, not a wait for a condition

    def lookup(self, num_tokens: int, hashes: Sequence[bytes]) -> LookupResult:
        """The real lookup, after the injected delay."""
        self._delay()
        return self.backend.lookup(num_tokens, hashes)

    def lookup_many(self, queries: Sequence[Any], extra_keys: Sequence[str] = ()) -> list[Any]:
        """The real batched lookup, after one injected delay for the whole batch."""
        self._delay()
        return self.backend.lookup_many(queries, extra_keys)

    def reset(self) -> Any:
        """Wipe the real store (our server's path), after the injected reset delay (if any)."""
        self._reset_delay()
        return self.backend.reset()

    def remove_all(self, force: bool = True) -> Any:
        """Wipe the real store (vLLM's server's path: ``store.remove_all``), after the injected reset delay."""
        self._reset_delay()
        return self.backend.remove_all(force)

    def _reset_delay(self) -> None:
        if self.reset_delay_s > 0:
            time.sleep(self.reset_delay_s)  # the injected fault itself: a wipe that takes this long

    def __getattr__(self, name: str) -> Any:  # remove_all, key, namespace, ... of the real backend
        return getattr(self.backend, name)


__all__ = ["InjectedDelayBackend"]
