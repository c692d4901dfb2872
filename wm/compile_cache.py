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
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch

from wm.atomic import write_bytes

FOLDER = "compile_cache"


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
    say(f"compile cache: loaded {len(data) / 2**20:.1f} MiB compiled on {describe(key)}")
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
    if old.is_file() and old.stat().st_size >= len(data):  # artifacts only accumulate: it holds these already
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_bytes(folder / f"{name}.bin", data)
    write_bytes(folder / f"{name}.json", json.dumps(
        {"key": key, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, indent=1))
    _loaded.add(name)
    say(f"compile cache: saved {len(data) / 2**20:.1f} MiB to {folder} (a resume on {describe(key)} skips the compile)")


_loaded: set = set()
