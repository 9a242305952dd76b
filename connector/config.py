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
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_lookout.connector.transport.names import PIPELINED, TRANSPORTS, UPSTREAM

if TYPE_CHECKING:
    from mooncake_lookout.connector.curve import ClientCurve, ServerCurve

PREFIX = "lookup_"
# Upstream's own lookup_* key (vLLM 0.33): it names the IPC path of the lookup channel.
UPSTREAM_KEYS = frozenset({"lookup_rpc_port"})
_META = "lookout_key"  # where a field keeps its meaning, check and rule (dataclasses field metadata)

_T = TypeVar("_T")
# What `auto` means (docs/tuning.md, "Deadlines", has the measurements behind them).
TIMEOUT_MS = 2000.0  # lookup_timeout_ms: an answer this late still beats a recompute; bounds memory and a dead server
SYNC_BLOCK_MS = 100.0  # lookup_block_ms: the longest one blocking call may stall the scheduler's step
_FILE_RULE = "'' or a zmq.auth certificate file"
# CURVE keys that only make sense together: the client's pair of files, the server's.
_CURVE_PAIRS = (("lookup_curve_server_public_key", "lookup_curve_client_secret_key"),
                ("lookup_curve_server_secret_key", "lookup_curve_allowed_clients"))


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
    words: tuple[str, ...] = ()  # strings accepted besides values of ``kind`` (``auto``)

    @property
    def accepts(self) -> str:
        """What the key accepts, in words, for error messages: ``an integer 0..100000 or auto``."""
        if self.kind is bool:
            return "true or false (a JSON boolean)"
        if self.kind is str:
            return self.rule or "a string"
        noun = "an integer" if self.kind is int else "a number"
        return f"{noun} {self.rule}" if self.rule else noun


def _key(default: _T, doc: str, check: Callable[[Any], bool] = lambda v: True, rule: str = "",
         words: tuple[str, ...] = ()) -> _T:
    """A :class:`LookupConfig` field: its default, meaning, check and the rule the check enforces."""
    info = {"doc": doc, "check": check, "rule": rule, "words": words}
    return dataclasses.field(default=default, metadata={_META: info})


def _coerce(key: Key, value: Any) -> Any:
    """Accept JSON-ish values (ints for floats, no strings for numbers, real bools only)."""
    if isinstance(value, str) and value in key.words:
        return value
    if key.kind is bool and isinstance(value, bool):
        return value
    if key.kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if key.kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if key.kind is str and isinstance(value, str):
        return value
    raise ConfigError(f"kv_connector_extra_config[{key.name!r}] must be {key.accepts}, got {value!r}")


def _checked(key: Key, value: Any) -> Any:
    """``value`` as ``key`` takes it, or :class:`ConfigError` naming the key and what it accepts."""
    value = _coerce(key, value)
    if not key.check(value):
        raise ConfigError(f"kv_connector_extra_config[{key.name!r}] = {value!r} is out of range: it must be "
                          f"{key.accepts}")
    return value


