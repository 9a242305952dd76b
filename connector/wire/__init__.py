"""Wire formats: the bytes a lookup and its answer travel as, one module per format.

* :mod:`.pipelined`: our versioned, id-tagged msgspec frames (DEALER/ROUTER; ``docs/protocol.md``);
* :mod:`.upstream`: vLLM 0.33's own lookup channel format, byte for byte (REQ/REP).

Both ends of each format import the same module, so client and server cannot disagree. Callers import
the modules themselves (``from mooncake_lookout.connector.wire import pipelined``).
"""

from __future__ import annotations

from mooncake_lookout.connector.wire import pipelined, upstream

__all__ = ["pipelined", "upstream"]
