"""The worker side of ``lookup_transport: pipelined``: our server over vLLM's own ``MooncakeStoreWorker``.

On a GPU worker, ``LookoutMooncakeStoreConnector`` serves our ``LookupServer`` over upstream's worker
(:class:`WorkerBackend`). No GPU here, so the worker is upstream's real class set up for lookups only, the
way vLLM's own unit tests build it (:func:`lookup_worker`), over a real Mooncake master; keys are written
by upstream's own save-path key code (:func:`saved_keys`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.job import HashBlob
from mooncake_lookout.connector.rigs.scheduler_driver import make_kv_cache_config, make_vllm_config
from mooncake_lookout.connector.rigs.vllm_lookup_server import PrefixIndexStoreWorker
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.prefix_index import StoreError
from mooncake_lookout.connector.server.store import open_store, open_writer_store
from mooncake_lookout.connector.server.vllm_store_worker import lookup_worker, saved_keys
from mooncake_lookout.connector.server.worker_backend import WorkerBackend, serve_pipelined
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport
from mooncake_lookout.connector.wire import pipelined as p

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16


class CountingStore:
    """The real store client, counting ``batch_is_exist`` calls (everything else passes through)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.exist_calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.exist_calls += 1
        return self.store.batch_is_exist(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.fixture
def worker(store: Any) -> Iterator[Any]:
    """vLLM's MooncakeStoreWorker (lookups only) on the session's real store, in a key space of its own."""
    config = make_vllm_config({"cache_prefix": f"t{time.monotonic_ns()}"})
    yield lookup_worker(config, make_kv_cache_config(4096), CountingStore(store))


def _store(worker: Any, hashes: list[bytes], blocks: int) -> None:
    keys = saved_keys(worker, blocks * BLOCK, hashes)
    assert worker.store.upsert_batch(keys, [b"\x01"] * len(keys)) == 0


def test_one_store_call_answers_a_batch_exactly_as_upstreams_own_lookup(worker: Any, make_hashes) -> None:
    prompts = [make_hashes(8, seed=300 + i) for i in range(12)]
    for i, hashes in enumerate(prompts):
        _store(worker, hashes, i % 9)
    queries = [(8 * BLOCK + 1, HashBlob(b"".join(h), 32)) for h in prompts]
    expected = [worker.lookup(n, list(h)) for n, h in queries]  # upstream's own answer, one call each
    assert {e.hit_length for e in expected} >= {0, 4 * BLOCK, 8 * BLOCK}
    before = worker.store.exist_calls
    got = WorkerBackend(worker).lookup_many(queries)
    assert worker.store.exist_calls - before == 1  # the whole batch in one batch_is_exist
    assert [(g.hit_length, g.tail_key_boundaries) for g in got] == \
        [(e.hit_length, e.tail_key_boundaries) for e in expected]


def test_our_server_coalesces_clients_lookups_over_the_workers_keys(worker: Any, make_hashes) -> None:
    prompts = [make_hashes(6, seed=400 + i) for i in range(40)]
    for i, hashes in enumerate(prompts):
        _store(worker, hashes, i % 7)
    backend = WorkerBackend(worker)
    counter = OutcomeCounter()
    with LookupServer(backend) as server:  # a private IPC socket: a client there may reset
        config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=5000)
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=config.timeout_s),
                              observer=counter)
        try:
            before = worker.store.exist_calls
            # Queued, not sent at admission (a step's first admissions leave a frame each, and the server may take
            # the first before the rest arrive): the step's hand-over sends all 40 in one frame.
            started = [client.start(f"r{i}", 6 * BLOCK + 1, hashes) for i, hashes in enumerate(prompts)]
            assert all(lk is not None and lk.t_queued is None for lk in started)
            hits = {}
            end = time.monotonic() + 10
            while len(hits) < len(prompts) and time.monotonic() < end:
                for i, hashes in enumerate(prompts):
                    result = client.lookup(f"r{i}", 6 * BLOCK + 1, hashes, non_block=True)
                    if result is not None:
                        hits[i] = result.hit_length
                client.end_step()
                time.sleep(0.001)
            assert hits == {i: (i % 7) * BLOCK for i in range(len(prompts))}
            assert len({lk.t_queued for lk in started}) == 1  # handed over together
            assert worker.store.exist_calls - before == 1  # 40 lookups sent in one frame: one store call
            assert client.reset()  # upstream's reset path: drain puts, remove_all
            client.discard("r3")
            assert client.lookup("r3", 6 * BLOCK + 1, prompts[3]).hit_length == 0  # the wipe reached the store
        finally:
            client.close()


