"""Security basics, checked on real processes: the standalone server's IPC socket is private (0700 folder,
0600 socket) and its TCP listener is on loopback unless configured; ``serve`` refuses a TCP address beyond
loopback without CURVE (unless ``--insecure``) and serves CURVE clients when given keys; a ``reset`` over
plain TCP is refused in both wire formats and the store stays whole, while an IPC client may still wipe it;
vLLM's lookup channel lives in a private folder; the server enforces its frame and hash-count limits; no raw
request id reaches a metric label.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from mooncake_lookout.connector.cli.serve import add_serve_parser
from mooncake_lookout.connector.cli.serve_security import ServeRefused, server_security
from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.curve import create_key_files
from mooncake_lookout.connector.rigs.processes import ChildProcess
from mooncake_lookout.connector.rigs.server_process import ServerProcess
from mooncake_lookout.connector.rigs.workload import unique_hashes
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.admission import RESET_REFUSED
from mooncake_lookout.connector.server.limits import Limits
from mooncake_lookout.connector.server.listen import HARD_MAX_MESSAGE_BYTES
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport import make_transport
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.connector.wire import pipelined as protocol
from mooncake_lookout.connector.wire import upstream as upstream_wire
from mooncake_lookout.metrics import catalogue
from mooncake_lookout.metrics.prometheus_sink import PrometheusSink

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

_enc = msgspec.msgpack.Encoder()


class Serve:
    """``python -m mooncake_lookout.connector.cli.serve`` as a child process, killed by pid."""

    def __init__(self, *args: str) -> None:
        self.child = ChildProcess([sys.executable, "-m", "mooncake_lookout.connector.cli.serve", *args],
                                  env=dict(os.environ, MC_LOG_LEVEL="ERROR"), name="serve")
        self.proc = self.child.proc
        self._next = 0

    @property
    def lines(self) -> list[str]:
        return self.child.lines()

    def wait_for(self, prefix: str, timeout_s: float = 60.0) -> str:
        """Wait (bounded) for an output line starting with ``prefix``, past the last one found; its rest."""
        try:
            number, line = self.child.find_line(prefix, timeout_s, after=self._next)
        except RuntimeError as e:
            raise AssertionError(f"serve exited: {e}") from None
        self._next = number + 1
        return line[len(prefix):].strip()

    def close(self) -> None:
        self.child.kill()


@pytest.fixture
def serve(mooncake_master: Any) -> Iterator[Any]:
    started: list[Serve] = []

    def start(*args: str) -> Serve:
        started.append(Serve("--master", mooncake_master.rpc_address, *args))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) in LISTEN state on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:
                    found.add(addr)
    return found


def test_standalone_server_ipc_socket_is_private(serve) -> None:
    s = serve()
    path = s.wait_for("listening on ").removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, oct(os.stat(path).st_mode)


def test_standalone_server_tcp_listens_on_loopback_only(serve) -> None:
    s = serve("--tcp-port", "0", "--metrics-port", "0")
    metrics = s.wait_for("metrics on ")
    address = s.wait_for("listening on ")
    m = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", address)
    assert m, address
    assert _listeners(int(m.group(1))) == {"0100007F"}, "the lookup port listens beyond loopback"
    mport = int(re.search(r":(\d+)/", metrics).group(1))  # type: ignore[union-attr]
    assert _listeners(mport) == {"0100007F"}, "the metrics port listens beyond loopback"


def test_a_shared_folder_is_refused(serve, tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    s = serve("--address", f"ipc://{shared}/lookup.sock")
    s.proc.wait(60)
    with pytest.raises(AssertionError, match="serve exited"):
        s.wait_for("listening on ")
    out = "\n".join(s.lines)
    assert s.proc.returncode != 0 and "0700" in out, out
    assert not (shared / "lookup.sock").exists()


def test_serve_refuses_an_open_tcp_port_without_curve_in_one_line(serve) -> None:
    s = serve("--address", "tcp://0.0.0.0:0")  # refused before anything binds
    assert s.proc.wait(60) == 2
    (line,) = [ln for ln in s.lines if "mooncake-lookout serve:" in ln]
    assert "refusing to listen on tcp://0.0.0.0:0 without CURVE" in line and "flood" in line and "--insecure" in line
    # --insecure lets it past the check: it then tries to bind (a TEST-NET address no interface holds, so nothing
    # listens beyond loopback here, and the bind error proves the check was passed).
    s = serve("--address", "tcp://192.0.2.1:0", "--insecure")
    assert s.proc.wait(60) != 0
    out = "\n".join(s.lines)
    assert "refusing" not in out and "192.0.2.1" in out, out


def test_serve_with_curve_keys_serves_an_allowed_client_and_lets_it_reset(serve, tmp_path,
                                                                            prefix_index: PrefixIndex) -> None:
    server_public, server_secret = create_key_files(str(tmp_path), "server")
    client_public, client_secret = create_key_files(str(tmp_path), "client")
    bad = serve("--tcp-port", "0", "--curve-secret-key", server_public, "--curve-allowed-clients", client_public)
    assert bad.proc.wait(60) == 2 and any("holds no secret key" in ln for ln in bad.lines), bad.lines
    s = serve("--tcp-port", "0", "--namespace", prefix_index.namespace,
              "--curve-secret-key", server_secret, "--curve-allowed-clients", client_public)
    address = s.wait_for("listening on ")
    hashes = unique_hashes(4, seed=31)
    prefix_index.store_prefixes([hashes])
    cfg = LookupConfig(lookup_timeout_ms=2000, lookup_curve_server_public_key=server_public,
                       lookup_curve_client_secret_key=client_secret)
    client = LookupClient(cfg, make_transport(cfg, address))
    try:
        assert client.lookup("a", 4 * 16 + 1, hashes).hit_length == 4 * 16
        assert client.reset()
        assert client.lookup("b", 4 * 16 + 1, hashes).hit_length == 0
    finally:
        client.close()


def test_only_an_open_tcp_address_without_curve_is_refused(tmp_path) -> None:
    server_public, server_secret = create_key_files(str(tmp_path), "server")
    args = _serve_args("--max-peer-lookups", "8", "--peer-share-keys", "16", "--max-peer-bytes", "1000000")
    for address in ("tcp://0.0.0.0:5570", "tcp://*:5570", "tcp://10.1.2.3:5570", "tcp://eth0:5570"):
        with pytest.raises(ServeRefused, match="without CURVE"):
            server_security(args, address)
    for address in (None, "ipc:///run/x/lookup.sock", "tcp://127.0.0.1:5570", "tcp://127.8.0.1:1", "tcp://[::1]:1",
                    "tcp://localhost:1"):
        assert server_security(args, address) == {
            "curve": None, "limits": Limits(max_peer_lookups=8, share_keys=16, max_peer_bytes=1_000_000)}
    args.insecure = True
    assert server_security(args, "tcp://0.0.0.0:5570")["curve"] is None
    args.insecure, args.curve_secret_key, args.curve_allowed_clients = False, server_secret, server_public
    assert server_security(args, "tcp://0.0.0.0:5570")["curve"] is not None  # CURVE: no --insecure needed
    args.curve_allowed_clients = None
    with pytest.raises(ServeRefused, match="go together"):
        server_security(args, "tcp://127.0.0.1:5570")
    for flags, message in ((("--max-peer-bytes", "0"), "max_peer_bytes must be at least 1"),
                           (("--max-total-lookups", "10"), r"max_peer_lookups \(4096\) exceeds max_total_lookups")):
        with pytest.raises(ServeRefused, match=message):
            server_security(_serve_args(*flags), None)


def _serve_args(*flags: str) -> argparse.Namespace:
    """``serve``'s own parser, as the command line reads ``flags``."""
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--embedded-master", *flags])


