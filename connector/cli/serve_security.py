"""``serve``'s security options: CURVE keys, the refusal of an open TCP port, and the bounds on what may wait.

Why a module of its own: ``serve`` grows other options (back-ends, layouts); who may talk to the server is
one job, kept here. :func:`add_security_arguments` adds the flags; :func:`server_security` turns them into
the :class:`~mooncake_lookout.connector.server.LookupServer` keyword arguments, or a :class:`ServeRefused`
whose one-line message says what is wrong (a bad key file; a TCP address beyond loopback without CURVE and
without ``--insecure``, naming the risk).
"""

from __future__ import annotations

import argparse
from typing import Any

from mooncake_lookout.connector.curve import CurveKeyError, ServerCurve
from mooncake_lookout.connector.server.limits import add_limit_arguments, limits_from_args
from mooncake_lookout.connector.server.listen import exposure

FIX = "give --curve-secret-key and --curve-allowed-clients, or --insecure to accept that risk"


class ServeRefused(RuntimeError):
    """``serve`` will not start as asked; the message is the one line to print."""


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    """Add the CURVE, ``--insecure`` and bounds flags to ``serve``'s parser."""
    g = p.add_argument_group("who may talk to the server (docs/security.md)")
    g.add_argument("--curve-secret-key", metavar="FILE",
                   help="the server's CURVE key pair, a zmq.auth secret certificate (server.key_secret): clients must "
                        "use CURVE with its public key")
    g.add_argument("--curve-allowed-clients", metavar="DIR|FILE",
                   help="client public keys admitted: a directory of zmq.auth *.key files, or one such file "
                        "(re-read when an unknown key knocks, at most every 5 s)")
    g.add_argument("--insecure", action="store_true",
                   help="listen on a TCP address beyond loopback without CURVE (anyone who reaches it can flood "
                        "the store with lookups and probe what is cached; reset stays refused on plain TCP)")
    bounds = p.add_argument_group("what may wait in the server, per peer (ZMQ connection; with CURVE, client key) "
                                  "and in all: past a bound a frame is answered busy (docs/security.md)")
    add_limit_arguments(bounds)


def server_security(args: argparse.Namespace, address: str | None) -> dict[str, Any]:
    """The LookupServer keyword arguments the flags ask for; :class:`ServeRefused` when it must not start."""
    if bool(args.curve_secret_key) != bool(args.curve_allowed_clients):
        raise ServeRefused("--curve-secret-key and --curve-allowed-clients go together (the server's key pair, and "
                           "the clients it admits)")
    try:
        limits = limits_from_args(args)
    except ValueError as e:
        raise ServeRefused(f"bad bound: {e}") from None
    curve = None
    if args.curve_secret_key:
        try:
            curve = ServerCurve.from_files(args.curve_secret_key, args.curve_allowed_clients)
        except CurveKeyError as e:
            raise ServeRefused(f"bad CURVE key: {e}") from None
    risk = exposure(address or "", curve, FIX)
    if risk is not None and not args.insecure:
        raise ServeRefused(risk)
    return {"curve": curve, "limits": limits}


__all__ = ["FIX", "ServeRefused", "add_security_arguments", "server_security"]