def test_a_store_error_is_an_error_not_a_miss(private_master: Any, make_hashes) -> None:
    """Upstream's lookup turns a failed ``batch_is_exist`` into a miss; through our backend it stays an error."""
    store = open_store(private_master.rpc_address, rpc_timeout_ms=300)
    try:
        worker = lookup_worker(make_vllm_config({}), make_kv_cache_config(1024), store)
        hashes = make_hashes(4, seed=500)
        private_master.pause()
        try:
            assert worker.lookup(4 * BLOCK + 1, hashes).hit_length == 0  # upstream: looks like a miss
            (answer,) = WorkerBackend(worker).lookup_many([(4 * BLOCK + 1, hashes)])
        finally:
            private_master.resume()
        assert isinstance(answer, StoreError)
        # Upstream's own operation record (its store metrics) still sees the failed call.
        assert any(op["status"] == "error" for op in worker.kv_connector_stats.data.get("lookup_exists", []))
    finally:
        store.close()


class Doomed:
    """Our server over upstream's worker on a private master the test kills: a raw DEALER asks it frame by frame."""

    def __init__(self, master: Any, server: LookupServer, sock: zmq.Socket) -> None:
        self.master, self.server, self.sock = master, server, sock
        self.frame_id = 0

    def ask(self, frame: list[bytes]) -> p.Reply:
        self.sock.send_multipart(frame)
        assert self.sock.poll(30_000), "no reply within 30 s"
        return p.decode_reply(self.sock.recv())

    def lookup(self, hashes: list[bytes]) -> p.Reply:
        self.frame_id += 1
        return self.ask(p.encode_lookups(self.frame_id, [p.query(self.frame_id, len(hashes) * BLOCK + 1, hashes)]))

    def reset(self) -> p.Reply:
        self.frame_id += 1
        return self.ask(p.encode_reset(self.frame_id))


@pytest.fixture
def doomed(private_master: Any) -> Iterator[Doomed]:
    """A writer client of a private master (it lends the memory the marker needs), upstream's worker over it, our
    server (keeping an epoch) and a DEALER at it."""
    store = open_writer_store(private_master.rpc_address, rpc_timeout_ms=500)
    ctx = zmq.Context()
    try:
        worker = lookup_worker(make_vllm_config({}), make_kv_cache_config(1024), store)
        with LookupServer(WorkerBackend(worker)) as server:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.address)
            yield Doomed(private_master, server, sock)
    finally:
        ctx.destroy(linger=0)
        if not private_master.running:
            private_master.start()  # the client's close unmounts its segment: quick with a master to answer
        store.close()


def test_a_marker_the_store_could_not_check_confirms_no_epoch(doomed: Doomed, make_hashes) -> None:
    """The master killed (a real fault): the batch's marker check fails with the lookups, and its reply vouches for
    no epoch (0), not for the one it could not check; the server keeps its marker. Restarted empty (a wipe), the
    next batch finds the marker gone: a new epoch."""
    hashes = make_hashes(4, seed=520)
    epoch = doomed.server.epoch
    assert epoch and doomed.lookup(hashes).epoch == epoch
    doomed.master.kill()
    dead = doomed.lookup(hashes)
    assert dead.status == p.OK and dead.results[0].status == p.ERROR and "-900" in dead.results[0].reason
    assert dead.epoch == 0, "a failed marker check vouched for the old epoch"
    assert doomed.server.epoch == epoch  # nothing says the store was wiped: the marker is asked again next time
    doomed.master.start()
    deadline = time.monotonic() + 30
    while (reply := doomed.lookup(hashes)).epoch in (0, epoch):  # until the client has remounted and the marker put
        assert time.monotonic() < deadline, f"no new epoch after the master's restart: {reply}"
        time.sleep(0.2)
    assert reply.results[0].status == p.MISS and doomed.server.epoch == reply.epoch


def test_a_wipe_the_store_refused_is_an_error_and_starts_no_epoch(doomed: Doomed) -> None:
    """``remove_all`` returns -900 with the master killed (a real fault): the reset is answered an error naming it,
    with epoch 0 (the wipe may or may not have happened: it vouches for nothing), and no new epoch starts."""
    epoch = doomed.server.epoch
    assert epoch and doomed.reset().status == p.OK  # a wipe that worked: a new epoch
    epoch = doomed.server.epoch
    doomed.master.kill()
    refused = doomed.reset()
    assert (refused.status, refused.epoch) == (p.ERROR, 0), refused
    assert "remove_all failed with code -900" in refused.reason
    assert doomed.server.epoch == epoch, "a failed wipe started a new epoch"


def test_pipelined_server_starts_only_on_the_rank_that_serves_lookups(prefix_index, lookup_vllm_config,
                                                                      tmp_path) -> None:
    config = LookupConfig(lookup_transport="pipelined", lookup_server_address=f"ipc://{tmp_path}/lookup.sock")
    worker = PrefixIndexStoreWorker(prefix_index)
    # Upstream starts its LookupKeyServer on one rank only (worker.lookup_server is None elsewhere).
    other_rank = SimpleNamespace(lookup_server=None, lookup=worker.lookup)
    assert serve_pipelined(lookup_vllm_config, config, other_rank) is None
    worker.lookup_server = object()  # this rank runs upstream's server, so it runs ours too
    server = serve_pipelined(lookup_vllm_config, config, worker)
    try:
        assert server is not None and server.address == config.lookup_server_address
    finally:
        server.close()


