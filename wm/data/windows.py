"""Windows over scenes, the resumable distributed sampler, and DataLoader wiring.

A sample is `past + future` frames of one scene taken every `stride`-th frame: occupancy uint8
(T, X, Y, Z) (kept uint8 all the way to the GPU; convert there), ego motion (T, 3) = (x, y, yaw)
of each frame relative to the last past frame, and optionally the visibility mask. The window index
is built from the shards' `scene_offsets` alone, so start-up does not grow with the data.

The sampler deals one global permutation per (seed, epoch): rank r takes every world_size-th
index. Its state is (epoch, samples consumed globally), so a resume, even on another number of
ranks, continues with exactly the samples that were not yet consumed, in the same order.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import signal
import sys
import weakref
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from wm.config.runtime import LoaderConfig
from wm.config.sections import DataConfig
from wm.data.shards import Manifest, Shard, check_moving, open_split
from wm.utils.errors import DataError, WMError


def check_against_config(m: Manifest, cfg: DataConfig) -> None:
    """Refuse a data set whose grid, classes or mask disagree with the config (before training)."""
    src = m.root / "manifest.json"
    if tuple(m.info.grid) != tuple(cfg.grid):
        raise DataError(f"{src}: grid {list(m.info.grid)} but data.grid is {list(cfg.grid)}; "
                        "set data.grid to match the data")
    if m.info.num_classes != cfg.num_classes:
        raise DataError(f"{src}: {m.info.num_classes} classes (free {m.info.free_class}) but data.num_classes is "
                        f"{cfg.num_classes}; set data.num_classes={m.info.num_classes} data.free_class="
                        f"{m.info.free_class} to match the data")
    if m.info.free_class != cfg.free_class:
        raise DataError(f"{src}: free class is {m.info.free_class} but data.free_class is "
                        f"{cfg.free_class}; set data.free_class to match the data")
    if cfg.use_mask and not m.info.has_mask:
        raise DataError(f"{src}: the data set has no visibility masks but data.use_mask is true")
    check_moving(cfg.moving_classes, m.info.class_names, m.info.free_class, f"data.moving_classes (data set {src})")


def window_index(shards: list[Shard], span: int, step: int = 1) -> np.ndarray:
    """(N, 2) int64 rows (shard id, first frame) of every window covering `span` consecutive frames
    inside one scene, starting every `step` frames; from scene offsets only, no frame reads."""
    rows = []
    for sid, sh in enumerate(shards):
        o = sh.scene_offsets
        starts, lens = o[:-1], np.diff(o)
        counts = np.maximum(0, (lens - span) // step + 1)  # windows per scene
        if counts.sum() == 0:
            continue
        scene = np.repeat(np.arange(len(counts)), counts)
        # position of each window inside its scene: 0, step, 2*step... restarting per scene
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        first = starts[scene] + within * step
        rows.append(np.stack([np.full_like(first, sid), first], 1))
    return np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)


def relative_motion(poses: np.ndarray, ref: int) -> np.ndarray:
    """(T, 4, 4) ego->global poses -> (T, 3) float32 (x, y, yaw) of each frame in the frame of
    pose[ref] (metres, radians in (-pi, pi])."""
    rel = np.linalg.inv(poses[ref])[None] @ poses
    yaw = np.arctan2(rel[:, 1, 0], rel[:, 0, 0])
    return np.stack([rel[:, 0, 3], rel[:, 1, 3], yaw], 1).astype(np.float32)


# how the window settings are named in messages: config keys here, a tool's own flags there
CONFIG_KEYS = {"past": "data.past={}", "future": "data.future={}", "stride": "data.stride={}"}


def spread(total: int, n: int) -> np.ndarray:
    """`n` indices spread evenly over range(total), first and last included (0 or n >= total: all):
    the windows data.max_windows keeps, and those tools/compare.py scores."""
    if n <= 0 or n >= total:
        return np.arange(total, dtype=np.int64)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


class OccWindows(Dataset):
    """The windows of one split of a data set; items are dicts of tensors:
    `occ` uint8 (T, X, Y, Z), `motion` float32 (T, 3), `mask` uint8 (T, X, Y, Z) if
    data.use_mask, `index` int64 (the window's index, for per-sample randomness and debugging).
    `keys` names past / future / stride in the message of a window longer than every scene;
    `h5_cache_mib`: HDF5's chunk cache per open dataset (loader.h5_cache_mib)."""

    def __init__(self, root: str | os.PathLike, split: str, cfg: DataConfig, keys: dict = CONFIG_KEYS,
                 h5_cache_mib: float = 1.0):
        self.cfg, self.split = cfg, split
        self.manifest, self.shards = open_split(root, split, int(h5_cache_mib * 2**20))
        check_against_config(self.manifest, cfg)
        self.index = window_index(self.shards, cfg.span, cfg.window_step)
        if len(self.index) == 0:
            longest = max(int(np.diff(s.scene_offsets).max()) for s in self.shards)
            raise DataError(f"{self.manifest.root / 'manifest.json'}: a window of {cfg.window} frames "
                            f"({keys['past'].format(cfg.past)} + {keys['future'].format(cfg.future)}) at "
                            f"{keys['stride'].format(cfg.stride)} "
                            f"spans {cfg.span} frames, but the longest scene in split {split!r} has "
                            f"{longest}; shorten the window or the stride")
        if cfg.max_windows and cfg.max_windows < len(self.index):
            self.index = self.index[spread(len(self.index), cfg.max_windows)]
        self.num_classes = self.manifest.info.num_classes

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def num_frames(self) -> int:
        return sum(s.num_frames for s in self.shards)

    def frame_base(self) -> np.ndarray:
        """Global index (over this split's frames, shards in manifest order) of each shard's frame 0."""
        return np.cumsum([0] + [s.num_frames for s in self.shards])[:-1]

    def __len__(self) -> int:
        return len(self.index)

    def locate(self, i: int) -> tuple[Shard, int, int]:
        """(shard, first frame, stop) of window i."""
        sid, first = self.index[i]
        return self.shards[sid], int(first), int(first) + self.cfg.span

    def __getitem__(self, i: int) -> dict:
        sh, a, b = self.locate(i)
        s = self.cfg.stride
        occ = sh.read("occ", a, b, s)
        top = int(occ.max())
        if top >= self.num_classes:  # a cheap pass over uint8; decompression costs far more
            raise DataError(f"shard {sh.path}: field 'occ' frames {a}:{b} hold class id {top} >= "
                            f"num_classes {self.num_classes}; fix the converter that wrote it")
        out = {"occ": torch.from_numpy(occ),
               "motion": torch.from_numpy(relative_motion(sh.pose[a:b:s], self.cfg.past - 1)),
               "index": torch.tensor(i, dtype=torch.int64)}
        if self.cfg.use_mask:
            m = sh.read("mask", a, b, s)
            if self.cfg.mask_bits:  # one of several masks stored as bits (e.g. Occ3D camera / lidar)
                m = ((m & self.cfg.mask_bits) != 0).view(np.uint8)
            out["mask"] = torch.from_numpy(m)
        return out


class CodeWindows(Dataset):
    """The same windows as `windows`, read from the token cache instead of the shards.

    `codes_path` is a `.npy` of int16 codes (N, h, w), one row per frame of the split in
    `windows.frame_base()` order (written once by the training loop with the frozen tokenizer).
    Items: `codes` int16 (T, h, w), `motion` float32 (T, 3), `index`, and with `mask_path` (a
    `.npy` of uint8 token-cell masks in the same rows, data.use_mask) `mask` uint8 (T, h, w).
    Opened lazily per process.
    """

    def __init__(self, windows: OccWindows, codes_path: str | os.PathLike,
                 mask_path: Optional[str | os.PathLike] = None):
        self.w, self.path = windows, Path(codes_path)
        self.mask_path = Path(mask_path) if mask_path else None
        self.base = windows.frame_base()
        self._codes: Optional[np.ndarray] = None
        self._mask: Optional[np.ndarray] = None
        codes = self._open()
        if codes.shape[0] != windows.num_frames or codes.dtype != np.int16:
            raise DataError(f"token cache {self.path}: {codes.dtype}{codes.shape} does not hold one int16 "
                            f"code map per frame ({windows.num_frames} frames); delete it to rebuild")
        if self.mask_path and self._open_mask().shape != codes.shape:
            raise DataError(f"token cache {self.mask_path}: shape {self._mask.shape}, the codes' is "
                            f"{codes.shape}; delete it to rebuild")
        self._codes = self._mask = None  # workers map them themselves

    @staticmethod
    def _map(path: Path) -> np.ndarray:
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"token cache {path} cannot be read ({e}); delete it to rebuild") from None

    def _open(self) -> np.ndarray:
        if self._codes is None:
            self._codes = self._map(self.path)
        return self._codes

    def _open_mask(self) -> np.ndarray:
        if self._mask is None:
            self._mask = self._map(self.mask_path)
        return self._mask

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int) -> dict:
        sid, first = self.w.index[i]
        g, s, span = int(self.base[sid] + first), self.w.cfg.stride, self.w.cfg.span
        codes = np.array(self._open()[g:g + span:s])
        sh = self.w.shards[sid]
        motion = relative_motion(sh.pose[first:first + span:s], self.w.cfg.past - 1)
        out = {"codes": torch.from_numpy(codes), "motion": torch.from_numpy(motion),
               "index": torch.tensor(i, dtype=torch.int64)}
        if self.mask_path:
            out["mask"] = torch.from_numpy(np.array(self._open_mask()[g:g + span:s]))
        return out

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_codes"] = d["_mask"] = None
        return d


