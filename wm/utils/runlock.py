"""One owner per folder: a lock file taken with a POSIX record lock (fcntl) before anything is
written. A run folder's is `<run>/run.lock` (RUN); a converter's output folder's is
`<out>/.convert.lock` (CONVERSION).

The file holds the owner as JSON (host, pid, start time, command line) while it runs. When the
owner ends, a run folder's is emptied and a converter's is removed, while still locked (a data set
folder holds only the data set); a taker checks that the file it locked is still the one at the
path, so one that locked a file removed meanwhile tries again. A taker that created the file and
could not write it removes it. The lock belongs to the process,
not to its open file: forked children (DataLoader workers) do not hold it, and the kernel drops it
when the process dies, however it dies; so a trainer killed with kill -9 can be restarted at once,
while its workers still live, and a refusal always names the live holder. A file still naming an
owner whose lock is free was left by a process that was killed: it is taken over with a note. (The
process must not open and close run.lock elsewhere: closing any descriptor of the file drops a
POSIX lock; this module keeps the one it holds.) pid_alive is wm's one check of a process.

Shared filesystems: POSIX locks work across nodes on NFSv4 and on NFSv3 with lockd, on Lustre
mounted with `-o flock`, on GPFS and CephFS. Where the filesystem refuses them (ENOLCK/EOPNOTSUPP,
e.g. Lustre with `-o noflock`), the lock falls back to the file's contents: an owner named on this
host whose pid is alive, or on another host, refuses the run (delete run.lock if that run is gone).
Lustre's `-o localflock` makes locks hold per node only: two nodes could then both hold it.
Only rank 0 of a run takes the lock (it is the one that writes).
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
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from wm.utils.errors import WMError, first_line

LOCK = "run.lock"


class Use(NamedTuple):
    """Whose folder a lock guards, as its messages name it."""

    file: str  # the lock file's name in the folder
    folder: str  # "run folder"
    lock: str  # "run lock"
    owner: str  # "that run"
    other: str  # how to go elsewhere: "use another run.name"
    writable: str  # how to write elsewhere: "set run.out_dir to a writable folder"
    keep: bool  # the file stays (emptied) when released


RUN = Use(LOCK, "run folder", "run lock", "that run", "use another run.name",
          "set run.out_dir to a writable folder", keep=True)
CONVERSION = Use(".convert.lock", "output folder", "conversion lock", "that conversion", "choose another --out",
                 "choose a writable --out", keep=False)

_HELD: dict[Path, list] = {}  # lock file -> [file, count]: one process may open a run twice (tests, tools)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (of this host) still runs; another user's counts."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or no such pid can exist
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


def _refusal(folder: Path, path: Path, f, host: str, use: Use) -> WMError:
    """The one line for a folder whose lock is held: the live holder named, never a dead one."""
    d, pid = _owner(f), _holder(f)
    if pid is not None and not (d.get("pid") == pid and d.get("host") == host):
        who = f"pid {pid} on host {host}"  # the file is not (yet) its own
    elif d.get("host") == host and isinstance(d.get("pid"), int) and not pid_alive(d["pid"]):
        who = "another process (the lock file still names pid {}, which has ended)".format(d["pid"])
    else:
        who = _who(d)
    return WMError(f"{use.folder} {folder} is in use by {who} (lock {path}); wait for {use.owner} to end, stop it, "
                   f"or {use.other}")


def _open(path: Path):
    """(run.lock opened read/write, whether this call created it)."""
    try:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "r+"), True
    except FileExistsError:
        return open(path, "r+"), False


def acquire(folder: str | os.PathLike, say: Callable[[str], object] = print, use: Use = RUN) -> Path:
    """Take the lock of `folder` (created if needed) or raise WMError naming the holder."""
    folder = Path(folder).resolve()
    path = folder / use.file
    if path in _HELD:
        _HELD[path][1] += 1
        return path
    host = socket.gethostname()
    for _ in range(10):  # again if the file was replaced between opening and locking it
        try:
            folder.mkdir(parents=True, exist_ok=True)
            f, created = _open(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise WMError(f"cannot create the {use.lock} {path} ({first_line(e)}); {use.writable}") from None
        try:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise _refusal(folder, path, f, host, use) from None
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
                running = same_host and isinstance(pid, int) and pid_alive(pid)
                if not locked and (running or not same_host):
                    raise WMError(f"{use.folder} {folder} is in use by {_who(old)} (lock {path}; this "
                                  f"filesystem has no locks, so its contents decide): wait for {use.owner} to "
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
                raise WMError(f"cannot write the {use.lock} {path} ({first_line(e)}); free space on its disk, "
                              f"or {use.writable}") from None
        except BaseException:
            f.close()
            raise
        _HELD[path] = [f, 1]
        return path
    raise WMError(f"cannot take the {use.lock} {path}: the file keeps being replaced; is another program "
                  "deleting it?")


def release(folder: str | os.PathLike, use: Use = RUN) -> None:
    """Give the lock back (empty or remove the file, as `use` says; unlock); a no-op if this process
    does not hold it."""
    path = Path(folder).resolve() / use.file
    held = _HELD.get(path)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    f = _HELD.pop(path)[0]
    try:
        if use.keep:
            f.seek(0)
            f.truncate()
            f.flush()
        else:
            os.unlink(path)  # while still locked: a taker that opened it meanwhile tries again
    except OSError:
        pass
    finally:
        f.close()  # closing the descriptor drops the lock


@contextmanager
def held(folder: str | os.PathLike, say: Callable[[str], object] = print, use: Use = RUN) -> Iterator[Path]:
    """The lock of `folder` for the `with` block."""
    path = acquire(folder, say, use)
    try:
        yield path
    finally:
        release(folder, use)


def move_held(old: str | os.PathLike, new: str | os.PathLike) -> None:
    """The folder whose run lock this process holds was renamed (--fresh moved it aside)."""
    old, new = Path(old).resolve() / LOCK, Path(new).resolve() / LOCK
    if old in _HELD:
        _HELD[new] = _HELD.pop(old)
