"""A lock-free way to wake a thread that waits in ``zmq.Poller.poll`` (used by transports and the server)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

_ONE = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # an eventfd takes an 8-byte count


def _write_holding_gil() -> Callable[[int, bytes, int], int] | None:
    """libc's ``write`` called without letting go of the GIL (``ctypes.PyDLL``), or ``None`` where unavailable.

    Why: ``os.write`` lets go of the GIL for the system call, and the thread it wakes (on the other core) often
    takes the GIL right there and runs its whole turn (encode, send) before the caller gets it back: inside
    vLLM's ``schedule()`` that cost 27-72 us a step on these VMs. Holding it, the woken thread runs when the
    caller next lets go (the model step). An eventfd write never blocks (non-blocking, never near overflow).
    """
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols in the process image
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write


_WRITE = _write_holding_gil()


class Waker:
    """Wakes a thread blocked in ``zmq.Poller.poll`` from any other thread, without a lock or a socket.

    An eventfd on Linux (a pipe elsewhere): register :attr:`fd` for ``zmq.POLLIN``, call :meth:`wake`
    from any thread and :meth:`clear` on the polling thread once woken. :meth:`wake` keeps the GIL: the
    woken thread runs when the caller next lets go of it, not in the middle of the caller's work.
    """

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._wfd = self.fd
        else:  # pragma: no cover - non-Linux
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._wfd, False)
        self._closed = False

    def wake(self) -> None:
        """Make the next (or current) poll on :attr:`fd` return."""
        if self._closed:
            return
        if _WRITE is not None:
            _WRITE(self._wfd, _ONE, 8)  # -1 (EAGAIN) only when already signalled enough
            return
        try:  # pragma: no cover - without libc's write in reach
            os.write(self._wfd, _ONE)
        except (BlockingIOError, OSError):  # already signalled enough, or closed
            pass

    def clear(self) -> None:
        """Consume the pending signals (polling thread)."""
        try:
            os.read(self.fd, 4096)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Release the descriptor(s); call once, after the polling thread is gone."""
        if self._closed:
            return
        self._closed = True
        os.close(self.fd)
        if self._wfd != self.fd:
            os.close(self._wfd)


__all__ = ["Waker"]
