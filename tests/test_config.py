"""Configuration: one validated object from kv_connector_extra_config; bad keys and values fail naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mooncake_lookout.connector.config import KEYS, SYNC_BLOCK_MS, TIMEOUT_MS, ConfigError, LookupConfig


def test_defaults_are_upstreams() -> None:
    config = LookupConfig.from_extra_config({})
    assert config.lookup_async is False and config.mode == "sync"
    assert config == LookupConfig()
    resolved = {**{k.name: k.default for k in KEYS}, "lookup_timeout_ms": TIMEOUT_MS,  # auto
                "lookup_block_ms": SYNC_BLOCK_MS}
    assert resolved == dataclasses.asdict(config)


def test_the_deadline_is_seconds_in_either_mode_and_a_blocking_call_a_short_bound() -> None:
    """`lookup_timeout_ms: auto` is seconds in either mode (a slow answer still beats a recompute: a real engine
    at load lost hits to a 100 ms deadline); what bounds the scheduler's block is `lookup_block_ms`."""
    assert LookupConfig().lookup_timeout_ms == LookupConfig(lookup_async=True).lookup_timeout_ms == TIMEOUT_MS
    assert LookupConfig().block_s == SYNC_BLOCK_MS / 1e3 == 0.1
    assert TIMEOUT_MS >= 10 * SYNC_BLOCK_MS
    assert LookupConfig.from_extra_config({"lookup_async": True, "lookup_timeout_ms": 250}).timeout_s == 0.25
    # A deadline set by hand keeps its meaning from before lookup_block_ms: a blocking call waits up to it.
    for set_by_hand in (40, 5000):
        assert LookupConfig.from_extra_config({"lookup_timeout_ms": set_by_hand}).block_s == set_by_hand / 1e3
    assert LookupConfig(lookup_timeout_ms=5000, lookup_block_ms=50).block_s == 0.05
    assert LookupConfig(lookup_block_ms=500, lookup_timeout_ms=200).block_s == 0.2
    again = LookupConfig.from_extra_config(LookupConfig().as_extra_config())
    assert again.lookup_timeout_ms == TIMEOUT_MS and again.lookup_block_ms == SYNC_BLOCK_MS


def test_other_connectors_keys_pass_through() -> None:
    config = LookupConfig.from_extra_config({"load_async": True, "lookup_rpc_port": 3, "lookup_async": True})
    assert config.lookup_async is True and config.mode == "async"


@pytest.mark.parametrize("extra, named", [
    ({"lookup_asynch": True}, "lookup_asynch"),
    ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
    ({"lookup_timeout_ms": "100"}, "lookup_timeout_ms"),
    ({"lookup_max_pending": 0}, "lookup_max_pending"),
    ({"lookup_max_pending": 1.5}, "lookup_max_pending"),
    ({"lookup_async": 1}, "lookup_async"),
    ({"lookup_transport": "grpc"}, "lookup_transport"),
    ({"lookup_wait_us": -1}, "lookup_wait_us"),
    ({"lookup_breaker_cooldown_s": 0}, "lookup_breaker_cooldown_s"),
    ({"lookup_breaker_failure_rate": 0}, "lookup_breaker_failure_rate"),
    ({"lookup_breaker_failure_rate": 1.5}, "lookup_breaker_failure_rate"),
    ({"lookup_breaker_window_s": 0}, "lookup_breaker_window_s"),
    ({"lookup_timeout_ms": "soon"}, "lookup_timeout_ms"),
    ({"lookup_server_address": "http://x"}, "lookup_server_address"),
])
def test_bad_keys_and_values_name_the_key(extra, named) -> None:
    with pytest.raises(ConfigError, match=named):
        LookupConfig.from_extra_config(extra)


def test_every_bad_key_is_named_in_one_line() -> None:
    """A deployment learns every bad key from one failed start (an engine costs tens of seconds to fail)."""
    with pytest.raises(ConfigError) as failed:
        LookupConfig.from_extra_config({"lookup_timeout_msec": 100, "lookup_max_pending": 0, "lookup_async": 1,
                                        "lookup_wait_us": 50, "lookup_typo": 1})
    message = str(failed.value)
    assert "\n" not in message
    for named in ("lookup_timeout_msec", "lookup_max_pending", "lookup_async", "lookup_typo"):
        assert f"kv_connector_extra_config[{named!r}]" in message, named
    assert "lookup_wait_us" not in message.split("known lookup keys")[0]  # a good key is not blamed


def test_round_trip_through_extra_config() -> None:
    config = LookupConfig(lookup_async=True, lookup_wait_us=200, lookup_transport="pipelined")
    assert LookupConfig.from_extra_config(config.as_extra_config()) == config
    assert config.mode == "budget" and config.wait_s == pytest.approx(200e-6)


def test_the_configuration_page_table_is_current() -> None:
    from mooncake_lookout.connector.cli.docs import extract, render_config_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert extract(page, "config-table") == render_config_table(), \
        "docs/configuration.md's table is stale: python -m mooncake_lookout.connector.cli.docs"
