"""``mooncake-lookout doctor``: probe a deployment and say what is wrong, in plain words.

Checks, each reported ``ok`` or ``FAIL`` with the reason and what to do:

* ``--config``: a ``kv_connector_extra_config``, or a whole ``--kv-transfer-config`` as ``vllm serve`` takes it
  (JSON text, or ``@file``), validated by :class:`LookupConfig` exactly as the connector will at start-up; a
  whole one must name our connector (``kv_connector``, ``kv_connector_module_path``);
* an ``ipc://`` address whose socket does not exist is named as such before any probe;
* ``--server``: the lookup server answers lookups in each wire format (``upstream``: vLLM 0.33's
  ``LookupKeyServer`` format, ``pipelined``: ours) within the deadline; the round-trip latency of
  ``--samples`` probe lookups (a cold prefix: a miss is the expected answer, an error is not). With the
  ``lookup_curve_*`` keys of ``--config``, the pipelined probe uses CURVE; a refused handshake is named;
* ``--master-metrics``: the Mooncake master's ``/health`` and ``/metrics`` (keys, clients, failures);
* ``--master``: the master's key lease covers ``lookup_answer_ttl_ms`` (of ``--config``, else the default) and
  the load's margin, as the lookup server's probe checks it (server/lease.py): a FAIL line names the key, about
  how long the lease is, and the rule. Takes up to the window and its margin (6 s by default); the probe puts
  one key, so the store needs memory lent to it.

Exit code 0 when every check passed, 1 when one failed, 2 when there was nothing to check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from mooncake_lookout.connector.config import ConfigError, LookupConfig
from mooncake_lookout.connector.plugin import CONNECTOR_NAME, MODULE_PATH
from mooncake_lookout.connector.transport.names import TRANSPORTS, UPSTREAM

MASTER_SERIES = ("master_key_count", "master_active_clients", "master_batch_exist_key_requests_total",
                 "master_batch_exist_key_failures_total")


@dataclass(frozen=True)
class Finding:
    """One check's verdict."""

    check: str
    ok: bool
    detail: str

    def line(self) -> str:
        """The finding as one report line."""
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.check}: {self.detail}"


# Keys that make a JSON object a whole --kv-transfer-config rather than its kv_connector_extra_config.
TRANSFER_KEYS = ("kv_connector", "kv_connector_extra_config", "kv_connector_module_path", "kv_role")


def _read_json(text: str) -> Any:
    """``text`` (or the file ``@path``) as JSON; a pasted ``--kv-transfer-config '...'`` loses its flag."""
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    text = text.strip()
    if text.startswith("--kv-transfer-config"):
        text = text[len("--kv-transfer-config"):].lstrip(" =").strip().strip("'")
    return json.loads(text)


def _extra_of(given: dict[str, Any]) -> tuple[Any, str]:
    """The ``kv_connector_extra_config`` of ``given`` and where it was found; ConfigError when a whole
    ``--kv-transfer-config`` would not load our connector."""
    if not any(k in given for k in TRANSFER_KEYS):
        return given, ""
    connector, module = given.get("kv_connector"), given.get("kv_connector_module_path")
    if connector is not None and connector != CONNECTOR_NAME:
        raise ConfigError(f"kv_connector is {connector!r}: vLLM would load that connector, not mooncake-lookout's "
                          f"(kv_connector: {CONNECTOR_NAME!r}), and no lookup_* key would be used")
    if module is not None and module != MODULE_PATH:
        raise ConfigError(f"kv_connector_module_path is {module!r}; mooncake-lookout's connector is {MODULE_PATH!r}")
    return given.get("kv_connector_extra_config", {}), "the --kv-transfer-config's kv_connector_extra_config: "


