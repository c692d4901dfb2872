"""Checkpoint files: their layout, writing one file with its checksum, reading and checking them, and
the exact-resume state helpers (docs/ARCHITECTURE.md, Invariants). wm/checkpoint/checkpointer.py saves them.

Layout of a checkpoints folder (``runs/<name>/<stage>/checkpoints/``)::

    step_000001000.pt         one complete checkpoint per saved step (torch.save, zip format)
    step_000001000.pt.sha256  its sha256 (``sha256sum -c`` format): written after the file, it is
                              what makes the step file count (a step file without it is unfinished)
    step_000002000.pt (+ .sha256)  ... the newest `keep_last` of them; older ones are rotated away
    latest                    JSON pointer to the newest committed checkpoint:
                              {"file": "step_000002000.pt", "step": 2000, "size": ..., "sha256": ...}
    best.pt                   hard link to the step file with the best metric (never rotated away)
    best.json                 {"source": "step_...pt", "step", "metric", "mode", "value", "size", "sha256"}:
                              best.pt's checksum record
    .step_000003000.pt.tmp-<pid>   a write in progress (or left by a killed process; removed on start)

Integrity: every load checks the file against its record (the .sha256 file of a step file;
best.json for best.pt); a file with no record (a checkpoint copied elsewhere) is checked against its
zip's own CRC-32 of every record. :func:`load_checked` is the one way to load a checkpoint file (a step file must also
hold the step its name says, and a caller's `check`, wm.checkpoint.checks, says whether an intact state
belongs where it is loaded); :func:`newest_valid` finds the newest one that passes in a folder,
naming each one it skips with the reason. Nothing is ever loaded
with anything but ``weights_only=True``, and no message suggests otherwise.

Every rank may call :func:`newest_valid` / :func:`load` to resume.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pickle
import random
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from wm.utils.atomic import write_atomic, write_bytes
from wm.utils.errors import WMError, first_line

__all__ = [
    "CheckpointError",
    "load",
    "load_checked",
    "newest_valid",
    "verify",
    "write_hashed",
    "latest_checkpoint",
    "list_checkpoints",
    "rng_state",
    "set_rng_state",
    "checkpoint_name",
    "to_cpu",
    "POINTER",
    "BEST",
    "BEST_JSON",
]

POINTER = "latest"
BEST = "best.pt"
BEST_JSON = "best.json"
SUMS = ".sha256"  # a step file's checksum file: step_000001000.pt.sha256
_STEP_RE = re.compile(r"^step_(\d{9,})\.pt$")


class CheckpointError(WMError):
    """A checkpoint that cannot be written or read; the one-line message names the file."""


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of `step`: ``step_000001234.pt``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    return f"step_{step:09d}.pt"


def step_of(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class _HashingWriter:
    """File wrapper for torch.save: hashes and counts what goes through, and keeps the first OSError
    (torch's zip writer turns a failing Python write into an unrelated RuntimeError)."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise
        mv = memoryview(b).cast("B")
        self.sha.update(mv[:n] if n is not None and n < len(mv) else mv)
        self.size += len(mv) if n is None else n
        return n

    def flush(self) -> None:
        self.f.flush()


def write_hashed(path: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """wm.utils.atomic.write_atomic that also returns the size and sha256 of what `write(fileobj)` wrote
    (the record that makes a checkpoint or the token cache checkable)."""
    def hashed(f):
        w = _HashingWriter(f)
        try:
            write(w)
        except Exception as e:
            if w.error is not None and w.error is not e:
                raise w.error from e
            raise
        done.append(w)

    done: list[_HashingWriter] = []
    write_atomic(path, hashed)
    return done[0].size, done[0].sha.hexdigest()


def write_json_atomic(path: Path, obj: dict) -> None:
    write_bytes(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def sha256_file(path: Path) -> str:
    """sha256 of a file (a checkpoint's identity: the world stage names its tokenizer by it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`, or None where it is missing, unreadable or not an object."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return d if isinstance(d, dict) else None


# --------------------------------------------------------------------------------------------------
# Copying state to CPU (and checking it will load with weights_only=True)


_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _cpu_copy(obj: Any, *, copy: bool, pinned: bool, memo: dict, cuda_devs: set, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:  # the same tensor twice (tied weights) stays one tensor
            return memo[id(obj)]
        t = obj.detach()
        if t.device.type == "cuda" and pinned:
            out = torch.empty_like(t, device="cpu", pin_memory=True)
            out.copy_(t, non_blocking=True)
            cuda_devs.add(t.device)
        elif copy:
            out = t.to("cpu", copy=True)
        else:
            out = t.cpu()
        memo[id(obj)] = out
        return out
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, dict):
        out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
        for k, v in obj.items():
            if type(k) not in _LEAVES:
                raise TypeError(f"checkpoint state key {where}{k!r} is a {type(k).__name__}; "
                                "use str/int keys so it loads with weights_only=True")
            out[k] = _cpu_copy(v, copy=copy, pinned=pinned, memo=memo, cuda_devs=cuda_devs,
                               where=f"{where}{k}.")
        meta = getattr(obj, "_metadata", None)  # module state_dict versions
        if meta is not None:
            out._metadata = _cpu_copy(meta, copy=copy, pinned=pinned, memo=memo,
                                      cuda_devs=cuda_devs, where=f"{where}_metadata.")
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [_cpu_copy(v, copy=copy, pinned=pinned, memo=memo, cuda_devs=cuda_devs,
                           where=f"{where}{i}.") for i, v in enumerate(obj)]
        return items if type(obj) is list else tuple(items)
    if isinstance(obj, np.generic):  # np.float32 metrics and the like
        return obj.item()
    for base in (bool, int, float, str):  # IntEnum, np.float64 (a float subclass), ...
        if isinstance(obj, base):
            return base(obj)
    raise TypeError(f"checkpoint state {where.rstrip('.') or '<root>'} is a {type(obj).__name__}, "
                    "which torch.load(weights_only=True) refuses; store tensors, numbers, strings, "
                    "lists, tuples or dicts (see rng_state() for RNG states)")


def to_cpu(state: Any, *, copy: bool = True) -> Any:
    """A CPU deep copy of `state`: every tensor `.detach().to('cpu', copy=True)` (CUDA tensors go
    through pinned memory with non_blocking copies and one synchronize per device), containers
    rebuilt, numpy scalars turned into Python numbers. Raises TypeError for values that
    ``torch.load(weights_only=True)`` would refuse. With copy=False CPU tensors are not copied."""
    memo: dict = {}
    cuda_devs: set = set()
    pinned = copy and torch.cuda.is_available()
    out = _cpu_copy(state, copy=copy, pinned=pinned, memo=memo, cuda_devs=cuda_devs, where="")
    for d in cuda_devs:
        torch.cuda.synchronize(d)
    return out


# --------------------------------------------------------------------------------------------------
# RNG states that survive weights_only=True


def rng_state() -> dict:
    """The process's RNG states as tensors/lists/numbers (all accepted by weights_only loading):
    torch CPU (ByteTensor), every CUDA device (list of ByteTensors, if CUDA is available), numpy's
    legacy global RNG, and Python's `random`."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    d = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": int(version), "internal": [int(x) for x in internal],
                   "gauss_next": None if gauss_next is None else float(gauss_next)},
    }
    if torch.cuda.is_available():
        d["cuda"] = torch.cuda.get_rng_state_all()
    return d


def set_rng_state(d: dict) -> None:
    """Restore what `rng_state()` captured (also after a weights_only round trip)."""
    torch.set_rng_state(torch.as_tensor(d["torch"], dtype=torch.uint8).cpu())
    if d.get("cuda") is not None and torch.cuda.is_available():
        states = [torch.as_tensor(s, dtype=torch.uint8).cpu() for s in d["cuda"]]
        n = min(len(states), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(states[:n])
    n = d["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]),
                         int(n["has_gauss"]), float(n["gauss"])))
    p = d["python"]
    gn = p["gauss_next"]
    random.setstate((int(p["version"]), tuple(int(x) for x in p["internal"]),
                     None if gn is None else float(gn)))


# --------------------------------------------------------------------------------------------------
# Finding and loading checkpoints


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The `step_*.pt` files of `folder`, oldest step first (temp files never match)."""
    folder = Path(folder)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError(f"checkpoint folder {folder} is a file, not a folder; move it away (a stage keeps "
                              "its checkpoints in that folder)") from None
    found = [(s, n) for n in names if (s := step_of(n)) is not None]
    return [folder / n for s, n in sorted(found)]


def _previous_of(path: Path) -> Path | None:
    """The newest step file of path's folder older than `path` (by step), if any."""
    step = step_of(path.name)
    older = [p for p in list_checkpoints(path.parent)
             if p.name != path.name and (step is None or step_of(p.name) < step)]
    return older[-1] if older else None


def _loads_quickly(path: Path) -> bool:
    """Whether `path` opens as a complete checkpoint (zip directory and pickle intact; tensor data
    memory-mapped, not read)."""
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return True
    except Exception:
        return False


def _pointer_target(folder: Path) -> Path | None:
    d = read_json(folder / POINTER)
    if d is None or not isinstance(d.get("file"), str) or step_of(d["file"]) is None:
        return None
    p = folder / d["file"]
    try:
        size = p.stat().st_size
    except OSError:
        return None
    if isinstance(d.get("size"), int) and d["size"] != size:
        return None
    return p


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of `folder`: the one the `latest` pointer names (if the pointer
    is readable and the file exists with the recorded size), else the newest `step_*.pt` that
    loads. None when there is none. Its checksum is not read: load it with load_checked, or use
    newest_valid, which does both."""
    folder = Path(folder)
    p = _pointer_target(folder)
    if p is not None:
        return p
    for c in reversed(list_checkpoints(folder)):
        if _loads_quickly(c):
            return c
    return None


def sums_file(path: Path) -> Path:
    return path.with_name(path.name + SUMS)


def write_sums(path: Path, sha: str) -> None:
    """step_N.pt.sha256 in sha256sum's format (`sha256sum -c step_N.pt.sha256` checks it by hand)."""
    write_bytes(sums_file(path), f"{sha}  {path.name}\n")


def _record(path: Path) -> tuple[str | None, str] | None:
    """(sha256 or None if the record is damaged, where it is recorded) for `path`, or None if no
    record names it: its .sha256 file, or best.json for best.pt."""
    sums = sums_file(path)
    if sums.exists():
        try:
            parts = sums.read_text().split()
        except (OSError, UnicodeDecodeError):
            parts = []
        ok = len(parts) >= 2 and parts[1].lstrip("*") == path.name and re.fullmatch(r"[0-9a-f]{64}", parts[0])
        return (parts[0] if ok else None), sums.name
    if path.name == BEST:
        d = read_json(path.parent / BEST_JSON)
        if d is not None or (path.parent / BEST_JSON).exists():
            sha = d.get("sha256") if d else None
            return (sha if isinstance(sha, str) else None), BEST_JSON
    return None


def _problem(path: Path) -> str | None:
    """Why `path` fails its integrity check (a short phrase), or None if it passes."""
    if not path.is_file():
        return "does not exist"
    rec = _record(path)
    try:
        if rec is not None:
            want, where = rec
            if want is None:
                return f"cannot be checked: its checksum record {where} is damaged"
            got = sha256_file(path)
            if got != want:
                return (f"is truncated or corrupt (its sha256 is {got[:12]}..., {where} records "
                        f"{want[:12]}...)")
            return None
        with zipfile.ZipFile(path) as z:  # no record anywhere: the archive's own CRC-32s
            bad = z.testzip()
        return None if bad is None else f"is truncated or corrupt (record {bad} fails its CRC-32)"
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as e:
        return f"is truncated or corrupt, or not a checkpoint ({first_line(e)})"
    except OSError as e:
        return f"cannot be read ({first_line(e)})"


def _refused(path: Path, why: str) -> CheckpointError:
    """The one-line error for a checkpoint that fails; `.why` keeps the phrase for newest_valid."""
    in_folder = step_of(path.name) is not None or path.name == BEST  # a file given by name has no "previous"
    e = CheckpointError(f"checkpoint {path} {why}" + (f"; {_prev_hint(path)}" if in_folder else ""))
    e.why = why
    return e


def verify(path: str | os.PathLike) -> None:
    """Check a checkpoint file against its checksum record; CheckpointError (one line) if it fails."""
    path = Path(path)
    why = _problem(path)
    if why is not None:
        raise _refused(path, why)


def _prev_hint(path: Path) -> str:
    prev = _previous_of(path)
    return f"the previous checkpoint is {prev}" if prev else f"no earlier checkpoint in {path.parent}"


def load_checked(path: str | os.PathLike, map_location: Any = "cpu",
                 check: Callable[[Path, Any], str | None] | None = None) -> dict:
    """Load one checkpoint file, checksum first: the one way wm loads a checkpoint (resume, the
    world stage's tokenizer, --eval-only, export).

    The file must match its record (see the module docstring), then it is loaded with
    ``torch.load(weights_only=True)``; a step file must hold the step its name says, and
    `check(path, state)` (wm.checkpoint.checks) says why an intact state does not belong, if it does not.
    A missing, unreadable, damaged or foreign file raises CheckpointError: one line naming it and
    the previous checkpoint of its folder, if any."""
    path = Path(path)
    verify(path)
    st = _load(path, map_location)
    if not isinstance(st, dict):  # every wm checkpoint is a dict: a caller may rely on it
        raise _refused(path, f"is not a wm checkpoint (it holds a {type(st).__name__}, not a training state)")
    n, got = step_of(path.name), st.get("step") if isinstance(st, dict) else None
    why = (f"holds step {got!r:.20}, not the step {n} its name says" if n is not None and isinstance(st, dict)
           and "step" in st and got != n else None) or (check(path, st) if check else None)
    if why:
        raise _refused(path, why)
    return st


def _load(path: Path, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except OSError as e:
        raise _refused(path, f"cannot be read ({first_line(e)})") from e
    except pickle.UnpicklingError as e:  # torch's own message would advise the unsafe way: not quoted
        raise _refused(path, "holds Python objects other than tensors and plain data, so it is not a wm "
                             "checkpoint (or it is damaged) and was not loaded") from e
    except Exception as e:  # torch raises RuntimeError/EOFError/... for damage
        msg = first_line(e)
        if "weights_only" in msg or "Weights only" in msg:
            msg = type(e).__name__
        raise _refused(path, f"is truncated or corrupt ({msg})") from e


load = load_checked  # the short name: every load is a checked one


def _committed(folder: Path) -> list[Path]:
    """The step files that count, newest first: those with their .sha256 file; where none has one
    yet (the first save killed between its rename and its .sha256), every step file: each was
    renamed into place whole, and is checked against its zip's CRC-32s."""
    files = list_checkpoints(folder)
    first = not any(sums_file(p).exists() for p in files)
    return [p for p in reversed(files) if first or sums_file(p).exists()]


def newest_valid(folder: str | os.PathLike, map_location: Any = "cpu", say: Callable[[str], Any] = print,
                 best: bool = False, check: Callable[[Path, Any], str | None] | None = None
                 ) -> tuple[Path, dict] | None:
    """The newest checkpoint of `folder` that passes its checksum, loads and passes `check` (see
    load_checked): (path, state).

    Tried in order: best.pt (only with best=True), the file the `latest` pointer names, then every
    committed step file, newest first. Each one skipped is named through `say`, with the reason.
    None when the folder holds no checkpoint at all; CheckpointError (one line) when it holds some
    but none is valid: the run must stop, never restart from step 0 over them."""
    folder = Path(folder)
    cands: list[Path] = []
    if best and (folder / BEST).is_file():
        cands.append(folder / BEST)
    ptr = _pointer_target(folder)
    for p in ([ptr] if ptr is not None else []) + _committed(folder):
        if p not in cands:
            cands.append(p)
    skipped = []
    for p in cands:
        try:
            return p, load_checked(p, map_location, check)
        except CheckpointError as e:
            say(f"warning: skipped {p}: it {getattr(e, 'why', e)}")
            skipped.append(f"{p.name} {getattr(e, 'why', 'is damaged')}")
    unfinished = [f"{p.name} is unfinished (no {p.name}{SUMS})" for p in list_checkpoints(folder) if p not in cands]
    if not skipped and not unfinished:
        return None
    why = skipped + unfinished
    raise CheckpointError(f"no valid checkpoint in {folder}: {'; '.join(why[:3])}"
                          f"{f' (and {len(why) - 3} more)' if len(why) > 3 else ''}; restore a copy of the "
                          "folder, or start over with --fresh (the folder is moved aside, not deleted)")
