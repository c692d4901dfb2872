"""What the tests share, imported by name (`from helpers import Tiny`): the tiny data set and its
train.py arguments, training subprocesses, bitwise state equality, CLIs run in this process, the
Triton kernels' check runner, a PNG reader. Fixtures and pytest's hooks are tests/conftest.py's."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

from wm.utils.errors import WMError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from procs import Proc as _Proc  # noqa: E402

OCCWORLD = ROOT / "configs" / "occworld.json"  # OccWorld's model sizes


def one_line(e: BaseException) -> str:
    """The message of a user error, checked to be the one line wm promises."""
    assert isinstance(e, WMError), f"{type(e).__name__}: {e}"
    s = str(e)
    assert s and "\n" not in s, f"message is not one line: {s!r}"
    return s


TINY_SETTINGS = {
    "data.grid": "16,16,4",
    "data.past": "2",
    "data.future": "2",
    "loader.num_workers": "0",
    "tokenizer.widths": "8,8,8",
    "tokenizer.mid_attention": "true",  # the export tests need the attention's MatMuls
    "tokenizer.codebook_size": "16",
    "tokenizer.code_dim": "8",
    "tokenizer.dead_code_steps": "2",  # resets draw from the torch RNG: exact resume must cover it
    "world.widths": "8,16",
    "world.heads": "2",
    "train.device": "cpu",
    "train.amp": "fp32",  # the hand-checked numbers are fp32's ("auto" is bf16 on a CPU with AMX)
    "logging.tensorboard": "false",
    "logging.every": "1",
    "train.stages": "tokenizer",
    "tokenizer_stage.batch_size": "2",  # 24 frames: 12 steps per epoch
    "tokenizer_stage.warmup_steps": "2",
    "tokenizer_stage.max_steps": "4",
    "world_stage.batch_size": "2",  # 18 windows: 9 steps per epoch
    "world_stage.warmup_steps": "2",
    "world_stage.max_steps": "4",
}


class Proc(_Proc):
    """A training subprocess (tools/procs.py) on one intra-op thread, its output unbuffered."""

    def __init__(self, cmd, env=None, cwd=ROOT):
        super().__init__(cmd, {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}, cwd)


class Tiny:
    """A tiny synthetic data set (2 train scenes of 12 frames, 1 val scene, 16x16x4) and tiny
    models; `args()` builds train.py arguments for a run folder under the test's tmp folder."""

    data_source = None  # in a test session: where the first Tiny's data set is kept, to copy from

    def __init__(self, base: Path, write: bool = True):
        from wm.data.synthetic.generate import write_synthetic

        self.base = base
        self.data = base / "data"
        if not write:  # the data set another process wrote there (shared_once)
            return
        src = Tiny.data_source
        if src is None:
            write_synthetic(self.data, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4))
            return
        if not (src / "manifest.json").is_file():  # once per process: the same files every time after
            shutil.rmtree(src, ignore_errors=True)
            write_synthetic(src, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4))
        shutil.copytree(src, self.data)  # a test may damage or replace its copy; the source stays

    def regenerate(self, seed: int) -> None:
        import shutil

        from wm.data.synthetic.generate import write_synthetic

        shutil.rmtree(self.data)
        write_synthetic(self.data, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4), seed=seed)

    def args(self, out: str = "runs", name: str = "r", flags=(), **over) -> list[str]:
        s = dict(TINY_SETTINGS)
        s["data.root"] = str(self.data)
        s["run.out_dir"] = str(self.base / out)
        s["run.name"] = name
        for k, v in over.items():
            s[k.replace("__", ".")] = str(v).lower() if isinstance(v, bool) else str(v)
        out_args = []
        for k, v in s.items():
            out_args += ["--set", f"{k}={v}"]
        return out_args + list(flags)

    def run_dir(self, out: str = "runs", name: str = "r") -> Path:
        return self.base / out / name

    def cmd(self, *a, **kw) -> list[str]:
        return [sys.executable, "train.py", *self.args(*a, **kw)]

    def spawn(self, *a, **kw) -> Proc:
        return Proc(self.cmd(*a, **kw))


