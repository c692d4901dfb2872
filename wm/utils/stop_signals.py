"""SIGTERM and SIGINT for programs that have nothing to save mid-way (export): the signal raises
:class:`wm.utils.errors.Stopped` in the main thread, so `finally` blocks remove temporary files on the way
out, no `except Exception` swallows it, and run_cli ends the program with one line saying what was
finished (`describe()`, asked when the signal comes) and the exit status of that signal."""

from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator

from wm.utils.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_with_one_line(describe: Callable[[str], str]) -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT raise Stopped(signum, describe(signal name))."""
    def handler(signum, frame):
        raise Stopped(signum, describe(signal.Signals(signum).name))

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
