"""The sizing rig behind docs/operations.md, on a real master and client (small numbers; the doc quotes 100,000 keys).

It checks what the doc's sizing advice rests on: every key put is on the master, the master's memory grows with
the keys, and a client's segment is anonymous memory of its own process, committed as data lands (it counts
against the container's memory limit, not against /dev/shm).
"""

from __future__ import annotations

from mooncake_lookout.connector.rigs.sizing import main, measure_client, measure_master

MIB = 1 << 20


def test_the_master_holds_every_key_and_grows_with_them() -> None:
    report = measure_master(4000, steps=2)
    assert report["keys"] == 4000
    assert [m["keys"] for m in report["marks"]] == [2000, 4000]
    assert report["marks"][-1]["grown_bytes"] > report["marks"][0]["grown_bytes"] > 0


def test_a_clients_segment_is_its_own_anonymous_memory_committed_as_data_lands() -> None:
    report = measure_client(segment_mib=256, buffer_mib=16, fill_mib=64)
    setup = report["after_setup"]["anon_bytes"] - report["before"]["anon_bytes"]
    filled = report["after_fill"]["anon_bytes"] - report["after_setup"]["anon_bytes"]
    assert setup < 64 * MIB  # a 256 MiB segment mounted: not committed up front
    assert filled >= 48 * MIB  # 64 MiB held: committed in the client's own memory
    assert report["shared_mappings"] == []  # no /dev/shm file, no memfd


def test_the_command_prints_both_measurements(capsys) -> None:
    assert main(["--keys", "2000", "--segment-mib", "64", "--buffer-mib", "16", "--fill-mib", "8"]) == 0
    out = capsys.readouterr().out
    assert "master_key_count 2000" in out and "B/key" in out and "mappings of /dev/shm or memfds: 0" in out
