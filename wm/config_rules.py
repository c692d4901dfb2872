"""What each config key may do between two runs of one run folder, and between a checkpoint and
the config that evaluates it: one rule for resume and one for --eval-only, declared where the key
is, so no list of keys is kept anywhere else.

A section (a config dataclass) declares its keys' rules as class attributes, `RESUME` and
`EVALUATE`; a key whose rule differs declares its own, `key: type = rule(default, resume=...)`.

    FREE     may change freely: how the run goes, not what it computes (loader, logging, kernels...)
    MATCH    must match: the data, the model, the seed, the batch
    ALLOWED  resume only: may change with --allow-changed (a stage's optimisation: lr, steps...)
"""

from __future__ import annotations

import dataclasses
from typing import Any

FREE, MATCH, ALLOWED = "free", "match", "allowed"
WORDS = {FREE: "may change", MATCH: "must match", ALLOWED: "--allow-changed"}


def rule(default: Any, resume: str | None = None, evaluate: str | None = None) -> Any:
    """A field's default with its own rule for resume and/or --eval-only (else its section's)."""
    meta = {"resume": resume, "evaluate": evaluate}
    if isinstance(default, (dict, list)):  # a mutable default: each config its own copy
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def rules(section: type, key: str) -> tuple[str, str]:
    """(resume rule, --eval-only rule) of `key` in config dataclass `section`."""
    f = next(f for f in dataclasses.fields(section) if f.name == key)
    return f.metadata.get("resume") or section.RESUME, f.metadata.get("evaluate") or section.EVALUATE
