"""Configs in and out: strict JSON loading into the sections' dataclasses, `--set a.b=value` overrides,
saving, and the per-key resume rules read off the dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Optional

from wm.config.rules import resolve_paths, rules
from wm.config.sections import Config, META_KEY
from wm.config.upgrade import DROPPED, MOVED, upgrade
from wm.utils.atomic import write_bytes
from wm.utils.errors import ConfigError


def key_rules() -> dict[str, dict[str, tuple[str, str]]]:
    """{section: {key: (resume rule, --eval-only rule)}} of every config key."""
    return {sec: {json_key(f.name): rules(cls, f.name) for f in dataclasses.fields(cls)}
            for sec, cls in _hints(Config).items()}


def stage_sections(stage: str) -> tuple[str, ...]:
    """The sections a checkpoint of `stage` depends on: all but the other stage's optimisation and,
    for the tokenizer, the world model."""
    other = ("world", "world_stage") if stage == "tokenizer" else ("tokenizer_stage",)
    return tuple(sec for sec in _hints(Config) if sec not in other)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def json_key(name: str) -> str:
    """A field's key in JSON and on the command line: `from_` is `from` (a Python keyword)."""
    return name[:-1] if name.endswith("_") else name


def _attr(cls, key: str) -> str:
    """The field of `cls` behind JSON key `key`."""
    return key + "_" if key + "_" in _hints(cls) else key


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"


def _coerce(value: Any, tp, key: str) -> Any:
    """A JSON value as field type `tp`, or ConfigError naming key, expected type and value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X], X | Y: the first type that takes it
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner[:-1]:
            try:
                return _coerce(value, a, key)
            except ConfigError:
                pass
        try:
            return _coerce(value, inner[-1], key)
        except ConfigError:
            raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}") from None
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected {_type_name(tp)} (an object of keys), got {type(value).__name__} {value!r}")
        kt, vt = args if args else (str, Any)
        return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(key, f"{value!r} is not a finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in _hints(cls).items():
        full = f"{prefix}{json_key(name)}"
        keys.append(full)
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, full + "."))
    return keys


def _unknown(key: str, root_cls) -> ConfigError:
    if key in MOVED:
        return ConfigError(key, f"unknown key: it is {MOVED[key]} now")
    if key in DROPPED:
        return ConfigError(key, f"unknown key: the knob is gone, {DROPPED[key][1]}")
    close = difflib.get_close_matches(key, _all_keys(root_cls), n=1, cutoff=0.6)
    if not close:  # a misspelt leaf under the right section, e.g. data.bach_size
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in _all_keys(root_cls)
                 if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.75)][:1]
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(key, f"unknown key{hint}")


def from_dict(cls, d: Any, prefix: str = "", root_cls=None, base=None):
    """Build dataclass `cls` from a (JSON) dict, refusing unknown keys and wrong types. Keys the dict
    leaves out keep their defaults, a section's defaults being its parent's (`base`: Config's demo
    stages and tokenizer), so a file's partial section means what the same keys given by --set mean.
    A whole Config's dict may be in an earlier run folder's layout (`upgrade`)."""
    root_cls = root_cls or cls
    if not isinstance(d, dict):
        raise ConfigError(prefix.rstrip(".") or "<root>", f"expected an object of keys, got {d!r}")
    if cls is Config and not prefix:
        d = upgrade(d)[0]
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, v in d.items():
        k = _attr(cls, key)
        if k not in hints or json_key(k) != key:
            raise _unknown(f"{prefix}{key}", root_cls)
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            f = fields[k]
            sub = getattr(base, k) if base is not None else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            kwargs[k] = from_dict(tp, v, f"{prefix}{key}.", root_cls, sub)
        else:
            kwargs[k] = _coerce(v, tp, f"{prefix}{key}")
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def from_saved(d: Any) -> "Config":
    """A run's saved config (its config.json, a checkpoint's): the keys it lacks were added after it
    was written and take their class defaults, which keep what ran before they existed (a partial
    config file takes the demo's defaults instead, as from_dict gives them)."""
    hints = _hints(Config)
    base = Config(**{f.name: hints[f.name]() for f in dataclasses.fields(Config)})
    return resolve_paths(from_dict(Config, d, base=base), saved=True)


def _plain(obj) -> Any:
    if dataclasses.is_dataclass(obj):
        return {json_key(f.name): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def to_dict(cfg) -> dict:
    """The config as plain JSON types (tuples become lists), keyed as in JSON files."""
    return json.loads(json.dumps(_plain(cfg)))


def _parse_raw(raw: str, tp) -> Any:
    """A command-line string as a JSON value of (roughly) the field's type, for _coerce to check."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null"):
            return None
        tp = [a for a in args if a is not type(None)][0]
        origin = typing.get_origin(tp)
    if tp is str:
        return raw
    if tp is bool:
        low = raw.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        return raw  # _coerce names it as a wrong type
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if origin in (tuple, list):  # a,b,c
            return [_parse_raw(p.strip(), typing.get_args(tp)[0]) for p in raw.split(",") if p.strip()]
        return raw


def apply_override(cfg, item: str) -> None:
    """Apply one `a.b=value` override in place."""
    if "=" not in item:
        raise ConfigError(item, "an override must look like section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    obj, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        hints = _hints(type(obj))
        part = _attr(type(obj), part)
        if part not in hints or part.endswith("_") and part[:-1] != parts[i]:
            raise _unknown(key, type(cfg))
        tp = hints[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(key, "is a section; set one of its keys, e.g. "
                                  f"{key}.{json_key(next(iter(_hints(tp))))}=...")
            setattr(obj, part, _coerce(_parse_raw(raw, tp), tp, key))
        else:
            if not dataclasses.is_dataclass(tp):
                raise _unknown(key, type(cfg))
            obj = getattr(obj, part)


def load(path: Optional[str | os.PathLike] = None, overrides: tuple[str, ...] | list[str] = (),
         cls=Config, say=print):
    """Defaults, then the JSON file (if any), then the overrides; validated. A file in an earlier
    run folder's layout is read as this one, each change said (`say`) in one line."""
    d: dict = {}
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError("--cfg", f"config file {p} does not exist")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError("--cfg", f"{p} is not valid JSON: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("--cfg", f"cannot read {p}: {e}") from None
    if isinstance(d, dict):
        d.pop(META_KEY, None)
        if cls is Config:
            d, notes = upgrade(d)
            for n in notes:
                say(f"note: {path}: {n}")
    try:
        cfg = from_dict(cls, d)
    except ConfigError as e:
        raise ConfigError(e.key, f"{e.msg} (in {path})" if path is not None else e.msg) from None
    for item in overrides:
        apply_override(cfg, item)
    return (resolve_paths(cfg) if cls is Config else cfg).validate()


def save(cfg, path: str | os.PathLike, meta: Optional[dict] = None) -> None:
    """Write the resolved config as JSON, atomically. `meta` (data fingerprint, versions, git
    commit...) goes under the top-level key "meta", which `load` ignores: the file loads back to
    an equal config."""
    d = to_dict(cfg)
    if meta:
        d[META_KEY] = meta
    write_bytes(path, json.dumps(d, indent=2) + "\n")