@dataclass(frozen=True)
class LookupConfig:
    """Validated lookup settings; build it with :meth:`from_extra_config`, never by hand in production."""

    lookup_async: bool = _key(
        False, "upstream's switch: defer with `None` instead of blocking the scheduler")
    lookup_wait_us: int | str = _key(
        0, "in async mode, how long the scheduler may wait for pending answers before deferring, per step "
           "(shared by all lookup calls of one step); `auto` follows the measured round trip, capped by "
           "`lookup_wait_auto_share` of the step interval",
        lambda v: v == "auto" or 0 <= v <= 100_000, "0..100000 or auto", words=("auto",))
    lookup_wait_auto_share: float = _key(
        0.25, "with `lookup_wait_us: auto`: the largest share of the measured step interval the scheduler may "
              "wait; past it, it defers at once",
        lambda v: 0 < v <= 0.9, "> 0 and <= 0.9")
    lookup_timeout_ms: float | str = _key(
        "auto", "deadline of one lookup, from when it is sent (time queued in the client is not the server's); "
                f"then a miss, counted as a timeout. `auto`: {TIMEOUT_MS:g} ms in either mode (it bounds memory and "
                "the wait for a dead server; a later answer still beats a recompute: docs/tuning.md)",
        lambda v: v == "auto" or 0 < v <= 60_000, "> 0 and <= 60000 or auto", words=("auto",))
    lookup_block_ms: float | str = _key(
        "auto", "blocking mode (`lookup_async: false`): the longest one scheduler call waits for its lookup; "
                "unanswered by then, the request is put off to a later step (vLLM's `None`, as in async mode) and "
                "its lookup runs on to `lookup_timeout_ms`, its later calls not waiting at all: a slow answer is "
                f"still a hit. `auto`: {SYNC_BLOCK_MS:g} ms with `lookup_timeout_ms: auto`; with a deadline set, "
                "that deadline (a call waits for its answer up to it, then a miss, as before this key)",
        lambda v: v == "auto" or 0 < v <= 60_000, "> 0 and <= 60000 or auto", words=("auto",))
    lookup_max_pending: int = _key(
        1024, "lookups queued or in flight; past it, an admission starts none and a non-blocking ask defers, "
              "a blocking ask gets an immediate miss counted as rejected",
        lambda v: 1 <= v <= 1_000_000, "1..1000000")
    lookup_max_held: int = _key(
        16384, "answers held for requests not yet allocated; past it the oldest is forgotten (asked again "
               "if needed)",
        lambda v: 1 <= v <= 10_000_000, "1..10000000")
    lookup_answer_ttl_ms: float = _key(
        5000.0, "how long a block found present is trusted, from the send of the store check that found it: a "
                "hit (fresh, held, or counting blocks the prefix cache knew) is served only while every block it "
                "counts is within it, else asked again; keep it at most half the master's `--default_kv_lease_ttl` "
                "(10 s by default): the rest of the lease is the load's margin (the lease probe refuses less "
                "than 1.2x)",
        lambda v: 0 < v <= 3_600_000, "> 0 and <= 3600000")
    lookup_prefix_cache_blocks: int = _key(
        131072, "block hashes the scheduler remembers as present in the store (each for at most "
                "`lookup_answer_ttl_ms` after the lookup that found it was sent, inside the master's lease), so "
                "a long prompt asks only for its new blocks; a found run keeps one in every 16 (and each of its last, "
                "partial 16), so the default covers up to about two million blocks; 0 turns the prefix cache off",
        lambda v: 0 <= v <= 100_000_000, "0..100000000")
    lookup_prefix_cache_confirm_ms: float = _key(
        0.0, "0: every lookup goes to the server, which asks the store only for blocks the prefix cache does not "
             "know (a wipe by any instance is always seen); > 0: a lookup the cache covers whole is answered "
             "with no round trip if the server confirmed the store's epoch within this many ms, at the price of "
             "that long a window after another instance's reset",
        lambda v: 0 <= v <= 60_000, "0..60000")
    lookup_reset_timeout_s: float = _key(
        60.0, "how long `reset` (vLLM's `reset_prefix_cache`) waits for the server to wipe the store",
        lambda v: 0 < v <= 3600, "> 0 and <= 3600")
    lookup_breaker_failures: int = _key(
        5, "failure events the circuit breaker needs before it opens: errors, and timeouts with no reply at all "
           "from the server since they were sent (a late reply proves it alive: slowness, not failure); lookups "
           "that failed together (one send, one frame, one poll) are one event. It opens when that many fall in "
           "`lookup_breaker_window_s` and make `lookup_breaker_failure_rate` of its events, or come in a row with "
           "nothing heard from the server between them",
        lambda v: 1 <= v <= 10_000, "1..10000")
    lookup_breaker_failure_rate: float = _key(
        0.5, "share of the window's events (a send's or a poll's lookups count once) that must be failures for the "
             "circuit breaker to open",
        lambda v: 0 < v <= 1, "> 0 and <= 1")
    lookup_breaker_window_s: float = _key(
        10.0, "the circuit breaker's window: failure and answered events older than this no longer count",
        lambda v: 0 < v <= 3600, "> 0 and <= 3600")
    lookup_breaker_cooldown_s: float = _key(
        5.0, "how long an open breaker answers misses at once before it lets one probe through",
        lambda v: 0 < v <= 3600, "> 0 and <= 3600")
    lookup_transport: str = _key(
        PIPELINED,
        f"`{PIPELINED}` (ours: a step's lookups in one frame, answered with one store call; the worker's "
        f"rank 0 serves it) or `{UPSTREAM}` (vLLM's own lookup server, one lookup in flight)",
        lambda v: v in TRANSPORTS, " or ".join(TRANSPORTS))
    lookup_on_admission: bool = _key(
        True, "start the lookup when the request arrives (`on_new_request`), not at its first scheduling")
    lookup_on_arrival: bool = _key(
        True, f"async lookups over `{PIPELINED}`: send the lookup from vLLM's input thread as the request is built "
              "(during the model step), so its answer is usually in by the first `schedule()` that sees it (with a "
              "wait budget too: the socket then lives on an I/O thread)")
    lookup_server_address: str = _key(
        "", f"{PIPELINED} transport: ZMQ address of the lookup server; empty derives a private IPC path "
            "from vLLM's config",
        lambda v: v == "" or (v.startswith(("ipc://", "tcp://")) and "\n" not in v),
        "'', ipc://... or tcp://..., one line")
    lookup_curve_server_public_key: str = _key(
        "", f"{PIPELINED} transport, client side: the lookup server's CURVE public key, a zmq.auth certificate file "
            "(`server.key`); with `lookup_curve_client_secret_key` the channel is encrypted and both ends "
            "authenticated (docs/security.md)", rule=_FILE_RULE)
    lookup_curve_client_secret_key: str = _key(
        "", "client side: this client's CURVE key pair, a zmq.auth secret certificate file (`client.key_secret`); "
            "its public key must be in the server's allow-list", rule=_FILE_RULE)
    lookup_curve_server_secret_key: str = _key(
        "", "server side (the worker's lookup server): its CURVE key pair (`server.key_secret`); with "
            "`lookup_curve_allowed_clients` the server admits only those clients", rule=_FILE_RULE)
    lookup_curve_allowed_clients: str = _key(
        "", "server side: the client public keys admitted, a directory of zmq.auth `*.key` files or one such file",
        rule="'' or a directory or file")

    def __post_init__(self) -> None:
        for key in KEYS:
            object.__setattr__(self, key.name, _checked(key, getattr(self, key.name)))
        if self.lookup_block_ms == "auto":  # resolved once: everything downstream reads a number
            block = SYNC_BLOCK_MS if self.lookup_timeout_ms == "auto" else float(self.lookup_timeout_ms)
            object.__setattr__(self, "lookup_block_ms", block)
        if self.lookup_timeout_ms == "auto":
            object.__setattr__(self, "lookup_timeout_ms", TIMEOUT_MS)
        self._check_curve()

    def _check_curve(self) -> None:
        """CURVE keys come in pairs per side, for the pipelined transport, from files that hold real keys."""
        from mooncake_lookout.connector.curve import CurveKeyError, load_allowed_keys, load_key_pair, load_public_key

        loaders = {"lookup_curve_server_public_key": load_public_key, "lookup_curve_client_secret_key": load_key_pair,
                   "lookup_curve_server_secret_key": load_key_pair, "lookup_curve_allowed_clients": load_allowed_keys}
        for name, load in loaders.items():
            path = getattr(self, name)
            if not path:
                continue
            if self.lookup_transport != PIPELINED:
                raise ConfigError(f"kv_connector_extra_config[{name!r}]: CURVE keys secure the {PIPELINED} "
                                  f"transport only (lookup_transport is {self.lookup_transport!r})")
            try:
                load(path)
            except (CurveKeyError, OSError, ValueError) as e:
                raise ConfigError(f"kv_connector_extra_config[{name!r}]: {e}") from None
        for pair in _CURVE_PAIRS:
            given = [name for name in pair if getattr(self, name)]
            if len(given) == 1:
                (missing,) = set(pair) - set(given)
                raise ConfigError(f"kv_connector_extra_config[{given[0]!r}] needs {missing!r} too (CURVE keys "
                                  "come in pairs: the peer's key and this end's)")

    def client_curve(self) -> ClientCurve | None:
        """The client's CURVE keys, read from their files (None: no CURVE)."""
        from mooncake_lookout.connector.curve import ClientCurve

        if not self.lookup_curve_client_secret_key:
            return None
        return ClientCurve.from_files(self.lookup_curve_server_public_key, self.lookup_curve_client_secret_key)

    def server_curve(self) -> ServerCurve | None:
        """The worker's lookup server's CURVE keys, read from their files (None: no CURVE)."""
        from mooncake_lookout.connector.curve import ServerCurve

        if not self.lookup_curve_server_secret_key:
            return None
        return ServerCurve.from_files(self.lookup_curve_server_secret_key, self.lookup_curve_allowed_clients)

    @property
    def timeout_s(self) -> float:
        """The deadline of one lookup, in seconds."""
        return float(self.lookup_timeout_ms) / 1000.0

    @property
    def block_s(self) -> float:
        """The longest one blocking call waits for its lookup, in seconds (never past the lookup's deadline)."""
        return min(float(self.lookup_block_ms), float(self.lookup_timeout_ms)) / 1000.0

    @property
    def wait_s(self) -> float | None:
        """The async wait budget per step, in seconds; ``None`` for ``auto``."""
        if isinstance(self.lookup_wait_us, str):
            return None
        return self.lookup_wait_us / 1e6

    @property
    def answer_ttl_s(self) -> float:
        """How long a held answer may be served, in seconds."""
        return self.lookup_answer_ttl_ms / 1000.0

    @property
    def mode(self) -> str:
        """``sync``, ``async`` or ``budget`` (async with a wait budget, fixed or auto): the ``mode`` label."""
        if not self.lookup_async:
            return "sync"
        return "budget" if self.lookup_wait_us == "auto" or self.lookup_wait_us else "async"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LookupConfig:
        """Parse our keys out of ``kv_connector_extra_config``; unknown ``lookup_*`` keys fail, naming the key."""
        ours: dict[str, Any] = {}
        wrong: list[str] = []  # every bad key, in one message: a deployment learns them all from one failed start
        unknown: list[str] = []
        for name, value in (extra or {}).items():
            if not name.startswith(PREFIX) or name in UPSTREAM_KEYS:
                continue
            if name not in KEYS_BY_NAME:
                unknown.append(f"unknown key kv_connector_extra_config[{name!r}]")
                continue
            try:
                _checked(KEYS_BY_NAME[name], value)
            except ConfigError as e:
                wrong.append(str(e))
                continue
            ours[name] = value
        if unknown:
            wrong.append("; ".join(unknown) + f"; known lookup keys: {', '.join(sorted(KEYS_BY_NAME))}")
        if wrong:
            raise ConfigError("; ".join(wrong))
        return cls(**ours)

    def as_extra_config(self) -> dict[str, Any]:
        """The settings as ``kv_connector_extra_config`` entries (round-trips through :meth:`from_extra_config`)."""
        return dataclasses.asdict(self)


def _kind(hint: Any) -> type:
    """The value type of a field: ``int | str`` (a number, or one of the key's words) is an ``int`` key."""
    if isinstance(hint, type):
        return hint
    return next(t for t in typing.get_args(hint) if t is not str)


def _keys() -> tuple[Key, ...]:
    kinds = typing.get_type_hints(LookupConfig)
    return tuple(Key(f.name, f.default, _kind(kinds[f.name]), **f.metadata[_META])
                 for f in dataclasses.fields(LookupConfig))


KEYS: tuple[Key, ...] = _keys()
KEYS_BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}

__all__ = ["ConfigError", "KEYS", "KEYS_BY_NAME", "Key", "LookupConfig", "SYNC_BLOCK_MS", "TIMEOUT_MS"]
