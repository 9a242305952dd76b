"""Who may connect to a CURVE lookup server: pyzmq's ZAP authenticator over an allow-list of client keys.

Why pyzmq's own ``ThreadAuthenticator``: it is the field's standard ZAP handler, it runs only during a
handshake (never on a lookup's way) and it stamps each connection with the client's key (its ``User-Id``),
which the server then uses as the peer's name. :class:`AllowList` is its credentials provider: the public
keys of a directory of ``*.key`` files or of one certificate file, read again (at most every
:data:`RELOAD_S`) when an unknown key knocks, so a key added to a mounted Secret is admitted without a
restart. A refused key is logged (rate-limited) and counted in ``refused``.

The authenticator must run for as long as the CURVE socket is open: libzmq admits every CURVE client
when no ZAP handler is bound in the context. :func:`start_authenticator` starts it before the socket binds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from mooncake_lookout.connector.curve import CurveKeyError, ServerCurve, load_allowed_keys
from mooncake_lookout.connector.logs import RateLimit

logger = logging.getLogger(__name__)

RELOAD_S = 5.0  # an unknown key re-reads the allow-list at most this often


class AllowList:
    """ZAP credentials provider: admits the client public keys found at ``path`` (Z85, as ZAP hands them)."""

    def __init__(self, path: str, clock: Any = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self.keys = load_allowed_keys(path)
        self._loaded_at = clock()
        self.refused = 0
        self._log_limit = RateLimit(10.0)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the authenticator's thread for each CURVE handshake."""
        if key in self.keys:
            return True
        now = self._clock()
        if now - self._loaded_at >= RELOAD_S:
            self._loaded_at = now
            try:
                self.keys = load_allowed_keys(self.path)
            except CurveKeyError as e:  # keep the keys we had: a half-written Secret must not lock everyone out
                logger.warning("cannot re-read the CURVE allow-list: %s", e)
            if key in self.keys:
                return True
        self.refused += 1
        if self._log_limit.allow(now):
            logger.warning("refused a CURVE client whose public key %s is not in the allow-list %s "
                           "(%d refused so far)", key.decode("ascii", "replace"), self.path, self.refused)
        return False


def start_authenticator(ctx: zmq.Context, curve: ServerCurve) -> tuple[ThreadAuthenticator, AllowList]:
    """A running ZAP handler in ``ctx`` that admits the clients of ``curve.allowed_clients``; stop it after the
    socket closes and before the context terminates."""
    allow = AllowList(curve.allowed_clients)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=allow)
    return auth, allow


__all__ = ["AllowList", "RELOAD_S", "start_authenticator"]
