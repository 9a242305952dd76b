"""Bench scenario (f): prompt length, from 8 to 4,096 blocks, through vLLM's real scheduler, both clients async.

Why: a lookup carries every block hash of its prompt, so its cost on the scheduler's thread grows with
the prompt: copying and joining the hashes, encoding the frame, building the store keys. At 4,096 blocks
(65,536 tokens) that is 131 KB of hashes per lookup. This runs scenario (c)'s set-up (:mod:`.sched`:
vLLM's V1 ``Scheduler``, requests arriving before a step, a made-up model step) with upstream's
connector and ours, both ``lookup_async``, for each prompt length, and reports per length:

* the cost of one ``get_num_new_matched_tokens`` call (the connector's lookup calls);
* the mean time of one ``schedule()`` call per step (it holds every lookup call of the step and, for
  ours, ``end_step``);
* the time from a request's arrival to its answer.

The store holds half of every prompt (the shared prefix) and the whole of every other one. Long prompts
arrive less often and the runs are shorter, so the scenario stays bounded in time; the scheduler gets a
``max_model_len`` and KV blocks to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.bench.rig import BLOCK_SIZE, Rig
from mooncake_lookout.connector.bench.sched import Workload, mode, run_mode

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


FULL = (Length(8, 200, 4), Length(64, 200, 2), Length(512, 120, 1, 2, 8), Length(4096, 60, 1, 6, 4))
QUICK = (Length(8, 40, 4), Length(64, 40, 2), Length(512, 24, 1, 2, 4), Length(4096, 12, 1, 6, 2))


def run(rig: Rig, lengths: Sequence[Length] = FULL, *, model_step_s: float = 0.0015) -> dict[str, Any]:
    """Scenario (f): for each length, upstream async then ours async (the order alternates by length)."""
    out: dict[str, Any] = {"lengths": []}
    for i, length in enumerate(lengths):
        workload = Workload(prompt_blocks=length.blocks, prefix_blocks=max(1, length.blocks // 2), num_prefixes=2,
                            seed=1000 + length.blocks, fill=length.fill)
        modes = MODES if i % 2 == 0 else MODES[::-1]
        runs = {}
        for m in modes:
            runs[m.label] = run_mode(rig, workload, m, arrivals_per_step=length.arrivals_per_step,
                                     arrival_every=length.arrival_every, steps=length.steps,
                                     model_step_s=model_step_s, first_request=0, num_blocks=length.num_blocks(),
                                     max_model_len=length.max_model_len, drain_s=10.0).as_dict()
        out["lengths"].append({"blocks": length.blocks, "steps": length.steps,
                               "arrivals_per_step": length.arrivals_per_step, "arrival_every": length.arrival_every,
                               "modes": {m.label: runs[m.label] for m in MODES}})
    return out


__all__ = ["FULL", "Length", "MODES", "QUICK", "run"]
