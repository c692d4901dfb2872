"""tools/gpu_check.py on a CPU: the same step checks with gloo ranks (CUDA rows skipped, saying so),
and any failing row makes the exit status non-zero."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import TINY_SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args, timeout=600):
    return subprocess.run([sys.executable, "tools/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def rows(out: str) -> dict:
    """{check: (status, detail)} from the table."""
    found = {}
    for ln in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(PASS|FAIL|SKIP)\s{2}(.*)$", ln)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


@pytest.mark.slow
def test_on_a_cpu_every_step_check_runs_with_gloo_and_passes(tiny):
    sets = [a for k, v in TINY_SETTINGS.items() if k not in ("train.device", "train.stages")
            for a in ("--set", f"{k}={v}")]
    # Dynamo's capture alone (backend eager): this is the tool's table and its DDP path; AOTAutograd
    # under DDP is test_distributed.py's compiled DDP test, Inductor the GPU run's
    r = gpu_check("--device", "cpu", "--backend", "eager", "--allreduce-mib", "4", "--data", str(tiny.data),
                  "--read-seconds", "1", "--set", "train.stages=tokenizer,world", *sets)
    assert r.returncode == 0, r.stdout + r.stderr
    got = rows(r.stdout)
    assert got["cuda tests"][0] == "SKIP" and "no CUDA here" in got["cuda tests"][1]
    steps = ["steps 1 cpu tokenizer", "steps 1 cpu world", "ddp 2xcpu tokenizer", "ddp 2xcpu world"]
    want = ["versions"] + [k for s in steps for k in (s, s + " captured")] + ["all-reduce", "reads"]
    assert [k for k in got if k != "cuda tests"] == want, r.stdout
    assert all(got[k][0] == "PASS" for k in want), r.stdout
    for k in steps:  # the captured step's code, run as it is on a CPU, is the uncaptured step bitwise
        assert "(worst rel 0.0e+00); not captured (no GPU" in got[k + " captured"][1], got[k + " captured"]
    for k in steps:  # compiled against eager, the same weights and batch
        rel = [float(x) for x in re.findall(r"\(rel ([0-9.e+-]+)\)", got[k][1])]
        assert len(rel) == 2 and max(rel) <= 1e-5, got[k]
    assert re.search(r"[0-9.]+ GB/s bus bandwidth, 4 MiB fp32 on 2 ranks \(gloo\)", got["all-reduce"][1])
    assert re.search(r"[0-9.]+ windows/s", got["reads"][1])
    assert "12 of 12 rows pass or skip, 0 fail" in r.stdout


def test_a_failing_row_makes_the_exit_status_non_zero(tmp_path):
    r = gpu_check("--device", "cpu", "--checks", "versions,reads", "--data", str(tmp_path), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    got = rows(r.stdout)
    assert got["versions"][0] == "PASS"
    status, detail = got["reads"]
    assert status == "FAIL" and detail.startswith(f"{tmp_path}: ") and "manifest.json" in detail, detail
    assert "1 of 2 rows pass or skip, 1 fail" in r.stdout


def test_a_step_row_fails_beyond_the_tolerance_or_on_a_bucket_stride_warning():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    G = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(G)
    a = SimpleNamespace(loss_tol=1e-2, grad_tol=5e-2)

    def res(loss, gnorm, warn=()):
        step = {"loss": 2.0, "grad_norm": 4.0, "seconds": 1.0, "stride_warnings": []}
        return {"stages": {"world": {"eager": step, "compiled": dict(step, loss=loss, grad_norm=gnorm,
                                                                     stride_warnings=list(warn))}}}

    assert G.step_rows("ddp", res(2.019, 4.19), a)[0]["status"] == "PASS"  # 0.95 % and 4.75 %
    assert G.step_rows("ddp", res(2.021, 4.0), a)[0]["status"] == "FAIL"  # 1.05 % of the loss
    assert G.step_rows("ddp", res(2.0, 4.21), a)[0]["status"] == "FAIL"  # 5.25 % of the gradient norm
    assert G.step_rows("ddp", res(float("nan"), 4.0), a)[0]["status"] == "FAIL"
    r = G.step_rows("ddp", res(2.0, 4.0, ["Grad strides do not match bucket view strides."]), a)[0]
    assert r["status"] == "FAIL" and r["detail"].startswith("DDP: Grad strides do not match")


def test_the_cuda_tests_row_names_the_first_failure_and_its_message():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    G = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(G)
    msg = ("wm.utils.errors.DataError: writing /tmp/pytest-of-root/t0/data/train-00000.h5 with zstd3 needs the "
           "hdf5plugin package: pip install hdf5plugin (or use compression gzip1, readable by stock HDF5)")
    out = ["..E.", "=========================== short test summary info ============================",
           f"ERROR tests/tools/test_bench_train.py::test_train_step_on_cuda_never_waits_for_the_gpu[tokenizer] - {msg}",
           "FAILED tests/models/test_world.py::test_other - AssertionError: 1 != 2",
           "1 failed, 2 passed, 1 error in 3.00s"]

    class Done:  # a finished `pytest -m cuda` process
        returncode = 1

        def communicate(self, timeout=None):
            return "\n".join(out) + "\n", ""

    r = G.cuda_tests(Done(), 10.0)
    assert r["status"] == "FAIL" and r["detail"].startswith("1 failed, 2 passed, 1 error in 3.00s; first: tests/tools/test_bench_train.py")
    # the middle of a long line goes; the test's name and the message's end stay
    assert "never_waits_for_the_gpu[tokenizer]" in r["detail"] and r["detail"].endswith("readable by stock HDF5)")
    assert "FAILED tests/models/test_world.py::test_other" in r["output"]
    Done.returncode = 0
    assert G.cuda_tests(Done(), 10.0) == G.row("cuda tests", "PASS", "1 failed, 2 passed, 1 error in 3.00s")
