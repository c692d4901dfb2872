"""Whether an intact checkpoint (its checksum proves that much) belongs where it is loaded.

A wm training state holds `TRAINING_KEYS`; it must be of the stage that loads it, shaped like the
model (and, to resume, like its optimizer), saved by this run (the caller's `belongs`: config and
data), and finite. :func:`problem` returns why not as a short phrase, which
:func:`wm.checkpoint.files.newest_valid` puts after the file's name when it skips it for the previous one.
:func:`all_finite` is the save-time check: one fused reduction on the device, read once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

TRAINING_KEYS = ("stage", "step", "model", "optimizer", "scaler", "sampler", "rng", "config")
EVAL_KEYS = ("stage", "model", "config")


def shapes(state_dict: dict) -> dict[str, tuple]:
    """{key: shape} of a module's state_dict (a model built on the meta device gives it for free)."""
    return {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def floats(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every non-empty floating-point tensor in nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel():
            yield prefix.rstrip("."), obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from floats(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from floats(v, f"{prefix}{i}.")


def _finite_flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor: finite or not, from one max-|x| reduction over all of them (NaN and inf propagate
    through it), on their device."""
    if not tensors:
        return torch.ones(0, dtype=torch.bool)
    return torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(tensors, float("inf"))]))


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool on the tensors' device: every value of every floating tensor is finite."""
    ts = [t for t in tensors if t.is_floating_point() and t.numel()]
    return _finite_flags(ts).all() if ts else torch.ones((), dtype=torch.bool)


def first_nonfinite(state: dict, keys=("model", "optimizer"), names: Optional[dict] = None) -> Optional[str]:
    """The dotted name of the first tensor under `keys` of `state` holding a NaN or inf, else None.
    `names` maps an optimizer state index to its parameter's name (said beside it)."""
    named = [(n, t) for k in keys for n, t in floats(state.get(k), f"{k}.")]
    flags = _finite_flags([t for _, t in named])
    if bool(flags.all()):
        return None
    name = named[int((~flags).nonzero()[0])][0]
    parts = name.split(".")
    if names and parts[:2] == ["optimizer", "state"] and parts[2].isdigit() and int(parts[2]) in names:
        name += f" (the moment of {names[int(parts[2])]})"
    return name


def _model_problem(got: Any, want: dict[str, tuple]) -> Optional[str]:
    if not isinstance(got, dict):
        return "holds no model weights (its 'model' is not a state dict)"
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    if missing or extra:
        k, what = (missing[0], "lacks") if missing else (extra[0], "has a key the model lacks:")
        more = len(missing) + len(extra) - 1
        return f"does not fit the model: it {what} {k}" + (f" (and {more} more keys differ)" if more else "")
    for k, s in want.items():
        t = got[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != s:
            return (f"does not fit the model: {k} is {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                    f", the model's is {list(s)}")
    return None


def _optimizer_problem(got: Any, want: list[tuple]) -> Optional[str]:
    """AdamW's state: as many parameters as the model trains, each moment of its parameter's shape."""
    if not isinstance(got, dict) or not isinstance(got.get("state"), dict) or not isinstance(got.get("param_groups"), list):
        return "holds no optimizer state"
    n = sum(len(g.get("params", ())) for g in got["param_groups"] if isinstance(g, dict))
    if n != len(want):
        return f"holds an optimizer of {n} parameters, the model trains {len(want)}"
    for i, st in got["state"].items():
        for k, t in (st.items() if isinstance(st, dict) else ()):
            if k.startswith("exp_avg") and (not isinstance(i, int) or not 0 <= i < n
                                            or not isinstance(t, torch.Tensor) or tuple(t.shape) != want[i]):
                return f"does not fit the optimizer: its moment {i}.{k} is not of its parameter's shape"
    return None


def problem(st: Any, stage: str, model: Optional[dict[str, tuple] | str] = None,
            optimizer: Optional[list[tuple]] = None, belongs: Optional[Callable[[dict], Optional[str]]] = None,
            names: Optional[dict] = None, keys=TRAINING_KEYS) -> Optional[str]:
    """Why state `st` may not be used as a `stage` checkpoint (a phrase after the file's name), or None.

    model: the model's {key: shape} (shapes()), or "own": the model its config describes; optimizer: the shape of each parameter in the
    optimizer's order; belongs(st): why another run's (config, data), or None; names: optimizer
    index -> parameter name, for naming a non-finite moment."""
    if not isinstance(st, dict):
        return f"is not a wm checkpoint (it holds a {type(st).__name__}, not a training state)"
    missing = [k for k in keys if k not in st]
    if missing:
        return f"is not a wm training checkpoint (it has no {', '.join(missing)})"
    if st["stage"] != stage:
        return f"is a {st['stage']!s:.20} checkpoint, not a {stage} one"
    if "step" in keys and (isinstance(st["step"], bool) or not isinstance(st["step"], int) or st["step"] < 0):
        return f"holds no valid step ({st['step']!r:.20})"
    if model == "own":  # the model the checkpoint's config describes
        why = own_model_problem(st, stage)
    else:
        why = model is not None and _model_problem(st["model"], model)
    why = why or (
        optimizer is not None and _optimizer_problem(st["optimizer"], optimizer)) or (belongs and belongs(st))
    if why:
        return why
    bad = first_nonfinite(st, ("model", "optimizer") if "optimizer" in keys else ("model",), names)
    return f"holds non-finite values (first: {bad})" if bad else None


def checker(stage: str, **kw) -> Callable[[Path, dict], Optional[str]]:
    """problem() as newest_valid's `check` (path, state) -> why."""
    return lambda path, st: problem(st, stage, **kw)


def meta_model(cfg, stage: str) -> torch.nn.Module:
    """The model `cfg` describes for `stage`, built on the meta device: its shapes and sizes, no memory, no time."""
    from wm.models.tokenizer import Tokenizer
    from wm.models.world import WorldModel

    with torch.device("meta"):
        if stage == "tokenizer":
            return Tokenizer(cfg.tokenizer, cfg.data.num_classes, tuple(cfg.data.grid))
        return WorldModel(cfg.world, cfg.tokenizer.codebook_size)


def own_model_problem(st: dict, stage: str) -> Optional[str]:
    """Whether the weights fit the model the checkpoint's own config describes (export, evaluation)."""
    from wm.config.loading import from_saved
    from wm.utils.errors import ConfigError

    try:
        cfg = from_saved(st["config"])
    except (ConfigError, TypeError, ValueError) as e:
        return f"holds a config this wm refuses ({e})"
    return _model_problem(st["model"], shapes(meta_model(cfg, stage).state_dict()))


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About the size of a checkpoint of `model`: its state, AdamW's two moments of every trained
    parameter, and 1 MiB for the rest (RNG states, config, the zip's records)."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return state + 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) + (1 << 20)
