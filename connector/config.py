"""The lookup path's configuration: every key, its default and its check live here and nowhere else.

Keys come from vLLM's ``kv_connector_extra_config``. Keys starting with ``lookup_`` belong to us and
must be known; any other key belongs to upstream's connector and passes through untouched.

Each key is declared once, as a field of :class:`LookupConfig` (its type, default, meaning, check and
the rule the check enforces); :data:`KEYS` is read off those fields, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from mooncake_lookout.connector.transport.names import PIPELINED, TRANSPORTS, UPSTREAM

PREFIX = "lookup_"
# Upstream's own lookup_* key (vLLM 0.33): it names the IPC path of the lookup channel.
UPSTREAM_KEYS = frozenset({"lookup_rpc_port"})
_META = "lookout_key"  # where a field keeps its meaning, check and rule (dataclasses field metadata)

_T = TypeVar("_T")


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


def _key(default: _T, doc: str, check: Callable[[Any], bool] = lambda v: True, rule: str = "") -> _T:
    """A :class:`LookupConfig` field: its default, meaning, check and the rule the check enforces."""
    info = {"doc": doc, "check": check, "rule": rule}
    return dataclasses.field(default=default, metadata={_META: info})


def _coerce(key: Key, value: Any) -> Any:
    """Accept JSON-ish values (ints for floats, no strings for numbers, real bools only)."""
    if key.kind is bool and isinstance(value, bool):
        return value
    if key.kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if key.kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if key.kind is str and isinstance(value, str):
        return value
    raise ConfigError(
        f"kv_connector_extra_config[{key.name!r}] must be {key.kind.__name__}, got {value!r}"
    )


@dataclass(frozen=True)
class LookupConfig:
    """Validated lookup settings; build it with :meth:`from_extra_config`, never by hand in production."""

    lookup_async: bool = _key(
        False, "upstream's switch: defer with `None` instead of blocking the scheduler")
    lookup_wait_us: int = _key(
        0, "in async mode, how long the scheduler may wait for pending answers before deferring, per step "
           "(shared by all lookup calls of one scheduling step)",
        lambda v: 0 <= v <= 100_000, "0..100000")
    lookup_timeout_ms: float = _key(
        100.0, "deadline of one lookup (queue + send + receive); then a miss, counted as a timeout",
        lambda v: 0 < v <= 60_000, "> 0 and <= 60000")
    lookup_max_pending: int = _key(
        1024, "lookups in flight or waiting; past it, an immediate miss, counted as rejected",
        lambda v: 1 <= v <= 1_000_000, "1..1000000")
    lookup_breaker_failures: int = _key(
        5, "consecutive failures (timeouts, errors) that open the circuit breaker",
        lambda v: 1 <= v <= 10_000, "1..10000")
    lookup_breaker_cooldown_s: float = _key(
        5.0, "how long an open breaker answers misses at once before it lets one probe through",
        lambda v: 0 < v <= 3600, "> 0 and <= 3600")
    lookup_transport: str = _key(
        UPSTREAM,
        f"`{UPSTREAM}` (vLLM's own lookup server, one lookup in flight) or `{PIPELINED}` (ours, many in flight)",
        lambda v: v in TRANSPORTS, " or ".join(TRANSPORTS))
    lookup_on_admission: bool = _key(
        True, "start the lookup when the request arrives (`on_new_request`), not at its first scheduling")
    lookup_server_address: str = _key(
        "", f"{PIPELINED} transport: ZMQ address of the lookup server; empty derives a private IPC path "
            "from vLLM's config",
        lambda v: v == "" or v.startswith(("ipc://", "tcp://")), "'', ipc://... or tcp://...")

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
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LookupConfig:
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


def _keys() -> tuple[Key, ...]:
    kinds = typing.get_type_hints(LookupConfig)
    return tuple(Key(f.name, f.default, kinds[f.name], **f.metadata[_META]) for f in dataclasses.fields(LookupConfig))


KEYS: tuple[Key, ...] = _keys()
KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}

__all__ = ["ConfigError", "KEYS", "KEYS_BY_NAME", "Key", "LookupConfig"]
