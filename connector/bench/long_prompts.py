"""Bench scenario (f): prompt length, from 8 to 4,096 blocks, through vLLM's real scheduler, both clients async.

Why: a lookup carries every block hash of its prompt, so its cost on the scheduler's thread grows with
the prompt: copying and joining the hashes, encoding the frame, building the store keys. At 4,096 blocks
(65,536 tokens) that is 131 KB of hashes per lookup. This runs scenario (c)'s set-up (:mod:`.sched`:
vLLM's V1 ``Scheduler``, a made-up model step) with upstream's
connector and ours, both ``lookup_async``, for each prompt length, and reports per length:

* the cost of one ``get_num_new_matched_tokens`` call (the connector's lookup calls);
* the mean time of one ``schedule()`` call per step (it holds every lookup call of the step and, for
  ours, ``end_step``);
* the time from a request's arrival to its answer.

Requests arrive as in a live engine: at a random moment of the model step (vLLM's input thread builds them
while the model runs), and are admitted at the next step's start. Each connector starts its lookup where it
can: upstream's at its first scheduling attempt, ours on the input thread (``lookup_on_arrival``).

Each length runs in ``rounds`` rounds, the two clients alternating (ABBA: upstream, ours, ours, upstream, ...),
and each client's rounds are pooled, so drift on a shared machine hits both alike. Our connector carries only
what vLLM attaches to it (no counting observer of the bench's), as upstream's does.

The store holds half of every prompt (the shared prefix) and the whole of every other one; each request ends
in a block of its own, so its lookup is asked (a request whose every block vLLM's own prefix cache holds is
answered at once, with no lookup: requests recur over a few prompts here, and would soon all be). Long prompts
arrive less often and the runs are shorter, so the scenario stays bounded in time; the scheduler gets a
``max_model_len`` and KV blocks to match.

:func:`run_load` is (f) under load (target f-load): 64-block prompts arriving faster than upstream's one
executor thread answers them (one round trip at a time), so its answers fall behind by steps; ours sends a
step's lookups in one frame, answered with one store call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.bench.rig import BLOCK_SIZE, Rig
from mooncake_lookout.connector.bench.sched import Mode, Workload, merge_runs, mode, run_mode
from mooncake_lookout.connector.bench.turns import abba_seat

MODES = (mode("upstream async", False, lookup_async=True), mode("ours async", True, lookup_async=True))


@dataclass(frozen=True)
class Length:
    """One prompt length's run: blocks per prompt, arrivals, steps, prompts filled in the store."""

    blocks: int
    steps: int
    arrivals_per_step: int = 1
    arrival_every: int = 1
    fill: int = 16

    @property
    def max_model_len(self) -> int:
        """Tokens the scheduler must take: the prompt, its partial block and the tokens generated."""
        return max(2048, (self.blocks + 1) * BLOCK_SIZE + 64)

    def num_blocks(self) -> int:
        """KV blocks for the requests alive at once (a few), with room for vLLM's own prefix cache."""
        return max(16_384, 8 * (self.blocks + 2))


    def workload(self) -> Workload:
        """The length's prompts: half of each is a prefix shared with every other prompt, the last block each
        request's own (so vLLM's own prefix cache never holds a whole prompt, and every lookup is asked)."""
        return Workload(prompt_blocks=self.blocks, prefix_blocks=max(1, self.blocks // 2), num_prefixes=2,
                        seed=1000 + self.blocks, fill=self.fill, own_last_block=True)


FULL = (Length(8, 200, 4), Length(64, 200, 2), Length(512, 120, 1, 2, 8), Length(4096, 60, 1, 6, 4))
QUICK = (Length(8, 40, 4), Length(64, 40, 2), Length(512, 24, 1, 2, 4), Length(4096, 12, 1, 6, 2))
FULL_ROUNDS, QUICK_ROUNDS = 10, 2
# f-load: 64-block prompts, LOAD_ARRIVALS a step (upstream's one thread answers about 4 a step here)
LOAD_ARRIVALS = 8
FULL_LOAD = Length(64, 150, LOAD_ARRIVALS, fill=64)
QUICK_LOAD = Length(64, 30, LOAD_ARRIVALS, fill=16)


def abba(rounds: int) -> list[int]:
    """The order of ``rounds`` rounds of two clients: 0, 1, 1, 0, 0, 1, ... (each round, both clients)."""
    return [abba_seat(i) for i in range(2 * rounds)]


def run_length(rig: Rig, length: Length, *, rounds: int, model_step_s: float = 0.0015,
               modes: Sequence[Mode] = MODES, first_client: int = 0) -> dict[str, Any]:
    """One length: ``rounds`` runs of each of ``modes`` (two clients, ABBA order from ``first_client``), pooled."""
    workload = length.workload()
    runs: dict[str, list[Any]] = {m.label: [] for m in modes}
    for who in abba(rounds):
        m = modes[(who + first_client) % 2]
        runs[m.label].append(run_mode(
            rig, workload, m, arrivals_per_step=length.arrivals_per_step, arrival_every=length.arrival_every,
            steps=length.steps, model_step_s=model_step_s, first_request=0, num_blocks=length.num_blocks(),
            max_model_len=length.max_model_len, drain_s=10.0, tally=False, arrive_in_step=True))
    return {"blocks": length.blocks, "steps": length.steps, "rounds": rounds,
            "arrivals_per_step": length.arrivals_per_step, "arrival_every": length.arrival_every,
            "modes": {m.label: merge_runs(runs[m.label]).as_dict() for m in modes}}


def run(rig: Rig, lengths: Sequence[Length] = FULL, *, rounds: int = FULL_ROUNDS,
        model_step_s: float = 0.0015) -> dict[str, Any]:
    """Scenario (f): for each length, upstream async and ours async in ABBA rounds (who starts alternates)."""
    return {"model_step_ms": model_step_s * 1e3,
            "lengths": [run_length(rig, length, rounds=rounds, model_step_s=model_step_s, first_client=i % 2)
                        for i, length in enumerate(lengths)]}


def run_load(rig: Rig, length: Length = FULL_LOAD, *, rounds: int = 2, model_step_s: float = 0.0015) -> dict[str, Any]:
    """Target f-load: (f) with prompts arriving faster than upstream's one executor thread answers."""
    out = run_length(rig, length, rounds=rounds, model_step_s=model_step_s)
    out["model_step_ms"] = model_step_s * 1e3
    return out


__all__ = ["FULL", "FULL_LOAD", "FULL_ROUNDS", "LOAD_ARRIVALS", "Length", "MODES", "QUICK", "QUICK_LOAD",
           "QUICK_ROUNDS", "abba", "run", "run_length", "run_load"]