def check_config(text: str) -> tuple[Finding, LookupConfig | None]:
    """Validate a ``kv_connector_extra_config`` or a whole ``--kv-transfer-config`` given as JSON text (or
    ``@path`` to a JSON file): the inner ``kv_connector_extra_config`` of a whole one."""
    try:
        given = _read_json(text)
    except (OSError, json.JSONDecodeError) as exc:
        return Finding("config", False, f"cannot read the JSON: {exc}"), None
    if not isinstance(given, dict):
        return Finding("config", False, "kv_connector_extra_config must be a JSON object"), None
    try:
        extra, where = _extra_of(given)
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {extra!r}")
        config = LookupConfig.from_extra_config(extra)
    except ConfigError as exc:
        return Finding("config", False, str(exc)), None
    wait = config.lookup_wait_us if isinstance(config.lookup_wait_us, str) else f"{config.lookup_wait_us} us"
    return Finding("config", True, f"{where}valid; mode {config.mode}, transport {config.lookup_transport}, "
                                   f"deadline {config.lookup_timeout_ms:g} ms, wait {wait}"), config


def check_ipc_path(address: str) -> Finding | None:
    """A finding when ``address`` is an ``ipc://`` socket that is not there (None otherwise): a probe would only
    say that nothing answers."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):]
    folder = os.path.dirname(path) or "."
    check = "server address"
    if "*" in path or "?" in path:
        return Finding(check, False, f"{path} is a shell pattern that matched no socket: no lookup server has bound "
                                     "one there (is the engine up, on this host or pod, and VLLM_RPC_BASE_PATH/TMPDIR "
                                     "the engine's?)")
    if not os.path.isdir(folder):
        return Finding(check, False, f"the socket's folder {folder} does not exist: no lookup server runs with it "
                                     "on this host (check the path, and that this is the engine's host or pod)")
    if not os.access(folder, os.X_OK):
        return Finding(check, False, f"the socket's folder {folder} is not open to this user (uid {os.getuid()}): "
                                     "run doctor as the engine's user")
    if not os.path.exists(path):
        return Finding(check, False, f"the socket {path} does not exist: no lookup server has bound it (is the "
                                     "engine running, and is this its address?)")
    return None


class TransportNotes(logging.Handler):
    """Holds what the transports log during a probe, so the report says it once, in its verdict.

    A probe of a silent server makes the client rebuild its socket (as it would inside vLLM) and log it; here
    those lines would only repeat the verdict, out of order (stderr before stdout). They become a count in the
    finding, and any other transport warning is quoted in it."""

    LOGGER = "mooncake_lookout.connector.transport"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.rebuilds = 0
        self.other: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "rebuilding the socket" in message:
            self.rebuilds += 1
        elif message not in self.other:
            self.other.append(message)

    @contextlib.contextmanager
    def held(self) -> Iterator[TransportNotes]:
        """Collect the transports' lines in the block instead of printing them."""
        logger = logging.getLogger(self.LOGGER)
        saved = logger.propagate
        logger.addHandler(self)
        logger.propagate = False
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.propagate = saved

    def suffix(self) -> str:
        """What to add to a finding's detail: the rebuilds (when any) and the other lines, quoted."""
        times = "once" if self.rebuilds == 1 else f"{self.rebuilds} times"
        out = f"; the probe's socket was rebuilt {times}, as the connector does after a silent deadline" \
            if self.rebuilds else ""
        return out + "".join(f"; the transport logged: {m}" for m in self.other)


def probe_server(address: str, wire: str, *, samples: int = 20, timeout_ms: float = 500.0,
                 config: LookupConfig | None = None) -> Finding:
    """``samples`` blocking lookups of a cold prefix over ``wire``; latency, or why there was no answer.

    ``config``: the deployment's settings, for its CURVE keys (pipelined wire). What the transport logs meanwhile
    (socket rebuilds, malformed replies) is said in the finding, not printed apart (:class:`TransportNotes`)."""
    with TransportNotes().held() as notes:
        finding = _probe(address, wire, samples=samples, timeout_ms=timeout_ms, config=config)
    return Finding(finding.check, finding.ok, finding.detail + notes.suffix())


