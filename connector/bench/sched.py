"""vLLM's real scheduler fed a shared-prefix workload: blocked time and deferrals per lookup mode.

Why: a lookup mode is judged by what the scheduler pays (time inside ``get_num_new_matched_tokens``)
and what requests pay (steps deferred, time from arrival to answer). This runs vLLM's real V1
``Scheduler`` (:class:`SchedulerDriver`) with either upstream's ``MooncakeStoreConnector`` or ours,
and measures both connectors the same way: a :class:`CallProbe` wraps the scheduler's call to the
connector (a measuring wrapper around the real method, not a fake). Requests arrive right before a
step, as vLLM's engine core reads its input queue right before ``schedule()``; each step then sleeps
``model_step_s`` in place of the model's forward pass. Used by ``bench`` scenario (c) and by ``demo``.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mooncake_lookout.connector.bench.rig import (
    BLOCK_SIZE,
    Rig,
    close_upstream_client,
    own_tokens,
    summary_us,
    token_prompts,
)
from mooncake_lookout.connector.events import LookupObserver, LookupRecord, OutcomeCounter
from mooncake_lookout.connector.transport.names import PIPELINED

ARRIVALS_PER_STEP = 4  # scenario (c): new requests before each step
MODEL_STEP_S = 0.0015  # scenario (c): the model's forward pass between steps


@dataclass(frozen=True)
class Mode:
    """One way of running lookups: whose connector, which transport, which ``lookup_*`` settings."""

    label: str
    ours: bool
    transport: str = PIPELINED
    config: tuple[tuple[str, Any], ...] = ()

    @property
    def extra(self) -> dict[str, Any]:
        """The ``lookup_*`` settings as a dict."""
        return dict(self.config)


def mode(label: str, ours: bool, transport: str = PIPELINED, **config: Any) -> Mode:
    """Shorthand for :class:`Mode` with ``lookup_*`` keyword settings."""
    return Mode(label, ours, transport, tuple(sorted(config.items())))


class CallProbe:
    """Wraps a connector's ``get_num_new_matched_tokens`` on one instance: times each call, counts ``None``."""

    def __init__(self, connector: Any) -> None:
        self._inner = connector.get_num_new_matched_tokens
        connector.get_num_new_matched_tokens = self
        self.calls: list[float] = []
        self.step_blocked = 0.0
        self.deferrals: dict[str, int] = defaultdict(int)
        self.answered_at: dict[str, float] = {}

    def __call__(self, request: Any, num_computed_tokens: int) -> Any:
        t0 = time.perf_counter()
        result = self._inner(request, num_computed_tokens)
        t1 = time.perf_counter()
        self.calls.append(t1 - t0)
        self.step_blocked += t1 - t0
        req_id = request.request_id
        if result[0] is None:
            self.deferrals[req_id] += 1
        else:
            self.answered_at.setdefault(req_id, t1)
        return result


