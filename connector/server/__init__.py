"""The lookup server side: answers lookups from a store, in vLLM's worker or as a process of its own.

* :mod:`.loop`: :class:`LookupServer`, one ROUTER socket speaking both wire formats, validated frames,
  coalesced store calls, fenced resets;
* :mod:`.backend`: what the server asks of a store (:class:`LookupBackend`, :class:`BatchLookupBackend`);
* :mod:`.observer`: its telemetry hooks (:class:`ServerObserver`) and plain counters (:class:`ServerStats`);
* :mod:`.prefix_index`: :class:`~.prefix_index.PrefixIndex`, a backend over a real Mooncake store for
  lookups outside a GPU worker (``serve``, demo, bench, tests);
* :mod:`.store`: opening real Mooncake store clients;
* :mod:`.worker_backend`: upstream's own store worker as a backend, inside vLLM's worker.
"""

from __future__ import annotations

from mooncake_lookout.connector.server.backend import BatchLookupBackend, LookupBackend
from mooncake_lookout.connector.server.loop import LookupServer
from mooncake_lookout.connector.server.observer import ServerObserver, ServerStats

__all__ = ["BatchLookupBackend", "LookupBackend", "LookupServer", "ServerObserver", "ServerStats"]
