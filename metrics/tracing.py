"""OpenTelemetry spans for lookups: one span per lookup, a child span for its round trip.

Enable
    Set the standard variables; nothing else configures tracing::

        OTEL_TRACES_EXPORTER=otlp
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf     # grpc needs opentelemetry-exporter-otlp-proto-grpc
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:4318/v1/traces
        OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.1
        OTEL_SERVICE_NAME=vllm-scheduler                     # default: mooncake-lookout

    With ``OTEL_TRACES_EXPORTER`` unset or ``none``, :func:`tracing_observer_from_env` returns ``None`` and
    no observer is attached: tracing off costs nothing.

Sampling
    Decided when a lookup starts, on the scheduler's thread, by :func:`sampler_from_env` from the standard
    ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` and the request's own ``traceparent`` flag (a
    ``parentbased_*`` sampler follows it). A lookup not sampled costs nothing more: no span is built for it.

Spans
    ``mooncake.lookup`` runs from submit to the answer being used (or the lookup discarded).
    ``mooncake.lookup.rpc`` is its child, from the hand-over to the transport to its answer. Both are built
    after the lookup ended, from its timestamps (explicit start and end times), on a background thread: the
    scheduler adapter hands each step's sampled lookups over at once (``BackgroundObserver.call``), so the
    scheduler pays one queue put a step. Request ids appear only hashed (``gen_ai.request.id``).

Parent from vLLM
    The scheduler adapter hands ``Request.trace_headers`` to the client when it starts the lookup; they
    ride on the lookup's own record (no state shared between threads), and are extracted with the
    propagators of ``OTEL_PROPAGATORS`` (W3C ``traceparent`` by default) when the spans are built.

The provider is private to this module's observer (it does not replace a global one vLLM may set),
and spans leave through a ``BatchSpanProcessor``: the scheduler never waits on the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Status, StatusCode, Tracer

from mooncake_lookout.connector.events import LookupRecord, NullObserver, Outcome

logger = logging.getLogger(__name__)

SPAN_LOOKUP = "mooncake.lookup"
SPAN_RPC = "mooncake.lookup.rpc"
ATTR_REQUEST_ID = "gen_ai.request.id"  # sha256 prefix of the request id, never the id itself
ATTR_TOKENS = "mooncake.lookup.num_tokens"
ATTR_BLOCKS = "mooncake.lookup.num_blocks"
ATTR_HIT_TOKENS = "mooncake.lookup.hit_tokens"
ATTR_OUTCOME = "mooncake.lookup.outcome"
ATTR_DEFERRED_STEPS = "mooncake.lookup.deferred_steps"
ATTR_TRANSPORT = "mooncake.lookup.transport"
ATTR_GENERATION = "mooncake.lookup.generation"
ATTR_ERROR = "mooncake.lookup.error"
DEFAULT_SERVICE_NAME = "mooncake-lookout"

_FAILED = frozenset({Outcome.ERROR, Outcome.TIMEOUT})


def hash_request_id(req_id: str) -> str:
    """The first 16 hex digits of sha256(req_id): joins spans of one request, reveals nothing of the id."""
    return hashlib.sha256(req_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class TracingObserver(NullObserver):
    """A :class:`LookupObserver` that turns each ended lookup into spans of ``tracer``.

    Spans are built when the lookup ends, from the record's timestamps (explicit start and end times),
    so the observer can run on a background thread (:class:`~mooncake_lookout.connector.events.
    BackgroundObserver`): neither the scheduler nor the transport thread creates a span.
    """

    def __init__(self, tracer: Tracer, provider: TracerProvider | None = None) -> None:
        self.tracer = tracer
        self.provider = provider
        # perf_counter seconds -> epoch nanoseconds, for explicit span times.
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def consumed(self, rec: LookupRecord) -> None:
        self._record(rec)

    def discarded(self, rec: LookupRecord) -> None:
        self._record(rec)

    def record_many(self, lookups: Sequence[LookupRecord]) -> None:
        """Spans for ``lookups`` (a step's sampled lookups that ended, handed over together)."""
        for rec in lookups:
            self._record(rec)

    def _record(self, rec: LookupRecord) -> None:
        headers = rec.trace_headers
        ctx = propagate.extract(headers) if headers else None
        end = rec.t_consume if rec.t_consume is not None else time.perf_counter()
        span = self.tracer.start_span(SPAN_LOOKUP, context=ctx, start_time=self._ns(rec.t_submit))
        if span.is_recording():
            outcome = rec.outcome if rec.outcome is not None else Outcome.ERROR
            span.set_attributes({
                ATTR_REQUEST_ID: hash_request_id(rec.req_id),
                ATTR_TOKENS: rec.num_tokens,
                ATTR_BLOCKS: rec.num_hashes,
                ATTR_TRANSPORT: rec.transport,
                ATTR_GENERATION: rec.generation,
                ATTR_OUTCOME: outcome.value,
                ATTR_HIT_TOKENS: rec.hit_tokens,
                ATTR_DEFERRED_STEPS: rec.deferrals,
            })
            if outcome in _FAILED:
                span.set_status(Status(StatusCode.ERROR, rec.error or outcome.value))
                if rec.error:
                    span.set_attribute(ATTR_ERROR, rec.error)
            self._record_rpc(rec, span, end)
        span.end(end_time=self._ns(end))

    def _record_rpc(self, rec: LookupRecord, parent: Any, end: float) -> None:
        """The round trip, as the lookup span's child; cut at the lookup's end if the answer came later."""
        t_start, t_answer = rec.t_start, rec.t_answer
        if t_start is None:
            return  # never left the queue (rejected, breaker open, discarded before sending)
        child = self.tracer.start_span(SPAN_RPC, context=trace.set_span_in_context(parent),
                                       start_time=self._ns(min(t_start, end)))
        child.set_attribute(ATTR_TRANSPORT, rec.transport)
        if t_answer is None or t_answer > end:
            child.set_status(Status(StatusCode.ERROR, "no answer before the lookup ended"))
            t_answer = end
        child.end(end_time=self._ns(t_answer))

    def shutdown(self) -> None:
        """Flush and stop the provider this observer owns (if any)."""
        if self.provider is not None:
            self.provider.shutdown()


_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
_TRACE_ID_BOUND = 1 << 64


def sampler_from_env(environ: Mapping[str, str] | None = None) -> Callable[[Mapping[str, str] | None], bool]:
    """``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` as a decision made when a lookup starts, on the
    scheduler's thread: a lookup not sampled is never handed to the tracing thread and builds no span.

    Follows the OTel SDK's samplers: ``parentbased_*`` follow the request's own ``traceparent`` sampled flag
    and apply the root sampler when there is none; ``traceidratio`` keeps a trace id when its lower 64 bits
    fall under ``ratio * 2**64`` (the request's trace id; for a lookup with no parent, one drawn at random,
    as the SDK draws the id it would create). Default, and for a name it does not know (as the SDK does):
    ``parentbased_always_on``.
    """
    env = os.environ if environ is None else environ
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if name not in _SAMPLERS:
        logger.warning("unknown OTEL_TRACES_SAMPLER %r: spans use parentbased_always_on", name)
        name = "parentbased_always_on"
    try:
        ratio = min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
    except ValueError:
        ratio = 1.0
    bound = round(ratio * _TRACE_ID_BOUND)
    root = name.removeprefix("parentbased_")
    parent_based = name.startswith("parentbased_")

    def decide(headers: Mapping[str, str] | None) -> bool:
        parent = _traceparent(headers) if headers else None
        if parent is not None and parent_based:
            return parent[1]
        if root == "always_on":
            return True
        if root == "always_off":
            return False
        if parent is None:  # a root: the id the SDK would draw is uniform, so a uniform draw decides alike
            return random.random() < ratio
        return (parent[0] & (_TRACE_ID_BOUND - 1)) < bound

    return decide


def _traceparent(headers: Mapping[str, str]) -> tuple[int, bool] | None:
    """(trace id, sampled) of a W3C ``traceparent`` header, or None when there is none or it is malformed."""
    value = headers.get("traceparent")
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[3]) != 2:
        return None
    try:
        return int(parts[1], 16), bool(int(parts[3], 16) & 1)
    except ValueError:
        return None