def test_a_reset_over_plain_tcp_is_refused_and_the_store_is_untouched(prefix_index: PrefixIndex) -> None:
    prompts = [unique_hashes(4, seed=40 + i) for i in range(3)]
    prefix_index.store_prefixes(prompts)
    cfg = LookupConfig(lookup_timeout_ms=2000)
    with LookupServer(prefix_index, "tcp://127.0.0.1:0") as server:
        client = LookupClient(cfg, make_transport(cfg, server.address))
        try:
            assert [client.lookup(f"before{i}", 4 * 16 + 1, h).hit_length for i, h in enumerate(prompts)] == [64] * 3
            assert client.reset() is False  # ours: bad_request, with the reason
            reply = protocol.decode_reply(_ask(server.address, protocol.encode_reset(9))[0])
            assert (reply.status, reply.reason) == (protocol.BAD_REQUEST, RESET_REFUSED)
            assert _ask(server.address, [upstream_wire.RESET_MSG], req_envelope=True)[1] == upstream_wire.RESP_ERR
            assert [client.lookup(f"after{i}", 4 * 16 + 1, h).hit_length for i, h in enumerate(prompts)] == [64] * 3
        finally:
            client.close()
        assert server.stats.answered_by_status["refused"] == 3
    with LookupServer(prefix_index) as ipc:  # the same client over IPC may wipe the store
        client = LookupClient(cfg, make_transport(cfg, ipc.address))
        try:
            assert client.reset()
            assert client.lookup("wiped", 4 * 16 + 1, prompts[0]).hit_length == 0
        finally:
            client.close()


