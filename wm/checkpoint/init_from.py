"""A stage's weights from another run (`init.from`): fine-tuning, which is not resuming.

A source is a run folder (each stage from its best checkpoint, else its newest valid one) or one
checkpoint file, checked as every load is (checksum, weights_only, stage, shapes against its own
config, finite). Its model must be this config's model but for what follows from the data and the
window: the class set (the class embedding, remapped row by row), the grid's height Z (the
tokenizer's first and last convolutions) and world.max_frames (the frame embeddings); anything
else that differs is refused before the first step, naming the key. The new state: tensors of the
same shape as they are, the class rows from their source classes (same names map by themselves,
free to free, init.class_map names the rest; a class with no source starts by init.new_classes),
tensors whose shape changed from the new model's own initialisation, the codebook's ages at zero
(a fine-tune must not reset the codes it brought in its first steps). Weights only: optimizer,
schedule, sampler and RNG streams start fresh, and only while the stage has no checkpoint of its
own, so rerunning the same command resumes the fine-tune. `load_report` says what happened to
every tensor, grouped by module, before the first step and in <run>/<stage>/init_report.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from wm.checkpoint.checks import EVAL_KEYS, checker
from wm.checkpoint.files import (BEST, CheckpointError, list_checkpoints, load_checked, newest_valid, read_json,
    sha256_file)
from wm.checkpoint.run_folder import Run
from wm.config.init import matches
from wm.config.loading import from_saved, key_rules, to_dict
from wm.config.rules import MATCH
from wm.config.sections import Config
from wm.utils import distributed
from wm.utils.atomic import write_bytes
from wm.utils.errors import ConfigError, WMError

REINIT_WARN = 0.10  # share of a model's values re-initialised past which the report says it is close to scratch
# keys whose change re-initialises the tensors they shape (beyond the classes, remapped row by row)
MAY_CHANGE = {"tokenizer": ("data.grid",), "world": ("world.max_frames",)}
CLASS_ROWS = {"tokenizer": "class_embed.weight"}  # the one tensor with a row per class
CODE_AGES = "quantizer.code_age"


@dataclass
class Source:
    """One stage's source checkpoint: where it is, its identity and what it was trained on."""

    stage: str
    path: Path
    state: dict  # model, config, step, data_fingerprint, class_names (the optimizer is dropped)
    sha256: str
    class_names: Optional[tuple[str, ...]]

    def provenance(self) -> dict:
        return {"path": str(self.path.resolve()), "sha256": self.sha256, "stage": self.stage,
                "step": self.state.get("step"), "data_fingerprint": self.state.get("data_fingerprint"),
                "class_names": list(self.class_names) if self.class_names else None}


@dataclass
class Plan:
    """What init.from does in this run: the stages it initialises, and (a world-only run) the
    tokenizer it takes as it is."""

    stages: list = field(default_factory=list)  # the stages init.from applies to while they have no checkpoint
    sources: dict = field(default_factory=dict)  # stage -> Source, of those that had none when the run started
    tokenizer: Optional[Source] = None  # train.stages=["world"]: the source's tokenizer, used as it is


# ---------------------------------------------------------------------------------------------
# finding the source


def own_checkpoints(run: Run, stage: str) -> bool:
    """Whether the stage has a checkpoint of its own (then init does not apply: it resumes)."""
    folder = run.stage_dir(stage) / "checkpoints"
    return bool(list_checkpoints(folder)) or (folder / BEST).exists()


def _kept(st: dict) -> dict:
    return {k: st[k] for k in ("stage", "model", "config", "step", "data_fingerprint", "class_names", "tokenizer",
                               "init") if k in st}


def _class_names(st: dict, path: Path) -> Optional[tuple[str, ...]]:
    """The classes a tokenizer checkpoint was trained on: recorded in it, else its run's data set's
    manifest (checkpoints written before they recorded them), else None."""
    names = st.get("class_names")
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return tuple(names)
    meta = (read_json(path.resolve().parent.parent.parent / "config.json") or {}).get("meta") or {}
    manifest = read_json(Path(str(meta.get("data_root", ""))) / "manifest.json") if meta.get("data_root") else None
    names = (manifest or {}).get("class_names")
    return tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def _source(path: Path, st: dict, stage: str) -> Source:
    return Source(stage, path, _kept(st), sha256_file(path), _class_names(st, path) if stage == "tokenizer" else None)


