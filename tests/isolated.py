"""Run a test function in a child process, so that a crash (segfault, abort, a hang) fails the
test instead of killing the whole pytest run.

One spawned worker (``concurrent.futures.ProcessPoolExecutor``) serves every call of a session:
it imports torch, triton and openmla once and inherits ``TRITON_INTERPRET`` and ``sys.path``
from this process. A call that kills the worker raises ``ChildCrashed`` here; the next call
starts a fresh worker. An exception in the call comes back as ``ChildFailed`` carrying the
child's traceback. A call that runs past its time limit is killed by ``SIGALRM`` in the
child, which counts as a crash. The function must be importable by name (module level) and
its arguments and result picklable.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest


class ChildCrashed(AssertionError):
    """The child process died (signal, abort, or the time limit) while running a call."""


class ChildFailed(AssertionError):
    """The call raised in the child; the message holds the child's traceback."""


def _with_alarm(fn, args: tuple, limit_s: int):
    signal.alarm(limit_s)  # default action: terminate the child, which the parent sees as a crash
    try:
        return fn(*args)
    except BaseException:  # noqa: BLE001 - pytest's outcome exceptions do not pickle: send the text
        raise ChildFailed(traceback.format_exc()) from None
    finally:
        signal.alarm(0)


class Isolated:
    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def run(self, fn, *args, limit_s: int = 120):
        """``fn(*args)`` in the worker; its return value, or ``ChildFailed`` with the child's traceback."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            return self._pool.submit(_with_alarm, fn, args, limit_s).result()
        except BrokenProcessPool:
            self._pool = None
            raise ChildCrashed(f"the child process died running {fn.__name__}{args!r} (crash, abort or hang)") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


@pytest.fixture(scope="session")
def isolated():
    """A session-wide child worker (see ``Isolated``)."""
    iso = Isolated()
    yield iso
    iso.close()