@dataclass
class SchedRun:
    """What one mode's run looked like, from the scheduler's side."""

    label: str
    requests: int = 0
    finished: int = 0
    steps: int = 0
    seconds: float = 0.0
    calls: list[float] = field(default_factory=list)  # seconds inside each lookup call
    blocked_per_step: list[float] = field(default_factory=list)
    schedule_seconds: list[float] = field(default_factory=list)  # each step's whole schedule() call
    deferred_steps: list[int] = field(default_factory=list)  # per answered request
    answer_delay: list[float] = field(default_factory=list)  # arrival -> answer used, seconds
    prompt_tokens: int = 0
    computed_tokens: int = 0  # tokens not recomputed at admission (vLLM's own cache + the store)
    store_queried_tokens: int = 0
    store_hit_tokens: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    wait_budgets: list[float] = field(default_factory=list)  # ours: each step's wait budget in force, seconds
    sent_to_collected: list[float] = field(default_factory=list)  # ours: sent -> answer collected, seconds
    budget_state: dict[str, float | None] = field(default_factory=dict)  # ours: what the wait budget knew at the end
    # Ours' prefix cache: blocks that could count and blocks it knew present, over lookups used; answers it gave
    # with no round trip; lookups sent to the server.
    countable_blocks: int = 0
    known_blocks: int = 0
    cache_answers: int = 0
    lookups_sent: int = 0
    store_keys: int | None = None  # keys the server sent to the store during the run, when counted (demo)

    @property
    def known_share(self) -> float | None:
        """Blocks the prefix cache knew present / blocks that could count (ours only)."""
        return self.known_blocks / self.countable_blocks if self.countable_blocks else None

    @property
    def keys_per_lookup(self) -> float | None:
        """Store keys the server sent per lookup sent to it, when the keys were counted."""
        if self.store_keys is None or not self.lookups_sent:
            return None
        return self.store_keys / self.lookups_sent

    @property
    def reuse_ratio(self) -> float:
        """Prompt tokens not recomputed at admission / prompt tokens."""
        return self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def store_hit_ratio(self) -> float | None:
        """Store hit tokens / tokens asked (our connector only; upstream reports no such figure)."""
        return self.store_hit_tokens / self.store_queried_tokens if self.store_queried_tokens else None

    @property
    def mean_deferred_steps(self) -> float:
        """Mean scheduler steps a request was deferred before its answer."""
        return sum(self.deferred_steps) / len(self.deferred_steps) if self.deferred_steps else 0.0

    @property
    def requests_deferred(self) -> float:
        """Share of answered requests deferred at least once."""
        return sum(1 for d in self.deferred_steps if d) / len(self.deferred_steps) if self.deferred_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Figures for JSON (microseconds for times)."""
        return {
            "label": self.label, "requests": self.requests, "finished": self.finished, "steps": self.steps,
            "seconds": self.seconds, "call_us": summary_us(self.calls),
            "blocked_per_step_us": summary_us(self.blocked_per_step),
            "schedule_us": summary_us(self.schedule_seconds),
            "mean_deferred_steps": self.mean_deferred_steps, "requests_deferred": self.requests_deferred,
            "answer_delay_us": summary_us(self.answer_delay), "reuse_ratio": self.reuse_ratio,
            "store_hit_ratio": self.store_hit_ratio, "outcomes": self.outcomes,
            "wait_budget_us": summary_us(self.wait_budgets), "sent_to_collected_us": summary_us(self.sent_to_collected),
            "budget_state": self.budget_state,
            "steps_without_wait": (sum(1 for b in self.wait_budgets if b <= 0) / len(self.wait_budgets)
                                   if self.wait_budgets else None),
            "prefix_cache": {"known_share": self.known_share, "known_blocks": self.known_blocks,
                             "countable_blocks": self.countable_blocks, "answers": self.cache_answers,
                             "lookups_sent": self.lookups_sent, "store_keys": self.store_keys,
                             "keys_per_lookup": self.keys_per_lookup},
        }


class Prompts(Protocol):
    """What :func:`run_mode` feeds the scheduler: a shared-prefix :class:`Workload`, or multi-turn conversations
    (:class:`~.conversations.ConversationStream`)."""

    def fill_store(self, rig: Rig, hash_of: Callable[[list[int]], list[bytes]]) -> int: ...

    def request(self, k: int) -> tuple[str, list[int]]: ...


class Workload:
    """Token prompts with shared prefixes, made on demand; the store is filled once, before any run.

    Prompts of even index are cached whole in the store, odd ones only up to their shared prefix,
    so the store answers a mix of long and short hits. ``own_last_block``: each request's last full block is
    its own (a prompt ending in a new question). Requests recur over ``fill`` prompts, so vLLM's own prefix
    cache soon holds all their blocks; without a block of its own, a request would have every block computed
    by vLLM, and the connector rightly asks the store nothing for it.
    """

    def __init__(self, *, prompt_blocks: int = 8, prefix_blocks: int = 4, num_prefixes: int = 4,
                 seed: int = 0, fill: int = 4096, own_last_block: bool = False) -> None:
        self.prompt_blocks = prompt_blocks
        self.own_last_block = own_last_block
        self.prefix_blocks = min(prefix_blocks, prompt_blocks)
        self.num_prefixes = num_prefixes
        self.seed = seed
        self.fill = fill
        self._filled = False
        self._cache: list[tuple[str, list[int]]] = []

    def prompts(self, n: int) -> list[tuple[str, list[int]]]:
        """The first ``n`` (req_id, prompt) pairs."""
        if len(self._cache) < n:
            self._cache = token_prompts(max(n, 2 * len(self._cache)), prefix_blocks=self.prefix_blocks,
                                        unique_blocks=self.prompt_blocks - self.prefix_blocks,
                                        num_prefixes=self.num_prefixes, seed=self.seed)
        return self._cache[:n]

    def request(self, k: int) -> tuple[str, list[int]]:
        """Request number ``k``: a fresh id, the prompt of ``k`` modulo the filled prompts (so hits recur)."""
        _, prompt = self.prompts(self.fill)[k % self.fill]
        if self.own_last_block:
            end = self.prompt_blocks * BLOCK_SIZE
            prompt = prompt[:end - BLOCK_SIZE] + own_tokens(k, BLOCK_SIZE, self.seed) + prompt[end:]
        return f"q{k}", prompt

    def fill_store(self, rig: Rig, hash_of: Callable[[list[int]], list[bytes]]) -> int:
        """Put the cached blocks of the first ``fill`` prompts into the store (once); returns keys written."""
        if self._filled:
            return 0
        lists = []
        for i, (_, prompt) in enumerate(self.prompts(self.fill)):
            hashes = hash_of(prompt)
            lists.append(hashes if i % 2 == 0 else hashes[:self.prefix_blocks])
        self._filled = True
        return rig.index.store_prefixes(lists)


def run_mode(rig: Rig, workload: Prompts, m: Mode, *, arrivals_per_step: int = ARRIVALS_PER_STEP,
             steps: int | None = 200, seconds: float | None = None, model_step_s: float = MODEL_STEP_S,
             first_request: int = 0,
             observers: Iterable[LookupObserver] = (), on_step: Callable[[SchedRun], None] | None = None,
             should_stop: Callable[[], bool] = lambda: False, drain_s: float = 5.0, arrival_every: int = 1,
             num_blocks: int = 16_384, max_model_len: int = 2048, tally: bool = True,
             prepare: Callable[[Any], None] | None = None,
             pace: Callable[[SchedRun], None] | None = None, arrive_in_step: bool = False) -> SchedRun:
    """Run vLLM's scheduler in mode ``m``: arrivals for ``steps`` steps (or ``seconds``), then drain.

    ``arrivals_per_step`` requests arrive before every ``arrival_every``-th step (long prompts arrive
    less often, so a run stays short). ``first_request`` offsets into the workload, so runs can use
    fresh request ids. ``observers`` are attached to our client (ignored for upstream's). ``on_step`` is
    called after each step (progress). ``num_blocks`` and ``max_model_len`` size the scheduler. ``tally``: the
    bench's own counting observer on our client (outcomes, tokens, wait budgets, the prefix cache's figures);
    without it our client carries only what vLLM's connector attaches (runs that compare ``schedule()`` time
    with upstream's, which has no such observer). ``prepare`` is given the scheduler's driver once it is built,
    before the first request. ``pace`` is called after every step, the drain's too (children taking turns,
    :mod:`.turns`, wait in it). ``arrive_in_step``: a step's requests reach the engine at a random moment of the
    model step before it (vLLM's input thread builds them then; the first step's, before it), and are admitted at
    the step's start; their answer delay counts from their arrival.
    """
    from mooncake_lookout.connector.rigs.scheduler_driver import (
        SchedulerDriver,
        make_vllm_config,
    )

    extra = rig.scheduler_extra(m.ours, m.transport, **m.extra)
    if m.ours:
        config = make_vllm_config(extra, max_model_len=max_model_len)
    else:
        config = make_vllm_config(extra, connector="MooncakeStoreConnector", module_path=None,
                                  max_model_len=max_model_len)
    driver = SchedulerDriver(config, num_blocks=num_blocks, model_step_s=model_step_s)
    run = SchedRun(m.label)
    counter = TokenTally()
    try:
        if prepare is not None:
            prepare(driver)
        workload.fill_store(rig, driver.block_hashes)
        if m.ours:
            client = driver.connector.lookup_client
            if tally:
                client.observers.add(counter)
            for obs in observers:
                client.observers.add(obs)
        probe = CallProbe(driver.connector)
        arrived: dict[str, float] = {}
        prompt_len: dict[str, int] = {}
        budget = steps if steps is not None else 1 << 30
        limit = seconds if seconds is not None else float("inf")
        next_req = first_request
        moments = random.Random(first_request)  # when, in the model step, the next step's requests arrive
        came: list[Any] = []  # arrived during the last model step, admitted at this step's start

        def build(k: int) -> Any:
            request = driver.make_request(*workload.request(k))
            prompt_len[request.request_id] = request.num_prompt_tokens
            return request

        def hand_on(request: Any) -> None:
            """``request`` reaches the engine: what vLLM's input thread hands the connector once it is built."""
            driver.arrive(request)
            arrived[request.request_id] = time.perf_counter()

        def arrive(step: int) -> list[Any]:
            nonlocal next_req
            arriving = arrivals_per_step if step % arrival_every == 0 else 0
            # Built (and hashed) before any is added: vLLM's engine builds a Request on its input thread.
            batch = [build(k) for k in range(next_req, next_req + arriving)]
            next_req += arriving
            if arrive_in_step:  # the first step's: they reached the engine before it
                for request in batch:
                    hand_on(request)
            return batch

        def arrive_one() -> None:
            """One request reaches the engine during the model step: built, handed on, admitted at the next step."""
            nonlocal next_req
            request = build(next_req)
            next_req += 1
            hand_on(request)
            came.append(request)

        def during_model() -> list[tuple[float, Callable[[], None]]]:
            """The next step's arrivals, each at a moment of its own in this model step (in time order)."""
            step = run.steps + 1
            if not arrive_in_step or step >= budget or step % arrival_every:
                return []
            return [(offset, arrive_one) for offset in sorted(moments.uniform(0.0, model_step_s)
                                                              for _ in range(arrivals_per_step))]

        t0 = time.perf_counter()
        while run.steps < budget and time.perf_counter() - t0 < limit and not should_stop():
            batch = came if arrive_in_step and run.steps else arrive(run.steps)
            came = []
            for request in batch:
                driver.add(request)
                if not arrive_in_step:
                    arrived[request.request_id] = time.perf_counter()
            _step(driver, probe, run, pace, during_model())
            if on_step is not None:
                on_step(run)
        for request in came:  # arrived in the last model step of a run cut short: admitted, then drained
            driver.add(request)
        drain_end = time.perf_counter() + drain_s
        while driver.scheduler.get_num_unfinished_requests() and time.perf_counter() < drain_end \
                and not should_stop():
            _step(driver, probe, run, pace)
        done = set(driver.stats.finished)
        left = [r for r in arrived if r not in done]
        if left:
            driver.abort(left)
        run.seconds = time.perf_counter() - t0
        run.requests = len(arrived)
        run.finished = len(driver.stats.finished)
        run.calls = probe.calls
        run.schedule_seconds = list(driver.stats.step_seconds)
        for req_id, t_add in arrived.items():
            if req_id in probe.answered_at:
                run.deferred_steps.append(probe.deferrals.get(req_id, 0))
                run.answer_delay.append(probe.answered_at[req_id] - t_add)
        for req_id, computed in driver.stats.computed_at_admission.items():
            if req_id in prompt_len:
                run.prompt_tokens += prompt_len[req_id]
                run.computed_tokens += computed
        run.outcomes = {o.value: n for o, n in counter.outcomes.items() if n}
        run.store_queried_tokens, run.store_hit_tokens = counter.queried_tokens, counter.hit_tokens
        run.wait_budgets, run.sent_to_collected = counter.wait_budgets, counter.sent_to_collected
        run.countable_blocks, run.known_blocks = counter.countable_blocks, counter.known_blocks
        run.cache_answers, run.lookups_sent = counter.cache_answers, counter.lookups_sent
        if m.ours:
            budget = driver.connector.lookup_client.budget
            p90 = budget.rtt_p90_s
            run.budget_state = {"rtt_p90_us": p90 * 1e6 if p90 is not None else None,
                                "step_interval_us": budget.step_interval_s * 1e6,
                                "cap_us": budget.share * budget.step_interval_s * 1e6}
    finally:
        if not m.ours:  # upstream's connector never closes its lookup client on the scheduler side
            close_upstream_client(driver.connector.connector_scheduler.client)
        driver.close()
    return run