def _probe(address: str, wire: str, *, samples: int, timeout_ms: float, config: LookupConfig | None) -> Finding:
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.events import Outcome, OutcomeCounter
    from mooncake_lookout.connector.rigs.workload import unique_hashes
    from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
    from mooncake_lookout.connector.transport.upstream import UpstreamTransport

    probe = LookupConfig(lookup_transport=wire, lookup_timeout_ms=timeout_ms, lookup_breaker_failures=10_000)
    counter = OutcomeCounter()
    try:
        if wire == UPSTREAM:
            transport: Any = UpstreamTransport(address)
        else:  # watch the handshake even without CURVE: a CURVE server is then named as the reason
            curve = config.client_curve() if config is not None else None
            transport = PipelinedTransport(address, timeout_s=probe.timeout_s, curve=curve, watch_handshakes=True)
        client = LookupClient(probe, transport, observer=counter)
    except Exception as exc:  # a malformed address fails here (ZMQ refuses it)
        return Finding(f"server {wire} wire", False, f"cannot connect to {address!r}: {exc}")
    hashes = unique_hashes(4, seed=0x0D0C)
    try:
        for i in range(samples):
            client.lookup(f"doctor-{i}", 4 * 16 + 1, hashes, non_block=False)
            client.discard(f"doctor-{i}")
            if counter.count(Outcome.TIMEOUT) and i == 0:
                break  # no answer at all: one deadline is enough to say so
    finally:
        client.close()
    answered = [r for r in counter.records if r.outcome in (Outcome.HIT, Outcome.MISS)]
    errors = [r for r in counter.records if r.outcome == Outcome.ERROR]
    check = f"server {wire} wire"
    if answered:
        rtts = [r.rpc_seconds * 1e6 for r in answered if r.rpc_seconds is not None]
        timeouts = counter.count(Outcome.TIMEOUT)
        detail = (f"{len(answered)}/{len(counter.records)} answered; round trip p50 {statistics.median(rtts):.0f} us, "
                  f"max {max(rtts):.0f} us")
        if timeouts:
            return Finding(check, False, detail + f"; {timeouts} timed out after {timeout_ms:g} ms: the server or "
                                                  "its store is overloaded or stalling")
        return Finding(check, True, detail)
    if errors:
        return Finding(check, False, f"the server answered with errors ({errors[0].error}): its Mooncake store "
                                     "fails; check the master (--master-metrics) and the server's log")
    hint = ("nothing answers there: is the lookup server running and is the address right?" if wire == UPSTREAM
            else "no pipelined answer: vLLM's own LookupKeyServer speaks only the upstream wire (then use "
                 "lookup_transport=upstream), or nothing listens there")
    diagnosis = getattr(transport, "diagnosis", None)
    if diagnosis:
        hint = diagnosis
    return Finding(check, False, f"no answer within {timeout_ms:g} ms at {address}; {hint}")


