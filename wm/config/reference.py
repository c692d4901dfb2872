"""The config reference, generated from the dataclasses: `python train.py --help-config`, docs/CONFIG.md.

Every key of every section with its type, its default (the built-in demo's, i.e. `Config()`), its
rules for resume and --eval-only (wm/config/rules.py) and one line of meaning: the comment on the
field's line in its dataclass (wm/config/sections.py, wm/config/runtime.py, wm/models/tokenizer.py, wm/models/world.py).
So the reference cannot drift from the code: a key added without a comment has no meaning to show, and tests/config/test_config_ref.py fails until it gets one; docs/CONFIG.md
is checked against `reference()` by the same test (regenerate it with
`python train.py --help-config > docs/CONFIG.md`).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import textwrap
import tokenize

from wm.config.loading import _hints, _type_name, json_key, key_rules, to_dict
from wm.config.rules import WORDS
from wm.config.sections import Config

INTRO = {
    "run": "the run folder and its seed",
    "data": "the data set, the windows cut from it, the batch size",
    "synthetic": "the built-in procedural scenes, used when data.root is empty",
    "tokenizer": "the VQ-VAE (model sizes and loss weights)",
    "world": "the forecasting transformer (model sizes and loss weights)",
    "train": "what holds for the whole run (both stages)",
    "tokenizer_stage": "optimisation of the tokenizer stage",
    "world_stage": "optimisation of the world-model stage",
    "loader": "how batches are read: DataLoader workers, pinned memory, the HDF5 chunk cache",
    "compile": "torch.compile of the training step",
    "kernels": "the Triton kernels (CUDA) and memory layouts the models run, each the same function as its torch path",
    "activation_checkpoint": "activation checkpointing: blocks recomputed in the backward pass to save memory",
    "ddp": "more than one rank: the collectives' timeout, DDP's gradient all-reduce",
    "checkpoint": "when checkpoints are written and how many are kept",
    "logging": "what is logged, and how often",
    "init": "fine-tuning: the stages start from another run's weights (docs/FINETUNE.md)",
}


def field_comments(cls) -> dict[str, str]:
    """{field name: the comment on its line} of a dataclass, read from its source."""
    src = textwrap.dedent(inspect.getsource(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    first_token: dict[int, str] = {}
    out: dict[str, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row = tok.start[0]
        if tok.type == tokenize.NAME and row not in first_token and tok.start[1] == 4:
            first_token[row] = tok.string
        elif tok.type == tokenize.COMMENT and first_token.get(row) in names:
            out[first_token[row]] = tok.string.lstrip("#").strip()
    return out


def _default(v) -> str:
    return json.dumps(v)


def sections() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """[(section, [(key, type, default, meaning)])] in Config's order."""
    cfg = Config()
    values = to_dict(cfg)
    out = []
    for f in dataclasses.fields(Config):
        cls = type(getattr(cfg, f.name))
        notes = field_comments(cls)
        rows = [(json_key(k), _type_name(tp), _default(values[f.name][json_key(k)]), notes.get(k, ""))
                for k, tp in _hints(cls).items()]
        out.append((f.name, rows))
    return out


def reference() -> str:
    """docs/CONFIG.md: one table per section."""
    lines = ["# Config reference", "",
             "Generated from the dataclasses by `python train.py --help-config` (do not edit by hand: "
             "`python train.py --help-config > docs/CONFIG.md`). Defaults are the built-in demo's "
             "(`python train.py` without `--cfg`); a config file holds only what differs, "
             "`--set section.key=value` overrides one key.", "",
             "*resume*: what rerunning the command of a run folder may change (a change of a key that must "
             "match is refused, naming it; one marked --allow-changed is taken when that flag names it, and "
             "recorded). *--eval-only*: what the config given for evaluation must share with the "
             "checkpoint's.", ""]
    rules = key_rules()
    for name, rows in sections():
        lines += [f"## {name}", "", f"{INTRO.get(name, '').capitalize()}.", "",
                  "| key | type | default | resume | --eval-only | meaning |", "|---|---|---|---|---|---|"]
        lines += [f"| `{name}.{k}` | {t} | `{d}` | {WORDS[rules[name][k][0]]} | {WORDS[rules[name][k][1]]} "
                  f"| {m.replace('|', '/')} |" for k, t, d, m in rows]
        lines.append("")
    return "\n".join(lines)
