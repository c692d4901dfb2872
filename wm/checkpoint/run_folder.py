"""The run folder: its lock, config.json, and whether a config or a checkpoint is this run's.

A run lives in `<run.out_dir>/<run.name>/`. Opening it takes the folder's lock, then resumes the
same run, refuses a different one (config or data), or moves it aside (`--fresh`); `belongs` tells
whether a checkpoint was saved by this run (its config, data and, for the world stage, tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

import torch

from wm.checkpoint.checks import checkpoint_bytes, meta_model
from wm.checkpoint.files import latest_checkpoint, read_json
from wm.config.loading import from_saved, key_rules, save as save_config, stage_sections, to_dict
from wm.config.rules import ALLOWED, FREE, MATCH
from wm.config.sections import Config, resolve_batch_sizes
from wm.config.upgrade import upgrade
from wm.data.windows import check_against_config, resolve_root
from wm.utils import distributed, runlock
from wm.utils.atomic import fsync_dir, mib, require_space, tmp_path
from wm.utils.errors import ConfigError, DataError, WMError, first_line
from wm.utils.logs import Logger
from wm.version import __version__


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None



class Run:
    """Everything both stages share: config, ranks, data root and fingerprint, folder, logger."""

    def __init__(self, cfg: Config, dist: distributed.Dist, fresh: bool = False, allow_new_data: bool = False,
                 allow_changed: tuple[str, ...] = ()):
        self.cfg, self.dist = cfg, dist
        self.locked = False
        self.init_plan = None  # wm.checkpoint.init_from.plan: what init.from initialises (check_stages sets it)
        self.dir = Path(cfg.run.out_dir) / cfg.run.name
        say = print if dist.is_main else (lambda *a, **k: None)
        self.say = say
        self.root = shared_root(cfg, dist, say)
        from wm.data.shards import load_manifest

        self.manifest = load_manifest(self.root)
        self.fingerprint = self.manifest.fingerprint
        # a data set that does not fit the config refuses to start before the run folder is made,
        # so the corrected command is not then refused as "another config"
        check_against_config(self.manifest, cfg.data)
        # the run folder: resume the same run, refuse a different one, start over only when asked
        meta = {"data_fingerprint": self.fingerprint, "data_root": str(self.root),
                "wm_version": __version__, "torch_version": torch.__version__,
                "git_commit": git_commit(), "world_size": dist.world_size,
                "shards": {s["path"]: s["sha256"] for s in self.manifest.shards}}  # what it trained on
        self.resuming, self.fingerprints = False, {self.fingerprint}  # the data its checkpoints may name
        error = None
        if dist.is_main:
            try:
                self._open_folder(fresh, allow_new_data, allow_changed, meta)
            except WMError as e:
                error = e
        failure = distributed.broadcast_object(None if error is None else str(error), dist)  # every rank stops with it
        if failure is not None:
            raise error or WMError(failure)
        self.resuming, self.fingerprints = distributed.broadcast_object((self.resuming, self.fingerprints), dist)
        distributed.barrier(dist)
        self.log = Logger(self.dir, enabled=dist.is_main, tensorboard=cfg.logging.tensorboard)

    def _open_folder(self, fresh: bool, allow_new_data: bool, allow_changed: tuple[str, ...], meta: dict) -> None:
        """Rank 0: take the folder's lock (before anything is written), then resume the same run,
        refuse a different one, or move it aside (--fresh); write config.json."""
        say = self.say
        todo = [s for s in self.cfg.train.stages if done_record(self.dir / s / DONE)[0] is None]
        if todo:  # a full disk is said before anything is written, not at the first save
            need, stage = max((checkpoint_bytes(meta_model(self.cfg, s)), s) for s in todo)
            require_space(self.dir, need + (1 << 20), f"the run folder with a {stage} checkpoint")
        runlock.acquire(self.dir, say)
        self.locked = True
        try:
            prev = self.dir / "config.json"
            if not (fresh and prev.is_file()):  # --fresh moves the folder aside whole
                self._check_folders(todo)
            history = []
            if prev.is_file() and fresh:
                base = f"{self.dir.name}.{time.strftime('%Y%m%d-%H%M%S')}"
                aside, n = self.dir.with_name(base), 1
                while aside.exists():  # two --fresh in one second: never onto an older run
                    aside, n = self.dir.with_name(f"{base}-{n}"), n + 1
                os.replace(self.dir, aside)
                runlock.move_held(self.dir, aside)
                self.locked = False
                runlock.acquire(self.dir, say)  # the new folder's own lock, then the old one's goes
                self.locked = True
                runlock.release(aside)
                say(f"--fresh: moved the previous run to {aside}")
            elif prev.is_file():
                history = self._check_same_run(prev, allow_new_data, allow_changed)
                self.resuming = True
                init = recorded(self.dir)
                if init:  # the fine-tune's sources (wm.checkpoint.init_from.record) stay named
                    meta["init"] = init
            elif allow_changed:
                raise WMError(f"--allow-changed resumes a run, but {self.dir} holds none yet; leave it out")
            if history:
                meta["history"] = history
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                save_config(self.cfg, self.dir / "config.json", meta)
            except OSError as e:
                raise WMError(f"cannot write the run folder {self.dir} ({e}); set run.out_dir to a "
                              "writable folder") from None
            self._set_aside_damaged_done()
        except BaseException:
            self.close()
            raise

    def _check_folders(self, todo: list[str]) -> None:
        """Refuse, before any work, a file where the run keeps a folder (a user's copy, a slip) and a
        stage folder this run cannot write (its first save would fail after the steps before it)."""
        folders = {self.dir / "token_cache": "token cache"}
        for s in STAGE_SECTIONS:
            folders.update({self.dir / s: f"{s} stage", self.dir / s / "checkpoints": f"{s} checkpoints"})
        for p, what in folders.items():
            if p.exists() and not p.is_dir():
                raise WMError(f"{p} is a file, but the run keeps its {what} folder there; move the file away "
                              "(the run reads nothing of it) and rerun")
        if (self.dir / "config.json").is_dir():
            raise WMError(f"{self.dir / 'config.json'} is a folder, but the run keeps its config file there; move "
                          "it away and rerun")
        for s in todo:  # the run folder itself: config.json is written before any work
            stage = next((p for p in (self.dir / s / "checkpoints", self.dir / s) if p.is_dir()), None)
            places = [(stage, "saves its checkpoints")] + (
                [(self.dir / "token_cache", "keeps its token cache")] if s == "world" else [])
            for p, what in places:
                why = p is not None and p.is_dir() and unwritable(p, 0)
                if why:  # the space a checkpoint needs is required above
                    raise WMError(f"cannot write in {p} ({why}), where the {s} stage {what}; make it writable, or "
                                  "set run.out_dir to a writable folder")

    def _set_aside_damaged_done(self) -> None:
        """A stage's done.json that is not the record the loop writes (torn by a crash, edited, a
        folder) is moved aside, kept, and said: the stage is then checked again from its checkpoints,
        which resume it at its last step and mark it done again, never from its record's guesses."""
        for s in self.cfg.train.stages:
            done = self.dir / s / DONE
            why = done_record(done)[1]
            if why:
                aside, n = done.with_name(f"{DONE}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"), 1
                while aside.exists():
                    aside, n = done.with_name(f"{DONE}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
                os.replace(done, aside)
                fsync_dir(done.parent)
                self.say(f"note: {done} {why}; moved it to {aside.name}: the {s} stage is checked again from its "
                         "checkpoints")

    def close(self) -> None:
        """Give the run folder's lock back (rank 0)."""
        if self.locked:
            runlock.release(self.dir)
            self.locked = False

    def _check_same_run(self, prev: Path, allow_new_data: bool, allow_changed: tuple[str, ...] = ()) -> list:
        """Refuse a run folder that holds another run; returns the config history to write (the
        earlier entries, plus this resume's --allow-changed changes)."""
        try:
            old = json.loads(prev.read_text())
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            raise WMError(f"{prev} is unreadable ({first_line(e)}); restore it, or use --fresh to start over "
                          "(the run folder is moved aside, not deleted)") from None
        meta = old.pop("meta", None) or {} if isinstance(old, dict) else None
        bad = (f"holds {json_kind(old)}" if meta is None else "has a meta that is not an object"
               if not isinstance(meta, dict) else None) or _meta_problem(meta)
        if bad:
            raise WMError(f"{prev} {bad}, not a run's config (an object of sections with its meta); restore it, "
                          "or use --fresh to start over (the run folder is moved aside, not deleted)")
        old, notes = upgrade(old)
        for n in notes:
            self.say(f"note: {prev}: {n}")
        fp = meta.get("data_fingerprint")
        if fp and fp != self.fingerprint and not allow_new_data:
            raise WMError(f"{self.dir} was trained on data {fp[:16]} but {self.root} is "
                          f"{self.fingerprint[:16]}; pass --allow-new-data to resume on it anyway, or "
                          "--fresh / another run.name to start over")
        try:
            old_cfg = from_saved(old)
        except ConfigError as e:
            raise WMError(f"{prev}: {e}; use --fresh to start over") from None
        a, b = resolve_batch_sizes(to_dict(old_cfg)), resolve_batch_sizes(to_dict(self.cfg))
        # a stage that has not saved anything yet may still be configured freely
        free = {sec for stage, secs in STAGE_SECTIONS.items()
                if not latest_checkpoint(self.dir / stage / "checkpoints") for sec in secs}
        rules = key_rules()
        changed = {f"{sec}.{k}": [a[sec][k], b[sec][k]] for sec in a if sec not in free for k in a[sec]
                   if a[sec][k] != b[sec][k] and rules[sec][k][0] != FREE}
        history = list(meta.get("history") or [])
        self.fingerprints |= {f for h in history for f in h.get("data_fingerprint", ())}
        for key in allow_changed:
            sec, _, k = key.partition(".")
            if sec not in a or k not in a[sec]:
                raise ConfigError(key, "unknown key given to --allow-changed")
            if rules[sec][k][0] != ALLOWED:
                raise WMError(f"--allow-changed {key}: {key} changes the data or the model, so a run cannot "
                              f"resume with it changed (keys that may change: {allowed_keys(rules)}); use --fresh "
                              "or another run.name")
        refused = [k for k in changed if k not in allow_changed]
        if refused:
            diffs = [f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused]
            safe = [k for k in refused if rules[k.partition(".")[0]][k.partition(".")[2]][0] == ALLOWED]
            hint = (f"; to resume with it, pass --allow-changed {','.join(safe)}" if len(safe) == len(refused)
                    else "")
            raise WMError(f"{self.dir} holds a run with another config ({'; '.join(diffs[:3])}"
                          f"{'...' if len(diffs) > 3 else ''}){hint}; use --fresh to start over or another run.name")
        steps = {}
        for stage in STAGE_SECTIONS:
            d = read_json(self.dir / stage / "checkpoints" / "latest")
            if d and isinstance(d.get("step"), int):
                steps[stage] = d["step"]
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if fp and fp != self.fingerprint:  # --allow-new-data: the older checkpoints stay this run's
            history.append({"time": now, "step": steps, "data_fingerprint": [fp, self.fingerprint]})
            self.fingerprints.add(fp)
        if changed:
            history.append({"time": now, "step": steps, "changed": changed})
            self.say("resuming with changed hyperparameters (recorded in config.json's meta.history): " +
                     ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in changed.items()))
            for stage in STAGE_SECTIONS:
                for k in (f"{stage}_stage.max_steps", f"{stage}_stage.epochs"):
                    if k in changed:
                        self._reopen(stage, k, changed[k][1])
                        break
        return history

    def _reopen(self, stage: str, key: str, new: int) -> None:
        """A finished stage given more steps (or epochs) goes on from its last checkpoint: its
        done.json goes before config.json records the change, so a kill between the two leaves a
        stage that the rerun resumes at its last step and marks finished again."""
        done = self.dir / stage / DONE
        d = done_record(done)[0]
        if d is None:  # none, or damaged: set aside once config.json is written, and the stage goes on
            return
        if d.get("reason", "finished") != "finished":
            self.say(f"note: the {stage} stage ended at step {d.get('step')} ({d.get('reason')}); it stays finished")
            return
        if key.endswith("max_steps") and 0 < new <= d.get("step", 0):
            return
        os.unlink(done)
        fsync_dir(done.parent)
        self.say(f"{stage} stage: finished at step {d.get('step')}; with {key}={new} it goes on from its "
                 "last checkpoint")

    def stage_dir(self, stage: str) -> Path:
        return self.dir / stage