def _load(path: Path, stage: str) -> Source:
    """A checkpoint file as a `stage` source: checked as every load is; one line if it fails."""
    try:
        st = load_checked(path, check=checker(stage, model="own", keys=EVAL_KEYS))
    except CheckpointError as e:
        raise WMError(f"init.from: {e}") from None
    return _source(path, st, stage)


def find_source(spec: str, stage: str, say=print) -> Optional[Source]:
    """The `stage` checkpoint of init.from `spec`, or None when the source has no such stage. A run
    folder gives its best checkpoint, else its newest valid one (each one skipped named); a
    tokenizer asked of a world checkpoint file is the one that checkpoint was trained on."""
    p = Path(spec)
    if p.is_dir():
        folder = p / stage / "checkpoints"
        if not (folder / BEST).exists() and not list_checkpoints(folder):
            if not (p / "config.json").is_file() and not any((p / s).is_dir() for s in ("tokenizer", "world")):
                raise WMError(f"init.from: {p} is not a wm run folder (no config.json, tokenizer/ or world/ in it); "
                              "give a run folder (runs/<name>) or one checkpoint file")
            return None
        try:
            found = newest_valid(folder, best=True, say=say, check=checker(stage, model="own", keys=EVAL_KEYS))
        except CheckpointError as e:
            raise WMError(f"init.from: {e}") from None
        return _source(*found, stage) if found else None
    if not p.is_file():
        raise WMError(f"init.from: {p} does not exist; give a run folder (runs/<name>) or one checkpoint file")
    try:
        st = load_checked(p)
    except CheckpointError as e:
        raise WMError(f"init.from: {e}") from None
    got = st.get("stage") if isinstance(st, dict) else None
    if got == stage:
        return _load(p, stage)
    if got == "world" and stage == "tokenizer":
        from wm.checkpoint.trained import world_tokenizer

        return _load(world_tokenizer(st, p, p.parent.parent.parent)[0], stage)
    if got not in ("tokenizer", "world"):
        raise WMError(f"init.from: {p} is not a wm training checkpoint (no stage in it)")
    return None


def plan(run: Run) -> Optional[Plan]:
    """Resolve and check init.from for every stage it applies to, before the first step of any
    stage: a source that cannot be used is one line now, not after hours of another stage."""
    cfg = run.cfg
    spec = cfg.init.from_
    if not spec:
        return None
    trains = cfg.train.stages
    reuse_tok = "tokenizer" not in trains and "world" in trains and not own_checkpoints(run, "tokenizer")
    asked = cfg.init.stages
    for s in asked:
        if s not in trains and not (s == "tokenizer" and reuse_tok):
            raise ConfigError("init.stages", f"names {s}, but train.stages {list(trains)} does not train it")
    out = Plan(stages=[s for s in (asked or trains) if s in trains])
    todo = [s for s in out.stages if not own_checkpoints(run, s)]
    for s in todo:
        out.sources[s] = resolve(run, s)
    if reuse_tok:
        # the tokenizer the source's world model was trained on, where the source names one
        world = out.sources.get("world")
        src = find_source(world.path if world else spec, "tokenizer", say=run.say)
        if src is None:
            raise WMError(f"init.from: train.stages is {list(trains)}: the world stage reuses the source's tokenizer, "
                          f"but {spec} has none; add the tokenizer stage to train.stages")
        check_model(cfg, src)
        rows = class_plan(run, src)
        new = [run.manifest.info.class_names[t] for t, s, _ in rows if s is None]
        z = (src.state["config"].get("data") or {}).get("grid")
        if new or (z and z[2] != cfg.data.grid[2]):
            why = f"classes {new} have no source class" if new else f"the source's Z is {z[2]}, this data's {cfg.data.grid[2]}"
            raise WMError(f"init: train.stages={list(trains)} takes the source's tokenizer as it is, but {why}; "
                          "map every class (init.class_map), or train the tokenizer stage too")
        out.tokenizer = src
    if not any(out.sources.values()) and out.tokenizer is None and todo:
        raise WMError(f"init.from: {spec} holds no checkpoint of the stages this run trains ({', '.join(todo)})")
    return out


def resolve(run: Run, stage: str) -> Optional[Source]:
    """init.from's `stage` checkpoint, checked against this config and data; None (said) when the
    source has no such stage and init.stages does not name it."""
    spec = run.cfg.init.from_
    src = find_source(spec, stage, say=run.say)
    if src is None:
        if stage in run.cfg.init.stages:
            raise WMError(f"init.from: {spec} has no {stage} checkpoint ({Path(spec) / stage / 'checkpoints'}), but "
                          f"init.stages names {stage}; train that stage there, or leave it out of init.stages")
        run.say(f"init: {spec} has no {stage} checkpoint; the {stage} stage trains from scratch")
        return None
    check_model(run.cfg, src)
    if stage == "tokenizer":
        class_plan(run, src)
    return src