def test_outcomes_are_counted_through_the_worker_path(worker: Any, make_hashes) -> None:
    hashes = make_hashes(5, seed=600)
    _store(worker, hashes, 5)
    counter = OutcomeCounter()
    with LookupServer(WorkerBackend(worker), "tcp://127.0.0.1:0") as server:
        config = LookupConfig(lookup_transport="pipelined", lookup_timeout_ms=5000)
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=5.0), observer=counter)
        try:
            assert client.lookup("hit", 5 * BLOCK + 1, hashes).hit_length == 5 * BLOCK
            assert client.lookup("miss", 5 * BLOCK + 1, make_hashes(5, seed=601)).hit_length == 0
        finally:
            client.close()
    assert counter.outcomes[Outcome.HIT] == 1 and counter.outcomes[Outcome.MISS] == 1


def test_known_blocks_are_not_asked_and_the_answer_is_upstreams(worker: Any, make_hashes) -> None:
    """The prefix cache's ``known`` count through upstream's key code: those blocks' keys are taken as present
    (they were found within their lease), the rest asked, and the hit is upstream's own."""
    hashes = make_hashes(40, seed=700)
    _store(worker, hashes, 40)
    blob = HashBlob(b"".join(hashes), 32)
    expected = worker.lookup(40 * BLOCK + 1, hashes)
    backend = WorkerBackend(worker)
    asked = []
    real = worker.store.batch_is_exist

    def spy(keys: list[str]) -> list[int]:
        asked.append(len(keys))
        return real(keys)

    worker.store.batch_is_exist = spy
    try:
        (got,) = backend.lookup_many([(40 * BLOCK + 1, blob, 32)])
    finally:
        worker.store.batch_is_exist = real
    assert (got.hit_length, got.tail_key_boundaries) == (expected.hit_length, expected.tail_key_boundaries)
    assert asked == [40 - 32]  # only the blocks the client did not know


def test_a_known_prefix_gives_upstreams_own_answer_whatever_the_prompt(worker: Any, make_hashes) -> None:
    """Prompts ending mid-block, on a block edge, past what is stored and wholly stored (the last token is
    then recomputed); known prefixes from none to all the client can know (only blocks found present).
    Each answer, alone and in one batch, equals upstream's own lookup of the whole prompt."""
    stored = 300
    hashes = make_hashes(600, seed=710)
    _store(worker, hashes, stored)
    backend = WorkerBackend(worker)
    cases = []
    for blocks in (1, 8, stored - 1, stored, stored + 1, 600):
        for extra_tokens in (0, 1, BLOCK - 1):
            prompt = hashes[:blocks]
            most = min(blocks, stored)
            for known in sorted({0, 1, most // 2, most}):
                cases.append((blocks * BLOCK + extra_tokens, prompt, known))
    expected = [worker.lookup(n, prompt) for n, prompt, _ in cases]
    queries = [(n, HashBlob(b"".join(prompt), 32), known) for n, prompt, known in cases]
    alone = [backend.lookup_many([q])[0] for q in queries]
    batched = backend.lookup_many(queries)
    for case, want, one, many in zip(cases, expected, alone, batched):
        answer = (want.hit_length, tuple(want.tail_key_boundaries))
        assert (one.hit_length, tuple(one.tail_key_boundaries)) == answer, case[::2]
        assert (many.hit_length, tuple(many.tail_key_boundaries)) == answer, case[::2]


def test_short_queries_share_one_store_call_and_a_long_one_has_its_own(worker: Any, make_hashes) -> None:
    from mooncake_lookout.connector.server.worker_backend import SOLO_BLOCKS

    short = [make_hashes(8, seed=720 + i) for i in range(3)]
    long = make_hashes(SOLO_BLOCKS + 10, seed=730)
    for hashes in (*short, long):
        _store(worker, hashes, len(hashes))
    marker = "mooncake-lookout-marker@test"
    assert worker.store.upsert_batch([marker], [b"\x01"]) == 0
    backend = WorkerBackend(worker)
    blob = lambda hs: HashBlob(b"".join(hs), 32)  # noqa: E731
    before = worker.store.exist_calls
    *results, code = backend.lookup_many([(len(hs) * BLOCK + 1, blob(hs)) for hs in (*short, long)], [marker])
    assert worker.store.exist_calls - before == 2
    assert [r.hit_length for r in results] == [len(hs) * BLOCK for hs in (*short, long)] and code == 1
    before = worker.store.exist_calls
    result, code = backend.lookup_many([(len(long) * BLOCK + 1, blob(long))], [marker])  # the marker rides along
    assert worker.store.exist_calls - before == 1 and result.hit_length == len(long) * BLOCK and code == 1
    worker.store.remove(marker, True)
