"""One owner per run folder: `<run>/run.lock`, taken with flock before anything is written.

The file holds the owner as JSON (host, pid, start time, command line) while it runs, and is
emptied when the run ends; it is never deleted (deleting a lock file lets a third process lock a
fresh file while a second still holds the old one). The kernel drops a flock when its process dies,
however it dies, so a lock is never stale on the machine that holds it: a file still naming an
owner whose lock is free was left by a process that was killed. It is taken over with a note.

Shared filesystems: flock works across nodes on NFSv4 and on NFSv3 with lockd, on Lustre mounted
with `-o flock`, on GPFS and CephFS. Where the filesystem refuses flock (ENOLCK/EOPNOTSUPP, e.g.
Lustre with `-o noflock`), the lock falls back to the file's contents: an owner named on this host
whose pid is alive, or on another host, refuses the run (delete run.lock if that run is gone).
Lustre's `-o localflock` makes flock succeed per node only: two nodes could then both hold it.
Only rank 0 takes the lock (it is the one that writes).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Callable

from wm.errors import WMError, first_line

LOCK = "run.lock"

_HELD: dict[Path, list] = {}  # folder -> [file, count]: one process may open a run twice (tests, tools)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(f) -> dict:
    f.seek(0)
    try:
        d = json.loads(f.read() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return d if isinstance(d, dict) else {}


def _who(d: dict) -> str:
    return f"pid {d.get('pid', '?')} on host {d.get('host', '?')} (started {d.get('start', '?')})"


def acquire(folder: str | os.PathLike, say: Callable[[str], object] = print) -> Path:
    """Take the lock of run folder `folder` (created if needed) or raise WMError naming the holder."""
    folder = Path(folder).resolve()
    if folder in _HELD:
        _HELD[folder][1] += 1
        return folder / LOCK
    path = folder / LOCK
    try:
        folder.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        raise WMError(f"cannot create the run lock {path} ({first_line(e)}); set run.out_dir to a "
                      "writable folder") from None
    host = socket.gethostname()
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            raise WMError(f"run folder {folder} is in use by {_who(_owner(f))} (lock {path}); wait for "
                          "that run to end, stop it, or use another run.name") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            locked = False  # this filesystem has no flock: the file's contents decide
        old = _owner(f)
        if old and old.get("pid") != os.getpid():
            same_host = old.get("host") == host
            pid = old.get("pid")
            running = same_host and isinstance(pid, int) and _alive(pid)
            if not locked and (running or not same_host):
                raise WMError(f"run folder {folder} is in use by {_who(old)} (lock {path}; this "
                              "filesystem has no flock, so its contents decide): wait for that run to "
                              "end, or delete the lock file if it is gone")
            why = "which is no longer running" if same_host and not running else "which did not release it"
            say(f"note: took over the lock {path} left by {_who(old)}, {why}")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"host": host, "pid": os.getpid(),
                            "start": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "argv": sys.argv}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    except BaseException:
        f.close()
        raise
    _HELD[folder] = [f, 1]
    return path


def release(folder: str | os.PathLike) -> None:
    """Give the lock back (empty the file, unlock); a no-op if this process does not hold it."""
    folder = Path(folder).resolve()
    held = _HELD.get(folder)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    f = _HELD.pop(folder)[0]
    try:
        f.seek(0)
        f.truncate()
        f.flush()
    except OSError:
        pass
    finally:
        f.close()  # closing the descriptor drops the flock


def move_held(old: str | os.PathLike, new: str | os.PathLike) -> None:
    """The folder whose lock this process holds was renamed (--fresh moved it aside)."""
    old, new = Path(old).resolve(), Path(new).resolve()
    if old in _HELD:
        _HELD[new] = _HELD.pop(old)