def _exporters_from_env() -> list[SpanExporter]:
    """Span exporters named by ``OTEL_TRACES_EXPORTER`` (and the OTLP protocol variables), via the SDK."""
    # The SDK's own reading of OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_*_PROTOCOL (private helpers,
    # pinned by opentelemetry-sdk<2); each exporter reads its endpoint, headers and timeout itself.
    from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters

    names = _get_exporter_names("traces")
    if not names:
        return []
    trace_exporters, _, _ = _import_exporters(names, [], [])
    return [cls() for cls in trace_exporters.values()]


def provider_from_env(exporters: list[SpanExporter] | None = None) -> TracerProvider | None:
    """A tracer provider configured by ``OTEL_*`` (sampler, resource, exporters); ``None`` if tracing is off."""
    if exporters is None:
        exporters = _exporters_from_env()
    if not exporters:
        return None
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    # Lookups are sampled when they start (sampler_from_env): the spans built are those of sampled lookups.
    provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def tracing_observer_from_env() -> TracingObserver | None:
    """The observer to attach, or ``None`` when ``OTEL_TRACES_EXPORTER`` is unset/none or unusable.

    A misconfiguration (say, the grpc protocol without its exporter installed) is logged and turns
    tracing off; it never stops lookups.
    """
    try:
        provider = provider_from_env()
    except Exception as exc:  # telemetry must not stop the scheduler from starting
        logger.error("mooncake-lookout tracing disabled: %s (check OTEL_TRACES_EXPORTER and "
                     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL; only http/protobuf ships with this package)", exc)
        return None
    if provider is None:
        return None
    return TracingObserver(provider.get_tracer("mooncake_lookout"), provider)


__all__ = [
    "ATTR_BLOCKS", "ATTR_DEFERRED_STEPS", "ATTR_ERROR", "ATTR_GENERATION", "ATTR_HIT_TOKENS", "ATTR_OUTCOME",
    "ATTR_REQUEST_ID", "ATTR_TOKENS", "ATTR_TRANSPORT", "SPAN_LOOKUP", "SPAN_RPC", "TracingObserver",
    "hash_request_id", "provider_from_env", "sampler_from_env", "tracing_observer_from_env",
]