class ResumableSampler(Sampler[int]):
    """Distributed sampler whose position survives a restart on any number of ranks.

    Per epoch there is one global order, a permutation of range(n) drawn from (seed, epoch)
    (identity if not shuffling). Positions consumed..end of that order are dealt round-robin:
    rank r gets positions consumed + r, consumed + r + world_size, ... Without drop_last the tail
    is padded by wrapping to the start of the order so every rank gets the same count; with
    drop_last the incomplete last round is dropped.

    The loop owns progress: after each optimizer step it calls `advance(global_batch)`; the state
    (epoch, consumed) goes into the checkpoint, and `load_state_dict` puts the sampler where the
    run stopped: the next `iter()` yields exactly what had not been consumed.
    """

    def __init__(self, n: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        if n < 1:
            raise DataError("the sampler got an empty data set")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.n, self.world_size, self.rank, self.seed = n, world_size, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.consumed = 0, 0

    def order(self, epoch: Optional[int] = None) -> np.ndarray:
        """The global order of an epoch."""
        e = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, e]).permutation(self.n)

    def __len__(self) -> int:
        """Samples this rank yields from the current position to the end of the epoch."""
        return self._left(self.consumed)

    def _left(self, consumed: int) -> int:
        """Samples this rank yields from global position `consumed` to the end of an epoch."""
        left = max(0, self.n - consumed)
        return left // self.world_size if self.drop_last else math.ceil(left / self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.epoch, self.consumed))

    def indices(self, epoch: int, consumed: int) -> list[int]:
        """This rank's samples of `epoch` from global position `consumed` to the epoch's end."""
        pos = consumed + self.rank + self.world_size * np.arange(self._left(consumed))
        return self.order(epoch)[pos % self.n].tolist()  # modulo: the padding wraps to the start

    def advance(self, samples: int) -> None:
        """Record that `samples` more (global) samples were consumed; rolls to the next epoch at
        the end of this one."""
        self.consumed += samples
        if self.consumed >= self.epoch_samples():
            self.epoch, self.consumed = self.epoch + 1, 0

    def epoch_samples(self) -> int:
        """Global samples in a full epoch on this world size."""
        per = self.n // self.world_size if self.drop_last else math.ceil(self.n / self.world_size)
        return per * self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "n": self.n, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, d: dict) -> None:
        if d["n"] != self.n:
            raise DataError(f"the checkpoint's sampler walked {d['n']} windows but the data now has "
                            f"{self.n}: the data or the window settings changed since it was saved")
        if (d["seed"], d["shuffle"]) != (self.seed, self.shuffle):
            raise DataError(f"the checkpoint's sampler used seed={d['seed']} shuffle={d['shuffle']}, "
                            f"this run seed={self.seed} shuffle={self.shuffle}; resume with the same")
        self.epoch, self.consumed = int(d["epoch"]), int(d["consumed"])


