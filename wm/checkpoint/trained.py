"""A trained run loaded for use: its best world-model checkpoint (or a named one), the tokenizer
it was trained on (found and its sha256 verified), and its config, checked against each other.
Evaluation, export and the Forecaster all load a run through here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from wm.checkpoint.checks import EVAL_KEYS, checker, first_nonfinite
from wm.checkpoint.files import latest_checkpoint, load, newest_valid, sha256_file
from wm.config.loading import from_saved, key_rules, stage_sections
from wm.config.rules import MATCH
from wm.config.sections import Config, model_options
from wm.config.upgrade import upgrade
from wm.models.tokenizer import Tokenizer
from wm.models.world import WorldModel
from wm.utils.errors import ConfigError, WMError


class TrainedRunError(WMError):
    """A run, or a checkpoint of it, that cannot be loaded for use (one line says why)."""


def config_diffs(old: dict, new: dict, stage: str) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every key that changes the function of a `stage` checkpoint
    between two config dicts (of any layout `upgrade` reads): the keys --eval-only must match."""
    old, new = upgrade(old)[0], upgrade(new)[0]
    rules = key_rules()
    keys = [(sec, k) for sec in stage_sections(stage) for k, (_, ev) in rules[sec].items() if ev == MATCH]
    return [(f"{sec}.{k}", old[sec][k], new[sec][k]) for sec, k in keys
            if isinstance(old.get(sec), dict) and k in old[sec] and isinstance(new.get(sec), dict) and k in new[sec]
            and old[sec][k] != new[sec][k]]


def more_keys(diffs: list) -> str:
    """' (and N more keys)' after the first of `diffs`, or ''."""
    return f" (and {len(diffs) - 1} more key{'s' if len(diffs) > 2 else ''})" if len(diffs) > 1 else ""


def world_tokenizer(st: dict, path: Path, run_dir: Path) -> tuple[Path, str]:
    """The tokenizer checkpoint a world-model checkpoint was trained on, its sha256 verified.

    Looked for where the checkpoint says, then in the same run's tokenizer folder (a run folder that
    was moved or copied); the file must have the recorded hash."""
    info = st.get("tokenizer") if isinstance(st.get("tokenizer"), dict) else {}
    rec, want = info.get("path"), info.get("sha256")
    if not isinstance(rec, str) or not isinstance(want, str) or not rec or not want:
        raise WMError(f"{path} does not name its tokenizer (path and sha256); it was not written by wm's world stage")
    rec = Path(rec)
    here = path.resolve().parent.parent.parent / "tokenizer" / "checkpoints" / rec.name
    cands = []
    for c in (rec, here, run_dir / "tokenizer" / "checkpoints" / rec.name):
        if c.is_file() and all(not c.samefile(o) for o in cands):
            cands.append(c)
    if not cands:
        raise WMError(f"{path} was trained on tokenizer {rec} (sha256 {want[:12]}), which is missing; restore "
                      "it: the world model's codes mean nothing without it")
    seen = []
    for c in cands:
        got = sha256_file(c)
        if got == want:
            return c, want
        seen.append((c, got))
    c, got = seen[0]
    raise WMError(f"tokenizer hash mismatch: {path} was trained on tokenizer {rec} with sha256 {want[:12]}, but "
                  f"{c} has sha256 {got[:12]}; the tokenizer changed since (retrained or replaced): restore "
                  "the one it was trained on, or retrain the world stage")


@dataclass
class Trained:
    """A world-model checkpoint with its frozen tokenizer and config."""

    cfg: Config
    tokenizer: Tokenizer
    world: WorldModel
    ckpt: Path
    tokenizer_ckpt: Path
    data_fingerprint: str
    init: dict = field(default_factory=dict)  # {stage: source} of a fine-tuned run (wm.checkpoint.init_from), else empty


def find_run(runs: str | os.PathLike = "runs") -> Path:
    """The run under `runs/` whose world stage saved most recently."""
    base = Path(runs)
    found = []
    for d in base.iterdir() if base.is_dir() else []:
        p = latest_checkpoint(d / "world" / "checkpoints")
        if p is not None:
            found.append((p.stat().st_mtime, d))
    if not found:
        raise TrainedRunError(f"no world-model run under {base}/ (looked for */world/checkpoints/); "
                          "train one first, or name it with --run")
    return max(found)[1]


def load_trained(run: str | os.PathLike, ckpt: Optional[str | os.PathLike] = None) -> Trained:
    """The run's best world-model checkpoint (or `ckpt`), its tokenizer, and its config; refused
    with one line when a piece is missing, truncated, from the tokenizer stage only, or does not
    match its config."""
    run = Path(run)
    if not run.is_dir():
        raise TrainedRunError(f"run folder {run} does not exist (--run)")
    if ckpt is None:
        folder = run / "world" / "checkpoints"
        # best.pt, else the newest valid step: each is checked against its recorded sha256, and a
        # damaged one is named and skipped (CheckpointError, one line, when none is valid)
        found = newest_valid(folder, best=True, say=print, check=checker("world", model="own", keys=EVAL_KEYS))
        if found is None:
            tok = latest_checkpoint(run / "tokenizer" / "checkpoints")
            what = "only the tokenizer stage" if tok else "no checkpoint"
            raise TrainedRunError(f"{run} holds {what}: the forecaster needs a world-model checkpoint "
                              f"({folder}); train the world stage first")
        ckpt, st = found
    else:
        ckpt = Path(ckpt)
        if not ckpt.is_file():
            raise TrainedRunError(f"checkpoint {ckpt} does not exist (--ckpt)")
        st = load(ckpt)  # CheckpointError (a WMError) names a truncated, corrupt or tampered file
    if st.get("stage") != "world":
        raise TrainedRunError(f"{ckpt} is a {st.get('stage', 'unknown')}-stage checkpoint; export needs a "
                          "world-model checkpoint (runs/<name>/world/checkpoints/)")
    if bad := first_nonfinite(st, ("model",)):
        raise TrainedRunError(f"{ckpt} holds non-finite values (first: {bad}); export a checkpoint saved before them")
    try:
        cfg = from_saved(st["config"]).validate()
    except ConfigError as e:
        raise TrainedRunError(f"{ckpt}: its config is refused ({e})") from None
    try:  # found where recorded (or in this run), its sha256 what the world stage trained on
        tpath, _ = world_tokenizer(st, ckpt, run)
    except WMError as e:
        raise TrainedRunError(str(e)) from None
    tst = load(tpath)
    diffs = config_diffs(tst.get("config") or {}, st["config"], "tokenizer")  # what --eval-only checks too
    if diffs:
        key, a, b = diffs[0]
        raise TrainedRunError(f"config mismatch: tokenizer {tpath} was trained with {key}={a!r} but world checkpoint "
                          f"{ckpt} records {b!r}{more_keys(diffs)}: its world stage ran that tokenizer with other "
                          "settings; retrain the world stage with the tokenizer's config")
    tok = Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid), **model_options(cfg, "tokenizer"))
    world = WorldModel(cfg.world, cfg.tokenizer.codebook_size, **model_options(cfg, "world"))
    try:
        tok.load_state_dict(tst["model"])
        world.load_state_dict(st["model"])
    except (RuntimeError, KeyError) as e:
        raise TrainedRunError(f"{ckpt}: the weights do not fit the model its config describes "
                          f"({str(e).splitlines()[0]})") from None
    init = {k: v for k, v in (("tokenizer", tst.get("init")), ("world", st.get("init"))) if v}
    return Trained(cfg, tok.eval(), world.eval(), ckpt, tpath, st.get("data_fingerprint", ""), init)