def check_master(url: str, timeout_s: float = 2.0) -> list[Finding]:
    """The master's ``/health`` and the figures of its ``/metrics`` (``url``: ``http://HOST:PORT``)."""
    from mooncake_lookout.metrics.exporter import sum_samples

    base = url.rstrip("/")
    out = []
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout_s) as resp:
            out.append(Finding("master /health", resp.status == 200, f"HTTP {resp.status}"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return [Finding("master /health", False, f"{base}/health unreachable ({exc}); is mooncake_master running "
                                                 "with --metrics_host/--metrics_port on that address?")]
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
        values = sum_samples(text, MASTER_SERIES)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return out + [Finding("master /metrics", False, f"cannot read or parse {base}/metrics: {exc}")]
    shown = ", ".join(f"{k.removeprefix('master_')}={v:g}" for k, v in values.items()) or "no master_* series"
    failures = values.get("master_batch_exist_key_failures_total", 0.0)
    ok = "master_key_count" in values and failures == 0
    detail = shown + ("" if failures == 0 else "; existence checks have failed: see the master's log")
    return out + [Finding("master /metrics", ok, detail)]


def check_master_lease(address: str, ttl_s: float) -> Finding:
    """Does the key lease of the master at ``address`` (``host:port``) cover a trust window of ``ttl_s``?"""
    from mooncake_lookout.connector.server.lease import LeaseTooShort, check_lease, probe_window_s
    from mooncake_lookout.connector.server.store import MARKER_LOCAL_BUFFER, MasterError, open_store

    check = "master lease"
    try:
        store = open_store(address, local_buffer_size=MARKER_LOCAL_BUFFER, setup_retries=1, rpc_timeout_ms=5000)
    except MasterError as exc:
        return Finding(check, False, str(exc))
    try:
        check_lease(store, "mooncake-lookout-doctor/", ttl_s)
    except LeaseTooShort as exc:
        return Finding(check, False, str(exc))
    except Exception as exc:  # noqa: BLE001 - the probe could not run: say why
        return Finding(check, False, f"the lease probe could not run ({exc}); is memory lent to the store (a "
                                     f"store pod, or an engine with a global segment)?")
    finally:
        store.close()
    return Finding(check, True, f"the key lease covers {probe_window_s(ttl_s) * 1000:g} ms: lookup_answer_ttl_ms "
                                f"({ttl_s * 1000:g} ms) and the load's margin")


def run_doctor(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the checks the arguments ask for, print one line each (to ``out``, default stdout); returns the exit code."""
    out = out if out is not None else sys.stdout
    findings: list[Finding] = []
    config = None
    if args.config is not None:
        finding, config = check_config(args.config)
        findings.append(finding)
    address = args.server or (config.lookup_server_address if config is not None else "")
    missing = check_ipc_path(address) if address else None
    if missing is not None:
        findings.append(missing)
    elif address:
        wires = [args.wire] if args.wire else list(TRANSPORTS)
        for wire in wires:
            findings.append(probe_server(address, wire, samples=args.samples, timeout_ms=args.timeout_ms,
                                         config=config))
    if args.master_metrics:
        findings += check_master(args.master_metrics)
    if args.master:
        ttl_s = (config if config is not None else LookupConfig()).answer_ttl_s
        findings.append(check_master_lease(args.master, ttl_s))
    if not findings:
        out.write("nothing to check: give --server, --master-metrics, --master and/or --config (see --help)\n")
        return 2
    for f in findings:
        out.write(f.line() + "\n")
    failed = [f for f in findings if not f.ok]
    out.write(f"{len(findings) - len(failed)} ok, {len(failed)} failed\n")
    return 1 if failed else 0


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``doctor`` subcommand; returns its parser."""
    p = subparsers.add_parser("doctor", help="probe a lookup server, a Mooncake master and a config",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--server", metavar="ADDRESS", help="lookup server: ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--wire", choices=TRANSPORTS, help="probe only this wire format (default: both)")
    p.add_argument("--master-metrics", metavar="URL", help="the master's HTTP base URL, e.g. http://127.0.0.1:9003")
    p.add_argument("--master", metavar="HOST:PORT",
                   help="the master's RPC address: check its key lease covers lookup_answer_ttl_ms (of --config)")
    p.add_argument("--config", metavar="JSON|@FILE",
                   help="kv_connector_extra_config, or a whole --kv-transfer-config, to validate")
    p.add_argument("--samples", type=int, default=20, help="probe lookups per wire format (default 20)")
    p.add_argument("--timeout-ms", type=float, default=500.0, help="deadline of one probe lookup (default 500)")
    p.set_defaults(func=run_doctor)
    return p


__all__ = ["Finding", "TRANSFER_KEYS", "TransportNotes", "add_doctor_parser", "check_config", "check_ipc_path",
           "check_master", "check_master_lease", "probe_server", "run_doctor"]