def test_vllm_lookup_channel_lives_in_a_private_folder(mooncake_master, rpc_base_path) -> None:
    with ServerProcess("upstream", mooncake_master.rpc_address, namespace="sec", rpc_port=4242,
                       rpc_base_path=rpc_base_path, standby=False) as server:
        path = server.address.removeprefix("ipc://")
        assert os.path.dirname(path) == rpc_base_path
        assert stat.S_IMODE(os.stat(rpc_base_path).st_mode) == 0o700


@pytest.fixture(scope="module")
def served(mooncake_master: Any) -> Iterator[ServerProcess]:
    with ServerProcess("pipelined", mooncake_master.rpc_address, namespace=f"sec-{uuid.uuid4().hex[:8]}",
                       standby=False) as server:
        yield server


def _ask(address: str, frames: list[bytes], req_envelope: bool = False) -> list[bytes]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(([b""] if req_envelope else []) + frames)
        assert sock.poll(10_000, zmq.POLLIN), "no reply"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)
        ctx.term()


def test_hash_count_and_size_limits_are_enforced(served: ServerProcess) -> None:
    header = _enc.encode(protocol.Header(protocol.VERSION, 5, protocol.OP_LOOKUP))
    too_many = _enc.encode([protocol.Query(1, 10, 1, b"h" * (protocol.MAX_HASHES + 1))])
    reply = protocol.decode_reply(_ask(served.address, [header, too_many])[0])
    assert reply.status == protocol.BAD_REQUEST and str(protocol.MAX_HASHES) in reply.reason
    too_long = _enc.encode([protocol.Query(1, 10, protocol.MAX_HASH_BYTES + 1, b"h" * (protocol.MAX_HASH_BYTES + 1))])
    reply = protocol.decode_reply(_ask(served.address, [header, too_long])[0])
    assert reply.status == protocol.BAD_REQUEST
    # vLLM's format: the same hash-count limit, answered with its error byte.
    frames = upstream_wire.encode_lookup(10, [b"h"] * (protocol.MAX_HASHES + 1))
    assert _ask(served.address, frames, req_envelope=True)[1] == upstream_wire.RESP_ERR


def test_a_message_over_the_hard_limit_is_dropped_and_the_server_goes_on(served: ServerProcess) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(served.address)
        header = _enc.encode(protocol.Header(protocol.VERSION, 6, protocol.OP_LOOKUP))
        sock.send_multipart([header, b"\x00" * (HARD_MAX_MESSAGE_BYTES + 1)])
        assert not sock.poll(500, zmq.POLLIN), "a message over ZMQ's limit should be dropped, not read"
    finally:
        sock.close(linger=0)
        ctx.term()
    assert served.running
    hashes = unique_hashes(2, seed=3)
    (result,) = protocol.decode_reply(_ask(served.address, protocol.encode_lookup(7, 33, hashes))[0]).results
    assert result.lookup_id == 7 and result.status in (protocol.OK, protocol.MISS)


def test_no_raw_request_id_in_metric_labels(served: ServerProcess) -> None:
    registry = CollectorRegistry()
    cfg = LookupConfig(lookup_timeout_ms=500, lookup_transport="pipelined")
    sink = PrometheusSink(cfg, registry)
    client = LookupClient(cfg, PipelinedTransport(served.address, timeout_s=cfg.timeout_s), observer=sink)
    secret = f"req-secret-{uuid.uuid4().hex}"
    try:
        for i in range(20):
            client.lookup(f"{secret}-{i}", 33, unique_hashes(2, seed=i), non_block=(i % 2 == 0))
        client.discard(f"{secret}-0")
        client.observers.scheduler_call("sync", 0.001)
    finally:
        client.close()
    text = generate_latest(registry).decode()
    assert "req-secret" not in text and secret not in text
    allowed = {label for spec in catalogue.CATALOGUE for label in spec.labels} | {"le"}
    for family in registry.collect():
        for sample in family.samples:
            assert set(sample.labels) <= allowed, (sample.name, sample.labels)


def test_server_metrics_carry_no_request_id(serve) -> None:
    s = serve("--tcp-port", "0", "--metrics-port", "0")
    metrics = s.wait_for("metrics on ")
    address = s.wait_for("listening on ")
    secret = f"req-secret-{uuid.uuid4().hex}"
    cfg = LookupConfig(lookup_timeout_ms=2000, lookup_transport="pipelined")
    client = LookupClient(cfg, PipelinedTransport(address, timeout_s=cfg.timeout_s))
    try:
        for i in range(10):
            client.lookup(f"{secret}-{i}", 33, unique_hashes(2, seed=i))
    finally:
        client.close()
    with urllib.request.urlopen(metrics, timeout=5) as resp:
        text = resp.read().decode()
    assert catalogue.SERVER_REQUESTS.name in text and "req-secret" not in text
