"""Why a CURVE connection never answers: the socket monitor's handshake events, turned into one sentence.

A ZMQ server that refuses a client's handshake says nothing the client's socket can read: the lookups just
time out. libzmq reports the reason on the socket's monitor, though: ``HANDSHAKE_FAILED_AUTH`` with the
ZAP status (the server's allow-list refused this client's key), ``HANDSHAKE_FAILED_NO_DETAIL`` (the server
dropped the handshake: a wrong server key), ``HANDSHAKE_FAILED_PROTOCOL`` with a mechanism mismatch (one
end uses CURVE, the other does not). :class:`HandshakeWatch` keeps that monitor beside the socket and is
read only on the slow path (a lookup timed out with the server silent), never on a lookup's way.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
NOT_ACCEPTED = ("CURVE handshake not accepted (ZAP status {status}) — is this client's public key in the server's "
                "allow-list?")
DROPPED = ("CURVE handshake dropped by the server — is lookup_curve_server_public_key this server's public key, "
           "and does the server use CURVE?")
SERVER_PLAIN = ("the server does not use CURVE (security mechanism mismatch): turn CURVE on at the server, "
                "or drop this client's lookup_curve_* keys")
SERVER_CURVE = ("handshake refused — the server probably requires CURVE: set lookup_curve_server_public_key and "
                "lookup_curve_client_secret_key")
_MAX_EVENTS = 256  # read per diagnosis: a refused client reconnects every 100 ms, the monitor keeps a backlog


class HandshakeWatch:
    """The monitor of one socket (open it before the socket connects); ``curve``: this end uses CURVE."""

    def __init__(self, sock: zmq.Socket, curve: bool) -> None:
        self._sock = sock
        self._curve = curve
        self._monitor: Any = sock.get_monitor_socket(EVENTS)
        self.succeeded = False

    def diagnose(self) -> str | None:
        """Why handshakes failed since the last call (the worst reason seen), or None if none failed."""
        auth: int | None = None
        mismatch = no_detail = False
        for _ in range(_MAX_EVENTS):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded = True
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                auth = value
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                mismatch = mismatch or value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                no_detail = True
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                no_detail = True
        if auth is not None:
            return NOT_ACCEPTED.format(status=auth)
        if mismatch:
            return SERVER_PLAIN if self._curve else SERVER_CURVE
        if no_detail:
            return DROPPED if self._curve else SERVER_CURVE
        return None

    def close(self) -> None:
        """Stop monitoring and close the monitor (before the socket closes)."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)


__all__ = ["DROPPED", "EVENTS", "HandshakeWatch", "NOT_ACCEPTED", "SERVER_CURVE", "SERVER_PLAIN"]