STAGE_SECTIONS = {"tokenizer": ("tokenizer", "tokenizer_stage"), "world": ("world", "world_stage")}


def allowed_keys(rules: dict) -> str:
    """The keys --allow-changed takes, for a message: '<stage>_stage.{epochs,max_steps,...}'."""
    groups: dict[str, list] = {}
    for sec, keys in rules.items():
        ks = [k for k, (resume, _) in keys.items() if resume == ALLOWED]
        if ks:
            groups.setdefault("<stage>_stage" if sec.endswith("_stage") else sec, ks)
    return ", ".join(f"{sec}.{{{','.join(ks)}}}" for sec, ks in groups.items())


def recorded(run_dir: Path) -> dict:
    """{stage: source} of a fine-tuned run's stages, as config.json's meta.init names them (empty for
    a run from scratch)."""
    d = read_json(run_dir / "config.json") or {}
    init = (d.get("meta") or {}).get("init")
    return init if isinstance(init, dict) else {}


def run_identity(cfg: dict, stage: str, sections: tuple = ()) -> dict:
    """The config keys a checkpoint of `stage` must share with this run to be its own: those a resume
    must match (wm/config/rules.py), of the sections the stage depends on (or `sections`). ConfigError
    for a config this wm cannot read."""
    d = resolve_batch_sizes(to_dict(from_saved(cfg)))
    rules = key_rules()
    return {f"{sec}.{k}": v for sec in sections or stage_sections(stage) for k, v in d[sec].items()
            if rules[sec][k][0] == MATCH}