def check_model(cfg: Config, src: Source) -> None:
    """The source's model must be this config's, but for MAY_CHANGE and the class set; else one line."""
    mine, theirs = to_dict(cfg), to_dict(from_saved(src.state["config"]))
    rules = key_rules()
    sections = ("tokenizer",) if src.stage == "tokenizer" else ("world",)
    keys = [f"{sec}.{k}" for sec in sections for k, (_, ev) in rules[sec].items() if ev == MATCH]
    if src.stage == "world":
        keys.append("tokenizer.codebook_size")  # the world model's code embedding and head
    diffs = [(key, *key.split(".")) for key in keys if key not in MAY_CHANGE[src.stage]]
    diffs = [(key, theirs[sec][k], mine[sec][k]) for key, sec, k in diffs if mine[sec][k] != theirs[sec][k]]
    if diffs:
        said = "; ".join(f"{key}={json.dumps(a)} (this config: {json.dumps(b)})" for key, a, b in diffs[:3])
        more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        raise WMError(f"init.from: {src.path} is another model: {said}{more}; a fine-tune keeps the source's model "
                      f"(what may differ: the classes, {', '.join(MAY_CHANGE[src.stage])}): take its config.json's "
                      f"model sections ({', '.join(sorted({d[0].split('.')[0] for d in diffs}))}) into this config")


# ---------------------------------------------------------------------------------------------
# classes


def _class_map(cfg: Config) -> dict:
    m = cfg.init.class_map
    if isinstance(m, dict):
        return m
    p = Path(m)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError("init.class_map", f"cannot read {p} ({e.strerror or e})") from None
    except ValueError as e:
        raise ConfigError("init.class_map", f"{p} is not valid JSON ({e})") from None
    if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in d.items()):
        raise ConfigError("init.class_map", f"{p} must hold one object of class name -> source class name")
    return d


def class_plan(run: Run, src: Source) -> list[tuple[int, Optional[int], str]]:
    """(this data's class id, the source class id or None, how: name | map | free | new) per class."""
    info, cfg = run.manifest.info, run.cfg
    names, free = tuple(info.class_names), info.free_class
    if src.class_names is None:
        raise WMError(f"init.from: cannot tell which classes {src.path} was trained on (its checkpoint names none, "
                      "and its run's data set is not here); copy its data set's manifest.json to the path its "
                      "config.json's meta.data_root names")
    theirs = src.class_names
    sfree = int(src.state["config"]["data"]["free_class"])
    cmap = _class_map(cfg)
    for k, v in cmap.items():
        if k not in names:
            raise ConfigError("init.class_map", f"{k!r} is not a class of this run's data (its classes: "
                              f"{', '.join(names)}; the source's: {', '.join(theirs)})")
        if v not in theirs:
            raise ConfigError("init.class_map", f"{k!r} -> {v!r}: {v!r} is not a class of the source {src.path} "
                              f"(its classes: {', '.join(theirs)}; this data's: {', '.join(names)})")
        if (names.index(k) == free) != (theirs.index(v) == sfree):
            raise ConfigError("init.class_map", f"{k!r} -> {v!r}: the free class maps to the source's free class "
                              f"({names[free]!r} -> {theirs[sfree]!r}) and no other class does")
    rows = []
    for t, n in enumerate(names):
        if n in cmap:
            rows.append((t, theirs.index(cmap[n]), "map"))
        elif t == free:
            rows.append((t, sfree, "free"))
        elif n in theirs and theirs.index(n) != sfree:
            rows.append((t, theirs.index(n), "name"))
        else:
            rows.append((t, None, "new"))
    return rows


# ---------------------------------------------------------------------------------------------
# the new state and its report


