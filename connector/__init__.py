"""mooncake-lookout's connector: a deadline-bound, observable prefix-cache lookup path for vLLM's Mooncake store.

The file tree is the architecture. The runtime, which ships inside vLLM, is this package's top level and
three sub-packages; it never imports the tools below it (import-linter checks):

* :mod:`.vllm_connector` (``LookoutMooncakeStoreConnector``) and :mod:`.plugin` (its ``vllm.general_plugins``
  entry point): what vLLM loads; :mod:`.scheduler_adapter`: the scheduler side, upstream's with our client;
* :mod:`.client` (:class:`LookupClient`): lookups bounded in time, memory and trust; :mod:`.job`,
  :mod:`.breaker`, :mod:`.events` (lifecycle events for telemetry), :mod:`.config` (every ``lookup_*`` key),
  :mod:`.addresses` (where channels live), :mod:`.waker`;
* :mod:`.transport`: how a lookup travels (pipelined or vLLM's upstream channel); :mod:`.wire`: the bytes
  on each; :mod:`.server`: the lookup server and its store back-ends.

The tools: :mod:`.cli` (the ``mooncake-lookout`` command), :mod:`.bench` (upstream vs ours) and
:mod:`.rigs` (real processes and workloads for tests, demo, bench and soak). Telemetry lives in
``mooncake_lookout.metrics``. ``docs/architecture.md`` follows one lookup through the files.
"""

from __future__ import annotations

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import ConfigError, LookupConfig
from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.job import LookupResult

__all__ = ["ConfigError", "LookupClient", "LookupConfig", "LookupResult", "Outcome"]
