"""One console for the tools' own processes (``demo``, ``serve``): Python logging, vLLM's and torch's loggers,
Python warnings and Mooncake's C++ log lines, with the known harmless start-up lines held back.

Why: a first run printed lines that look like errors (an ``E1201 ...`` line from Mooncake's client, vLLM's
``Failed to import from vllm._C``, ...). Each is expected on a CPU machine and says nothing is wrong;
:data:`KNOWN_LINES` lists them with the reason, and docs/troubleshooting.md quotes every one (a test keeps
the two in step). :class:`Console` hides exactly those lines, counts them, and says so in one line that
names ``--verbose``, which shows everything. Any other line, a real error included, is printed as it came.

Where the lines come from, and how each is routed:

* Python loggers (ours, vLLM's when ``VLLM_CONFIGURE_LOGGING=0``, ``warnings`` through
  ``logging.captureWarnings``): one handler on the root logger, on stderr, with :class:`KnownLineFilter`;
* torch's logger keeps its own handler (torch installs it and stops propagation): the filter is added there;
* Mooncake's client logs from C++ (glog) straight to file descriptor 2 while it sets up:
  :meth:`Console.native` holds that descriptor in a temporary file around the set-up and then prints every
  line it caught, except the known ones (nothing is lost: the lines are printed when the block ends, also
  when it raises).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownLine:
    """A start-up line that is expected and harmless: the text that identifies it, who prints it, and why."""

    text: str
    source: str
    why: str


KNOWN_LINES: tuple[KnownLine, ...] = (
    KnownLine("Logging before InitGoogleLogging()", "Mooncake (glog)",
              "Mooncake's C++ logging announces that it was not initialised by the process; it comes with the "
              "first line Mooncake logs, the one below"),
    KnownLine("Local segment descriptor not found", "Mooncake (glog, transfer_metadata.cpp)",
              "logged at ERROR level by every Mooncake client as it sets up with the P2PHANDSHAKE metadata "
              "mode, before it has registered its own segment; the set-up then succeeds"),
    KnownLine("Failed to import from vllm._C", "vLLM",
              "vLLM's CPU build has no compiled GPU kernels; the scheduler, the only part of vLLM used here, "
              "needs none"),
    KnownLine("Initializing KVConnectorBase_V1. This API is experimental", "vLLM",
              "vLLM warns once for every KV connector it builds, its own and ours alike"),
    KnownLine("Triton not available", "torch",
              "torch looks for Triton kernels; none is needed on a CPU machine"),
)


def known_line(text: str) -> KnownLine | None:
    """The :class:`KnownLine` that ``text`` is, or None."""
    return next((k for k in KNOWN_LINES if k.text in text), None)


class KnownLineFilter(logging.Filter):
    """Drops log records that are :data:`KNOWN_LINES`, counting them in ``hidden``; lets everything else through."""

    def __init__(self, hidden: Counter[str]) -> None:
        super().__init__()
        self.hidden = hidden

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        known = known_line(message)
        if known is None:
            return True
        self.hidden[known.text] += 1
        return False


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Console:
    """The logging of one tool process; ``verbose`` shows every line, the known ones included.

    Call :meth:`install` once, before vLLM is imported (it sets ``VLLM_CONFIGURE_LOGGING=0`` unless the
    caller set it, so that vLLM's loggers reach the one handler instead of vLLM's own).
    """

    def __init__(self, *, verbose: bool = False, level: str = "WARNING", stream: object = None) -> None:
        self.verbose = verbose
        self.level = level.upper()
        self.stream = stream if stream is not None else sys.stderr
        self.hidden: Counter[str] = Counter()
        self.filter = KnownLineFilter(self.hidden)
        self.handler: logging.Handler | None = None

    def install(self) -> Console:
        """One handler on the root logger (level, format, the filter unless verbose); Python warnings through it."""
        if not self.verbose:
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        handler = logging.StreamHandler(self.stream)  # type: ignore[arg-type]
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        if not self.verbose:
            handler.addFilter(self.filter)
        root = logging.getLogger()
        for old in list(root.handlers):
            root.removeHandler(old)
        root.addHandler(handler)
        root.setLevel(self.level)
        logging.captureWarnings(True)
        self.handler = handler
        return self

    def adopt_torch(self) -> None:
        """Import torch (vLLM will) and filter its own handlers too: torch installs them and stops propagation."""
        if self.verbose:
            return
        try:
            import torch  # noqa: F401
        except ImportError:
            return
        for handler in logging.getLogger("torch").handlers:
            if self.filter not in handler.filters:
                handler.addFilter(self.filter)

    @contextlib.contextmanager
    def native(self) -> Iterator[None]:
        """Hold what C++ code writes to file descriptor 2 in the block; then print it without the known lines."""
        if self.verbose:
            yield
            return
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                held.seek(0)
                self._replay(held.read().decode("utf-8", "replace"))

    def _replay(self, text: str) -> None:
        kept = []
        for line in text.splitlines(keepends=True):
            known = known_line(line)
            if known is None:
                kept.append(line)
            else:
                self.hidden[known.text] += 1
        if kept:
            os.write(2, "".join(kept).encode())

    def summary(self) -> str | None:
        """One line on what was hidden and how to see it; None when nothing was."""
        if not self.hidden:
            return None
        sources = sorted({k.source.split(" (")[0] for k in KNOWN_LINES if self.hidden.get(k.text)})
        count = sum(self.hidden.values())
        lines = f"{count} known start-up line{'s' if count != 1 else ''}"
        return (f"({lines} of {' and '.join(sources)} hidden, none of them a fault: --verbose shows them, "
                "docs/troubleshooting.md says what each means)")


__all__ = ["KNOWN_LINES", "LOG_FORMAT", "Console", "KnownLine", "KnownLineFilter", "known_line"]
