"""Keep the trunk's steps on one core, whichever data-plane thread takes them.

Each client's requests are served by a thread of the data plane's pool, and the shared
trunk steps in the thread of the request it serves: with two clients streaming, the
steps alternate between two threads. Linux wakes each on whichever core is idle, so
consecutive steps hop between cores and each starts with the weights, gradients and
momentum out of that core's caches. Measured on a 2-core host (the default job's
SmallCNN trunk, batch 32, one intra-op thread): 8.9 ms a step from one thread,
10.3-11.4 ms alternating between two, 8.8-9.2 ms alternating with :class:`StickyCore`
(``python -m benchmarks handoff``).

:class:`StickyCore` moves the thread that is about to step onto the core the previous
step ended on, then gives it back its whole allowed set at once, so the scheduler may
still move it when that core gets busy; the next step follows. Where the operating
system cannot do this (no ``sched_setaffinity``/``sched_getcpu``), it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable


def _sched_getcpu() -> Callable[[], int] | None:
    """Return the C library's ``sched_getcpu`` (the calling thread's core now), or None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu if getcpu() >= 0 else None


class StickyCore:
    """Start each unit of work on the core where the last one ended.

    Parameters
    ----------
    enabled : bool
        False (or an operating system without thread affinity): :meth:`enter` and
        :meth:`leave` do nothing.

    Not thread-safe by itself: call :meth:`enter` and :meth:`leave` under the lock that
    serialises the work (the trunk's).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self._getcpu = _sched_getcpu() if enabled else None
        #: The core the last unit of work ended on (None before the first).
        self.last: int | None = None
        #: Times :meth:`enter` moved a thread to :attr:`last`.
        self.moves = 0

    @property
    def active(self) -> bool:
        """Whether this host lets it move threads (and it was enabled)."""
        return self._getcpu is not None

    def enter(self) -> None:
        """Move the calling thread onto :attr:`last`, if it is elsewhere and allowed there."""
        if self._getcpu is None or self.last is None or self._getcpu() == self.last:
            return
        allowed = os.sched_getaffinity(0)  # 0: the calling thread (Linux)
        if self.last not in allowed:
            return
        try:
            os.sched_setaffinity(0, {self.last})  # the kernel moves the thread there now
        except OSError:  # the core went offline or out of the cpuset since
            return
        os.sched_setaffinity(0, allowed)  # free again: the scheduler may move it later
        self.moves += 1

    def leave(self) -> None:
        """Note the core the work ended on, for the next :meth:`enter`."""
        if self._getcpu is not None:
            self.last = self._getcpu()