def shared_once(tmp_path_factory, name: str, build):
    """`build(folder)` once per test session, even across pytest-xdist's workers: the first worker
    that asks builds into a folder of the session's shared temporary folder (under a file lock; a
    worker asking meanwhile waits for it), the others find it built. Returns what `build` returned
    (JSON), and the folder. The tests read what was built, never change it (test_int8 writes its own
    export folder beside the run, once per session)."""
    import json

    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, shared by gw0, gw1, ...
    folder = root / f"shared-{name}"
    with FileLock(str(folder) + ".lock"):
        done = folder / ".built.json"
        if done.is_file():
            return json.loads(done.read_text()), folder
        shutil.rmtree(folder, ignore_errors=True)  # a build cut short
        folder.mkdir()
        info = build(folder)
        done.write_text(json.dumps(info))
    return info, folder


def assert_same(a, b, where="state", ordered=False):
    """Recursive equality of checkpoint contents: tensors bitwise (dtype, shape and bytes, so NaNs
    compare too), dicts by keys (in order with `ordered`, and sequences of one type), the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        x, y = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        same = torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)) if x.numel() else True
        assert same, f"{where} differs (max |diff| " \
            f"{(x.double() - y.double()).abs().max().item() if x.is_floating_point() else 'int'})"
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        if ordered:
            assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        assert set(a) == set(b), f"{where}: keys {sorted(a, key=str)} vs {sorted(b, key=str)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", ordered)
    elif isinstance(a, (list, tuple)):
        assert not ordered or type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]", ordered)
    else:
        assert not ordered or type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert a == b, f"{where}: {a!r} != {b!r}"


def count_checkpoints(monkeypatch, module) -> list:
    """Route `module.checkpoint` through torch's, recording each checkpointed callable (and checking
    the non-reentrant variant is used); returns the list it fills."""
    import torch.utils.checkpoint

    calls = []

    def counting_checkpoint(fn, *args, **kw):
        assert kw.get("use_reentrant") is False
        calls.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, **kw)

    monkeypatch.setattr(module, "checkpoint", counting_checkpoint)
    return calls


_CLI_MODULES = {}  # script path -> its module, loaded once


def cli_in_process(script, *argv):
    """`python <script> <argv>` (a CLI of this repository) run in this process: its own main through
    wm.utils.errors.run_cli, as its `__main__` block runs it (a WMError: one line on stderr, exit status 2).
    Returns (returncode, stdout, stderr), as subprocess.run does. For refusals, whose check takes
    milliseconds where a process start (importing torch and wm) takes seconds; the tests of each CLI
    keep real process calls too. What main changes in this process is put back: sys.argv, the
    working folder, the SIGTERM/SIGINT handlers, torch's grad mode and TF32 switches."""
    import contextlib
    import importlib.util
    import io
    from types import SimpleNamespace

    from wm.utils.errors import run_cli

    path = Path(script) if Path(script).is_absolute() else ROOT / script
    if path not in _CLI_MODULES:
        spec = importlib.util.spec_from_file_location(f"_cli_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _CLI_MODULES[path] = module
    argv = [str(a) for a in argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = (sys.argv, os.getcwd(), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)},
             torch.is_grad_enabled(), torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    sys.argv = [str(path), *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_cli(lambda: _CLI_MODULES[path].main(argv))
            except SystemExit as e:
                if isinstance(e.code, str):  # sys.exit("message"), as the interpreter ends on it
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        for s, h in saved[2].items():
            signal.signal(s, h)
        torch.set_grad_enabled(saved[3])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[4:]
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def run_kernel_check(script: str, dev: str) -> None:
    """Run a Triton kernel's check `script` (Python source with {root}, {tests} and {dev} slots that
    prints OK when its checks pass) on `dev`: "cuda" in this process, the kernels compiled; "cpu" in a
    subprocess with TRITON_INTERPRET=1, where Triton's interpreter runs them on CPU tensors, so a
    machine without a GPU tests them (the variable must be set before triton is imported)."""
    source = script.format(root=str(ROOT), tests=str(ROOT / "tests"), dev=dev)
    if dev == "cuda":
        exec(source, {})
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def read_png(path: Path):
    """Decode wm.data.viz.write_png's PNGs (8-bit RGB, filter 0) to an (H, W, 3) array, to check what was drawn."""
    import zlib

    import numpy as np

    b = path.read_bytes()
    assert b[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", None, None
    while pos < len(b):
        n = int.from_bytes(b[pos:pos + 4], "big")
        tag, body = b[pos + 4:pos + 8], b[pos + 8:pos + 8 + n]
        assert zlib.crc32(tag + body) == int.from_bytes(b[pos + 8 + n:pos + 12 + n], "big")
        if tag == b"IHDR":
            w, h = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            assert body[8:10] == bytes([8, 2])  # 8-bit RGB
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "train.py"]


def run_two_ranks(script: str, threads: int, timeout: float = 240) -> list[dict]:
    """`script` in two gloo processes (RANK 0 and 1), each printing `RESULT <json>`: both."""
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0 and "RESULT " in out, out[-4000:]
            outs.append(json.loads(out.split("RESULT ", 1)[1]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return outs


def cdir(run_dir: Path, stage: str = "tokenizer") -> Path:
    return run_dir / stage / "checkpoints"


def stop_after(monkeypatch, steps: int) -> None:
    """As if SIGTERM came during step `steps`: the run saves it and exits 0."""
    import wm.training.loop as L  # here, not at the top: every test session imports this module

    real, calls = L.train_step, {"n": 0}

    def step(*a, **kw):
        calls["n"] += 1
        if calls["n"] == steps:
            kw["stop"].requested = True
        return real(*a, **kw)

    monkeypatch.setattr(L, "train_step", step)


def flip_chunk(shard: Path, field: str, frame: int) -> None:
    import h5py

    with h5py.File(shard, "r") as f:
        info = f[field].id.get_chunk_info_by_coord((frame, 0, 0, 0))
    b = bytearray(shard.read_bytes())
    mid = info.byte_offset + info.size // 2
    for i in range(mid, mid + 8):
        b[i] ^= 0x5A
    shard.write_bytes(bytes(b))


def plant(folder: Path, name: str, obj) -> Path:
    """Put `obj` as checkpoint `name` with its .sha256 and the `latest` pointer updated to match:
    intact by every checksum, so only what it holds can tell it does not belong."""
    import wm.checkpoint.files as ck

    path = folder / name
    path.unlink(missing_ok=True)  # a new file: best.pt is a hard link of a step file
    torch.save(obj, path)
    sha = ck.sha256_file(path)
    (folder / f"{name}.sha256").write_text(f"{sha}  {name}\n")
    if name != ck.BEST:
        (folder / "latest").write_text(json.dumps({"file": name, "step": ck.step_of(name),
                                                   "size": path.stat().st_size, "sha256": sha}))
    else:
        b = json.loads((folder / ck.BEST_JSON).read_text())
        (folder / ck.BEST_JSON).write_text(json.dumps(dict(b, sha256=sha, size=path.stat().st_size)))
    return path


def windows_with_poses(f, batch: int):
    """A Forecaster's val windows as --eval-only batches them, each with its 4x4 ego->global poses from the shards."""
    import numpy as np

    from wm.data.windows import OccWindows

    cfg = f.cfg
    ds = OccWindows(cfg.data.root, cfg.data.val_split, cfg.data)
    for i in range(0, len(ds), batch):
        idx = range(i, min(i + batch, len(ds)))
        occ = torch.stack([ds[j]["occ"] for j in idx])
        poses = []
        for j in idx:
            sh, a, b = ds.locate(j)
            poses.append(sh.pose[a:b:cfg.data.stride])
        yield occ, np.stack(poses)
