"""vLLM's input thread: the first place a request's lookup can start (:mod:`.arrivals` says why it pays).

vLLM's engine core builds each request, block hashes included, in ``EngineCore.preprocess_add_request``, which
its input thread calls "to allow request initialization running in parallel with Model forward" (an in-process
engine, ``InprocClient``, calls it too); the busy loop admits the request at the next step. No connector hook
runs there, so this wraps that method, once per process, and hands each request built to the listener of THAT
engine core: the one registered for the KV connector its scheduler holds (``self.scheduler.connector``). One
process may run several engine cores (offline ``LLM`` objects with in-process engines, RLHF and eval harnesses),
each with its own connector, client and lookup server, and request ids that collide (each counts from 0): a
request reaches only its own engine's listener, and an engine core with no listener (another connector, or one
closed) reaches none. Listeners are held by their connector's identity, weakly: an entry leaves with ``stop``
or when its connector is collected. Without the method (another vLLM), nothing is wrapped and lookups start at
admission.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from mooncake_lookout.connector.logs import RateLimit

logger = logging.getLogger(__name__)

# id(connector) -> its listener. Keyed by identity, not by the object: a look-up per request costs an ``id()``
# (no weak reference made), and the entry is removed by a finalizer when the connector goes, before its id can
# be reused. The listener must not hold its connector (else the entry would keep it alive): the scheduler
# adapter's bound method does not; the connector holds the adapter, not the other way round.
_listeners: dict[int, Callable[[Any], None]] = {}
_finalizers: dict[int, weakref.finalize] = {}
_installed = False
_log_limit = RateLimit(60.0)


def request_built(connector: Any, request: Any) -> None:
    """The engine core whose scheduler holds ``connector`` built ``request`` on vLLM's input thread: pass it to
    that connector's listener, if any. Never raises: a failure here must not lose the request (it is only
    logged; the lookup then starts at admission)."""
    listener = _listeners.get(id(connector))
    if listener is not None:
        _hand(listener, request)


def _hand(listener: Callable[[Any], None], request: Any) -> None:
    try:
        listener(request)
    except Exception:
        _failed()


def _failed() -> None:
    """Log (rate-limited) what a listener raised; called from its ``except`` block."""
    if _log_limit.allow(time.perf_counter()):
        logger.exception("starting a lookup on vLLM's input thread failed (it starts at admission instead)")


def available() -> bool:
    """True when vLLM's engine core can be hooked here (the hook is installed once; nobody listens yet)."""
    return _install()


def listen(connector: Any, listener: Callable[[Any], None]) -> bool:
    """Hand every request built from now on by the engine core whose scheduler holds ``connector`` (its KV
    connector) to ``listener``, replacing that connector's earlier listener only; False if vLLM's engine core
    cannot be hooked here."""
    if not _install():
        return False
    key = id(connector)
    old = _finalizers.pop(key, None)
    if old is not None:
        old.detach()
    _listeners[key] = listener
    _finalizers[key] = weakref.finalize(connector, _forget, key)
    return True


def stop(connector: Any, listener: Callable[[Any], None]) -> None:
    """``listener`` hears no more of ``connector``'s engine core (if it is still the one listening there)."""
    key = id(connector)
    if _listeners.get(key) == listener:
        finalizer = _finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()
        del _listeners[key]


def listening() -> int:
    """How many connectors have a listener (each closed or collected one leaves none behind)."""
    return len(_listeners)


def _forget(key: int) -> None:
    _listeners.pop(key, None)
    _finalizers.pop(key, None)


def _install() -> bool:
    global _installed
    if _installed:
        return True
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    original = getattr(EngineCore, "preprocess_add_request", None)
    if original is None:
        logger.info("vLLM's EngineCore has no preprocess_add_request: lookups start at admission")
        return False

    @functools.wraps(original)
    def preprocess_add_request(self: Any, request: Any) -> Any:
        built = original(self, request)
        if _listeners:  # the engine core's own scheduler names the listener (vLLM 0.32 and 0.33: .scheduler)
            try:
                listener = _listeners.get(id(self.scheduler.connector))
            except AttributeError:  # not an engine core with a scheduler (yet): nobody of ours to tell
                return built
            if listener is not None:  # _hand, inline (a call frame less a request)
                try:
                    listener(built[0] if isinstance(built, tuple) else built)
                except Exception:
                    _failed()
        return built

    EngineCore.preprocess_add_request = preprocess_add_request
    _installed = True
    return True


__all__ = ["available", "listen", "listening", "request_built", "stop"]
