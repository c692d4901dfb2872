"""Run logs: TensorBoard scalars/images and the HParams records (wm/training/main.py writes them at start and end), `metrics.jsonl` for scripts, and a console line.

Only rank 0 logs. Names carry their units (`loss/ce`, `perf/samples_per_s`, `mem/max_alloc_gib`).
A logger that fails (tensorboard not installed, folder unwritable, disk full) warns once and is
switched off; the run goes on, and the other sinks keep working: metrics never cost a run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def _clean(v: Any) -> Any:
    """JSON-safe: floats stay floats, NaN/inf become None (strict JSON has no NaN)."""
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return v if math.isfinite(v) else None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class Logger:
    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True,
                 stream=None):
        self.dir, self.enabled = Path(run_dir), enabled
        self.stream = stream or sys.stdout
        self._tb = None
        self._jsonl = None
        self._failed: set[str] = set()
        self._last_line = 0.0
        if not enabled:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tb"))
            except Exception as e:  # ImportError, OSError, anything: warn and go on
                self._fail("tensorboard", e)
        try:
            cut = drop_partial_line(self.dir / "metrics.jsonl")
            if cut:
                print(f"note: {self.dir / 'metrics.jsonl'} ended in a record cut short ({cut} bytes, by a full disk "
                      "or a kill mid-write); dropped it, so the next record starts a line of its own", file=self.stream)
            self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        except OSError as e:
            self._fail("metrics.jsonl", e)

    def _fail(self, sink: str, e: BaseException) -> None:
        if sink not in self._failed:
            self._failed.add(sink)
            warnings.warn(f"logging to {sink} failed ({type(e).__name__}: {e}); it is switched off, "
                          "training goes on", RuntimeWarning, stacklevel=3)
        if sink == "tensorboard":
            self._tb = None
        elif sink == "metrics.jsonl":
            self._jsonl = None

    def scalars(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        """One record: TensorBoard scalars under their names, and a line in metrics.jsonl. A kind
        '<stage>/<what>' files the TensorBoard scalars under '<stage>/': each stage counts its own
        steps, so two stages under one name would zig-zag in one curve."""
        if not self.enabled:
            return
        if self._tb is not None:
            scope = kind.partition("/")[0] + "/" if "/" in kind else ""
            try:
                for k, v in values.items():
                    if v is not None and math.isfinite(float(v)):
                        self._tb.add_scalar(scope + k, float(v), step)
            except Exception as e:
                self._fail("tensorboard", e)
        if self._jsonl is not None:
            try:
                rec = {"kind": kind, "step": step, "time": round(time.time(), 3), **_clean(values)}
                self._jsonl.write(json.dumps(rec) + "\n")
            except Exception as e:
                self._fail("metrics.jsonl", e)

    def record(self, step: int, kind: str, payload: dict) -> None:
        """A structured (non-scalar) record in metrics.jsonl only, e.g. a per-class table."""
        if self.enabled and self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps({"kind": kind, "step": step, **_clean(payload)}) + "\n")
            except Exception as e:
                self._fail("metrics.jsonl", e)

    def image(self, tag: str, step: int, rgb: np.ndarray) -> None:
        """(H, W, 3) uint8 picture."""
        if self.enabled and self._tb is not None:
            try:
                self._tb.add_image(tag, rgb, step, dataformats="HWC")
            except Exception as e:
                self._fail("tensorboard", e)

    def hparams_start(self, hparams: dict, metrics: list[str], trial_id: str) -> None:
        """The HParams tab's records at the start of a process (a fresh run or a resume), into the run's
        own event file: the experiment (every hparam with its type, the fixed `metrics`: scalar tags this
        run logs) and the session start (`hparams`: bool, number or str values; the others as text).
        TensorBoard keeps the first record of a tag per run, so a resume's repeat changes nothing."""
        if self.enabled and self._tb is not None:
            try:
                hp = {k: _hp_value(v) for k, v in hparams.items()}
                self._tb._get_file_writer().add_summary(_experiment(hp, metrics))
                self._tb._get_file_writer().add_summary(_session_start(hp, trial_id))
                self._tb.flush()
            except Exception as e:
                self._fail("tensorboard", e)

    def hparams_end(self, status: str) -> None:
        """The session end: status "success", "failure", "running" or "unknown" (api_pb2.Status)."""
        if self.enabled and self._tb is not None:
            try:
                self._tb._get_file_writer().add_summary(_session_end(status))
                self._tb.flush()
            except Exception as e:
                self._fail("tensorboard", e)

    def console(self, text: str, every_s: float = 0.0) -> None:
        """A progress line (rate-limited by every_s); rank 0 only."""
        if not self.enabled:
            return
        now = time.monotonic()
        if every_s and now - self._last_line < every_s:
            return
        self._last_line = now
        try:
            print(text, file=self.stream, flush=True)
        except Exception:
            pass  # a closed console must not stop training either

    def flush(self) -> None:
        for sink in (self._tb, self._jsonl):
            if sink is not None:
                try:
                    sink.flush()
                except Exception:
                    pass

    def close(self) -> None:
        self.flush()
        for sink in (self._tb, self._jsonl):
            if sink is not None:
                try:
                    sink.close()
                except Exception:
                    pass
        self._tb = self._jsonl = None


