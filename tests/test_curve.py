"""CURVE on the lookup channel, with real ZMQ CURVE sockets, pyzmq's ZAP handler and a real Mooncake master.

A server with CURVE keys serves the clients of its allow-list (hits, and a reset: an authenticated peer
may wipe the store), refuses any other key, and the refused client says why (once, rate-limited) instead
of only timing out; so does ``doctor``. A plain client and a wrong server key are told apart too. The
config keys refuse missing files, malformed keys, half pairs and the wrong transport, naming the key.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from mooncake_lookout.connector.cli.doctor import probe_server
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import ConfigError, LookupConfig
from mooncake_lookout.connector.curve import ServerCurve, create_key_files
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.auth import RELOAD_S, AllowList
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport import handshake, make_transport
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16
TIMEOUT_MS = 300


@dataclass
class Keys:
    """zmq.auth certificate files: the server's, an allowed client's, a stranger's, and the allow-list folder."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str
    stranger_public: str
    stranger_secret: str
    allowed: str


def make_keys(folder: Path) -> Keys:
    server = create_key_files(str(folder), "server")
    client = create_key_files(str(folder), "client")
    stranger = create_key_files(str(folder), "stranger")
    allowed = folder / "allowed"
    allowed.mkdir()
    shutil.copy(client[0], allowed)
    return Keys(*server, *client, *stranger, str(allowed))


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return make_keys(tmp_path)


@pytest.fixture
def curve_server(prefix_index: PrefixIndex, keys: Keys) -> Iterator[LookupServer]:
    with LookupServer(prefix_index, "tcp://127.0.0.1:0",
                      curve=ServerCurve.from_files(keys.server_secret, keys.allowed)) as server:
        yield server


def client_config(keys: Keys, secret: str | None = None, server_public: str | None = None, **kw: Any) -> LookupConfig:
    return LookupConfig(lookup_timeout_ms=TIMEOUT_MS, lookup_breaker_failures=1000,
                        lookup_curve_server_public_key=server_public or keys.server_public,
                        lookup_curve_client_secret_key=secret or keys.client_secret, **kw)


def test_a_client_of_the_allow_list_is_served_and_may_reset(curve_server: LookupServer, keys: Keys,
                                                             prefix_index: PrefixIndex, make_hashes: Any) -> None:
    hashes = make_hashes(4, seed=11)
    prefix_index.store_prefixes([hashes])
    cfg = client_config(keys)
    client = LookupClient(cfg, make_transport(cfg, curve_server.address))
    try:
        assert client.lookup("a", 4 * BLOCK + 1, hashes).hit_length == 4 * BLOCK
        assert client.reset(), "an authenticated peer may wipe the store"
        assert client.lookup("b", 4 * BLOCK + 1, hashes).hit_length == 0
    finally:
        client.close()
    assert curve_server.stats.answered_by_status["ok"] == 3
    assert curve_server.allow_list.refused == 0


