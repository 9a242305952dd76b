"""Where and how the lookup server listens: its ROUTER socket, CURVE on it, and what a TCP address exposes.

* :func:`bind_router`: the server's socket with its memory guards, bound (errors name the address); with
  CURVE keys, pyzmq's ZAP handler starts first (:mod:`.auth`), since libzmq admits every CURVE client of
  a context without one;
* :func:`exposure`: the one-line refusal for a TCP address beyond loopback without CURVE (``serve`` and the
  vLLM worker both apply it): whoever reaches such a port can flood the store with lookups and probe
  which prompts are cached, all in clear text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from mooncake_lookout.connector.curve import ServerCurve
from mooncake_lookout.connector.wire.pipelined import MAX_BODY_BYTES

# ZMQ drops (and disconnects) a peer sending a message part above this: a memory guard above the limit the
# protocol answers with an error (MAX_BODY_BYTES), so a frame a little over it still gets its error reply.
HARD_MAX_MESSAGE_BYTES = MAX_BODY_BYTES + (1 << 20)
HWM = 100_000  # replies queued per peer; past it ZMQ drops them (the peer does not read)
# Messages ZMQ reads ahead per connection while the loop is busy (in a store call): past it, it holds off reading
# and the rest wait in the kernel and at the peer. Bounds what a connection holds in the server before the
# admission's bounds see it: RECV_HWM + 1 messages, each part at most HARD_MAX_MESSAGE_BYTES.
RECV_HWM = 8
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]", "lo")


@dataclass
class Listener:
    """A bound ROUTER socket, its context and (with CURVE) the ZAP handler and allow-list that guard it."""

    ctx: zmq.Context
    sock: zmq.Socket
    address: str  # as bound, with the real port
    auth: Any = None
    allow_list: Any = None

    def stop_auth(self) -> None:
        """Stop the ZAP handler (after the socket closed, before the context terminates)."""
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


def bind_router(address: str, curve: ServerCurve | None) -> Listener:
    """A new context and ROUTER bound to ``address`` (``tcp://HOST:0`` picks a port); raises naming the address."""
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    listener = Listener(ctx, sock, address)
    try:
        if curve is not None:
            from mooncake_lookout.connector.server.auth import start_authenticator

            listener.auth, listener.allow_list = start_authenticator(ctx, curve)
            curve.apply(sock)
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        listener.stop_auth()
        ctx.term()
        raise zmq.ZMQError(e.errno, f"{e.strerror} (addr={address!r})") from None
    listener.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return listener


def is_loopback(address: str) -> bool:
    """True for ``tcp://`` on a loopback host (127.0.0.0/8, ::1, localhost); False for any other TCP host."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    return host.startswith("127.") or host in LOOPBACK_HOSTS


def exposure(address: str, curve: object | None, how_to_fix: str) -> str | None:
    """The one-line refusal for listening on ``address`` without CURVE beyond loopback; None when it is safe."""
    if curve is not None or not address.startswith("tcp://") or is_loopback(address):
        return None
    return (f"refusing to listen on {address} without CURVE: anyone who reaches that port can flood the store "
            f"with lookups and probe which prompts are cached, in clear text (docs/security.md); {how_to_fix}")


def resets_allowed(address: str, curve: object | None) -> bool:
    """A peer may wipe the store over IPC (a private folder) or CURVE (authenticated), never over plain TCP."""
    return curve is not None or address.startswith(("ipc://", "inproc://"))


__all__ = ["HARD_MAX_MESSAGE_BYTES", "HWM", "Listener", "RECV_HWM", "bind_router", "exposure", "is_loopback",
           "resets_allowed"]