def belongs(run: "Run", stage: str, tok_sha: Optional[str] = None, sections: tuple = ()):
    """wm.checkpoint.checks' `belongs` for this run: why a checkpoint is another run's (config, data, or
    for the world stage the tokenizer it trained on), or None. `sections`: see run_identity."""
    mine = run_identity(to_dict(run.cfg), stage, sections)

    def why(st: dict) -> Optional[str]:
        try:
            theirs = run_identity(st["config"], stage, sections)
        except (ConfigError, TypeError, KeyError):
            return "holds a config this wm cannot read, so it is another program's or another run's"
        k = next((k for k in mine if theirs.get(k) != mine[k]), None)
        if k:
            return f"was saved by another run ({k} is {theirs.get(k)!r:.40}, this run's {mine[k]!r:.40})"
        fp = st.get("data_fingerprint")
        if fp not in run.fingerprints:
            return f"was trained on other data (fingerprint {str(fp)[:16]}, this run's {run.fingerprint[:16]})"
        got = st["tokenizer"].get("sha256") if isinstance(st.get("tokenizer"), dict) else None
        if tok_sha and got != tok_sha:
            return f"was trained on another tokenizer (sha256 {str(got)[:12]}, this world stage's is {tok_sha[:12]})"
        return None
    return why




DONE = "done.json"  # <stage>/done.json: the loop's record of a finished stage


