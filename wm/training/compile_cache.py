"""torch.compile's artifacts kept with the run, so a resume on a fresh machine of the same kind
(preemption, a spot node) reaches its first step in seconds instead of recompiling for minutes.

After a stage's first compiled step, rank 0 writes what torch compiled so far
(`torch.compiler.save_cache_artifacts`: Inductor's graphs and kernels, AOTAutograd's graphs, tuning
results) to `<run>/compile_cache/train-<key>.bin` (the Forecaster its own, `forecast-<key>.bin`,
after each new input shape it compiles); a process that compiles loads the file of its own key
before it compiles (`load_cache_artifacts` fills torch's local caches, and the compile then reuses
them). The key is what makes a kernel valid: the GPU's name and compute capability, torch, Triton
and CUDA versions. A file of another key is left alone and the stage compiles, saying so in one
line; a damaged file is said and ignored. Torch still traces the model (Dynamo) on a cache hit.

Torch's artifacts hold the kernels Inductor built while compiling a graph, not those Triton built
when the first step tuned a kernel (coordinate descent picks a launch config then, and a cached
graph reloads with that choice): without them a fresh node rebuilds each such kernel, one by one,
in the first step. So the Triton cache entries this process wrote travel too, in
`triton-<key>.tar` beside the artifacts, merged across saves and unpacked into the local Triton
cache before anything compiles.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
import time
from pathlib import Path
from typing import Optional

import torch

from wm.utils.atomic import write_bytes

FOLDER = "compile_cache"
_STARTED = time.time()  # Triton cache entries written after this are this process's


def machine_key(device: torch.device) -> dict:
    """What a compiled kernel depends on, besides the model: the device and the compiler stack."""
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        dev = {"device": torch.cuda.get_device_name(device), "capability": f"{cap[0]}.{cap[1]}"}
    else:
        dev = {"device": platform.processor() or platform.machine(), "capability": None}
    return {**dev, "torch": torch.__version__, "triton": triton_v, "cuda": torch.version.cuda}


def key_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def describe(key: dict) -> str:
    return (f"{key['device']}{' sm ' + key['capability'] if key.get('capability') else ''}, torch {key['torch']}"
            f"{', Triton ' + key['triton'] if key.get('triton') else ''}{', CUDA ' + key['cuda'] if key.get('cuda') else ''}")


def prepare() -> None:
    """Set torch's caches up for what a run folder's artifacts hold, before anything compiles."""
    allow_custom_functions()
    keep_tuned_configs()


def allow_custom_functions() -> None:
    """Our autograd.Functions inside the compiled region (the class embedding, the fused head) are
    pure functions of their inputs; without this AOTAutograd's cache skips every graph holding one."""
    import torch._functorch.config as fc

    try:
        fc.autograd_cache_allow_custom_autograd_functions = True
    except AttributeError:  # a torch without the switch caches what it can
        pass


def fixes_tuning_reload(source: str) -> bool:
    """Whether torch's recheck_autotune_cache (its source) marks a kernel reloaded from the FX
    graph cache as already tuned when the autotune cache holds its coordinate-descent result."""
    return "compile_result.config.found_by_coordesc" in source


def keep_tuned_configs() -> bool:
    """Torch releases with pytorch/pytorch#172819 (2.11 among them) reload a cached kernel without
    its coordinate-descent mark and tune it again, which is most of a cached resume's first step.
    Where the installed torch has that bug, its recheck is followed by ours (`tuned_recheck`).
    Returns whether it patched."""
    import inspect

    try:
        from torch._inductor.runtime import triton_heuristics as th

        recheck = th.CachingAutotuner.recheck_autotune_cache
        if getattr(recheck, "keeps_tuning", False) or fixes_tuning_reload(inspect.getsource(recheck)):
            return False
    except (ImportError, AttributeError, OSError, TypeError):  # another torch: leave it as it is
        return False
    th.CachingAutotuner.recheck_autotune_cache = tuned_recheck(recheck, th.check_autotune_cache,
                                                               th.triton_config_to_hashable)
    return True


