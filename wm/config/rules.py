"""What each config key may do between two runs of one run folder, and between a checkpoint and
the config that evaluates it: one rule for resume and one for --eval-only, declared where the key
is, so no list of keys is kept anywhere else.

A section (a config dataclass) declares its keys' rules as class attributes, `RESUME` and
`EVALUATE`; a key whose rule differs declares its own, `key: type = rule(default, resume=...)`.

    FREE     may change freely: how the run goes, not what it computes (loader, logging, kernels...)
    MATCH    must match: the data, the model, the seed, the batch
    ALLOWED  resume only: may change with --allow-changed (a stage's optimisation: lr, steps...)

A key that names a file or folder says so, `rule(default, path=True)`: a leading `~` is expanded as a
shell does and a NUL byte refused (`resolve_paths`). Bounds that hold for several sections' keys
live here too (`at_most`, MAX_BATCH).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from wm.utils.errors import ConfigError

FREE, MATCH, ALLOWED = "free", "match", "allowed"
WORDS = {FREE: "may change", MATCH: "must match", ALLOWED: "--allow-changed"}


def rule(default: Any, resume: str | None = None, evaluate: str | None = None, path: bool = False) -> Any:
    """A field's default with its own rule for resume and/or --eval-only (else its section's).
    `path`: the key names a file or folder (wm.config.sections expands its leading ~ and refuses a NUL byte)."""
    meta = {"resume": resume, "evaluate": evaluate, "path": path}
    if isinstance(default, (dict, list)):  # a mutable default: each config its own copy
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def rules(section: type, key: str) -> tuple[str, str]:
    """(resume rule, --eval-only rule) of `key` in config dataclass `section`."""
    f = next(f for f in dataclasses.fields(section) if f.name == key)
    return f.metadata.get("resume") or section.RESUME, f.metadata.get("evaluate") or section.EVALUATE



# samples a step, per rank or all ranks together: no accelerator holds more, so a larger batch is a
# slip (an extra digit), refused before it reaches the loader
MAX_BATCH = 1 << 16
BATCH_WHY = "samples a step is more than any accelerator's memory holds"
FRESH_SUFFIX = len(".20260101-000000-99")  # what --fresh adds to a run folder's name when it moves it aside


def at_most(section: Any, keys: tuple[str, ...], top: int, why: str) -> None:
    """ConfigError naming the first of `keys` of `section` above `top`, saying `why` it is refused."""
    for k in keys:
        if getattr(section, k) > top:
            raise ConfigError(k, f"{getattr(section, k)} {why}; at most {top}")


def name_max(folder: str) -> int:
    """The longest file name (bytes) the file system of `folder` (or its nearest existing parent) takes."""
    p = Path(folder or ".").absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.pathconf(p, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def resolve_paths(cfg: Any, saved: bool = False) -> Any:
    """A whole config's path keys (rule(..., path=True)) and run.name as the operating system takes
    them: a NUL byte (no file name holds one) and a run.name longer than its file system's names
    refused (ConfigError), a leading `~` expanded in place: run.out_dir=~/runs is in the home folder,
    not in a folder named '~'. `saved`: a config a run wrote, whose name its file system took. Returns cfg."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        for g in dataclasses.fields(section):
            v = getattr(section, g.name)
            if not g.metadata.get("path") and (f.name, g.name) != ("run", "name") or not isinstance(v, str):
                continue
            if "\0" in v:
                raise ConfigError(f"{f.name}.{g.name.rstrip('_')}", f"{v!r} holds a NUL byte, which no file name "
                                  "can; remove it")
            if v.startswith("~"):
                setattr(section, g.name, os.path.expanduser(v))
    name, room = cfg.run.name, 0 if saved else name_max(cfg.run.out_dir) - FRESH_SUFFIX
    if not saved and len(os.fsencode(name)) > room:
        raise ConfigError("run.name", f"{name[:24]!r}... is {len(os.fsencode(name))} bytes; the file system of "
                          f"{cfg.run.out_dir} takes names of {room + FRESH_SUFFIX} (PC_NAME_MAX), less {FRESH_SUFFIX} "
                          f"for the date --fresh adds: choose a name of at most {room} bytes")
    return cfg
