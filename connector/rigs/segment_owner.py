"""A process that lends a Mooncake store its memory, so KV saved by an engine outlives that engine.

Why: in Mooncake's ``embedded`` mode each engine lends its own segment and its KV dies with it; engines in
``standalone-store`` mode lend none, and the values they save live in a separate owner's segment. This is
that owner, real and minimal: a ``MooncakeDistributedStore`` client with a global segment, in a child process
started and stopped by pid (:class:`~.processes.ChildProcess`), held open until it is stopped.
"""

from __future__ import annotations

import sys

from mooncake_lookout.connector.rigs.processes import ChildProcess

SEGMENT_BYTES = 256 << 20
READY = "segment owner ready"

_SCRIPT = f"""
import sys
from mooncake_lookout.connector.server.store import open_store
store = open_store(sys.argv[1], global_segment_size=int(sys.argv[2]), local_buffer_size=16 << 20)
print({READY!r}, flush=True)
sys.stdin.read()  # until stopped (or the pipe closes)
store.close()
"""


class SegmentOwner:
    """A child holding a ``segment_bytes`` segment on the master at ``master_address``; a context manager."""

    def __init__(self, master_address: str, segment_bytes: int = SEGMENT_BYTES, start_timeout_s: float = 60.0) -> None:
        self.master_address, self.segment_bytes, self.start_timeout_s = master_address, segment_bytes, start_timeout_s
        self._child: ChildProcess | None = None

    def start(self) -> SegmentOwner:
        child = ChildProcess([sys.executable, "-c", _SCRIPT, self.master_address, str(self.segment_bytes)],
                             stdin=True, keep_lines=200, name="segment-owner")
        self._child = child
        try:
            child.wait_line(READY, self.start_timeout_s, "its segment mounted")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int:
        assert self._child is not None, "not started"
        return self._child.pid

    def stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.stop()

    def __enter__(self) -> SegmentOwner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["READY", "SEGMENT_BYTES", "SegmentOwner"]
