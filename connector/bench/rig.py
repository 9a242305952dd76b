"""One real Mooncake master, a filled prefix index and both lookup servers: what demo and bench stand on.

Why: every comparison must run upstream's client and ours in the same process, against the same
master, the same keys and the same kind of server. :class:`Rig` starts them once:

* a real ``mooncake_master`` on 127.0.0.1 (:class:`EmbeddedMaster`, stopped by pid on exit), with
  Mooncake's default key lease (10 s): a found key stays leased for twice the default
  ``lookup_answer_ttl_ms``, the rule a prefix cache relies on;
* a writer store client and a :class:`PrefixIndex` over it (to fill the store);
* a separate *server process* (:class:`~mooncake_lookout.connector.rigs.server_process.ServerProcess`), as
  in vLLM where the lookup server lives in the worker, not in the scheduler's process (in-process server
  threads would fight the scheduler for the GIL and skew every latency): it runs vLLM's own
  ``LookupKeyServer`` (upstream wire, IPC path derived from a real ``VllmConfig``) and our
  :class:`LookupServer` (pipelined and upstream wire), both over a :class:`PrefixIndex` on its own store
  client; with ``keep_epoch`` our server keeps the store's epoch, so our clients' prefix caches are on
  (the bench's scenarios (a)-(f) run without it: their figures are of the lookup without the cache);
* with ``floor=True``, the round-trip floor's child process (:class:`~.floors.FloorServer`) on the same master.

Clients are built on demand: vLLM's ``LookupKeyClient``, or our :class:`LookupClient` with either
transport. :func:`token_prompts` gives token prompts with shared prefixes for vLLM's real scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import Any

from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupObserver, ObserverSet
from mooncake_lookout.connector.rigs.master import MOONCAKE_LEASE_MS
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM

BLOCK_SIZE = 16
_ports = itertools.count(7000 + os.getpid() % 1000 * 10)


def next_lookup_port() -> int:
    """A ``lookup_rpc_port`` no other rig of this process uses (it only names an IPC path)."""
    return next(_ports)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[rank]


def summary_us(seconds: Sequence[float]) -> dict[str, float]:
    """n, mean, p50, p90, p99 and max of durations given in seconds, in microseconds."""
    if not seconds:
        return {"n": 0}
    us = [s * 1e6 for s in seconds]
    return {"n": len(us), "mean": statistics.fmean(us), "p50": quantile(us, 0.5), "p90": quantile(us, 0.9),
            "p99": quantile(us, 0.99), "max": max(us)}


def _tokens(seed: int, kind: int, owner: int, count: int) -> list[int]:
    return [(seed * 1_000_003 + kind * 100_003 + owner * 7919 + j * 31) % 50_000 + 1 for j in range(count)]


def token_prompts(n: int, *, prefix_blocks: int = 4, unique_blocks: int = 4, num_prefixes: int = 4,
                  extra_tokens: int = 1, seed: int = 0) -> list[tuple[str, list[int]]]:
    """``n`` (req_id, prompt) pairs; request ``i`` starts with prefix ``i % num_prefixes``, then its own tokens."""
    prefixes = [_tokens(seed, 1, p, prefix_blocks * BLOCK_SIZE) for p in range(num_prefixes)]
    own = unique_blocks * BLOCK_SIZE + extra_tokens
    return [(f"r{seed}-{i}", prefixes[i % num_prefixes] + _tokens(seed, 2, i, own)) for i in range(n)]


def own_tokens(owner: int, count: int, seed: int = 0) -> list[int]:
    """``count`` tokens of ``owner``'s own, unlike any of :func:`token_prompts`' (a request's new question)."""
    return _tokens(seed, 3, owner, count)


def close_upstream_client(client: Any, timeout_s: float = 5.0) -> bool:
    """Close vLLM's ``LookupKeyClient`` safely: only once its thread is idle; True if it was.

    Upstream's ``close()`` closes the socket while its executor thread may sit in ``recv()`` and never
    terminates its ZMQ context (a context left to the garbage collector can hang in ``term()``). Here a
    no-op job proves the single executor thread is idle before the socket is closed; a wedged client is
    left alone (its daemon-less thread stays blocked until its server answers) and False is returned.
    """
    try:
        client.executor.submit(lambda: None).result(timeout=timeout_s)
    except Exception:
        return False
    client.executor.shutdown(wait=True)
    client.socket.close(linger=0)
    client.ctx.term()
    return True


class ClientMaker:
    """Builds the clients a scenario compares: vLLM's ``LookupKeyClient`` and ours with either transport.

    A subclass gives ``lookup_vllm_config`` (where vLLM's client connects) and ``addresses`` (transport ->
    the address our client connects to).
    """

    lookup_vllm_config: Any = None

    @property
    def addresses(self) -> dict[str, str]:
        """Transport -> the address a client of that transport connects to."""
        raise NotImplementedError

    def floor_frame(self, request: Any) -> bytes:
        """The round-trip floor's request for ``request``: the keys its lookup asks the store."""
        raise NotImplementedError

    def upstream_client(self) -> Any:
        """vLLM 0.33's own ``LookupKeyClient``, connected to vLLM's ``LookupKeyServer``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
            LookupKeyClient,
        )

        return LookupKeyClient(self.lookup_vllm_config)

    def address(self, transport: str) -> str:
        """Where a client of ``transport`` connects: vLLM's server for upstream, ours for pipelined."""
        return self.addresses[transport]

    def our_client(self, transport: str, observers: Iterable[LookupObserver] = (), *, socket: str | None = None,
                   **config: Any) -> Any:
        """Our ``LookupClient`` over ``transport`` with ``config`` keys (``lookup_`` prefix optional), the transport
        as vLLM's connector builds it for that config; ``socket`` (``caller`` or ``io``) forces where the
        ``pipelined`` socket lives instead (a diagnosis: docs/architecture.md)."""
        from mooncake_lookout.connector.client import LookupClient
        from mooncake_lookout.connector.transport import make_transport

        keys = {(k if k.startswith("lookup_") else "lookup_" + k): v for k, v in config.items()}
        cfg = LookupConfig(lookup_transport=transport, **keys)
        # make_transport picks the socket's thread by the mode: a forced one is the mode that picks it
        built_as = cfg if socket is None else dataclasses.replace(cfg, lookup_async=socket == "io", lookup_wait_us=0)
        return LookupClient(cfg, make_transport(built_as, self.address(transport)),
                            observer=ObserverSet(list(observers)))


class Rig(ClientMaker):
    """A real master, a prefix index and both lookup servers; a context manager that stops them all by pid.

    ``rpc_timeout_ms`` bounds one store call of the servers' client (Mooncake's ``MC_RPC_TIMEOUT_MS``);
    ``kv_lease_ttl_ms`` is the master's key lease; ``keep_epoch``: our server keeps the store's epoch (see
    the module docstring); ``upstream_server``: also vLLM's own server, for upstream's client (the child
    then imports vLLM: seconds more to start; the demo, which runs only ours, goes without).
    """

    def __init__(self, *, namespace: str = "bench", rpc_timeout_ms: int | None = 30_000, floor: bool = False,
                 kv_lease_ttl_ms: int = MOONCAKE_LEASE_MS, keep_epoch: bool = False,
                 upstream_server: bool = True) -> None:
        self.namespace = namespace
        self.rpc_timeout_ms = rpc_timeout_ms
        self.with_floor = floor
        self.kv_lease_ttl_ms = kv_lease_ttl_ms
        self.keep_epoch = keep_epoch
        self.upstream_server = upstream_server
        self._stack = ExitStack()
        self.master: Any = None
        self.index: Any = None
        self.writer: Any = None  # the store client that fills the store
        self.servers: Any = None
        self.floor: Any = None
        self.lookup_rpc_port = next_lookup_port()

    def start(self) -> Rig:
        """Start the master, the store client and both servers; on any failure, stop what started."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        from mooncake_lookout.connector.rigs.master import EmbeddedMaster
        from mooncake_lookout.connector.rigs.rpc_base_path import private_rpc_base_path
        from mooncake_lookout.connector.rigs.server_process import ServerProcess
        from mooncake_lookout.connector.rigs.vllm_lookup_server import lookup_vllm_config
        from mooncake_lookout.connector.server.prefix_index import PrefixIndex
        from mooncake_lookout.connector.server.store import open_writer_store

        stack = self._stack
        self.master = stack.enter_context(EmbeddedMaster(kv_lease_ttl_ms=self.kv_lease_ttl_ms))
        self.rpc_base_path = stack.enter_context(private_rpc_base_path())
        # The writer first: it lends the memory that holds the values, our server's epoch marker included.
        self.writer = store = open_writer_store(self.master.rpc_address)
        stack.callback(store.close)
        self.index = PrefixIndex(store, BLOCK_SIZE, namespace=self.namespace)
        transports = (UPSTREAM, PIPELINED) if self.upstream_server else (PIPELINED,)
        self.servers = stack.enter_context(ServerProcess(
            transports, self.master.rpc_address, namespace=self.namespace, block_size=BLOCK_SIZE,
            rpc_port=self.lookup_rpc_port, rpc_base_path=self.rpc_base_path,
            store_rpc_timeout_ms=self.rpc_timeout_ms, start_timeout_s=120.0, standby=False,
            keep_epoch=self.keep_epoch))
        self.lookup_vllm_config = lookup_vllm_config(self.lookup_rpc_port)
        if self.with_floor:
            from mooncake_lookout.connector.bench.floors import FloorServer

            self.floor = stack.enter_context(FloorServer(self.master.rpc_address, rpc_timeout_ms=self.rpc_timeout_ms))

    def floor_frame(self, request: Any) -> bytes:
        """The round-trip floor's request for ``request``: the very keys our index asks for its lookup."""
        from mooncake_lookout.connector.bench.floors import key_frame

        hashes = request.block_hashes
        return key_frame(self.index.keys(hashes, self.index.countable_blocks(request.num_tokens, len(hashes))))

    # -- clients -------------------------------------------------------------------------------------------
    @property
    def addresses(self) -> dict[str, str]:
        """Transport -> address of the server process's servers."""
        return dict(self.servers.addresses)

    def scheduler_extra(self, ours: bool, transport: str = PIPELINED, **config: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` for a scheduler wired to this rig's servers."""
        extra: dict[str, Any] = {"lookup_rpc_port": self.lookup_rpc_port, "load_async": False}
        if ours:
            extra["lookup_transport"] = transport
            if transport == PIPELINED:
                extra["lookup_server_address"] = self.servers.addresses[PIPELINED]
        extra.update(config)
        return extra

    def close(self) -> None:
        """Stop the servers, close the store client, stop the master (by pid)."""
        self._stack.close()

    def __enter__(self) -> Rig:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BLOCK_SIZE", "MOONCAKE_LEASE_MS", "ClientMaker", "Rig", "close_upstream_client", "next_lookup_port",
           "own_tokens", "quantile", "summary_us", "token_prompts"]
