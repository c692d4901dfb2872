"""A subprocess whose merged stdout/stderr a thread reads line by line, in a session of its own:
wait for a line, for the exit (its group killed past a timeout), or kill its group. Shared by
tools/attack.py and the tests' training subprocesses (tests/helpers.py)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Hung(AssertionError):
    """The process ran past its timeout; its group was killed."""


class Proc:
    def __init__(self, cmd, env=None, cwd=ROOT):
        self.cmd = [str(c) for c in cmd]
        self.p = subprocess.Popen(self.cmd, cwd=cwd, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.q.put(line)
        self.q.put(None)

    @property
    def pid(self) -> int:
        return self.p.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> bool:
        """Read lines until one matches `pattern` (regex); False at the end of the output or at `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is None:
                self.q.put(None)
                return False
            self.lines.append(line)
            if re.search(pattern, line):
                return True
        return False

    def finish(self, timeout: float) -> int:
        """The exit status; past `timeout` the process group is killed and Hung raised."""
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self._drain()
            raise Hung(f"{' '.join(self.cmd)} did not end within {timeout:.0f} s (killed with its process group):\n"
                       f"{self.output[-4000:]}") from None
        self.t.join(10)
        self._drain()
        return rc

    def _drain(self):
        while True:
            try:
                line = self.q.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self.lines.append(line)

    def kill_group(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def group_gone(self) -> bool:
        """Whether no process of its group is left (a moment after its exit)."""
        time.sleep(0.3)
        try:
            os.killpg(self.p.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def kill(self) -> None:
        """SIGKILL the process group (while the process is unreaped: a reaped pid may be another's)."""
        if self.p.poll() is None:
            self.kill_group()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
