"""Shared test helpers."""

# ---------------------------------------------------------------------------------------------
# training tests (tests/test_train.py, tests/test_distributed.py): the `slow` marker and a tiny
# data set + config + process helpers

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from procs import Proc as _Proc  # noqa: E402

OCCWORLD = ROOT / "configs" / "occworld.json"  # OccWorld's model sizes


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process training tests (they still run in CI)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device (`pytest -m cuda`, tools/gpu_check.py)")


def pytest_collection_modifyitems(config, items):
    # a test that skips itself without CUDA is a CUDA test: `pytest -m cuda` selects them all
    for item in items:
        if any(m.kwargs.get("reason") == "needs CUDA" for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session", autouse=True)
def subprocess_tmpdir():
    """The temporary folders of the processes the tests start (torchrun's torchelastic_* of every
    agent, multiprocessing's pymp-* of a killed worker: neither removes its own) go into one folder
    that the session removes, so none outlives the tests."""
    tempfile.gettempdir()  # this process keeps the system's (pytest's tmp_path lives there)
    d = tempfile.mkdtemp(prefix="wm-tests-subprocesses-")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = d
    yield Path(d)
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    shutil.rmtree(d, ignore_errors=True)


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

    def __init__(self, base: Path):
        from wm.synthetic import write_synthetic

        self.base = base
        self.data = base / "data"
        write_synthetic(self.data, train_scenes=2, val_scenes=1, frames=12, grid=(16, 16, 4))

    def regenerate(self, seed: int) -> None:
        import shutil

        from wm.synthetic import write_synthetic

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


@pytest.fixture
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("t"))


@pytest.fixture
def restore_signals():
    """wm.train.main installs SIGTERM/SIGINT handlers: put them back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """For module-scoped fixtures: a fresh `Tiny` per call."""
    return lambda: Tiny(tmp_path_factory.mktemp("t"))


@pytest.fixture(scope="session")
def trained_tiny(tiny_factory):
    """A tiny run trained through both stages (2 + 2 steps), shared by the export tests."""
    import wm.train as T

    t = tiny_factory()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert T.main(t.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                             world_stage__max_steps=2)) == 0
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return t


@pytest.fixture(scope="module")
def ev(trained_tiny, tmp_path_factory):
    """A copy of trained_tiny's run folder (both stages, 2 + 2 steps, 2 past + 2 future frames at
    2 Hz) and `args(*flags, **settings)`: the train.py --eval-only arguments for it."""
    import shutil
    from types import SimpleNamespace

    base = tmp_path_factory.mktemp("ev")
    shutil.copytree(trained_tiny.run_dir(), base / "runs" / "r")

    def args(*flags, **over):
        return trained_tiny.args(train__stages="tokenizer,world", run__out_dir=str(base / "runs"),
                                 **over) + ["--eval-only", *flags]

    return SimpleNamespace(t=trained_tiny, base=base, run=base / "runs" / "r", args=args)


@pytest.fixture(scope="session")
def tiny_export(trained_tiny, tmp_path_factory):
    """One export.py run of trained_tiny that the export and benchmark tests read (an export takes
    tens of seconds here): FP32 and FP16 graphs, then INT8 calibration on 8 windows and the report
    on all the val windows. `p`: the finished process, `out`: its folder."""
    from types import SimpleNamespace

    out = tmp_path_factory.mktemp("cli_export")
    p = subprocess.run([sys.executable, "export.py", "--run", str(trained_tiny.run_dir()), "--out", str(out),
                        "--fp16", "--int8", "--calib-windows", "8", "--eval-windows", "100"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    return SimpleNamespace(p=p, out=out)


@pytest.fixture(scope="module")
def one_thread():
    """In-process runs on one intra-op thread, as the subprocesses (OMP_NUM_THREADS=1): on a small
    shared machine two spinning OpenMP threads make these tiny convolutions 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_same(a, b, where="state"):
    """Recursive bitwise equality of checkpoint contents (tensors with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs (max |diff| " \
            f"{(a.double() - b.double()).abs().max().item() if a.is_floating_point() else 'int'})"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a, key=str)} vs {sorted(b, key=str)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
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
    """Decode wm.viz.write_png's PNGs (8-bit RGB, filter 0) to an (H, W, 3) array, to check what was drawn."""
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