def _hp_value(v: Any) -> Any:
    """A hparam as TensorBoard holds one: bool, number (not NaN/inf) or str; anything else as text."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v)):
        return float(v)
    return v if isinstance(v, str) else str(v)


def _hparams_summary(tag: str, **data):
    """One Summary value of the hparams plugin: `data` (experiment= / session_start_info= /
    session_end_info=) in HParamsPluginData, serialized into the value's plugin metadata."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    content = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **data)
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def _experiment(hp: dict, metrics: list[str]):
    from tensorboard.plugins.hparams import api_pb2, metadata

    kind = {bool: api_pb2.DATA_TYPE_BOOL, float: api_pb2.DATA_TYPE_FLOAT64, str: api_pb2.DATA_TYPE_STRING}
    exp = api_pb2.Experiment(
        time_created_secs=time.time(),
        hparam_infos=[api_pb2.HParamInfo(name=k, type=kind[type(v)]) for k, v in hp.items()],
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(group="", tag=m)) for m in metrics])
    return _hparams_summary(metadata.EXPERIMENT_TAG, experiment=exp)


def _session_start(hp: dict, trial_id: str):
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(group_name=trial_id, start_time_secs=time.time())
    for k, v in hp.items():
        field = "bool_value" if isinstance(v, bool) else "number_value" if isinstance(v, float) else "string_value"
        setattr(info.hparams[k], field, v)
    return _hparams_summary(metadata.SESSION_START_INFO_TAG, session_start_info=info)


def _session_end(status: str):
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(f"STATUS_{status.upper()}"),
                                          end_time_secs=time.time())
    return _hparams_summary(metadata.SESSION_END_INFO_TAG, session_end_info=info)


def drop_partial_line(path: Path) -> int:
    """Cut a JSON-lines file back to its last complete line (one that ends in a newline); returns the
    bytes cut (0: none, or no file). A line cut short is no record, and one appended to it would be
    glued onto it."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        end = pos = f.seek(0, 2)
        while pos > 0:
            n = min(pos, 1 << 16)
            pos -= n
            f.seek(pos)
            chunk = f.read(n)
            if pos + n == end and chunk.endswith(b"\n"):
                return 0
            i = chunk.rfind(b"\n")
            if i >= 0:
                pos += i + 1
                break
        f.truncate(pos)
        f.flush()
        os.fsync(f.fileno())
        return end - pos


def eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, r = divmod(seconds, 3600)
    m, s = divmod(r, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """One console line per phase step at most every `every` seconds: done/total, rate, ETA."""

    def __init__(self, what: str, total: int, unit: str, log=print, every: float = 10.0):
        self.what, self.total, self.unit, self.log, self.every = what, total, unit, log, every
        self.t0 = self.last = time.perf_counter()
        self.done = 0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            self.log(f"  {self.what}: {self.done}/{self.total} {self.unit}, {rate:.2f} {self.unit}/s, "
                     f"ETA {eta((self.total - self.done) / max(rate, 1e-9))}")

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0
