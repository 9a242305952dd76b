"""CURVE keys of the lookup channel over TCP: read and check zmq.auth certificate files, put them on sockets.

Why: on TCP, anyone who reaches the lookup server's port could wipe the store (``reset``) or flood it.
ZMQ's CURVE mechanism encrypts the channel and authenticates both ends; pyzmq's ``zmq.auth`` gives the
field's standard key files, and this module only reads those:

* ``zmq.auth.create_certificates(DIR, "server")`` writes ``server.key`` (the public key, to hand out) and
  ``server.key_secret`` (the key pair, to keep private); the same for each client;
* the server takes its key pair and an allow-list of client public keys: a directory of ``*.key`` files
  (as ``zmq.auth.load_certificates`` reads it) or one certificate file;
* a client takes the server's public key and its own key pair.

Every error names the file and what is wrong with it (missing, no key in it, a key of the wrong length, a
pair whose halves do not match), so :mod:`.config` can turn it into a clear start-up error.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

Z85_KEY_CHARS = 40  # a 32-byte CURVE key, Z85-encoded
PUBLIC_SUFFIX = ".key"  # zmq.auth's public certificate; ".key_secret" holds the pair


class CurveKeyError(ValueError):
    """A CURVE key file is missing, unreadable or malformed; the message names the file and the problem."""


def _read_certificate(path: str) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) from a zmq.auth certificate file, each checked."""
    import zmq.auth

    if not os.path.isfile(path):
        what = "a directory, not a certificate file" if os.path.isdir(path) else "no such file"
        raise CurveKeyError(f"{path}: {what}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:  # unreadable, or no public-key line
        raise CurveKeyError(f"{path}: not a zmq.auth certificate ({e})") from None
    _check_key(path, "public", public)
    if secret is not None:
        _check_key(path, "secret", secret)
    return public, secret


def _check_key(path: str, which: str, key: bytes) -> None:
    if len(key) != Z85_KEY_CHARS:
        raise CurveKeyError(f"{path}: the {which} key has {len(key)} characters; a CURVE key has "
                            f"{Z85_KEY_CHARS} (Z85 of 32 bytes, as zmq.auth.create_certificates writes)")
    from zmq.utils import z85

    try:
        z85.decode(key)
    except Exception:  # a character outside Z85's alphabet (KeyError), a value past 32 bits (struct.error)
        raise CurveKeyError(f"{path}: the {which} key is not Z85 text") from None


def load_public_key(path: str) -> bytes:
    """The public key of a certificate file (``NAME.key``, or the pair's ``NAME.key_secret``)."""
    return _read_certificate(path)[0]


def load_key_pair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate file (``NAME.key_secret``); its halves must match."""
    public, secret = _read_certificate(path)
    if secret is None:
        raise CurveKeyError(f"{path}: holds no secret key; give the NAME.key_secret file of the pair, "
                            "not the public NAME.key")
    import zmq

    if zmq.curve_public(secret) != public:
        raise CurveKeyError(f"{path}: its public key is not the one of its secret key")
    return public, secret


def load_allowed_keys(path: str) -> frozenset[bytes]:
    """The client public keys a server admits: every ``*.key`` file of a directory, or one certificate file."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*" + PUBLIC_SUFFIX)))
        if not files:
            raise CurveKeyError(f"{path}: no client public key files (*{PUBLIC_SUFFIX}) in this directory")
        return frozenset(load_public_key(f) for f in files)
    if not os.path.exists(path):
        raise CurveKeyError(f"{path}: no such file or directory")
    return frozenset({load_public_key(path)})


@dataclass(frozen=True, repr=False)
class ClientCurve:
    """A client's CURVE keys: the server's public key and this client's pair (secret: never printed)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_key: str, client_secret_key: str) -> ClientCurve:
        """Read ``server.key`` (or its pair) and this client's ``client.key_secret``."""
        public, secret = load_key_pair(client_secret_key)
        return cls(load_public_key(server_public_key), public, secret)

    def apply(self, sock: Any) -> None:
        """Make ``sock`` a CURVE client of the server (before it connects)."""
        import zmq

        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)

    def __repr__(self) -> str:
        return f"ClientCurve(public={self.public.decode()!r}, server={self.server_public.decode()!r})"


@dataclass(frozen=True, repr=False)
class ServerCurve:
    """A server's CURVE keys: its pair, and where the allow-list of client public keys lives."""

    public: bytes
    secret: bytes
    allowed_clients: str

    @classmethod
    def from_files(cls, server_secret_key: str, allowed_clients: str) -> ServerCurve:
        """Read ``server.key_secret`` and check the allow-list (a directory of ``*.key`` files or one file)."""
        public, secret = load_key_pair(server_secret_key)
        load_allowed_keys(allowed_clients)
        return cls(public, secret, allowed_clients)

    def apply(self, sock: Any) -> None:
        """Make ``sock`` a CURVE server (before it binds); clients are then checked by the context's ZAP handler."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)

    def __repr__(self) -> str:
        return f"ServerCurve(public={self.public.decode()!r}, allowed_clients={self.allowed_clients!r})"


def create_key_files(directory: str, name: str) -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` in ``directory`` (zmq.auth's own format); returns both paths.

    The secret file is made readable by its owner only."""
    import zmq.auth

    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


__all__ = ["ClientCurve", "CurveKeyError", "PUBLIC_SUFFIX", "ServerCurve", "Z85_KEY_CHARS", "create_key_files",
           "load_allowed_keys", "load_key_pair", "load_public_key"]