class EpochBatches:
    """A DataLoader `batch_sampler`: one rank's batches in a ResumableSampler's order, endless. The
    rest of the sampler's current epoch, then every next epoch, each cut to whole batches (what
    drop_last does to an epoch), so one loader iterator runs through the epoch ends: its workers'
    prefetch queue never runs dry there, as it did with a new iterator per epoch (a step's wait
    for data at every epoch start). Reads the sampler's position when iterated; the loop moves it."""

    def __init__(self, sampler: ResumableSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        s, b = self.sampler, self.batch_size
        epoch, consumed = s.epoch, s.consumed
        while True:
            idx = s.indices(epoch, consumed)
            if consumed == 0 and len(idx) < b:
                raise DataError(f"an epoch of {s.n} samples gives this rank {len(idx)}, fewer than one "
                                f"batch of {b}; lower the batch size or add data")
            for k in range(len(idx) // b):
                yield idx[k * b:(k + 1) * b]
            epoch, consumed = epoch + 1, 0


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: workers ignore SIGTERM and SIGINT. Clusters (SLURM at preemption
    or time limit, `timeout`, Ctrl-C in a terminal) signal the whole process group; a worker that
    died of it would take the trainer down before it could save. The trainer alone decides: it
    stops at the next step boundary, saves, and shuts its workers down itself (workers also exit
    when the trainer is gone)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by start_workers


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def start_workers(loader: DataLoader) -> "Batches":
    """`iter(loader)` (as `Batches`) with SIGTERM/SIGINT blocked while the workers are forked: a
    signal that comes before a new worker reaches `ignore_stop_signals` waits (and is then ignored
    there), and one for the trainer is delivered as soon as the workers are started."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        return Batches(loader, iter(loader))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Batches:
    """A loader's iterator whose errors read as they would in the main process. torch re-raises a
    worker's exception with the worker's whole traceback as its message (or as a RuntimeError, where
    the type takes other arguments): a WMError from a worker becomes the same WMError with its own one
    line again, anything else (a bug) keeps its traceback. Either way the workers are ended at once."""

    def __init__(self, loader: DataLoader, it):
        self.loader, self.it = loader, it
        _STARTED.add(it)
        _WORKERS.update(getattr(it, "_workers", ()))

    def __iter__(self) -> "Batches":
        return self

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            raise
        except Exception as e:
            self.close()
            mine = from_worker(e)
            if mine is None:
                raise
            raise mine from None

    def close(self) -> None:
        """End the worker processes now (an iterator that failed is of no further use)."""
        end_workers(self.it)
        if getattr(self.loader, "_iterator", None) is self.it:  # persistent workers: no reuse of ended ones
            self.loader._iterator = None


_CAUGHT = re.compile(r"Caught (\w+) in (.+?)\.\nOriginal Traceback")


def from_worker(e: BaseException) -> Optional[WMError]:
    """The WMError that a DataLoader worker raised, rebuilt from the text torch re-raised it with
    ("Caught X in DataLoader worker process N.\nOriginal Traceback ...\nmodule.X: message");
    None for an exception of any other kind or origin."""
    text = str(e)
    head = _CAUGHT.match(text)
    if head is None:
        return None
    name, where = head.groups()
    last = None
    for last in re.finditer(rf"^([\w.]+)\.{name}(?:: |$)", text, re.M):
        pass
    cls = getattr(sys.modules.get(last.group(1)), name, None) if last else None
    if not (isinstance(cls, type) and issubclass(cls, WMError)):
        return None
    msg = text[last.end():].strip() or f"{name} in {where}"  # the worker's id only when nothing else is said
    try:
        return cls(msg)
    except TypeError:  # a constructor of other arguments (ConfigError's key and message): the same line
        err = cls.__new__(cls)
        Exception.__init__(err, msg)
        return err


def end_workers(it) -> None:
    """End a loader iterator's worker processes: torch's own shutdown, then a kill for any still
    alive (they ignore SIGTERM, so torch's terminate() would leave them)."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is None:  # no workers (num_workers=0)
        return
    workers = list(getattr(it, "_workers", ()))
    try:
        stop()
    except Exception:  # a shutdown that fails half-way: the kill below still ends them
        pass
    for w in workers:
        if w.is_alive():
            w.kill()
            w.join(5)


_STARTED: "weakref.WeakSet" = weakref.WeakSet()  # every iterator start_workers made and not yet freed
_WORKERS: "weakref.WeakSet" = weakref.WeakSet()  # and their worker processes


@atexit.register  # registered after multiprocessing's own exit handler, so it runs before it
def _end_workers_at_exit() -> None:
    """multiprocessing's exit handler terminates daemonic children (SIGTERM, which the workers ignore)
    and then waits for them without a limit: a process leaving on an error whose traceback still held
    a loader iterator waited forever. End every worker first."""
    for it in list(_STARTED):
        end_workers(it)
    for w in list(_WORKERS):  # an iterator freed in a garbage cycle: its queues closed before it could end them
        if w.is_alive():
            w.kill()
            w.join(5)


def make_loader(ds: Dataset, sampler, cfg: LoaderConfig, batch_size: int, drop_last: bool = True,
                endless: bool = False) -> DataLoader:
    """DataLoader over `ds` in `sampler`'s order, in batches of `batch_size`. Workers open HDF5 files
    lazily (the shards reopen their handle in the reading process), memory is pinned for async copies
    to the GPU, and persistent workers keep open handles and warm caches between epochs. `endless`
    (a ResumableSampler's, training's): one iterator over every epoch from the sampler's position,
    each epoch cut to whole batches (EpochBatches)."""
    workers = cfg.num_workers
    batching = dict(batch_sampler=EpochBatches(sampler, batch_size)) if endless else \
        dict(batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    return DataLoader(
        ds, **batching, num_workers=workers, pin_memory=cfg.pin_memory and torch.cuda.is_available(),
        persistent_workers=cfg.persistent_workers and workers > 0, worker_init_fn=ignore_stop_signals,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None)


def resolve_root(cfg, log=print) -> Path:
    """data.root, or the built-in synthetic data set (generated once) when it is empty."""
    if cfg.data.root:
        return Path(cfg.data.root).expanduser()
    from wm.data.synthetic.generate import ensure_synthetic

    return ensure_synthetic(cfg.synthetic, tuple(cfg.data.grid), log=log)