def build_state(model: nn.Module, src: Source, rows: Optional[list], new_classes: str) -> tuple[dict, dict]:
    """(the state to load into `model`, the load report): see the module docstring."""
    mine, theirs = model.state_dict(), src.state["model"]
    out, report = {}, {"loaded": [], "remapped": [], "reinitialised": [], "not_in_source": [], "unused": [],
                       "restarted": []}
    for k, t in mine.items():
        s = theirs.get(k)
        if k == CODE_AGES:
            out[k] = torch.zeros_like(t)
            report["restarted"].append(k)
        elif s is None:
            out[k] = t
            report["not_in_source"].append({"name": k, "shape": list(t.shape)})
        elif k == CLASS_ROWS.get(src.stage) and rows is not None:
            new = t.clone()
            sfree = int(src.state["config"]["data"]["free_class"])
            keep = [i for i in range(s.shape[0]) if i != sfree]
            for ti, si, how in rows:
                if si is not None:
                    new[ti] = s[si]
                elif new_classes == "mean":
                    new[ti] = s[keep].mean(0)
            out[k] = new
            report["remapped"].append({"name": k, "from": list(s.shape), "to": list(t.shape), "classes": [
                {"class": ti, "source": si, "how": how} for ti, si, how in rows]})
        elif tuple(s.shape) != tuple(t.shape):
            out[k] = t
            report["reinitialised"].append({"name": k, "from": list(s.shape), "to": list(t.shape)})
        else:
            out[k] = s.to(t.dtype)
            report["loaded"].append(k)
    report["unused"] = [{"name": k, "shape": list(v.shape)} for k, v in theirs.items() if k not in mine]
    fresh = sum(mine[r["name"]].numel() for r in report["reinitialised"] + report["not_in_source"])
    if rows is not None:
        fresh += sum(mine[CLASS_ROWS[src.stage]][0].numel() for _, si, _ in rows if si is None)
    report["reinit_share"] = fresh / max(1, sum(v.numel() for k, v in mine.items() if k != CODE_AGES))
    return out, report


def _groups(names: list[str]) -> str:
    """'encoder (20), decoder (18), quantizer': tensor names counted by their first module."""
    counts: dict[str, int] = {}
    for n in names:
        top = n.split(".")[0]
        counts[top] = counts.get(top, 0) + 1
    return ", ".join(f"{g} ({c})" if c > 1 else g for g, c in counts.items())


def report_lines(stage: str, src: Source, rep: dict, class_names, source_names) -> list[str]:
    """The load report as printed before the first step: one line per kind, grouped by module."""
    lines = [f"{stage}: init from {src.path} (sha256 {src.sha256[:12]}, step {src.state.get('step')}, data "
             f"{str(src.state.get('data_fingerprint'))[:12]}); weights only, optimizer and schedule start fresh"]
    lines.append(f"  loaded as they are: {len(rep['loaded'])} tensors: {_groups(rep['loaded']) or 'none'}")
    for r in rep["remapped"]:
        by = {}
        for c in r["classes"]:
            by.setdefault(c["how"], []).append(c)
        said = []
        for how, word in (("name", "by name"), ("map", "by init.class_map"), ("free", "free to free")):
            if how in by:
                said.append(f"{len(by[how])} {word}" + (": " + ", ".join(
                    f"{class_names[c['class']]} <- {source_names[c['source']]}" for c in by[how]) if how == "map" else ""))
        if "new" in by:
            said.append(f"{len(by['new'])} new ({'mean of the source classes' if rep.get('new_classes') == 'mean' else 'fresh'}): "
                        + ", ".join(class_names[c["class"]] for c in by["new"]))
        lines.append(f"  remapped (classes): {r['name']} {r['from']} -> {r['to']}: " + "; ".join(said))
    if rep["reinitialised"]:
        lines.append("  re-initialised (shape changed): " + ", ".join(
            f"{r['name']} {r['from']} -> {r['to']}" for r in rep["reinitialised"]))
    if rep["not_in_source"]:
        lines.append("  not in the source (new): " + ", ".join(r["name"] for r in rep["not_in_source"]))
    if rep["unused"]:
        lines.append("  source tensors unused: " + ", ".join(r["name"] for r in rep["unused"]))
    if rep["restarted"]:
        lines.append(f"  restarted: {', '.join(rep['restarted'])} (no code counts as unused yet)")
    share = rep["reinit_share"]
    lines.append(f"  {100 * share:.1f} % of the model's values start from scratch")
    if share > REINIT_WARN:
        lines.append(f"warning: {stage}: {100 * share:.0f} % of the model's values are re-initialised (more than "
                     f"{100 * REINIT_WARN:.0f} %): this fine-tune is closer to training from scratch")
    return lines


@dataclass
class Applied:
    """What init did to one stage's model in this process: its source and report."""

    source: Source
    report: dict


def apply(run: Run, stage: str, model: nn.Module) -> Optional[Applied]:
    """Initialise `model` (the `stage` model, freshly built) from the run's plan, if it names a
    source for the stage and the stage has no checkpoint of its own; print and save the report."""
    p: Optional[Plan] = getattr(run, "init_plan", None)
    if p is None or stage not in p.stages or own_checkpoints(run, stage):
        return None
    if stage not in p.sources:  # its checkpoints were moved aside since (a world stage whose tokenizer went on)
        p.sources[stage] = resolve(run, stage)
    src = p.sources[stage]
    return None if src is None else _apply(run, stage, model, src)


