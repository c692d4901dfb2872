"""One owner per run folder: `<run>/run.lock`, taken with a POSIX record lock (fcntl) before
anything is written.

The file holds the owner as JSON (host, pid, start time, command line) while it runs, and is
emptied when the run ends; it is not deleted (a process that opened it could then lock an orphan
while a third locks a fresh file; a taker checks that the file it locked is still the one at the
path), except by a taker that created it and could not write it. The lock belongs to the process,
not to its open file: forked children (DataLoader workers) do not hold it, and the kernel drops it
when the process dies, however it dies; so a trainer killed with kill -9 can be restarted at once,
while its workers still live, and a refusal always names the live holder. A file still naming an
owner whose lock is free was left by a process that was killed: it is taken over with a note. (The
process must not open and close run.lock elsewhere: closing any descriptor of the file drops a
POSIX lock; this module keeps the one it holds.)

Shared filesystems: POSIX locks work across nodes on NFSv4 and on NFSv3 with lockd, on Lustre
mounted with `-o flock`, on GPFS and CephFS. Where the filesystem refuses them (ENOLCK/EOPNOTSUPP,
e.g. Lustre with `-o noflock`), the lock falls back to the file's contents: an owner named on this
host whose pid is alive, or on another host, refuses the run (delete run.lock if that run is gone).
Lustre's `-o localflock` makes locks hold per node only: two nodes could then both hold it.
Only rank 0 takes the lock (it is the one that writes).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import struct
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


def _holder(f) -> int | None:
    """The pid that holds a conflicting POSIX lock on `f` (Linux's struct flock), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return None
    kind, _, _, _, pid = struct.unpack("hhqqi4x", got)
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None


def _refusal(folder: Path, path: Path, f, host: str) -> WMError:
    """The one line for a folder whose lock is held: the live holder named, never a dead one."""
    d, pid = _owner(f), _holder(f)
    if pid is not None and not (d.get("pid") == pid and d.get("host") == host):
        who = f"pid {pid} on host {host}"  # the file is not (yet) its own
    elif d.get("host") == host and isinstance(d.get("pid"), int) and not _alive(d["pid"]):
        who = "another process (the lock file still names pid {}, which has ended)".format(d["pid"])
    else:
        who = _who(d)
    return WMError(f"run folder {folder} is in use by {who} (lock {path}); wait for that run to end, stop it, "
                   "or use another run.name")


def _open(path: Path):
    """(run.lock opened read/write, whether this call created it)."""
    try:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "r+"), True
    except FileExistsError:
        return open(path, "r+"), False


def acquire(folder: str | os.PathLike, say: Callable[[str], object] = print) -> Path:
    """Take the lock of run folder `folder` (created if needed) or raise WMError naming the holder."""
    folder = Path(folder).resolve()
    if folder in _HELD:
        _HELD[folder][1] += 1
        return folder / LOCK
    path = folder / LOCK
    host = socket.gethostname()
    for _ in range(10):  # again if the file was replaced between opening and locking it
        try:
            folder.mkdir(parents=True, exist_ok=True)
            f, created = _open(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise WMError(f"cannot create the run lock {path} ({first_line(e)}); set run.out_dir to a "
                          "writable folder") from None
        try:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise _refusal(folder, path, f, host) from None
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                locked = False  # this filesystem has no locks: the file's contents decide
            try:
                same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                f.close()
                continue
            old = _owner(f)
            if old and old.get("pid") != os.getpid():
                same_host = old.get("host") == host
                pid = old.get("pid")
                running = same_host and isinstance(pid, int) and _alive(pid)
                if not locked and (running or not same_host):
                    raise WMError(f"run folder {folder} is in use by {_who(old)} (lock {path}; this "
                                  "filesystem has no locks, so its contents decide): wait for that run to "
                                  "end, or delete the lock file if it is gone")
                why = "which is no longer running" if same_host and not running else "which did not release it"
                say(f"note: took over the lock {path} left by {_who(old)}, {why}")
            try:
                f.seek(0)
                f.truncate()
                f.write(json.dumps({"host": host, "pid": os.getpid(),
                                    "start": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                    "argv": sys.argv}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                if created:  # ours, locked, unwritable: nothing of this run is left behind
                    os.unlink(path)
                raise WMError(f"cannot write the run lock {path} ({first_line(e)}); free space on its disk, "
                              "or set run.out_dir to a writable folder") from None
        except BaseException:
            f.close()
            raise
        _HELD[folder] = [f, 1]
        return path
    raise WMError(f"cannot take the run lock {path}: the file keeps being replaced; is another program "
                  "deleting it?")


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
        f.close()  # closing the descriptor drops the lock


def move_held(old: str | os.PathLike, new: str | os.PathLike) -> None:
    """The folder whose lock this process holds was renamed (--fresh moved it aside)."""
    old, new = Path(old).resolve(), Path(new).resolve()
    if old in _HELD:
        _HELD[new] = _HELD.pop(old)
