"""vLLM's input thread: the first place a request's lookup can start (:mod:`.arrivals` says why it pays).

vLLM's engine core builds each request, block hashes included, in ``EngineCore.preprocess_add_request``, which
its input thread calls "to allow request initialization running in parallel with Model forward"; the busy loop
admits the request at the next step. No connector hook runs there, so this wraps that method, once per
process, and hands each request built to the one scheduler-side connector listening (an engine core process
has one scheduler). Without the method (another vLLM), nothing is wrapped and lookups start at admission.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from mooncake_lookout.connector.logs import RateLimit

logger = logging.getLogger(__name__)

_listener: Callable[[Any], None] | None = None
_installed = False
_log_limit = RateLimit(60.0)


def request_built(request: Any) -> None:
    """A request was built on vLLM's input thread: pass it to the listener, if any. Never raises: a failure
    here must not lose the request (it is only logged; the lookup then starts at admission)."""
    listener = _listener
    if listener is None:
        return
    try:
        listener(request)
    except Exception:
        if _log_limit.allow(time.perf_counter()):
            logger.exception("starting a lookup on vLLM's input thread failed (it starts at admission instead)")


def available() -> bool:
    """True when vLLM's engine core can be hooked here (the hook is installed once; nobody listens yet)."""
    return _install()


def listen(listener: Callable[[Any], None]) -> bool:
    """Hand every request built from now on to ``listener`` (replacing any other); False if vLLM's engine core
    cannot be hooked here."""
    global _listener
    if not _install():
        return False
    _listener = listener
    return True


def stop(listener: Callable[[Any], None]) -> None:
    """``listener`` hears no more (if it is still the one listening)."""
    global _listener
    if _listener == listener:
        _listener = None


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
        request_built(built[0] if isinstance(built, tuple) else built)
        return built

    EngineCore.preprocess_add_request = preprocess_add_request
    _installed = True
    return True


__all__ = ["listen", "request_built", "stop"]
