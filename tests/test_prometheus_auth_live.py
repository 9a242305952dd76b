"""``size`` and ``advise`` reach a Prometheus that requires authentication, as a production one does.

On 127.0.0.1: a Mooncake master, our lookup server in a process of its own, our client with the Prometheus sink on
an endpoint of its own, and a real ``prometheus`` scraping both, whose own web server (``--web.config.file``)
requires HTTPS with a certificate from a CA made here (``openssl``), a client certificate from that CA (mutual
TLS), and basic auth (a bcrypt hash, from the C library's ``crypt``). The tools run as users run them (the console
script) with the flags of :mod:`mooncake_lookout.connector.cli.prom_http`; each missing piece is named.

Prometheus cannot require a bearer token or a tenant header itself: :class:`TenantGateway`, a small real reverse
proxy in this test, stands in for Mimir's (or a Thanos/OAuth) gateway in front of it. It admits a request only with
``Authorization: Bearer <token>`` and ``X-Scope-OrgID: <tenant>`` (else 401, as Mimir answers ``no org id``) and
forwards it to the Prometheus above with the gateway's own credentials.

Every wait is bounded; every process is stopped by pid, the proxy's thread is joined.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.processes import stop_process
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.metrics import catalogue as cat

from live_stack import Prometheus  # noqa: E402 - dashboards/ is on sys.path (conftest)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
USER, PASSWORD = "ops", "s3cret-pass"
TOKEN, TENANT = "gateway-token-123", "team-a"
SCRAPED_TIMEOUT_S = 30.0
TWO_HALVES = (120, 120)  # lookups before and after Prometheus' first sample: increase() needs both


def _openssl(workdir: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True, timeout=60)


def _make_pki(workdir: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it (EC P-256, 1 day)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(workdir, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=lookout test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (workdir / f"{name}.ext").write_text(ext)
        _openssl(workdir, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        _openssl(workdir, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")


def _bcrypt(password: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # crypt: deprecated in 3.11, the C library's bcrypt
        import crypt

    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    assert hashed and hashed.startswith("$2"), "the C library has no bcrypt"
    return hashed


class SecuredPrometheus(Prometheus):
    """A real ``prometheus`` whose web server requires TLS, a client certificate and basic auth."""

    def __init__(self, targets: dict[str, list[str]], workdir: Path, binary: str) -> None:
        super().__init__(targets, workdir, binary)
        self.url = f"https://127.0.0.1:{self.port}"
        (workdir / "web.yml").write_text(
            f"tls_server_config:\n  cert_file: {workdir / 'server.pem'}\n  key_file: {workdir / 'server.key'}\n"
            f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {workdir / 'ca.pem'}\n"
            f"basic_auth_users:\n  {USER}: '{_bcrypt(PASSWORD)}'\n")
        self.context = ssl.create_default_context(cafile=str(workdir / "ca.pem"))
        self.context.load_cert_chain(str(workdir / "client.pem"), str(workdir / "client.key"))
        self.auth = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """``GET path`` with the client certificate and basic auth: (status, body)."""
        request = urllib.request.Request(self.url + path, headers={"Authorization": self.auth, **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def api(self, path: str, **params: str) -> dict[str, Any]:
        return json.loads(self.get(f"/api/v1/{path}?{urllib.parse.urlencode(params)}")[1])

    def start(self, timeout_s: float = 30.0) -> SecuredPrometheus:
        log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             f"--web.config.file={self.workdir / 'web.yml'}"], stdout=log, stderr=subprocess.STDOUT)
        self.log = log
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                if self.get("/-/ready")[0] == 200:
                    return self
            time.sleep(0.1)  # poll interval, bounded by the deadline
        raise TimeoutError("prometheus did not become ready")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, timeout_s=10.0)
            self.log.close()
        self.proc = None


class TenantGateway(http.server.ThreadingHTTPServer):
    """Stands in for Mimir's gateway: a bearer token and ``X-Scope-OrgID`` in, the Prometheus' own TLS and basic
    auth out (a real HTTP server on 127.0.0.1, forwarding every admitted GET)."""

    def __init__(self, backend: SecuredPrometheus) -> None:
        self.backend = backend
        self.seen: list[dict[str, str]] = []
        super().__init__(("127.0.0.1", 0), _GatewayHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/prometheus"
        self.thread = threading.Thread(target=self.serve_forever, name="tenant-gateway", daemon=True)

    def __enter__(self) -> TenantGateway:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=10)


class _GatewayHandler(http.server.BaseHTTPRequestHandler):
    server: TenantGateway

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})  # names are case-insensitive
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, b"authentication required\n")
        if self.headers.get("X-Scope-OrgID") != TENANT:
            return self._answer(401, b"no org id\n")
        status, body = self.server.backend.get(self.path.removeprefix("/prometheus"))
        self._answer(status, body)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Stack:
    prom: SecuredPrometheus
    workdir: Path

    def tls(self, *, client_cert: bool = True) -> list[str]:
        flags = ["--prometheus", self.prom.url, "--prometheus-ca-file", str(self.workdir / "ca.pem")]
        if client_cert:
            flags += ["--prometheus-cert-file", str(self.workdir / "client.pem"),
                      "--prometheus-key-file", str(self.workdir / "client.key")]
        return flags

    def basic(self) -> list[str]:
        return ["--prometheus-user", USER, "--prometheus-password-file", str(self.workdir / "password")]


def _latest(prom: SecuredPrometheus, expr: str) -> float | None:
    result = prom.api("query", query=expr)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(prom: SecuredPrometheus, expr: str, value: float) -> None:
    deadline = time.monotonic() + SCRAPED_TIMEOUT_S
    while (seen := _latest(prom, expr)) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus holds {seen} for {expr}, the target serves {value}")
        time.sleep(0.5)  # half the scrape interval, bounded by the deadline


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prometheus_binary: str) -> Iterator[Stack]:
    """The deployment, scraped by the secured Prometheus, with 240 lookups in two halves it saw apart."""
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.events import ObserverSet
    from mooncake_lookout.connector.rigs.server_process import ServerProcess
    from mooncake_lookout.connector.server.prefix_index import PrefixIndex
    from mooncake_lookout.connector.server.store import open_writer_store
    from mooncake_lookout.connector.transport import make_transport
    from mooncake_lookout.metrics.exporter import new_registry, serve_metrics
    from mooncake_lookout.metrics.prometheus_sink import PrometheusSink

    workdir = tmp_path_factory.mktemp("secured-prometheus")
    _make_pki(workdir)
    (workdir / "password").write_text(PASSWORD + "\n")
    (workdir / "token").write_text(TOKEN + "\n")
    requests = shared_prefix_workload(sum(TWO_HALVES), num_prefixes=4, seed=11)
    with EmbeddedMaster(kv_lease_ttl_ms=10_000) as master, \
            ServerProcess("pipelined", master.rpc_address, namespace="auth-live", standby=False) as server:
        writer = open_writer_store(master.rpc_address)
        client = endpoint = prom = None
        try:
            PrefixIndex(writer, 16, namespace="auth-live").store_prefixes([r.block_hashes for r in requests[::2]])
            config = LookupConfig(lookup_async=False, lookup_transport="pipelined", lookup_timeout_ms=5000)
            registry = new_registry()
            client = LookupClient(config, make_transport(config, server.address),
                                  observer=ObserverSet([PrometheusSink(config, registry)]))
            endpoint = serve_metrics(0, registry=registry)
            prom = SecuredPrometheus({"engine": [f"127.0.0.1:{endpoint.port}"],
                                      "master": [f"127.0.0.1:{master.metrics_port}"]}, workdir, prometheus_binary)
            prom.start()
            _wait_for(prom, 'sum(up{job=~"engine|master"})', 2.0)
            done = 0
            for half in TWO_HALVES:
                for r in requests[done:done + half]:
                    assert client.lookup(r.req_id, r.num_tokens, list(r.block_hashes)) is not None
                    client.discard(r.req_id)
                    client.end_step()  # one scheduler step a lookup, as vLLM's scheduler ends each
                done += half
                _wait_for(prom, f"sum({cat.REQUESTS.sample_names[0]})", float(done))
            yield Stack(prom, workdir)
        finally:
            for stop in (prom.stop if prom else None, endpoint.stop if endpoint else None,
                         client.close if client else None, writer.close):
                if stop is not None:
                    stop()


def _tool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


SIZE = ("size", "--selector", '{job="engine"}', "--master-selector", '{job="master"}', "--window", "5m", "--json")
ADVISE = ("advise", "--selector", '{job="engine"}', "--window", "5m", "--json")


def test_size_and_advise_read_through_tls_client_certificates_and_basic_auth(stack: Stack) -> None:
    done = _tool(*SIZE, *stack.tls(), *stack.basic())
    assert done.returncode == 0, done.stderr
    live = json.loads(done.stdout)["live"]
    assert live["engines"] == 1 and live["lookups_per_s"] > 0 and live["master_calls_per_s"] > 0
    values = stack.workdir / "advised-values.yaml"
    advised = _tool(*ADVISE, *stack.tls(), *stack.basic(), "--write-values", str(values))
    assert advised.returncode == 0, advised.stderr
    answer = json.loads(advised.stdout)
    assert answer["in_force"]["mode"] == "sync" and answer["costs"]["lookups"] > 0
    assert {a["key"] for a in answer["advice"]} >= {"lookup_async", "lookup_timeout_ms"}
    # --write-values: the Helm values of the same advice, for `helm upgrade --reuse-values -f FILE`
    assert f"wrote the advised values to {values}" in advised.stderr
    written = yaml.safe_load(values.read_text())["engine"]["connector"]["lookup"]
    assert written == answer["kv_transfer_config"]["kv_connector_extra_config"]


@pytest.mark.parametrize("tool", [SIZE, ADVISE], ids=["size", "advise"])
def test_each_missing_piece_is_named(stack: Stack, tool: tuple[str, ...]) -> None:
    no_auth = _tool(*tool, *stack.tls())
    assert no_auth.returncode == 2 and "HTTP 401 Unauthorized: it requires authentication; give " \
                                      "--prometheus-bearer-token-file" in no_auth.stderr, no_auth.stderr
    (stack.workdir / "wrong").write_text("not-it")
    wrong = _tool(*tool, *stack.tls(), "--prometheus-user", USER, "--prometheus-password-file",
                  str(stack.workdir / "wrong"))
    assert wrong.returncode == 2 and "the credentials given were refused" in wrong.stderr, wrong.stderr
    no_ca = _tool(*tool, "--prometheus", stack.prom.url, *stack.basic())
    assert no_ca.returncode == 2 and "was not verified" in no_ca.stderr and "--prometheus-ca-file" in no_ca.stderr
    no_cert = _tool(*tool, *stack.tls(client_cert=False), *stack.basic())
    assert no_cert.returncode == 2 and "--prometheus-cert-file" in no_cert.stderr, no_cert.stderr


def test_insecure_skip_verify_reaches_it_without_the_ca(stack: Stack) -> None:
    flags = ["--prometheus", stack.prom.url, "--prometheus-insecure-skip-verify", "--prometheus-cert-file",
             str(stack.workdir / "client.pem"), "--prometheus-key-file", str(stack.workdir / "client.key")]
    done = _tool(*SIZE, *flags, *stack.basic())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["live"]["engines"] == 1


def test_a_bearer_token_and_a_tenant_header_through_a_gateway(stack: Stack) -> None:
    with TenantGateway(stack.prom) as gateway:
        token = ["--prometheus-bearer-token-file", str(stack.workdir / "token")]
        done = _tool(*SIZE, "--prometheus", gateway.url, *token, "--prometheus-header", f"X-Scope-OrgID: {TENANT}")
        no_tenant = _tool(*SIZE, "--prometheus", gateway.url, *token)
        advised = _tool(*ADVISE, "--prometheus", gateway.url, *token, "--prometheus-header",
                        f"X-Scope-OrgID: {TENANT}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["live"]["engines"] == 1
    assert {"authorization": f"Bearer {TOKEN}", "x-scope-orgid": TENANT}.items() <= gateway.seen[0].items()
    assert no_tenant.returncode == 2 and "HTTP 401 Unauthorized: the credentials given were refused" in \
        no_tenant.stderr and "X-Scope-OrgID" in no_tenant.stderr, no_tenant.stderr
    assert advised.returncode == 0 and json.loads(advised.stdout)["in_force"]["mode"] == "sync", advised.stderr
