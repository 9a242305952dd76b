"""A lock-free way to wake a thread that waits in ``zmq.Poller.poll`` (used by transports and the server)."""

from __future__ import annotations

import os


class Waker:
    """Wakes a thread blocked in ``zmq.Poller.poll`` from any other thread, without a lock or a socket.

    An eventfd on Linux (a pipe elsewhere): register :attr:`fd` for ``zmq.POLLIN``, call :meth:`wake`
    from any thread and :meth:`clear` on the polling thread once woken.
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
        try:
            os.write(self._wfd, b"\x01\x00\x00\x00\x00\x00\x00\x00")
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
