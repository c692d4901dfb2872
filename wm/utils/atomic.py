"""Durable, atomic file replacement: the one way wm puts a file under its final name.

Write to `.<name>.tmp-<pid>` in the same folder, flush, fsync, `os.replace` onto the name, then
fsync the folder so the rename itself survives a power cut. A reader therefore sees the old file
or the complete new one, never a half-written one; a failure removes the temporary and leaves the
old file as it was. Writers that need a path rather than a file object (h5py shards, onnx.save)
write to `tmp_path` and `publish` it. `clean_temps` removes what a killed writer left.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional, Any, Callable

from wm.utils.errors import WMError


def tmp_path(path: str | os.PathLike) -> Path:
    """The temporary name beside `path` (hidden, per process, never mistaken for the real file)."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make the folder's entries (a rename) durable. File systems that cannot fsync a folder
    (EINVAL) and write-only folders (EACCES/EPERM) are let be; other errors propagate."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Move a complete, flushed temporary (written by a library, e.g. onnx.save) onto its final
    name and make the rename durable."""
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def discard(tmp: str | os.PathLike) -> None:
    """Remove a temporary if it is there (after a failed write; a failure to remove it must not
    hide the error that made it stale)."""
    try:
        os.unlink(tmp)
    except OSError:
        pass


def write_atomic(path: str | os.PathLike, write: Callable[[Any], object]) -> None:
    """Put `path` in place atomically and durably, its bytes written by `write(file)`. On any
    failure (a full disk included) the temporary is removed, `path` is left as it was, and the
    error propagates: the caller turns it into one line."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview | str) -> int:
    """Atomically replace `path` with `data` (str is written as UTF-8); returns the byte count."""
    view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
    write_atomic(path, lambda f: f.write(view))
    return view.nbytes


_TEMP = re.compile(r"\..+\.tmp-\d+")


def clean_temps(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporaries (files or folders) that killed writers left in `folder`; returns
    them. Only for a folder this process owns (holds its lock): every temporary there is stale."""
    folder, removed = Path(folder), []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return removed
    for n in names:
        p = folder / n
        if not _TEMP.fullmatch(n):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:  # a leftover, not a failure: say so and go on
            warnings.warn(f"cannot remove the stale temporary {p}: {e.strerror or e}", stacklevel=2)
    return removed


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def free_space(folder: str | os.PathLike) -> Optional[int]:
    """Bytes free for this user on the file system that holds `folder` (or its nearest existing
    parent); None where it cannot be read."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def require_space(folder: str | os.PathLike, need: int, what: str) -> None:
    """Refuse (one line naming the folder, the space needed and the space free) unless the file
    system that holds `folder` (or its nearest existing parent) has `need` bytes free for this user:
    a full disk is found before the work whose result could not be saved, not at its first save."""
    free = free_space(folder)
    if free is None:
        return  # no figure to go by: the writes themselves still fail in one line
    if free < need:
        raise WMError(f"not enough space for {folder}: {what} needs about {mib(need)}, its disk has "
                      f"{mib(free)} free; free space there, or set run.out_dir to another disk")
