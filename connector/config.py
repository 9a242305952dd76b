"""The lookup path's configuration: every key, its default and its check live here and nowhere else.

Keys come from vLLM's ``kv_connector_extra_config``. Keys starting with ``lookup_`` belong to us and
must be known; any other key belongs to upstream's connector and passes through untouched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

PREFIX = "lookup_"
TRANSPORTS = ("upstream", "pipelined")
# Upstream's own lookup_* key (vLLM 0.33): it names the IPC path of the lookup channel.
UPSTREAM_KEYS = frozenset({"lookup_rpc_port"})


class ConfigError(ValueError):
    """A key in ``kv_connector_extra_config`` is unknown or has a bad value; the message names it."""


@dataclass(frozen=True)
class Key:
    """One configuration key: its default, a one-line meaning and the check its value must pass."""

    name: str
    default: Any
    kind: type
    doc: str
    check: Callable[[Any], bool] = lambda v: True
    rule: str = ""


KEYS: tuple[Key, ...] = (
    Key("lookup_async", False, bool,
        "upstream's switch: defer with `None` instead of blocking the scheduler"),
    Key("lookup_wait_us", 0, int,
        "in async mode, how long the scheduler may wait for pending answers before deferring, per step "
        "(shared by all lookup calls of one scheduling step)",
        lambda v: 0 <= v <= 100_000, "0..100000"),
    Key("lookup_timeout_ms", 100.0, float,
        "deadline of one lookup (queue + send + receive); then a miss, counted as a timeout",
        lambda v: 0 < v <= 60_000, "> 0 and <= 60000"),
    Key("lookup_max_pending", 1024, int,
        "lookups in flight or waiting; past it, an immediate miss, counted as rejected",
        lambda v: 1 <= v <= 1_000_000, "1..1000000"),
    Key("lookup_breaker_failures", 5, int,
        "consecutive failures (timeouts, errors) that open the circuit breaker",
        lambda v: 1 <= v <= 10_000, "1..10000"),
    Key("lookup_breaker_cooldown_s", 5.0, float,
        "how long an open breaker answers misses at once before it lets one probe through",
        lambda v: 0 < v <= 3600, "> 0 and <= 3600"),
    Key("lookup_transport", "upstream", str,
        "`upstream` (vLLM's own lookup server, one lookup in flight) or `pipelined` (ours, many in flight)",
        lambda v: v in TRANSPORTS, " or ".join(TRANSPORTS)),
    Key("lookup_on_admission", True, bool,
        "start the lookup when the request arrives (`on_new_request`), not at its first scheduling"),
    Key("lookup_server_address", "", str,
        "pipelined transport: ZMQ address of the lookup server; empty derives a private IPC path "
        "from vLLM's config", lambda v: v == "" or v.startswith(("ipc://", "tcp://")), "'', ipc://... or tcp://..."),
)
KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}


def _coerce(key: Key, value: Any) -> Any:
    """Accept JSON-ish values (ints for floats, no strings for numbers, real bools only)."""
    if key.kind is bool:
        if isinstance(value, bool):
            return value
    elif key.kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif key.kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif key.kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(
        f"kv_connector_extra_config[{key.name!r}] must be {key.kind.__name__}, got {value!r}"
    )


@dataclass(frozen=True)
class LookupConfig:
    """Validated lookup settings; build it with :meth:`from_extra_config`, never by hand in production."""

    lookup_async: bool = False
    lookup_wait_us: int = 0
    lookup_timeout_ms: float = 100.0
    lookup_max_pending: int = 1024
    lookup_breaker_failures: int = 5
    lookup_breaker_cooldown_s: float = 5.0
    lookup_transport: str = "upstream"
    lookup_on_admission: bool = True
    lookup_server_address: str = ""

    def __post_init__(self) -> None:
        for key in KEYS:
            value = _coerce(key, getattr(self, key.name))
            if not key.check(value):
                raise ConfigError(
                    f"kv_connector_extra_config[{key.name!r}] = {value!r} is out of range ({key.rule})"
                )
            object.__setattr__(self, key.name, value)

    @property
    def timeout_s(self) -> float:
        """The deadline of one lookup, in seconds."""
        return self.lookup_timeout_ms / 1000.0

    @property
    def wait_s(self) -> float:
        """The async wait budget, in seconds."""
        return self.lookup_wait_us / 1e6

    @property
    def mode(self) -> str:
        """``sync``, ``async`` or ``budget`` (async with a wait budget): the ``mode`` label of metrics."""
        if not self.lookup_async:
            return "sync"
        return "budget" if self.lookup_wait_us > 0 else "async"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "LookupConfig":
        """Parse our keys out of ``kv_connector_extra_config``; unknown ``lookup_*`` keys fail, naming the key."""
        ours: dict[str, Any] = {}
        for name, value in (extra or {}).items():
            if not name.startswith(PREFIX) or name in UPSTREAM_KEYS:
                continue
            if name not in KEYS_BY_NAME:
                known = ", ".join(sorted(KEYS_BY_NAME))
                raise ConfigError(
                    f"unknown key kv_connector_extra_config[{name!r}]; known lookup keys: {known}"
                )
            ours[name] = value
        return cls(**ours)

    def as_extra_config(self) -> dict[str, Any]:
        """The settings as ``kv_connector_extra_config`` entries (round-trips through :meth:`from_extra_config`)."""
        return dataclasses.asdict(self)


def render_config_table() -> str:
    """The README's configuration table, rendered from :data:`KEYS` (a test keeps the README in step)."""
    rows = ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    for k in KEYS:
        default = "`" + (repr(k.default) if k.kind is str else str(k.default).lower() if k.kind is bool
                         else str(k.default)) + "`"
        allowed = k.rule or k.kind.__name__
        rows.append(f"| `{k.name}` | {default} | {allowed} | {k.doc} |")
    return "\n".join(rows)


# The dataclass fields and KEYS must agree; fail at import, not in production.
assert [f.name for f in dataclasses.fields(LookupConfig)] == [k.name for k in KEYS]
assert all(f.default == KEYS_BY_NAME[f.name].default for f in dataclasses.fields(LookupConfig))

__all__ = ["ConfigError", "KEYS", "KEYS_BY_NAME", "Key", "LookupConfig", "TRANSPORTS", "render_config_table"]
