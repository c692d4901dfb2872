"""pytest's hooks and the shared fixtures (the tiny data set, trained runs, exports); the helpers the
tests import are tests/helpers.py."""

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per pytest worker (and, inherited, per process it starts, unless the test
    # sets its own): `-n 2` on 2 cores already keeps both busy, and a second spinning OpenMP thread in
    # each worker (or in its subprocesses) oversubscribes the cores, making tiny models many times
    # slower. Set before torch is imported; a test that wants more threads asks for them.
    _ONE_THREAD = "OMP_NUM_THREADS" not in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Inductor's pool of compile workers (each a process importing torch) costs more than it saves
    # on the tiny graphs here, with both cores already busy
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
else:
    _ONE_THREAD = False

import torch  # noqa: E402

if _ONE_THREAD:
    torch.set_num_threads(1)

from helpers import ROOT, Tiny, shared_once  # noqa: E402


# Rough wall seconds of the long test files on 2 workers and 2 cores (the README's test command). pytest-xdist's
# --dist loadfile hands a worker the next file when it is almost done with its own, in collection
# order (pytest_configure turns off xdist's own reordering, by number of tests, which put the few-test
# long files last). Collected longest first, no long file starts near the end while the other worker
# runs out of files. Approximate is enough; files not named (a few seconds each) follow in their order.
FILE_SECONDS = {
    "test_distributed.py": 170, "test_int8.py": 165, "test_train.py": 100, "test_export.py": 85, "test_aoti.py": 60,
    "test_sweep.py": 60, "test_recipe.py": 36, "test_gpu_check.py": 35, "test_reliability.py": 32, "test_tools.py": 28,
    "test_int8_sensitivity.py": 28, "test_finetune.py": 26, "test_memory_plan.py": 22, "test_evaluate.py": 22,
    "test_compiled_activations.py": 22, "test_bench_train.py": 20, "test_attack.py": 15, "test_worker_errors.py": 16,
    "test_compare.py": 16, "test_world.py": 14, "test_reliability4.py": 14, "test_tokenizer.py": 12,
    "test_ckpt_checks.py": 8, "test_runlock.py": 8,
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process training tests (they still run in CI)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device (`pytest -m cuda`, tools/gpu_check.py)")
    if getattr(config.option, "loadscopereorder", None):  # pytest-xdist: keep FILE_SECONDS' order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # a test marked cuda is skipped where there is none; `pytest -m cuda` selects them all
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    # the long files first (FILE_SECONDS); each file's tests stay together and in their order
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-FILE_SECONDS.get(item.path.name, 0), first[item.path]))


_FROZEN_AT = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test file starts with the objects alive so far (the imports, the collected tests, what
    earlier files keep) frozen out of the garbage collector's sight (gc.freeze, after a collection
    that frees what the last file left). The full collections a training run makes in this process
    (wm.training.host_gc at each stage and validation, the memory plan's release: several a run) then go over
    this file's objects only, not the hundreds of thousands a pytest worker holds (0.3-0.8 s each
    on 2 cores). Nothing the tests create is frozen before its file starts."""
    if item.path != _FROZEN_AT[0]:  # the previous file's module fixtures are torn down by now
        _FROZEN_AT[0] = item.path
        gc.collect()
        gc.freeze()


@pytest.fixture
def tmp_path(tmp_path_factory):
    """A fresh folder with a neutral name ("t0", "t1", ...): pytest's own embeds the test's name,
    and a word a test asserts in a message ("missing", "truncated") must not pass by being in the path."""
    return tmp_path_factory.mktemp("t")


@pytest.fixture(scope="session", autouse=True)
def subprocess_tmpdir():
    """The temporary folders of the processes the tests start (torchrun's torchelastic_* of every
    agent, multiprocessing's pymp-* of a killed worker: neither removes its own) go into one folder
    that the session removes, so none outlives the tests."""
    tempfile.gettempdir()  # this process keeps the system's (pytest's tmp_path lives there)
    d = tempfile.mkdtemp(prefix="wm-tests-subprocesses-")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = d
    Tiny.data_source = Path(d) / "tiny-data-source"  # Tiny's data set, written once, copied after
    yield Path(d)
    Tiny.data_source = None
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("t"))


@pytest.fixture
def restore_signals():
    """wm.training.main.main installs SIGTERM/SIGINT handlers: put them back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """For module-scoped fixtures: a fresh `Tiny` per call."""
    return lambda: Tiny(tmp_path_factory.mktemp("t"))


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """A tiny run trained through both stages (2 + 2 steps), shared by the export tests (trained
    once per session: shared_once)."""

    def build(folder):
        import wm.training.main as T

        t = Tiny(folder)
        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = T.main(t.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                               world_stage__max_steps=2))
        finally:
            for s, h in saved.items():
                signal.signal(s, h)
        return {"rc": rc}

    info, folder = shared_once(tmp_path_factory, "trained_tiny", build)
    assert info["rc"] == 0
    return Tiny(folder, write=False)


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
    on all the val windows. `p`: the finished process (its returncode, stdout, stderr), `out`: its
    folder. Run once per session (shared_once), as trained_tiny is trained once."""
    from types import SimpleNamespace

    def build(folder):
        out = folder / "cli_export"
        out.mkdir()
        p = subprocess.run([sys.executable, "export.py", "--run", str(trained_tiny.run_dir()), "--out", str(out),
                            "--fp16", "--int8", "--calib-windows", "8", "--eval-windows", "100"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        return {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "out": str(out)}

    r, _ = shared_once(tmp_path_factory, "tiny_export", build)
    return SimpleNamespace(p=SimpleNamespace(returncode=r["returncode"], stdout=r["stdout"], stderr=r["stderr"]),
                           out=Path(r["out"]))


@pytest.fixture(scope="module")
def one_thread():
    """In-process runs on one intra-op thread, as the subprocesses (OMP_NUM_THREADS=1): on a small
    shared machine two spinning OpenMP threads make these tiny convolutions 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


