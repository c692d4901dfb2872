"""The forecast compiled ahead of time (wm/export/aoti.py, export.py --aoti): the traced module is
the Forecaster's computation, a package is found by shape and machine and refused in one line when
it is another machine's, damaged, or built from another checkpoint; one real AOTInductor compile at
the tiny size runs in the Forecaster as the launched forecast does."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from wm import Forecaster
from wm.checkpoint.trained import load_trained
from wm.export import aoti as A
from wm.training import compile_cache as C
from wm.utils.errors import WMError


def _inputs(f, batch=2):
    from helpers import windows_with_poses

    occ, poses = next(windows_with_poses(f, batch))
    return occ, poses, f.cfg.data.past


@pytest.fixture
def exported(monkeypatch):
    """torch.export's program saved and loaded in place of AOTInductor's C++ compile: what is tested
    here is wm's packaging, not Inductor."""
    options = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda program, package_path, **kw: options.append(kw) or torch.export.save(program, package_path)
                        or package_path)
    monkeypatch.setattr(torch._inductor, "aoti_load_package",
                        lambda path, **kw: options.append({"load": kw}) or torch.export.load(path).module())
    return options


@pytest.mark.parametrize("motion", ["given", "predicted"])
def test_the_whole_forecast_module_is_the_forecasters_computation(ev, motion):
    f = Forecaster.from_run(ev.run)
    occ, poses, P = _inputs(f)
    fut = poses[:, P:] if motion == "given" else None
    want = f(occ[:, :P], poses[:, :P], future_poses=fut)
    from wm.forecaster import prepare_inputs

    o, m, fm, S, _, _ = prepare_inputs(f.cfg, f.device, occ[:, :P], poses[:, :P], fut)
    module = A.WholeForecast(f.tokenizer, f.world, S, None)
    with torch.no_grad():
        got = module(o, m.float(), None if fm is None else fm.float())
    assert torch.equal(got[0], want.occ) and torch.equal(got[2], want.codes)
    assert torch.allclose(got[1], want.motion.float())


def test_a_package_is_written_with_its_record_and_runs_in_the_forecaster(ev, tmp_path, exported):
    run = tmp_path / "run"
    shutil.copytree(ev.run, run)
    t = load_trained(run)
    said = []
    r = A.build(t, run / "export", torch.device("cpu"), "fp32", batch=2, say=said.append)
    key = C.key_name(C.machine_key(torch.device("cpu")))
    assert r["file"] == f"forecast-b2-p{t.cfg.data.past}-s{t.cfg.data.future}-given-fp32-{key}.pt2"
    assert r["class_agreement"] == 1.0 and r["given"] is True and r["load_s"] >= 0
    meta = json.loads((run / "export" / (r["file"] + ".json")).read_text())
    assert meta["key"] == C.machine_key(torch.device("cpu")) and meta["bytes"] == r["bytes"]
    assert said and "traced the forecast (batch 2" in said[0]

    plain = Forecaster.from_run(run)
    f = Forecaster.from_run(run, aoti=True)
    f.say = said.append
    occ, poses, P = _inputs(plain)
    fut = poses[:, P:]
    want, got = plain(occ[:, :P], poses[:, :P], future_poses=fut), f(occ[:, :P], poses[:, :P], future_poses=fut)
    assert torch.equal(got.occ, want.occ) and torch.equal(got.codes, want.codes)
    assert said[-1].startswith(f"AOTInductor package {r['file']}: loaded in ")
    # a shape without its package: one line naming what is there and the command that builds it
    with pytest.raises(WMError, match=r"no AOTInductor package for batch 1, .* predicted ego motion, fp32 on .*; "
                                      rf".* holds {r['file']}: run python export.py --run <run> --aoti --aoti-batch 1 "
                                      r"--aoti-dtype fp32 --aoti-motion predicted"):
        f(occ[:1, :P], poses[:1, :P])
    with pytest.raises(WMError, match="returns no logits"):
        f(occ[:, :P], poses[:, :P], future_poses=fut, logits=True)
    with pytest.raises(WMError, match="leave compile=None"):
        Forecaster(f.cfg, f.tokenizer, f.world, compile="default", aoti_dir=run / "export")