def _apply(run: Run, stage: str, model: nn.Module, src: Source) -> Applied:
    rows = class_plan(run, src) if stage == "tokenizer" else None
    state, rep = build_state(model, src, rows, run.cfg.init.new_classes)
    rep["new_classes"] = run.cfg.init.new_classes
    model.load_state_dict(state)
    for line in report_lines(stage, src, rep, run.manifest.info.class_names, src.class_names or ()):
        run.say(line)
    if run.dist.is_main:
        folder = run.stage_dir(stage)
        folder.mkdir(parents=True, exist_ok=True)
        write_bytes(folder / "init_report.json", json.dumps({"source": src.provenance(), **rep}, indent=1))
        record(run, stage, src.provenance())
    return Applied(src, rep)


def record(run: Run, stage: str, prov: dict) -> None:
    """config.json's meta.init names each stage's source (rank 0)."""
    path = run.dir / "config.json"
    d = read_json(path)
    if d is None:
        return
    d.setdefault("meta", {}).setdefault("init", {})[stage] = prov
    write_bytes(path, json.dumps(d, indent=2) + "\n")


def adopt_tokenizer(run: Run, model: nn.Module) -> None:
    """A world-only run's tokenizer: the source's (classes remapped), written as this run's tokenizer
    checkpoint of step 0, so the token cache, evaluation and export find it as any run's."""
    p: Optional[Plan] = getattr(run, "init_plan", None)
    if p is None or p.tokenizer is None or own_checkpoints(run, "tokenizer"):
        return
    applied = _apply(run, "tokenizer", model, p.tokenizer)
    if run.dist.is_main:
        from wm.checkpoint.checkpointer import Checkpointer

        state = {"stage": "tokenizer", "step": 0, "model": model.state_dict(), "config": to_dict(run.cfg),
                 "data_fingerprint": run.fingerprint, "class_names": list(run.manifest.info.class_names),
                 "init": applied.source.provenance()}
        with Checkpointer(run.stage_dir("tokenizer") / "checkpoints", keep_last=2, async_save=False) as ck:
            ck.save(state, 0)
        run.say(f"tokenizer: the source's tokenizer, used as it is, saved as {run.stage_dir('tokenizer') / 'checkpoints'}")
    distributed.barrier(run.dist)


# ---------------------------------------------------------------------------------------------
# freezing


def freeze(run: Run, stage: str, model: nn.Module, applied: Optional[Applied]) -> None:
    """<stage>_stage.freeze: those parameters stay fixed. At a fresh start each must have been loaded
    by init (a frozen module that was never trained stays useless); said with the counts."""
    s = getattr(run.cfg, f"{stage}_stage")
    named = dict(model.named_parameters())
    for key, prefixes in ((f"{stage}_stage.freeze", s.freeze), (f"{stage}_stage.lr_mult", tuple(s.lr_mult))):
        for p in prefixes:
            if not any(matches(n, p) for n in named):
                tops = sorted({n.split(".")[0] for n in named})
                raise ConfigError(key, f"{p!r} names no parameter of the {stage} model (its modules: {', '.join(tops)})")
    if not s.freeze:
        return
    frozen = [n for n in named if any(matches(n, p) for p in s.freeze)]
    if not own_checkpoints(run, stage):
        if applied is None:
            raise ConfigError(f"{stage}_stage.freeze", f"{list(s.freeze)} would stay as initialised at random: the "
                              f"{stage} stage is not initialised from a source (init.from, init.stages)")
        rep = applied.report
        fresh = {r["name"] for r in rep["reinitialised"] + rep["not_in_source"]}
        fresh |= {r["name"] for r in rep["remapped"] if any(c["source"] is None for c in r["classes"])}
        bad = [n for n in frozen if n in fresh]
        if bad:
            raise ConfigError(f"{stage}_stage.freeze", f"{bad[0]} is frozen but was re-initialised, not loaded "
                              f"(see the report above); a frozen module must come from the source")
    for n in frozen:
        named[n].requires_grad_(False)
    n_frozen = sum(named[n].numel() for n in frozen)
    n_all = sum(p.numel() for p in named.values())
    run.say(f"{stage}: {(n_all - n_frozen) / 1e6:.2f} M parameters trainable, {n_frozen / 1e6:.2f} M frozen "
            f"({', '.join(s.freeze)})")
