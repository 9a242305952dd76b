"""Load for a real engine over HTTP: shared-prefix and multi-turn prompts, several concurrent clients, TTFT.

Why: ``demo --engine`` and bench scenario (i) measure what a user of ``vllm serve`` sees, so they talk to it as
users do: streaming ``/v1/completions`` over HTTP, greedy (temperature 0, fixed seed), several clients at once.
Prompts are token ids drawn from a seeded generator (no tokenizer involved, so their block boundaries are
exact): a shared-prefix prompt is one of a few prefixes of whole blocks followed by tokens of its own; a
conversation's turn is the previous turn's prompt plus new tokens, so each turn finds the previous one saved.
The time to first token is the time from sending a request to its first streamed chunk.

A job is a sequence of prompts one client sends in order (one prompt for shared-prefix, a conversation's turns
for multi-turn); clients take jobs from a shared queue until none is left or the time is up. Also here: reading
a ``/metrics`` page and the deltas of its counters.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_lookout.connector.rigs.master import read_metrics

FIRST_TOKEN = 3  # ids 0-2 are the tiny tokenizer's specials
MODEL_NAME = "tiny"  # the engines' --served-model-name
_SERIES = re.compile(r'^([^{]+)(?:\{(.*)\})?$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def shared_prefix_jobs(n: int, *, prefixes: int, prefix_tokens: int, own_tokens: int, seed: int,
                       vocab: int = 2048) -> list[list[list[int]]]:
    """``n`` one-prompt jobs: prefix ``i % prefixes`` (``prefix_tokens`` long) then ``own_tokens`` of its own."""
    rng = random.Random(seed)
    heads = [_tokens(rng, prefix_tokens, vocab) for _ in range(prefixes)]
    return [[heads[i % prefixes] + _tokens(rng, own_tokens, vocab)] for i in range(n)]


def multi_turn_jobs(conversations: int, *, turns: int, context_tokens: int, turn_tokens: int, seed: int,
                    vocab: int = 2048) -> list[list[list[int]]]:
    """One job per conversation: turn ``k``'s prompt is turn ``k-1``'s plus ``turn_tokens`` new tokens."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(conversations):
        prompt = _tokens(rng, context_tokens, vocab)
        turns_of = [list(prompt)]
        for _ in range(turns - 1):
            prompt = prompt + _tokens(rng, turn_tokens, vocab)
            turns_of.append(list(prompt))
        jobs.append(turns_of)
    return jobs


@dataclass
class LoadResult:
    """What one load run saw: each request's time to first token (s), failures, requests, wall seconds."""

    ttft_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    requests: int = 0
    seconds: float = 0.0
    texts: list[str] = field(default_factory=list)

    def percentile_ms(self, q: float) -> float | None:
        """The ``q``-th percentile (0-100) of the time to first token in ms (nearest rank), None if none."""
        if not self.ttft_s:
            return None
        ordered = sorted(self.ttft_s)
        index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
        return ordered[index] * 1e3

    def merge(self, other: LoadResult) -> None:
        """Add ``other``'s requests to these (turns of one engine's run)."""
        self.ttft_s += other.ttft_s
        self.failures += other.failures
        self.texts += other.texts
        self.requests += other.requests
        self.seconds += other.seconds


async def _complete(session: Any, url: str, prompt: list[int], max_tokens: int, result: LoadResult) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    text = []
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            result.failures.append(f"HTTP {reply.status}: {(await reply.text())[:200]}")
            return
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "choices" not in chunk:  # the server ended the stream with an error object
                result.failures.append(f"stream error: {str(chunk.get('error', chunk))[:300]}")
                return
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk["choices"][0].get("text", ""))
    result.requests += 1
    if first is not None:
        result.ttft_s.append(first)
    result.texts.append("".join(text))


async def _run(url: str, jobs: Sequence[Sequence[list[int]]], clients: int, max_tokens: int,
               seconds: float | None, timeout_s: float) -> LoadResult:
    import aiohttp

    result = LoadResult()
    queue: asyncio.Queue[Sequence[list[int]]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    t0 = time.perf_counter()
    end = None if seconds is None else t0 + seconds

    async def client(session: Any) -> None:
        while not queue.empty() and (end is None or time.perf_counter() < end):
            job = queue.get_nowait()
            for prompt in job:
                try:
                    await _complete(session, url, prompt, max_tokens, result)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    result.failures.append(f"{type(exc).__name__}: {exc}")

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    result.seconds = time.perf_counter() - t0
    return result


def run_load(url: str, jobs: Sequence[Sequence[list[int]]], *, clients: int, max_tokens: int = 8,
             seconds: float | None = None, timeout_s: float = 60.0) -> LoadResult:
    """Send ``jobs`` to the engine at ``url`` from ``clients`` concurrent clients (until done, or ``seconds``)."""
    return asyncio.run(_run(url, jobs, clients, max_tokens, seconds, timeout_s))


def scrape(base_url: str) -> dict[str, float]:
    """An engine's ``/metrics`` as ``{series: value}`` (series with their labels, as the page writes them)."""
    return read_metrics(base_url, timeout_s=10.0)


def labels_of(series: str) -> tuple[str, dict[str, str]]:
    """``name{a="x"}`` -> (``name``, ``{"a": "x"}``)."""
    match = _SERIES.match(series)
    if match is None:
        return series, {}
    return match.group(1), dict(_LABEL.findall(match.group(2) or ""))


def total(page: dict[str, float], name: str, **labels: str) -> float | None:
    """The sum of ``name``'s series whose labels include ``labels``; None when the page has no such series."""
    found = None
    for series, value in page.items():
        got, have = labels_of(series)
        if got == name and all(have.get(k) == v for k, v in labels.items()):
            found = (found or 0.0) + value
    return found


def by_label(page: dict[str, float], name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s series summed per value of ``label`` (those whose labels include ``labels``)."""
    out: dict[str, float] = {}
    for series, value in page.items():
        got, have = labels_of(series)
        if got == name and label in have and all(have.get(k) == v for k, v in labels.items()):
            out[have[label]] = out.get(have[label], 0.0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counter deltas between two scrapes of one engine (series missing before count from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


__all__ = ["FIRST_TOKEN", "MODEL_NAME", "LoadResult", "by_label", "delta", "labels_of", "multi_turn_jobs",
           "run_load", "scrape", "shared_prefix_jobs", "total"]