def test_an_unknown_key_is_refused_and_the_client_says_why_once(curve_server: LookupServer, keys: Keys,
                                                                prefix_index: PrefixIndex, make_hashes: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    hashes = make_hashes(4, seed=12)
    prefix_index.store_prefixes([hashes])
    cfg = client_config(keys, secret=keys.stranger_secret)
    counter = OutcomeCounter()
    client = LookupClient(cfg, make_transport(cfg, curve_server.address), observer=counter)
    caplog.set_level(logging.WARNING, logger="mooncake_lookout.connector.transport.pipelined")
    try:
        for i in range(3):  # each one times out, and each timeout rebuilds the socket (a new handshake)
            assert client.lookup(f"s{i}", 4 * BLOCK + 1, hashes).hit_length == 0
    finally:
        client.close()
    assert counter.count(Outcome.TIMEOUT) == 3 and counter.count(Outcome.HIT) == 0
    assert curve_server.allow_list.refused >= 1
    assert curve_server.stats.answered_by_status == {}, "a refused client must reach nothing"
    said = [r.getMessage() for r in caplog.records if "CURVE handshake not accepted" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # said, and rate-limited
    assert "is this client's public key in the server's allow-list?" in said[0]


def test_a_wrong_server_key_and_a_plain_client_are_told_apart(curve_server: LookupServer, keys: Keys,
                                                              make_hashes: Any) -> None:
    hashes = make_hashes(2, seed=13)
    wrong = client_config(keys, server_public=keys.stranger_public)
    plain = LookupConfig(lookup_timeout_ms=TIMEOUT_MS, lookup_breaker_failures=1000)
    transports = {"wrong": make_transport(wrong, curve_server.address),
                  "plain": PipelinedTransport(curve_server.address, timeout_s=plain.timeout_s, watch_handshakes=True)}
    diagnoses = {}
    for name, transport in transports.items():
        client = LookupClient(wrong if name == "wrong" else plain, transport)
        try:
            assert client.lookup(name, 2 * BLOCK + 1, hashes).hit_length == 0
            diagnoses[name] = transport.diagnosis  # type: ignore[attr-defined]
        finally:
            client.close()
    assert diagnoses == {"wrong": handshake.DROPPED, "plain": handshake.SERVER_CURVE}
    assert curve_server.stats.answered_by_status == {}


def test_doctor_reports_a_refused_key(curve_server: LookupServer, keys: Keys, tmp_path: Path) -> None:
    known = probe_server(curve_server.address, "pipelined", samples=3, config=client_config(keys))
    assert known.ok, known.detail
    refused = probe_server(curve_server.address, "pipelined", samples=3,
                           config=client_config(keys, secret=keys.stranger_secret))
    assert not refused.ok and "CURVE handshake not accepted" in refused.detail, refused.detail


def test_the_allow_list_rereads_its_folder_for_an_unknown_key(keys: Keys) -> None:
    now = [100.0]
    allow = AllowList(keys.allowed, clock=lambda: now[0])
    stranger = zmq.auth.load_certificate(keys.stranger_public)[0]
    client = zmq.auth.load_certificate(keys.client_public)[0]
    assert allow.callback("*", client) and not allow.callback("*", stranger)
    shutil.copy(keys.stranger_public, keys.allowed)
    assert not allow.callback("*", stranger), "re-read at most every RELOAD_S"
    now[0] += RELOAD_S
    assert allow.callback("*", stranger), "a key added to the folder is admitted without a restart"
    os.remove(os.path.join(keys.allowed, os.path.basename(keys.client_public)))
    os.remove(os.path.join(keys.allowed, os.path.basename(keys.stranger_public)))
    now[0] += RELOAD_S
    assert not allow.callback("*", b"x" * 40)
    assert allow.callback("*", stranger), "an empty folder (a half-written Secret) keeps the keys it had"
    assert allow.refused == 3


# -- configuration --------------------------------------------------------------------------------------------
def _error(**extra: Any) -> str:
    with pytest.raises(ConfigError) as e:
        LookupConfig.from_extra_config(extra)
    return str(e.value)


def test_config_takes_a_client_key_pair_and_a_server_key_pair(keys: Keys) -> None:
    cfg = LookupConfig.from_extra_config({
        "lookup_curve_server_public_key": keys.server_public, "lookup_curve_client_secret_key": keys.client_secret,
        "lookup_curve_server_secret_key": keys.server_secret, "lookup_curve_allowed_clients": keys.allowed})
    client, server = cfg.client_curve(), cfg.server_curve()
    assert client is not None and server is not None
    assert client.server_public == server.public and client.secret.decode() not in repr(client)
    assert LookupConfig().client_curve() is None and LookupConfig().server_curve() is None


def test_config_names_what_is_wrong_with_a_key_file(keys: Keys, tmp_path: Path) -> None:
    pair = {"lookup_curve_server_public_key": keys.server_public}
    missing = _error(**pair, lookup_curve_client_secret_key=str(tmp_path / "nope.key_secret"))
    assert "'lookup_curve_client_secret_key'" in missing and "no such file" in missing
    short = tmp_path / "short.key"
    short.write_text('curve\n    public-key = "abc"\n')
    bad = _error(lookup_curve_server_public_key=str(short), lookup_curve_client_secret_key=keys.client_secret)
    assert "'lookup_curve_server_public_key'" in bad and "3 characters" in bad and "40" in bad
    public_only = _error(**pair, lookup_curve_client_secret_key=keys.client_public)
    assert "holds no secret key" in public_only
    junk = tmp_path / "junk.key_secret"
    junk.write_text("hello\n")
    assert "not a zmq.auth certificate" in _error(**pair, lookup_curve_client_secret_key=str(junk))
    mixed = tmp_path / "mixed.key_secret"  # the client's public key with the stranger's secret key
    public = zmq.auth.load_certificate(keys.client_secret)[0].decode()
    secret = zmq.auth.load_certificate(keys.stranger_secret)[1].decode()  # type: ignore[union-attr]
    mixed.write_text(f'curve\n    public-key = "{public}"\n    secret-key = "{secret}"\n')
    assert "not the one of its secret key" in _error(**pair, lookup_curve_client_secret_key=str(mixed))
    empty = tmp_path / "empty"
    empty.mkdir()
    no_keys = _error(lookup_curve_server_secret_key=keys.server_secret, lookup_curve_allowed_clients=str(empty))
    assert "'lookup_curve_allowed_clients'" in no_keys and "no client public key files" in no_keys


def test_config_wants_whole_pairs_and_the_pipelined_transport(keys: Keys) -> None:
    half = _error(lookup_curve_client_secret_key=keys.client_secret)
    assert "'lookup_curve_client_secret_key'" in half and "'lookup_curve_server_public_key'" in half
    assert "'lookup_curve_server_secret_key'" in _error(lookup_curve_allowed_clients=keys.allowed)
    upstream = _error(lookup_transport="upstream", lookup_curve_server_public_key=keys.server_public,
                      lookup_curve_client_secret_key=keys.client_secret)
    assert "pipelined transport only" in upstream
