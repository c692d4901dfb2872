"""The Checkpointer: saves a run's checkpoints into its folder (the layout: wm/checkpoint/files.py), one
step at a time, asynchronously, keeping the newest few and the best by a metric.

Every file is written to a ``.<name>.tmp-<pid>`` file in the same folder, flushed, fsynced,
``os.replace``-d onto its name, and the folder is fsynced; so a name holds the old file or the
complete new one. The save of step N makes these renames, in this order (the done.json of a stage
is written by the loop after the stage's last save has finished: ``Checkpointer.close``):

    1. step_N.pt             the state
    2. best.pt               only if step N is a new best (a hard link of step_N.pt, renamed on)
    3. best.json             only if step N is a new best: best.pt's checksum, metric and value
    4. step_N.pt.sha256      commits step N: from here on it counts as a valid checkpoint
    5. latest                the pointer (the fast path to the newest checkpoint)
    6. rotation              step files beyond `keep_last` (the file, then its .sha256)
    (loop) done.json         the stage is finished: only after the last save's step 5 is on disk

Why no kill at any instant loses best, latest or a finished stage:

- before 4, step N does not count (no checksum file), so a restart resumes from step N-1 and
  replays step N. A best update that began (2, 3) is redone by the replay with the same value, or,
  if 3 had already happened, best.json already says N and best.pt holds N. Between 2 and 3 best.pt
  (new) fails its check against best.json (old) and readers fall back to the newest valid step
  file until the replay rewrites both. So best is never behind a committed step: the bug of
  updating `latest` first (a resume from step N with best.json still at an older step, then a
  worse step taking best.pt) cannot happen.
- between 4 and 5 step N is valid and `latest` names N-1: a restart resumes from N-1 (the pointer)
  and replays step N to the same bytes.
- rotation deletes only files older than the newest `keep_last`, after 5; best.pt is its own link.
- done.json is renamed on only after every save of the stage is on disk, so a finished stage is
  never marked before its last checkpoint and best exist; a kill before it makes the rerun resume
  at the last step and write it then.

- A failed save leaves no new file under a checkpoint name and no temp file, keeps every previous
  checkpoint and the pointer, and raises :class:`CheckpointError` (one line).
- :meth:`Checkpointer.save` copies every tensor to CPU (a real copy, never an alias of live
  parameters) before returning, then writes in a background thread; the next ``save``/``wait``/
  ``close`` waits for it and re-raises its failure.

It knows nothing of distributed training: the loop calls it on rank 0 only.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch

from wm.checkpoint.files import (BEST, BEST_JSON, POINTER, SUMS, CheckpointError, checkpoint_name, latest_checkpoint,
    list_checkpoints, read_json, sums_file, to_cpu, write_hashed, write_json_atomic, write_sums)
from wm.utils.atomic import clean_temps, discard, fsync_dir, publish, tmp_path
from wm.utils.errors import ConfigError, first_line

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves checkpoints of one run into `folder`. Use it on rank 0 only: it knows nothing of DDP.

    - ``keep_last`` (>= 2): how many `step_*.pt` files to keep; the new one is saved first, then the
      oldest beyond it are deleted.
    - ``best_metric`` / ``best_mode`` ("max" or "min"): when a save's `metrics` carry a better value,
      ``best.pt`` (a hard link to the step file) and ``best.json`` are replaced atomically.
    - ``async_save``: write in a background thread (default) or before `save` returns.

    After each save, ``last_blocked_s`` is how long `save` held the caller (waiting for the previous
    write + the CPU copy); ``last_write_s`` is how long the latest finished write took (valid after
    `wait()`, or after the next `save` has returned); ``last_path`` is the latest complete file.
    Stale temp files of a killed writer are removed when the Checkpointer is built.
    """

    def __init__(self, folder: str | os.PathLike, keep_last: int = 3, best_metric: str | None = None,
                 best_mode: str = "max", async_save: bool = True):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 2:
            raise ConfigError("keep_last", f"must be an int >= 2 (a checkpoint is deleted only once a "
                                           f"newer one exists), got {keep_last!r}")
        if best_mode not in ("max", "min"):
            raise ConfigError("best_mode", f"must be 'max' or 'min', got {best_mode!r}")
        self.folder = Path(folder)
        self.keep_last, self.best_metric, self.best_mode = keep_last, best_metric, best_mode
        self.async_save = bool(async_save)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint folder {self.folder}: {first_line(e)}") from e
        clean_temps(self.folder)
        for f in self.folder.glob("step_*.pt" + SUMS):  # left by a rotation killed half-way
            if not f.with_name(f.name[: -len(SUMS)]).exists():
                discard(f)
        self.best_value: float | None = None
        self.best_step: int | None = None
        b = read_json(self.folder / BEST_JSON)
        if (best_metric is not None and b is not None and b.get("metric") == best_metric
                and b.get("mode") == best_mode and isinstance(b.get("value"), (int, float))
                and (self.folder / BEST).is_file()):
            self.best_value, self.best_step = float(b["value"]), b.get("step")
        self.last_blocked_s = 0.0
        self.last_write_s = 0.0
        self.last_path: Path | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    # -- public ------------------------------------------------------------------------------------

    def save(self, state: dict, step: int, metrics: dict | None = None) -> None:
        """Save `state` as ``step_{step:09d}.pt``. Waits for the previous save (re-raising its
        failure), copies every tensor to CPU, then writes in the background (or now, if not async)."""
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("Checkpointer.save() after close()")
        name = checkpoint_name(step)
        self.wait()
        cpu_state = to_cpu(state, copy=self.async_save)
        value = self._metric_value(metrics)
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=(cpu_state, step, name, value),
                                            name=f"checkpoint-{name}", daemon=False)
            self._thread.start()
            self.last_blocked_s = time.perf_counter() - t0
        else:
            self._run(cpu_state, step, name, value)
            self.last_blocked_s = time.perf_counter() - t0
            self._raise_pending()

    def wait(self) -> None:
        """Block until the write in progress is done; re-raise its failure (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def close(self) -> None:
        """Wait for the last write (re-raising its failure); further saves are refused."""
        self._closed = True
        self.wait()

    def latest(self) -> Path | None:
        """The newest complete checkpoint on disk (a write still in progress is not counted)."""
        return latest_checkpoint(self.folder)

    def list(self) -> list[Path]:
        """The `step_*.pt` files, oldest step first."""
        return list_checkpoints(self.folder)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the original exception behind a save failure
            self._closed = True
            try:
                self.wait()
            except Exception:
                pass

    # -- internals ---------------------------------------------------------------------------------

    def _raise_pending(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _metric_value(self, metrics: dict | None) -> float | None:
        if self.best_metric is None or not metrics or self.best_metric not in metrics:
            return None
        v = metrics[self.best_metric]
        try:
            v = float(v.item() if isinstance(v, torch.Tensor) else v)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metric {self.best_metric!r} = {v!r} is not a number") from e
        return v if math.isfinite(v) else None

    def _better(self, v: float | None) -> bool:
        if v is None:
            return False
        if self.best_value is None:
            return True
        return v > self.best_value if self.best_mode == "max" else v < self.best_value

    def _run(self, state: dict, step: int, name: str, value: float | None) -> None:
        try:
            self._write(state, step, name, value)
        except BaseException as e:  # surfaces at the next save()/wait()/close()
            self._error = e

    def _write(self, state: dict, step: int, name: str, value: float | None) -> None:
        t0 = time.perf_counter()
        path = self.folder / name
        try:
            prev = self.latest()
        except OSError:
            prev = None
        kept = self._keep(path)  # a step saved again (a replay): its earlier file comes back if this save fails
        gone = f"the new {name} was removed and the earlier one put back" if kept else f"{name} was removed"
        intact = ("the pointer is intact" if kept else f"the previous checkpoint {prev.name} and the pointer are intact"
                  if prev else f"no earlier checkpoint in {self.folder}")
        try:
            self._commit(state, step, name, value, path, gone, intact)
        except BaseException:
            for f, k in kept:
                os.replace(k, f)
                discard(k)  # still there where f was never replaced: a rename onto its own hard link does nothing
            if kept:
                fsync_dir(self.folder)
            raise
        for _, k in kept:
            discard(k)
        self.last_path = path
        self._rotate(keep=path)  # 6
        self.last_write_s = time.perf_counter() - t0

    def _keep(self, path: Path) -> list[tuple[Path, Path]]:
        """(file, a hard link or copy of it) of `path` and its .sha256 where they exist: what a failed
        save of the same step puts back (a temporary's name, so a killed writer's is removed on start)."""
        kept = []
        for f in (path, sums_file(path)):
            if f.exists():
                k = f.with_name(f".{f.name}.kept.tmp-{os.getpid()}")
                discard(k)
                try:
                    try:
                        os.link(f, k)
                    except OSError as e:
                        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                            raise
                        _copy(f, k)  # file system without hard links
                except OSError as e:
                    for _, k2 in kept + [(f, k)]:
                        discard(k2)
                    raise CheckpointError(f"cannot save checkpoint {path} again: keeping its earlier file failed "
                                          f"({first_line(e)}); nothing was changed, {path.name} is intact") from e
                kept.append((f, k))
        return kept

    def _commit(self, state: dict, step: int, name: str, value: float | None, path: Path, gone: str,
                intact: str) -> None:
        """Steps 1 to 5 of the save of `step` (the module docstring)."""
        try:
            size, sha = write_hashed(path, lambda f: torch.save(state, f))  # 1
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint {path}: {first_line(e)}; nothing was "
                                  f"saved under that name, {intact}") from e
        if self._better(value):  # 2, 3: before step N counts, so best is never behind it
            try:
                self._update_best(path, step, value, size, sha, gone)
            except CheckpointError:
                discard(path)
                raise
        target = self.folder / POINTER
        try:
            target = sums_file(path)
            write_sums(path, sha)  # 4: step N counts from here
            target = self.folder / POINTER
            write_json_atomic(target, {"file": name, "step": step, "size": size, "sha256": sha})  # 5
        except OSError as e:
            discard(path)  # a failed save leaves nothing under a checkpoint name
            discard(sums_file(path))
            raise CheckpointError(f"cannot write checkpoint record {target}: "
                                  f"{first_line(e)}; {gone}, {intact}") from e

    def _update_best(self, path: Path, step: int, value: float, size: int, sha: str, gone: str) -> None:
        best = self.folder / BEST
        tmp = tmp_path(best)
        try:
            discard(tmp)
            try:
                os.link(path, tmp)  # no copy; deleting the step file later leaves best.pt intact
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                    raise
                _copy(path, tmp)  # file system without hard links
            publish(tmp, best)
            write_json_atomic(self.folder / BEST_JSON, {
                "source": path.name, "step": step, "metric": self.best_metric,
                "mode": self.best_mode, "value": value, "size": size, "sha256": sha})
        except OSError as e:
            discard(tmp)
            held = f"step {self.best_step}" if self.best_step is not None else "the previous best"
            raise CheckpointError(f"cannot update {best} for {path.name}: {first_line(e)}; {gone}, {best} still "
                                  f"holds {held}") from e
        self.best_value, self.best_step = value, step

    def _rotate(self, keep: Path) -> None:
        others = [p for p in self.list() if p.name != keep.name]
        doomed = others[: max(0, len(others) - (self.keep_last - 1))]
        for p in doomed:
            for f in (p, sums_file(p)):  # the file first: a lone .sha256 is harmless
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    warnings.warn(f"cannot delete old checkpoint {f}: {first_line(e)}", stacklevel=2)
        if doomed:
            try:
                fsync_dir(self.folder)
            except OSError:
                pass


def _copy(src: Path, tmp: Path) -> None:
    with open(src, "rb") as fi, open(tmp, "wb") as fo:
        shutil.copyfileobj(fi, fo, 16 << 20)
        fo.flush()
        os.fsync(fo.fileno())