def test_a_package_of_another_machine_a_damaged_one_and_another_checkpoints_are_one_line(ev, tmp_path, exported):
    run = tmp_path / "run"
    shutil.copytree(ev.run, run)
    t = load_trained(run)
    cpu = torch.device("cpu")
    r = A.build(t, run / "export", cpu, "fp32", batch=1, say=lambda m: None)
    assert exported[0] == {}  # an untuned package: Inductor's own options
    path = run / "export" / r["file"]
    record = path.with_name(path.name + ".json")
    meta = json.loads(record.read_text())

    other = {**meta, "key": {**meta["key"], "torch": "0.0.1"}}
    record.write_text(json.dumps(other))
    with pytest.raises(WMError, match=r"was compiled for .*torch 0\.0\.1.*; this machine is .*: build one here"):
        A.load_package(path, cpu)
    record.write_text(json.dumps({**meta, "checkpoint_sha256": "0" * 64}))
    with pytest.raises(WMError, match=rf"was built from .*, not {t.ckpt}; rebuild it"):
        A.load_package(path, cpu, t.ckpt)
    record.write_text(json.dumps(meta))
    # a runner recorded into a CUDA graph skips its own event waits, which a capturing stream forbids
    exported.clear()
    A.load_package(path, cpu)
    A.load_package(path, cpu, graph=True)
    assert exported == [{"load": {"run_single_threaded": False}}, {"load": {"run_single_threaded": True}}]
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(WMError, match="does not match its recorded sha256"):
        A.load_package(path, cpu)
    record.write_text("[1, 2")
    with pytest.raises(WMError, match=r"its record .*\.json is missing or damaged"):
        A.load_package(path, cpu)
    with pytest.raises(WMError, match="--aoti-dtype 'int8' must be one of fp32, bf16, fp16"):
        A.build(t, run / "export", cpu, "int8")
    # a tuned package: Inductor is given the tuning options, the record says so
    r = A.build(t, run / "export", cpu, "fp32", batch=1, say=lambda m: None, tuned=True)
    assert exported[-2] == {"inductor_configs": A.TUNED} and r["tuned"] is True
    assert json.loads(record.read_text())["tuned"] is True


@pytest.mark.slow
def test_a_real_aotinductor_package_forecasts_as_the_launched_model(ev, tmp_path):
    """AOTInductor's own compile (C++ on a CPU) at the tiny size: the package, loaded, forecasts
    what the launched model forecasts (argmax classes; float rounding may move a tie). Inductor's C++
    kernels scalar (cpp.vec_isa_ok off) and built unoptimised (aot_inductor.debug_compile: -O0): the
    same graph, compiled, packaged and loaded in about half the time; vectorised, optimised code
    generation is Inductor's own to test."""
    run = tmp_path / "run"
    shutil.copytree(ev.run, run)
    t = load_trained(run)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False, "aot_inductor.debug_compile": True}):
        r = A.build(t, run / "export", torch.device("cpu"), "fp32", batch=1, given=False, say=lambda m: None)
    assert r["class_agreement"] >= 0.999 and (run / "export" / r["file"]).stat().st_size == r["bytes"]
    plain, f = Forecaster.from_run(run), Forecaster.from_run(run, aoti=True)
    f.say = lambda m: None
    occ, poses, P = _inputs(plain, 1)
    want, got = plain(occ[:, :P], poses[:, :P]), f(occ[:, :P], poses[:, :P])
    assert (got.occ == want.occ).float().mean() >= 0.999
    assert f.package_load_s and max(f.package_load_s.values()) < 30
