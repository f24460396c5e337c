"""A cooperative CPU-time limit for numeric work: ``with cpu_limit(1.0): ...``.

Every numeric routine gaussdp runs per request has a bounded cost (no float-step walks, bounded
root finding), but how much a bound is worth depends on inputs such as the number of distinct
events a principal has composed. A service therefore also caps the CPU time of each request: inside
``cpu_limit(seconds)`` the hot loops (the Gaussian privacy profile, the ledger's searches) call
:func:`check_work_limit`, which raises :class:`~gaussdp.errors.WorkLimitExceeded` once the calling
thread has used more than ``seconds`` of CPU since the block was entered. The ledger runs that work
before it takes any lock or charges anything, so a cancelled request has charged nothing.

The limit is a context variable (per thread and per asyncio task, no global state) and counts the
CPU time of the thread that entered the block (``time.thread_time``): other threads, and waiting
for the GIL or the database, are not counted.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gaussdp.errors import WorkLimitExceeded

__all__ = ["check_work_limit", "cpu_limit", "cpu_limited", "no_cpu_limit"]

# (thread id, thread CPU time at which the limit is reached, the limit in seconds)
_LIMIT: contextvars.ContextVar[tuple[int, float, float] | None] = contextvars.ContextVar(
    "gaussdp_cpu_limit", default=None
)


@contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Limit the numeric work of the enclosed block to ``seconds`` of this thread's CPU time.

    Nested limits keep the earlier end. ``seconds`` must be > 0.
    """
    seconds = float(seconds)
    if not seconds > 0.0:
        raise ValueError(f"seconds must be > 0, got seconds={seconds!r}")
    ident = threading.get_ident()
    end = time.thread_time() + seconds
    outer = _LIMIT.get()
    if outer is not None and outer[0] == ident and outer[1] < end:
        end, seconds = outer[1], outer[2]
    token = _LIMIT.set((ident, end, seconds))
    try:
        yield
    finally:
        _LIMIT.reset(token)


def cpu_limited() -> bool:
    """Whether an enclosing :func:`cpu_limit` applies here (one context-variable read)."""
    return _LIMIT.get() is not None


class no_cpu_limit:  # used as a function: ``with no_cpu_limit():``
    """Lift the limit for the enclosed block: for work that must not fail half-way, e.g. the
    bookkeeping after a charge was recorded (a cancelled request must have charged nothing).

    A class rather than a generator: it sits on every release's path (about 1 us less a call)."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _LIMIT.set(None)

    def __exit__(self, *exc: object) -> None:
        _LIMIT.reset(self._token)


def check_work_limit() -> None:
    """Raise :class:`~gaussdp.errors.WorkLimitExceeded` if the enclosing limit has run out."""
    limit = _LIMIT.get()
    if limit is None or limit[0] != threading.get_ident():
        return
    if time.thread_time() > limit[1]:
        raise WorkLimitExceeded(
            f"the computation needed more than {limit[2]:g} s of CPU, the limit of one request; "
            "nothing was charged or released"
        )
