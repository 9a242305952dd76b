"""The HTTP load of ``demo --engine`` and bench scenario (i), without an engine: the prompts it builds (token ids
with exact block boundaries, reproducible from the seed), the percentiles it reports and how it reads a
``/metrics`` page. The engine end of it runs in tests/test_demo_engine.py and tests/test_engine_modes.py.
"""

from __future__ import annotations

from mooncake_lookout.connector.bench.http_load import (
    FIRST_TOKEN,
    LoadResult,
    by_label,
    delta,
    labels_of,
    multi_turn_jobs,
    shared_prefix_jobs,
    total,
)


def test_shared_prefix_jobs_share_whole_prefixes_and_differ_after_them() -> None:
    jobs = shared_prefix_jobs(6, prefixes=3, prefix_tokens=64, own_tokens=10, seed=1)
    prompts = [job[0] for job in jobs]
    assert all(len(p) == 74 and min(p) >= FIRST_TOKEN for p in prompts)
    assert prompts[0][:64] == prompts[3][:64] != prompts[1][:64]
    assert prompts[0][64:] != prompts[3][64:]
    assert jobs == shared_prefix_jobs(6, prefixes=3, prefix_tokens=64, own_tokens=10, seed=1)
    assert jobs != shared_prefix_jobs(6, prefixes=3, prefix_tokens=64, own_tokens=10, seed=2)


def test_each_turn_of_a_conversation_extends_the_previous_one() -> None:
    (turns, other) = multi_turn_jobs(2, turns=3, context_tokens=32, turn_tokens=8, seed=0)
    assert [len(t) for t in turns] == [32, 40, 48]
    assert turns[1][:32] == turns[0] and turns[2][:40] == turns[1]
    assert other[0] != turns[0]


def test_percentiles_are_nearest_rank_in_ms() -> None:
    result = LoadResult(ttft_s=[i / 1000 for i in range(1, 101)])
    assert result.percentile_ms(50) == 50 and result.percentile_ms(99) == 99 and result.percentile_ms(100) == 100
    assert LoadResult().percentile_ms(50) is None


def test_a_metrics_page_is_read_by_name_and_labels() -> None:
    page = {'vllm:mooncake_lookup_requests_total{engine="0",model_name="tiny",outcome="hit"}': 5.0,
            'vllm:mooncake_lookup_requests_total{engine="0",model_name="tiny",outcome="miss"}': 2.0,
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"}': 320.0}
    assert labels_of('a{b="c",d="e \\"x\\""}') == ("a", {"b": "c", "d": 'e \\"x\\"'})
    assert total(page, "vllm:mooncake_lookup_requests_total") == 7.0
    assert total(page, "vllm:mooncake_lookup_requests_total", outcome="miss") == 2.0
    assert total(page, "vllm:nothing_total") is None
    assert by_label(page, "vllm:mooncake_lookup_requests_total", "outcome") == {"hit": 5.0, "miss": 2.0}
    later = {k: v + 1 for k, v in page.items()}
    assert total(delta(later, page), "vllm:external_prefix_cache_hits_total") == 1.0