def done_record(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """A stage's done.json as the loop writes it ({"step", "metrics", "reason"}), else why not:
    (record, None); (None, None) where there is none; (None, why) where it is damaged."""
    if not os.path.lexists(path):
        return None, None
    if path.is_dir():
        return None, "is a folder, not the stage's record"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"is damaged ({first_line(e)})"
    if not isinstance(d, dict):
        return None, f"is damaged (it holds {json_kind(d)}, not the stage's record)"
    step, metrics = d.get("step"), d.get("metrics")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, f"is damaged (its step is {json_kind(step)}, not a step number)"
    if "metrics" not in d:
        return None, "is damaged (it has no metrics)"
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, (int, float))
                                                and not isinstance(v, bool)) for k, v in metrics.items()):
        return None, "is damaged (its metrics are not an object of numbers)"
    if not isinstance(d.get("reason", ""), str):
        return None, "is damaged (its reason is not a text)"
    return d, None


def json_kind(v) -> str:
    """What a JSON value is, in JSON's words: 'a list', 'null', 'the text "x"', 'the number 3'."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, (int, float, str)):
        return f"the {'text' if isinstance(v, str) else 'number'} {json.dumps(v)[:24]}"
    return {dict: "an object", list: "a list"}.get(type(v), type(v).__name__)


def _meta_problem(meta: dict) -> Optional[str]:
    """Why a config.json's meta cannot be read back (its fields are what _check_same_run relies on), or None."""
    if not isinstance(meta.get("data_fingerprint"), (str, type(None))):
        return "has a meta.data_fingerprint that is not a text"
    h = meta.get("history")
    if h is not None and not (isinstance(h, list) and all(isinstance(x, dict) for x in h)):
        return "has a meta.history that is not a list of objects"
    return None