def tuned_recheck(recheck, check_autotune_cache, hashable):
    """`recheck` (torch's, on a kernel reloaded from the FX graph cache), then: if the autotune
    cache holds a coordinate-descent result for the kernel's configs, the kernel runs that config
    marked as tuned (compiled now if it was not among the reloaded ones), so it is not tuned again."""

    def run(self, reload_kernel_from_src):
        configs = [r.config for r in self.compile_results]
        recheck(self, reload_kernel_from_src)
        cached, _, _ = check_autotune_cache(configs, self.filename, self.inductor_meta)
        if len(cached) != 1 or not getattr(cached[0], "found_by_coordesc", False):
            return
        best, want = cached[0], hashable(cached[0])
        for r in self.compile_results:
            if hashable(r.config) == want:
                r.config.found_by_coordesc = True
                self.compile_results = [r]
                return
        if self.fn.fn is None:  # compiled in a worker: the parent reloads its source first
            self.fn = reload_kernel_from_src().fn
        self.compile_results = [self._precompile_config(best)]

    run.keeps_tuning = True
    return run


def load(run_dir: Path, device: torch.device, say, kind: str = "train") -> bool:
    """Load this machine kind's artifacts of `kind` (train: the training steps; forecast: the
    Forecaster's graphs) into torch's caches, once per process; say what happened. Returns whether
    artifacts were loaded."""
    prepare()
    folder = Path(run_dir) / FOLDER
    key = machine_key(device)
    name = f"{kind}-{key_name(key)}"
    if name in _loaded:
        return True
    if not folder.is_dir():
        return False
    blob, meta = folder / f"{name}.bin", folder / f"{name}.json"
    if not blob.is_file():
        others = []
        for m in sorted(folder.glob(f"{kind}-*.json")):
            try:
                others.append(describe(json.loads(m.read_text())["key"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        if others:
            say(f"compile cache: {folder} holds artifacts of {'; '.join(others)}; this machine is "
                f"{describe(key)}, so the first step compiles")
        return False
    try:
        data = blob.read_bytes()
        want = json.loads(meta.read_text())["sha256"]
        if hashlib.sha256(data).hexdigest() != want:
            raise ValueError("its checksum does not match")
        torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # noqa: BLE001 - a cache is an optimisation: a bad one only costs the compile
        say(f"compile cache: {blob} is damaged ({type(e).__name__}: {str(e)[:120]}); ignored, the first step compiles")
        return False
    _loaded.add(name)
    kernels = unpack_triton(folder / f"triton-{key_name(key)}.tar", device, say)
    say(f"compile cache: loaded {len(data) / 2**20:.1f} MiB compiled on {describe(key)}"
        + (f" and {kernels} Triton kernels" if kernels else ""))
    return True


def misses() -> int:
    """Graphs Inductor compiled so far in this process because its caches did not hold them."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"]


def save(run_dir: Path, device: torch.device, say, kind: str = "train") -> None:
    """Write what this process compiled so far for this machine kind (rank 0; atomic)."""
    got = torch.compiler.save_cache_artifacts()
    if not got:
        return
    data = got[0]
    key = machine_key(device)
    folder = Path(run_dir) / FOLDER
    name = f"{kind}-{key_name(key)}"
    old = folder / f"{name}.bin"
    folder.mkdir(parents=True, exist_ok=True)
    kernels = pack_triton(folder / f"triton-{key_name(key)}.tar", device)
    if old.is_file() and old.stat().st_size >= len(data):  # artifacts only accumulate: it holds these already
        return

    write_bytes(folder / f"{name}.bin", data)
    write_bytes(folder / f"{name}.json", json.dumps(
        {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, indent=1))
    _loaded.add(name)
    say(f"compile cache: saved {len(data) / 2**20:.1f} MiB" + (f" and {kernels} Triton kernels" if kernels else "")
        + f" to {folder} (a resume on {describe(key)} skips the compile)")


# ---------------------------------------------------------------------------------------------
# Triton's own cache: the kernels the first step tuned and built


def triton_dir(device: torch.device) -> Optional[Path]:
    """The folder Triton caches its built kernels in for `device` (Inductor's choice: TRITON_CACHE_DIR,
    else a folder of Inductor's cache); None off CUDA."""
    if device.type != "cuda":
        return None
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    except ImportError:
        return None
    return Path(triton_cache_dir(device.index or 0))


def _read_tar(tar: Path) -> bytes:
    """`tar`'s bytes, checked against the checksum saved beside it (ValueError when they differ)."""
    data = tar.read_bytes()
    want = json.loads(tar.with_suffix(".json").read_text())["sha256"]
    if hashlib.sha256(data).hexdigest() != want:
        raise ValueError("its checksum does not match")
    return data


def pack_triton(tar: Path, device: torch.device, since: Optional[float] = None) -> int:
    """Add to `tar` the Triton cache entries (one folder per kernel) written since `since` (default:
    this process's start) that it does not hold yet; atomic, with its checksum beside it. Returns
    the kernels it holds."""
    try:
        old = tarfile.open(fileobj=io.BytesIO(_read_tar(tar))) if tar.is_file() else None
        members = old.getmembers() if old else []
    except (OSError, ValueError, KeyError, TypeError, tarfile.TarError):  # damaged: it starts again
        old, members = None, []
    have = {m.name.split("/")[0] for m in members}
    src = triton_dir(device)
    since = _STARTED if since is None else since
    new = [] if src is None or not src.is_dir() else sorted(
        e.name for e in src.iterdir() if e.is_dir() and e.name not in have and e.stat().st_mtime >= since)
    if not new:
        return len(have)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as out:
        for m in members:
            out.addfile(m, old.extractfile(m) if m.isfile() else None)
        for name in new:
            out.add(src / name, arcname=name)
    data = buf.getvalue()
    write_bytes(tar, data)
    write_bytes(tar.with_suffix(".json"), json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                                                      "kernels": len(have) + len(new)}, indent=1))
    return len(have) + len(new)


def _relocate(grp: Path, home: Path) -> None:
    """Point a Triton group record's files (absolute paths where the kernel was built) at `home`,
    the kernel's folder here; a record of another form is left as it is."""
    try:
        rec = json.loads(grp.read_text())
        paths = rec["child_paths"]
        rec["child_paths"] = {k: str(home / Path(v).name) if os.path.isabs(v) else v for k, v in paths.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    grp.write_text(json.dumps(rec))


def unpack_triton(tar: Path, device: torch.device, say) -> int:
    """Unpack `tar`'s kernels into this machine's Triton cache (those it lacks), so the first step
    finds them built. Returns how many it holds; a damaged file is said and ignored."""
    dst = triton_dir(device)
    if dst is None or not tar.is_file():
        return 0
    os.environ.setdefault("TRITON_CACHE_DIR", str(dst))  # Inductor and its compile workers look here
    try:
        t = tarfile.open(fileobj=io.BytesIO(_read_tar(tar)))
        members = t.getmembers()
    except (OSError, ValueError, KeyError, TypeError, tarfile.TarError) as e:
        say(f"compile cache: {tar} is damaged ({type(e).__name__}: {str(e)[:120]}); ignored, its kernels are rebuilt")
        return 0
    names = {m.name.split("/")[0] for m in members}
    tmp = dst / f".wm-unpack.tmp-{os.getpid()}"
    try:
        dst.mkdir(parents=True, exist_ok=True)
        missing = [m for m in members if not (dst / m.name.split("/")[0]).exists()]
        t.extractall(tmp, members=missing, filter="data")  # "data": nothing outside tmp, no links out
        for e in (tmp.iterdir() if tmp.is_dir() else ()):
            for grp in e.glob("__grp__*"):
                _relocate(grp, dst / e.name)
            try:  # a kernel appears whole or not at all, to Triton and to other ranks unpacking beside us
                os.replace(e, dst / e.name)
            except OSError:  # another process put the same kernel there first
                pass
    except (OSError, tarfile.TarError) as e:
        say(f"compile cache: cannot unpack {tar.name} into {dst} ({type(e).__name__}: {str(e)[:120]}); "
            "its kernels are rebuilt")
        return 0
    finally:
        t.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return len(names)


_loaded: set = set()
