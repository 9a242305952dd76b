"""The metric catalogue: every metric name, help text, label and bucket of mooncake-lookout.

Nothing else in the code base spells a metric name. Sinks, dashboards, alerts, docs and tests read
them from here (or are checked against this module by tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lookout.connector.arrivals import DROP_REASONS as ARRIVAL_DROP_REASONS
from mooncake_lookout.connector.events import Outcome

PREFIX = "vllm:mooncake_lookup_"

# Seconds histograms span 10 us to 10 s (DESIGN): 1-2.5-5 per decade.
SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
STEPS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 5, 10, 20, 50, 100, 1000)
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)

OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)  # the ``outcome`` label: how a lookup ended
MODES: tuple[str, ...] = ("sync", "async", "budget")
DROP_REASONS: tuple[str, ...] = ("expired", "evicted", "wiped")
CACHE_CLEAR_REASONS: tuple[str, ...] = ("reset", "epoch", "failure")
# The ``state`` label of prefix_cache_state (the client's view, prefix_cache.StoreView.state) and of
# server_prefix_cache_state (the server's lease probe: server/lease.py STATES, checked equal by a test).
PREFIX_CACHE_STATES: tuple[str, ...] = ("on", "off", "unproven")
SERVER_PREFIX_CACHE_STATES: tuple[str, ...] = ("on", "probing", "store_refused", "lease_too_short", "off")
# The ``status`` label of server_requests: ok, error (lookups answered; the store failed), bad_request (malformed
# frames, or frames past a bound on their own), busy (lookups turned away: their peer, or all peers, at a bound
# of what may wait in the server), refused (resets from a peer that may not wipe the store: plain TCP). The
# first four are also the wire's frame statuses (wire/pipelined.py).
SERVER_BUSY = "busy"
SERVER_REFUSED = "refused"
SERVER_STATUSES: tuple[str, ...] = ("ok", "error", "bad_request", SERVER_BUSY, SERVER_REFUSED)
# The labels of server_bounds: whose bound (one peer's, or all peers' together) and what it counts.
SERVER_BOUND_SCOPES: tuple[str, ...] = ("peer", "total")
SERVER_BOUND_MEASURES: tuple[str, ...] = ("lookups", "keys", "bytes")


@dataclass(frozen=True)
class MetricSpec:
    """One metric family; ``name`` is the full Prometheus name (counters without ``_total``, as the client wants)."""

    name: str
    kind: str  # counter, gauge, histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    side: str = "client"  # client: the scheduler's lookup client; server: the lookup server

    @property
    def key(self) -> str:
        """The short name without the prefix (``requests``), used as a Python identifier by sinks."""
        return self.name.removeprefix(PREFIX)

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The series names Prometheus stores for this family (what queries use)."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _m(key: str, kind: str, help: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = (),
       side: str = "client") -> MetricSpec:
    return MetricSpec(PREFIX + key, kind, help, labels, buckets, side)


REQUESTS = _m("requests", "counter", "Lookups by how they ended.", ("outcome",))
QUERIED_TOKENS = _m("queried_tokens", "counter", "Prompt tokens the store answered for (hits and misses).")
HIT_TOKENS = _m("hit_tokens", "counter", "Prompt tokens found in the store.")
PENDING = _m("pending", "gauge", "Lookups submitted and not yet answered to the scheduler: what lookup_max_pending "
             "bounds.")
MAX_PENDING = _m("max_pending", "gauge", "The configured bound on pending lookups (lookup_max_pending).")
HELD = _m("held", "gauge", "Answers kept for requests not yet allocated (not pending: bounded by lookup_max_held).")
MAX_HELD = _m("max_held", "gauge", "The configured bound on held answers (lookup_max_held).")
ANSWERS_DROPPED = _m("answers_dropped", "counter",
                     "Held answers forgotten before use: expired (older than lookup_answer_ttl_ms), evicted (bound), "
                     "wiped (the store was wiped after they were answered).",
                     ("reason",))
ARRIVALS_DROPPED = _m("arrivals_dropped", "counter",
                      "Lookups sent as their request arrived (lookup_on_arrival) that the request never took over, "
                      "each also counted discarded in requests: unclaimed (not claimed before its deadline: aborted "
                      "before admission), prompt_changed (claimed with another prompt), reset (fenced by a reset), "
                      "closed. Their replies are not late replies.", ("reason",))
WAIT_BUDGET_SECONDS = _m("wait_budget_seconds", "gauge",
                         "The per-step wait budget in force (lookup_wait_us, or what auto chose).")
PREFIX_CACHE_BLOCKS = _m("prefix_cache_blocks", "gauge",
                         "Block hashes the prefix cache remembers as present in the store (within their lease).")
PREFIX_CACHE_QUERY_BLOCKS = _m("prefix_cache_query_blocks", "counter",
                               "Blocks that could count toward a hit, over lookups with the prefix cache on.")
PREFIX_CACHE_KNOWN_BLOCKS = _m("prefix_cache_known_blocks", "counter",
                               "Of those, blocks the prefix cache knew present: not asked of the store.")
PREFIX_CACHE_ANSWERS = _m("prefix_cache_answers", "counter",
                          "Lookups the prefix cache answered whole, with no round trip.")
PREFIX_CACHE_CLEARS = _m("prefix_cache_clears", "counter",
                         "Times the prefix cache was cleared: reset, epoch (the store was wiped, by any instance, "
                         "or the master restarted) or failure (a lookup failed).", ("reason",))
PREFIX_CACHE_STATE = _m("prefix_cache_state", "gauge",
                        "1 for the prefix cache's state, 0 for the others: on; off (lookup_prefix_cache_blocks 0, the "
                        "upstream transport, or a layout where a hash is not one block); unproven (the lookup server "
                        "vouches for no store epoch: its lease probe has not passed, the store having no memory yet, "
                        "or it found the master's lease too short; server_prefix_cache_state and its log say which). "
                        "While unproven nothing is cached and no hit is held.", ("state",))
DEFERRALS = _m("deferrals", "counter", "Times the scheduler got None and retried on a later step.")
DEFERRED_STEPS = _m("deferred_steps", "histogram",
                    "Per lookup: scheduler steps deferred before its answer was used.", (), STEPS_BUCKETS)
QUEUE_SECONDS = _m("queue_seconds", "histogram", "Time a lookup waited in the client before it was sent.", (),
                   SECONDS_BUCKETS)
RPC_SECONDS = _m("rpc_seconds", "histogram",
                 "From sending a lookup until the client read its answer, or gave up on it (timeout): the round trip "
                 "when the scheduler waited for it; an answer nobody waited for is read at the next step.", (),
                 SECONDS_BUCKETS)
SECONDS = _m("seconds", "histogram", "From submit to the answer being used (lookups that were sent).", (),
             SECONDS_BUCKETS)
SCHEDULER_BLOCKED_SECONDS = _m("scheduler_blocked_seconds", "histogram",
                               "Time one scheduler call (admission or lookup) spent inside the lookup path.",
                               ("mode",), SECONDS_BUCKETS)
STEP_INTERVAL_SECONDS = _m("step_interval_seconds", "histogram",
                           "Time between two scheduler steps as the lookup client sees them: what a step costs, and "
                           "what lookup_wait_us auto caps its wait by.", (), SECONDS_BUCKETS)
BREAKER_OPEN = _m("breaker_open", "gauge", "1 while the circuit breaker is open.")
LATE_REPLIES = _m("late_replies", "counter", "Replies that came after their lookup's deadline, or for no lookup known: "
                  "the server was slow (a reply in time for a lookup nobody waits for any more is not counted).")
INFO = _m("info", "gauge", "Lookup configuration, value 1.", ("transport", "lookup_async", "mode",
                                                              "lookup_wait_us", "lookup_wait_auto_share",
                                                              "lookup_timeout_ms", "lookup_block_ms",
                                                              "lookup_max_pending"))

SERVER_REQUESTS = _m("server_requests", "counter",
                     "Lookups the lookup server answered, by status: ok, error (the store failed), busy (the peer, or "
                     "all peers, at a bound of what may wait: server_bounds); and frames it refused: bad_request "
                     "(malformed, or past a bound on its own), refused (a reset from a peer that may not wipe the "
                     "store).", ("status",), side="server")
SERVER_QUEUE_DEPTH = _m("server_queue_depth", "gauge", "Lookups received and not yet answered by the server.",
                        side="server")
SERVER_INFLIGHT = _m("server_inflight", "gauge", "Store calls the server is running right now.", side="server")
SERVER_STORE_SECONDS = _m("server_store_seconds", "histogram", "Latency of one store call (batch_is_exist).",
                          (), SECONDS_BUCKETS, side="server")
SERVER_BATCH_SIZE = _m("server_batch_size", "histogram", "Lookups coalesced into one store call.", (),
                       BATCH_BUCKETS, side="server")
SERVER_STORE_ERRORS = _m("server_store_errors", "counter", "Store calls that failed or returned error codes.",
                         side="server")
SERVER_WAITING_KEYS = _m("server_waiting_keys", "gauge",
                         "Store keys of the lookups received and not yet answered by the server, all peers.",
                         side="server")
SERVER_WAITING_BYTES = _m("server_waiting_bytes", "gauge",
                          "Bytes the server holds for lookups received and not yet answered, all peers (their frames "
                          "plus a fixed cost per lookup).", side="server")
SERVER_BOUNDS = _m("server_bounds", "gauge",
                   "The server's bounds on what may wait in it, per peer and in total (scope), in lookups, store keys "
                   "and bytes (measure): a frame past one is answered busy.", ("scope", "measure"), side="server")

SERVER_PREFIX_CACHE_STATE = _m("server_prefix_cache_state", "gauge",
                               "1 for the server's state, 0 for the others: on (it keeps a store epoch: the master's "
                               "lease covers lookup_answer_ttl_ms); probing (its lease probe waits out the window); "
                               "store_refused (the probe could not run: no memory lent to the store yet, or the store "
                               "failed; retried with backoff); lease_too_short (refused for good); off (no epoch by "
                               "configuration).", ("state",), side="server")

CATALOGUE: tuple[MetricSpec, ...] = (
    REQUESTS, QUERIED_TOKENS, HIT_TOKENS, PENDING, MAX_PENDING, HELD, MAX_HELD, ANSWERS_DROPPED, ARRIVALS_DROPPED,
    WAIT_BUDGET_SECONDS,
    PREFIX_CACHE_BLOCKS, PREFIX_CACHE_QUERY_BLOCKS, PREFIX_CACHE_KNOWN_BLOCKS, PREFIX_CACHE_ANSWERS,
    PREFIX_CACHE_CLEARS, PREFIX_CACHE_STATE,
    DEFERRALS, DEFERRED_STEPS, QUEUE_SECONDS, RPC_SECONDS, SECONDS, SCHEDULER_BLOCKED_SECONDS, STEP_INTERVAL_SECONDS,
    BREAKER_OPEN, LATE_REPLIES, INFO,
    SERVER_REQUESTS, SERVER_QUEUE_DEPTH, SERVER_INFLIGHT, SERVER_STORE_SECONDS, SERVER_BATCH_SIZE,
    SERVER_STORE_ERRORS, SERVER_WAITING_KEYS, SERVER_WAITING_BYTES, SERVER_BOUNDS,
    SERVER_PREFIX_CACHE_STATE,
)
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOGUE}


def all_series_names() -> set[str]:
    """Every series name a Prometheus query may use for our metrics."""
    return {s for m in CATALOGUE for s in m.sample_names}


__all__ = [
    "ARRIVAL_DROP_REASONS", "BY_NAME", "CACHE_CLEAR_REASONS", "CATALOGUE", "DROP_REASONS", "MODES", "MetricSpec",
    "OUTCOMES", "PREFIX", "PREFIX_CACHE_STATES", "SECONDS_BUCKETS", "SERVER_BOUND_MEASURES", "SERVER_BOUND_SCOPES",
    "SERVER_BUSY", "SERVER_PREFIX_CACHE_STATES", "SERVER_REFUSED", "SERVER_STATUSES", "all_series_names",
]
