"""How ``advise`` and ``size`` reach a Prometheus HTTP API as operators run it: behind authentication and TLS.

A production Prometheus (or a Thanos or Mimir query front end) is seldom open: it sits behind basic auth or a
bearer token, serves HTTPS with a private CA, sometimes wants a client certificate, and multi-tenant front ends
need a tenant header (``X-Scope-OrgID``). :func:`add_access_args` gives both tools the same flags,
:meth:`Access.from_args` reads them, and :class:`PromHTTP` makes the GETs with the standard library only (``ssl``,
``urllib``): no dependency is added to the package for it. Secrets are read from files (a Kubernetes secret or
service account token mounted as a file), never taken on the command line where ``ps`` shows them.

Every failure is a :class:`PrometheusError` with a one-line message that says what to give (401: credentials;
403: a tenant or a role; a certificate not verified: ``--prometheus-ca-file``).
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

_AUTH_HINT = ("give --prometheus-bearer-token-file FILE, or --prometheus-user USER with --prometheus-password-file "
              "FILE (and --prometheus-header 'X-Scope-OrgID: TENANT' for a Mimir/Thanos tenant)")


class PrometheusError(Exception):
    """Why a Prometheus could not be asked; ``code`` is the tools' exit code (2), the message one line."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _secret(path: str | None, what: str) -> str | None:
    """The first line of ``path`` (a mounted secret), or None without a path."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise PrometheusError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
    if not text:
        raise PrometheusError(f"the {what} file {path} is empty")
    return text


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or any(c in text for c in "\r\n"):
        raise PrometheusError(f"--prometheus-header must look like 'X-Scope-OrgID: tenant-1', got {text!r}")
    return name.strip(), value.strip()


@dataclass(frozen=True)
class Access:
    """Where a Prometheus is and how to get in: every field is a flag of :func:`add_access_args`."""

    url: str
    bearer_token_file: str | None = None
    user: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False
    headers: tuple[str, ...] = field(default_factory=tuple)  # "Name: value"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Access:
        """The access the parsed flags describe."""
        return cls(args.prometheus, args.prometheus_bearer_token_file, args.prometheus_user,
                   args.prometheus_password_file, args.prometheus_ca_file, args.prometheus_cert_file,
                   args.prometheus_key_file, args.prometheus_insecure_skip_verify, tuple(args.prometheus_header or ()))


def add_access_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """``--prometheus URL`` and how to reach it (authentication, TLS, headers), for ``advise`` and ``size``."""
    g = parser.add_argument_group("reaching Prometheus (or a Thanos/Mimir query front end)")
    g.add_argument("--prometheus", required=required, metavar="URL",
                   help="Prometheus base URL, e.g. http://127.0.0.1:9090 or https://mimir.example/prometheus")
    g.add_argument("--prometheus-bearer-token-file", metavar="FILE",
                   help="send 'Authorization: Bearer <the file's content>' (e.g. a service account token)")
    g.add_argument("--prometheus-user", metavar="USER", help="basic auth user (with --prometheus-password-file)")
    g.add_argument("--prometheus-password-file", metavar="FILE", help="basic auth password, read from FILE")
    g.add_argument("--prometheus-ca-file", metavar="FILE", help="CA bundle (PEM) that signed Prometheus' certificate "
                   "(default: the system's trust store)")
    g.add_argument("--prometheus-cert-file", metavar="FILE", help="client certificate (PEM) for mutual TLS")
    g.add_argument("--prometheus-key-file", metavar="FILE", help="its private key (PEM)")
    g.add_argument("--prometheus-insecure-skip-verify", action="store_true",
                   help="do not verify Prometheus' TLS certificate (a test setup only)")
    g.add_argument("--prometheus-header", action="append", metavar="'NAME: VALUE'",
                   help="an extra header on every request, e.g. 'X-Scope-OrgID: tenant-1' (repeatable)")


class PromHTTP:
    """GETs against one Prometheus with the credentials, TLS settings and headers of an :class:`Access`."""

    def __init__(self, access: Access, timeout_s: float = 10.0) -> None:
        self.url = access.url.rstrip("/")
        self.timeout_s = timeout_s
        if not self.url.startswith(("http://", "https://")):
            raise PrometheusError(f"--prometheus must be an http:// or https:// URL, got {access.url!r}")
        self.headers = dict(_header(h) for h in access.headers)
        token = _secret(access.bearer_token_file, "bearer token")
        password = _secret(access.password_file, "password")
        if token and access.user:
            raise PrometheusError("give either a bearer token or basic auth (--prometheus-user), not both")
        if (password is None) != (access.user is None):
            raise PrometheusError("basic auth needs both --prometheus-user and --prometheus-password-file")
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        elif access.user is not None and password is not None:
            pair = base64.b64encode(f"{access.user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {pair}"
        self.context = self._tls(access) if self.url.startswith("https://") else None

    @staticmethod
    def _tls(access: Access) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=access.ca_file)
            if access.cert_file:
                context.load_cert_chain(access.cert_file, access.key_file)
        except (OSError, ssl.SSLError) as e:
            raise PrometheusError(f"cannot load the TLS files ({e})") from None
        if access.insecure_skip_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def get_json(self, path: str, params: dict[str, str]) -> Any:
        """``GET url/path?params`` as JSON. A Prometheus error body (HTTP 400/422/503 with ``error``) is returned;
        anything else that is not a JSON answer is a :class:`PrometheusError`."""
        request = urllib.request.Request(f"{self.url}{path}?{urllib.parse.urlencode(params)}", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as e:
            body = _json_or_none(e.read())
            if isinstance(body, dict) and "error" in body:
                return body
            raise PrometheusError(self._refused(e.code, path)) from None
        except urllib.error.URLError as e:
            raise PrometheusError(self._unreachable(e.reason)) from None
        except OSError as e:
            raise PrometheusError(self._unreachable(e)) from None
        body = _json_or_none(raw)
        if body is None:
            raise PrometheusError(f"{self.url}{path} did not answer JSON: is it a Prometheus server?")
        return body

    def _refused(self, status: int, path: str) -> str:
        if status == 401:
            sent = "the credentials given were refused" if "Authorization" in self.headers else \
                "it requires authentication"
            return f"Prometheus at {self.url} answered HTTP 401 Unauthorized: {sent}; {_AUTH_HINT}"
        if status == 403:
            return (f"Prometheus at {self.url} answered HTTP 403 Forbidden: these credentials may not query it "
                    "(a tenant header such as --prometheus-header 'X-Scope-OrgID: TENANT', or a role)")
        return (f"{self.url} answered HTTP {status} to {path}: is it a Prometheus server (its base URL, e.g. "
                "http://prometheus:9090)?")

    def _unreachable(self, reason: object) -> str:
        if isinstance(reason, ssl.SSLCertVerificationError):
            return (f"the TLS certificate of {self.url} was not verified ({reason.verify_message}): give "
                    "--prometheus-ca-file with the CA that signed it (or --prometheus-insecure-skip-verify)")
        if isinstance(reason, ssl.SSLError):
            return (f"TLS with {self.url} failed ({reason}): a server that wants a client certificate needs "
                    "--prometheus-cert-file and --prometheus-key-file")
        return f"cannot reach Prometheus at {self.url}: {reason}"


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


__all__ = ["Access", "PromHTTP", "PrometheusError", "add_access_args"]
