"""What the lookup server asks of a store: a prefix lookup and a wipe, or many lookups in one call.

vLLM's store worker (:class:`~mooncake_lookout.connector.server.worker_backend.WorkerBackend`) and our
:class:`~mooncake_lookout.connector.server.prefix_index.PrefixIndex` both fit. The server calls a
backend from its one loop thread, one call at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from mooncake_lookout.connector.job import LookupResult


@runtime_checkable
class LookupBackend(Protocol):
    """What the server asks: a prefix lookup and a wipe. vLLM's store worker and our PrefixIndex both fit."""

    def lookup(self, num_tokens: int, hashes: Sequence[bytes]) -> LookupResult: ...

    def reset(self) -> Any: ...


@runtime_checkable
class BatchLookupBackend(LookupBackend, Protocol):
    """A backend that answers many lookups with one store call; an exception in the list is that lookup's error.

    A query is ``(num_tokens, hashes, known)``: its first ``known`` blocks are present (the client knows
    them), only the rest are asked. The codes of ``extra_keys`` (the server's marker) follow the results,
    asked in the same call. A backend that can also hold a marker key offers ``marker_key(name)`` and
    ``put_marker(key)`` (see :mod:`.epoch`).
    """

    def lookup_many(self, queries: Sequence[tuple[int, Sequence[bytes], int]],
                    extra_keys: Sequence[str] = ()) -> list[Any]: ...


def failed(result: Any) -> bool:
    """True when a backend's answer is an error (an exception, or anything but a result)."""
    return isinstance(result, BaseException) or not hasattr(result, "hit_length")


def as_result(result: Any) -> LookupResult | BaseException:
    """A backend's answer as a result or the error it stands for."""
    if isinstance(result, BaseException):
        return result
    if not hasattr(result, "hit_length"):
        return RuntimeError(f"backend returned {type(result).__name__}, not a LookupResult")
    return result


def failure_reason(result: Any) -> str:
    """Why a backend's answer (or a reset's outcome) is a failure, in a few words."""
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    if result is False:
        return "store reported failure"
    return f"backend returned {type(result).__name__}, not a LookupResult"


__all__ = ["BatchLookupBackend", "LookupBackend", "as_result", "failed", "failure_reason"]
