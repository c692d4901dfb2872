"""The world stage's token cache: every training frame encoded once by the frozen tokenizer, keyed
by the tokenizer checkpoint and the data (a cache that does not match is rebuilt, never used)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from wm.checkpoint.files import read_json, sha256_file, write_hashed
from wm.checkpoint.run_folder import Run
from wm.data.windows import OccWindows, ignore_stop_signals, start_workers
from wm.evaluation.evaluate import frames_config
from wm.models.tokenizer import Tokenizer
from wm.utils import distributed
from wm.utils.atomic import clean_temps, write_bytes
from wm.utils.errors import WMError, first_line
from wm.utils.precision import autocast


CELL_MASK = "cell_mask.npy"


@torch.no_grad()
def build_token_cache(run: Run, tok: Tokenizer, tok_sha: str, device, dtype) -> Path:
    """Encode every training frame once into <run>/token_cache/<key>/codes.npy (int16), keyed by
    the tokenizer checkpoint and the data fingerprint: a cache that does not match is rebuilt,
    never silently used. With data.use_mask also cell_mask.npy (uint8, Tokenizer.token_mask of
    each frame's mask; the mask bits are part of the key). Rank 0 builds; the others wait at the
    barrier."""
    cfg, dist = run.cfg, run.dist
    use_mask = cfg.data.use_mask
    keyed = {"tokenizer": tok_sha, "data": run.fingerprint, "split": cfg.data.train_split}
    if use_mask:  # only then: the caches of runs without masks keep their keys
        keyed["mask_bits"] = cfg.data.mask_bits
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    folder = run.dir / "token_cache" / key
    path = folder / "codes.npy"
    for f in (folder.parent, folder):
        if f.exists() and not f.is_dir():  # every rank sees it (a shared folder); never removed: a user's file
            raise WMError(f"{f} is a file, but the world stage keeps its token cache folder there; move the file "
                          "away (nothing reads it) and rerun")
    why = _token_cache_problem(folder, tok_sha, run.fingerprint, use_mask) if dist.is_main else None
    if why and not why.startswith("missing"):
        run.say(f"note: the token cache {why}; encoding the training frames again")
    if why:  # rank 0 builds: the run folder is shared by all ranks
        frames = OccWindows(run.root, cfg.data.train_split, frames_config(cfg.data, use_mask=use_mask),
                            h5_cache_mib=cfg.loader.h5_cache_mib)
        h, w = tok.token_shape
        clean_temps(folder)  # the half-written codes of a killed build
        # codes are gathered in memory (int16 50x50 per frame: 140 MB for nuScenes' 28k train frames),
        # then written like a checkpoint: no memory map that a full disk would turn into SIGBUS
        out = np.empty((frames.num_frames, h, w), dtype=np.int16)
        cells = np.empty((frames.num_frames, h, w), dtype=np.uint8) if use_mask else None
        # frames in shard order: the OccWindows index of single frames is exactly frame_base order
        loader = torch.utils.data.DataLoader(frames, batch_size=max(8, cfg.data.batch_size), shuffle=False,
                                             num_workers=cfg.loader.num_workers, worker_init_fn=ignore_stop_signals)
        t0, done = time.time(), 0
        for batch in start_workers(loader):
            occ = batch["occ"].to(device)[:, 0]
            with autocast(device, dtype):
                codes = tok.encode(occ)
            out[done:done + len(occ)] = codes.to(torch.int16).cpu().numpy()
            if cells is not None:
                cells[done:done + len(occ)] = tok.token_mask(batch["mask"][:, 0]).numpy()
            done += len(occ)
            tty = sys.stdout.isatty()  # a log file gets a line per 10 %, not a line per batch
            if dist.is_main and (tty or done == frames.num_frames or
                              done * 10 // frames.num_frames != (done - len(occ)) * 10 // frames.num_frames):
                print(("\r" if tty else "") + f"token cache: {done}/{frames.num_frames} frames encoded "
                      f"({done / max(1e-9, time.time() - t0):.0f} frames/s)", end="" if tty else "\n", flush=True)
        if dist.is_main and sys.stdout.isatty():
            print()
        write_token_cache(folder, out, {"tokenizer_sha256": tok_sha, "data_fingerprint": run.fingerprint,
                                        "split": cfg.data.train_split, "frames": frames.num_frames}, cells)
        run.say(f"token cache written: {path}")
    distributed.barrier(dist)
    return path


def write_token_cache(folder: Path, codes: np.ndarray, meta: dict, cells: np.ndarray | None = None) -> None:
    """codes.npy (and cell_mask.npy), then meta.json with their sha256 (the cache counts only once
    meta.json is there), each through the checkpoints' atomic write: a failure (a full disk) is one
    line and leaves no partial cache."""
    try:
        if (folder / "meta.json").exists():
            (folder / "meta.json").unlink()  # a cache being replaced stops counting first
        folder.mkdir(parents=True, exist_ok=True)
        size, sha = write_hashed(folder / "codes.npy", lambda f: np.lib.format.write_array(f, codes))
        meta = dict(meta, codes_bytes=size, codes_sha256=sha)
        if cells is not None:
            meta["cell_mask_sha256"] = write_hashed(folder / CELL_MASK, lambda f: np.lib.format.write_array(f, cells))[1]
        write_bytes(folder / "meta.json", json.dumps(meta, indent=1))
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise WMError(f"cannot write the token cache {folder}: {e.strerror or first_line(e)}; nothing was kept "
                      f"(the tokenizer checkpoints are intact): free space under {folder.parent} and rerun") from None


def _token_cache_problem(folder: Path, tok_sha: str, fingerprint: str, use_mask: bool = False) -> Optional[str]:
    """None for a complete cache of this tokenizer and data whose codes (and cell mask) match their
    recorded sha256; else why not: "missing", or which file is damaged and how."""
    if not (folder / "meta.json").exists():
        return "missing"
    m = read_json(folder / "meta.json")
    if not m or m.get("tokenizer_sha256") != tok_sha or m.get("data_fingerprint") != fingerprint:
        return f"{folder / 'meta.json'} is damaged (unreadable, or naming another tokenizer or data)"
    for name, key in (("codes.npy", "codes_sha256"),) + (((CELL_MASK, "cell_mask_sha256"),) if use_mask else ()):
        try:
            got = sha256_file(folder / name)
        except OSError as e:
            return f"{folder / name} cannot be read ({e.strerror or first_line(e)})"
        if got != m.get(key):
            return f"{folder / name} is damaged (its sha256 is {got[:12]}..., meta.json records {str(m.get(key))[:12]}...)"
    return None


