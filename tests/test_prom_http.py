"""The access flags of ``advise`` and ``size`` (connector/cli/prom_http.py) refuse what cannot work before any
request, in one line naming the flag: the live behaviour against a real secured Prometheus is in
tests/test_prometheus_auth_live.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.cli.prom_http import Access, PrometheusError, PromHTTP

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"


@pytest.fixture
def token(tmp_path: Path) -> str:
    (tmp_path / "token").write_text("abc\n")
    return str(tmp_path / "token")


def test_a_token_and_basic_auth_are_sent_as_headers(token: str, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("secret\n")
    assert PromHTTP(Access("http://p:9090", bearer_token_file=token)).headers["Authorization"] == "Bearer abc"
    basic = PromHTTP(Access("http://p:9090", user="ops", password_file=str(tmp_path / "pw")))
    assert basic.headers["Authorization"] == "Basic b3BzOnNlY3JldA=="  # base64 of ops:secret
    tenant = PromHTTP(Access("https://p/prometheus", headers=("X-Scope-OrgID: team-a",)))
    assert tenant.headers == {"X-Scope-OrgID": "team-a"} and tenant.context is not None


@pytest.mark.parametrize("access,words", [
    (Access("prometheus:9090"), "must be an http:// or https:// URL"),
    (Access("http://p", user="ops"), "needs both --prometheus-user and --prometheus-password-file"),
    (Access("http://p", bearer_token_file="/nonexistent/token"), "cannot read the bearer token file /nonexistent"),
    (Access("http://p", headers=("X-Scope-OrgID=team-a",)), "--prometheus-header must look like"),
    (Access("https://p", ca_file="/nonexistent/ca.pem"), "cannot load the TLS files"),
])
def test_what_cannot_work_is_refused_naming_the_flag(access: Access, words: str) -> None:
    with pytest.raises(PrometheusError, match=words.replace(".", r"\.")):
        PromHTTP(access)


def test_a_token_and_a_user_together_are_refused(token: str, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("x")
    with pytest.raises(PrometheusError, match="either a bearer token or basic auth"):
        PromHTTP(Access("http://p", bearer_token_file=token, user="ops", password_file=str(tmp_path / "pw")))


def test_the_console_script_says_it_in_one_line_and_exits_2(token: str) -> None:
    for tool in (["advise"], ["size"]):
        done = subprocess.run([str(SCRIPT), *tool, "--prometheus", "http://127.0.0.1:1", "--prometheus-header", "bad"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--prometheus-header must look like" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