def shared_root(cfg: Config, dist: distributed.Dist, say=print) -> Path:
    """The data root on every rank: data.root, or the synthetic set, which rank 0 generates first and
    the others then find."""
    root = data_root(cfg, log=say) if dist.is_main or cfg.data.root else None
    distributed.barrier(dist)
    return root if root is not None else data_root(cfg, log=say)


def unwritable(folder: Path, need: int = 1 << 20) -> Optional[str]:
    """Why files cannot be written in `folder` (made where missing), or None: a probe file written and
    removed, and `need` bytes free (a full disk takes an empty file, not its contents)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tmp_path(folder / ".write-test")
        probe.write_bytes(b"")
        probe.unlink()
        free = shutil.disk_usage(folder).free
    except OSError as e:
        return e.strerror or first_line(e)
    return f"its disk has {mib(free)} free" if free < need else None


def data_root(cfg: Config, log=print) -> Path:
    """wm.data.windows.resolve_root, where a synthetic data cache that cannot be written is one line naming
    it and the two keys that move it; a quoted `~` in $WM_CACHE means the home folder, as unquoted."""
    if cfg.data.root:
        return resolve_root(cfg, log=log)
    env = os.environ.get("WM_CACHE", "")
    if not cfg.synthetic.cache_dir and env.startswith("~"):
        cfg = dataclasses.replace(cfg, synthetic=dataclasses.replace(cfg.synthetic, cache_dir=os.path.expanduser(env)))
    from wm.data.synthetic.generate import default_cache_dir

    base = cfg.synthetic.cache_dir or default_cache_dir()
    try:
        return resolve_root(cfg, log=log)
    except OSError as e:
        where = ("synthetic.cache_dir" if cfg.synthetic.cache_dir else "$WM_CACHE" if env else
                 "the default cache folder (~/.cache/wm)")
        raise DataError(f"cannot write the synthetic data cache {base} ({where}): {e.strerror or first_line(e)}; "
                        "set synthetic.cache_dir or $WM_CACHE to a writable folder with room") from None