def merge_runs(runs: Sequence[SchedRun]) -> SchedRun:
    """Several runs of one mode as one: counts added, samples pooled (the last run's budget state kept)."""
    out = SchedRun(runs[0].label)
    for run in runs:
        for name, value in vars(run).items():
            if name == "label":
                continue
            if isinstance(value, list):
                getattr(out, name).extend(value)
            elif name == "outcomes":
                for outcome, n in value.items():
                    out.outcomes[outcome] = out.outcomes.get(outcome, 0) + n
            elif name == "budget_state":
                out.budget_state = value
            elif name == "store_keys":
                out.store_keys = None if value is None else (out.store_keys or 0) + value
            else:
                setattr(out, name, getattr(out, name) + value)
    return out


class TokenTally(OutcomeCounter):
    """An :class:`OutcomeCounter` that also adds up tokens asked about and tokens found, keeps each step's
    wait budget and each lookup's time from sent to answer collected (the round trip when the answer was
    waited for; up to a step more when it was collected at a later step's drain), and adds up what the
    prefix cache knew (blocks that could count, blocks known, answers with no round trip) and the
    lookups sent to the server."""

    def __init__(self) -> None:
        super().__init__(keep=0)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.wait_budgets: list[float] = []
        self.sent_to_collected: list[float] = []
        self.countable_blocks = 0
        self.known_blocks = 0
        self.cache_answers = 0
        self.lookups_sent = 0

    def consumed(self, rec: LookupRecord) -> None:
        super().consumed(rec)
        self.queried_tokens += rec.num_tokens
        self.hit_tokens += rec.hit_tokens
        self.countable_blocks += rec.countable_blocks
        self.known_blocks += rec.known_blocks
        self.cache_answers += rec.from_cache

    def started(self, rec: LookupRecord) -> None:
        super().started(rec)
        self.lookups_sent += 1

    def answered(self, rec: LookupRecord) -> None:
        super().answered(rec)
        if rec.t_start is not None and rec.t_answer is not None:
            self.sent_to_collected.append(rec.t_answer - rec.t_start)

    def step_ended(self, wait_budget_s: float, held: int, cached_blocks: int,
                   interval_s: float | None = None) -> None:
        super().step_ended(wait_budget_s, held, cached_blocks, interval_s)
        self.wait_budgets.append(wait_budget_s)


def _step(driver: Any, probe: CallProbe, run: SchedRun, pace: Callable[[SchedRun], None] | None = None,
          during_model: Sequence[tuple[float, Callable[[], None]]] = ()) -> None:
    probe.step_blocked = 0.0
    driver.step(during_model)
    run.steps += 1
    run.blocked_per_step.append(probe.step_blocked)
    if pace is not None:
        pace(run)


__all__ = ["ARRIVALS_PER_STEP", "CallProbe", "MODEL_STEP_S", "Mode", "Prompts", "SchedRun", "TokenTally",
           "Workload", "merge_runs", "mode", "run_mode"]
