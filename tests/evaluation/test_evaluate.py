"""Evaluation under OccWorld's protocol (wm/evaluation/evaluate.py, `train.py --eval-only`): hand-computed
metrics on fabricated forecasts in both absent-class modes, horizons from frame rate and stride,
the visibility mask, the CLI on a trained tiny run (its numbers equal the training-time
validation of the same checkpoints), torchrun, and every bad input as one line and exit 2."""

import dataclasses
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from wm.checkpoint.files import load
from wm.config.loading import load as load_config
from wm.data.windows import OccWindows
import wm.evaluation.evaluate as E
from wm.evaluation.metrics import OCCWORLD_STEPS
import wm.training.main as T
import wm.utils.distributed as D
from wm.utils.errors import WMError, run_cli

ROOT = Path(__file__).resolve().parents[2]
ONE = D.Dist()  # a world of one on the CPU
pytestmark = pytest.mark.usefixtures("one_thread")





# ---------------------------------------------------------------------------------------------
# a fabricated case: 4 voxels (grid 4x1x1), classes car 0, road 1, ped 2 (never in the ground
# truth), free 3; one past frame, six future frames at 2 Hz


NAMES = ["car", "road", "ped", "free"]
FREE = 3
LAST = [0, 1, 3, 3]  # the last past frame: what copy-last predicts at every step
TARGET = [0, 1, 1, 3]  # every future frame's ground truth
PRED = {  # the fabricated forecast per future step (0-based); 1, 3, 5 are 1 s, 2 s, 3 s
    0: [3, 3, 3, 3], 1: [0, 1, 1, 3], 2: [3, 3, 3, 3], 3: [0, 0, 1, 3], 4: [3, 3, 3, 3], 5: [1, 1, 2, 2]}


class FakeTokenizer:
    """encode: the occupancy itself as codes; decode: one-hot logits of the codes, with class
    `swap[0]` turned into `swap[1]` (a reconstruction error we can count by hand)."""

    def __init__(self, swap=None):
        self.swap = swap
        self.quantizer = SimpleNamespace(size=8)

    def encode(self, occ):
        return occ.long()

    def decode(self, codes):
        if self.swap:
            codes = torch.where(codes == self.swap[0], self.swap[1], codes)
        logits = F.one_hot(codes, len(NAMES)).float()  # (..., X, Y, Z, C)
        return logits.movedim(-1, codes.dim() - 3)  # (..., C, X, Y, Z)


class FakeWorld:
    """rollout returns the fabricated forecast as codes; checks it got the given ego motion."""

    def __init__(self):
        self.calls = []

    def rollout(self, past_codes, past_motion, steps, future_motion=None):
        b = past_codes.shape[0]
        self.calls.append(future_motion)
        pred = torch.tensor([PRED[s] for s in range(steps)]).view(1, steps, 4, 1, 1).expand(b, -1, -1, -1, -1)
        return pred.long(), torch.zeros(b, steps, 3)


def window(mask_voxel=None) -> dict:
    occ = torch.tensor([LAST] + [TARGET] * 6, dtype=torch.uint8).view(1, 7, 4, 1, 1)
    out = {"occ": occ, "motion": torch.arange(21, dtype=torch.float32).view(1, 7, 3)}
    if mask_voxel is not None:
        mask = torch.ones_like(occ)
        mask[:, :, mask_voxel] = 0
        out["mask"] = mask
    return out


def run_fake(batches, mode, given=True):
    world = FakeWorld()
    f = E.forecast(FakeTokenizer(), world, batches, ONE, torch.device("cpu"), None, past=1, future=6,
                   num_classes=4, free=FREE, given_motion=given)
    steps = E.horizon_steps((1, 2, 3), 2.0, 1, 6)
    return E.forecast_report(f, steps, (1, 2, 3), mode, NAMES), world


def close(got, want):
    """Equal within 1e-9 (None for undefined), elementwise through lists and dicts."""
    if isinstance(want, dict):
        assert set(got) == set(want), (got, want)
        for k in want:
            close(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), (got, want)
        for a, b in zip(got, want):
            close(a, b)
    elif want is None:
        assert got is None, got
    else:
        assert got == pytest.approx(want, abs=1e-9), (got, want)


T3 = 100 / 3
# by hand, from TARGET vs PRED / LAST (IoU = tp / (target + predicted - tp), in %):
#   1 s (PRED[1]) perfect: car 100, road 100, ped absent and not predicted; occupied 3/3
#   2 s (PRED[3]) car 1/2, road 1/2, ped absent; occupied 3/3
#   3 s (PRED[5]) car 0/1, road 1/3, ped 2 false positives (0, or 100 in occworld mode);
#                 occupied 3 of 4 predicted -> 3/4; free 0/1
#   copy-last: car 1/1, road 1/2, ped absent; occupied 2/3
#   steps 0, 2, 4 (all free): car 0, road 0, occupied 0
EXPECTED = {
    "exclude": {
        "forecast": {"iou": [100, 100, 75], "iou_avg": 275 / 3, "miou": [100, 50, T3 / 3],
                     "miou_avg": (150 + T3 / 3) / 3,
                     "per_class": {"car": [100, 50, 0], "road": [100, 50, T3], "ped": [None, None, 0],
                                   "free": [100, 100, 0]},
                     "per_class_avg": {"car": 50, "road": (150 + T3) / 3, "ped": 0, "free": 200 / 3},
                     "iou_all_steps": [0, 100, 0, 100, 0, 75], "iou_all_steps_avg": 275 / 6,
                     "miou_all_steps": [0, 100, 0, 50, 0, T3 / 3], "miou_all_steps_avg": (150 + T3 / 3) / 6},
        "copy_last": {"iou": [200 / 3] * 3, "iou_avg": 200 / 3, "miou": [75] * 3, "miou_avg": 75,
                      "per_class": {"car": [100] * 3, "road": [50] * 3, "ped": [None] * 3, "free": [50] * 3},
                      "per_class_avg": {"car": 100, "road": 50, "ped": None, "free": 50}},
    },
    "occworld": {  # a class absent from the ground truth scores 100 %, predicted or not
        "forecast": {"iou": [100, 100, 75], "iou_avg": 275 / 3, "miou": [100, 200 / 3, (T3 + 100) / 3],
                     "miou_avg": (100 + 200 / 3 + (T3 + 100) / 3) / 3,
                     "per_class": {"car": [100, 50, 0], "road": [100, 50, T3], "ped": [100, 100, 100],
                                   "free": [100, 100, 0]},
                     "per_class_avg": {"car": 50, "road": (150 + T3) / 3, "ped": 100, "free": 200 / 3},
                     "miou_all_steps": [T3, 100, T3, 200 / 3, T3, (T3 + 100) / 3]},
        "copy_last": {"iou": [200 / 3] * 3, "miou": [250 / 3] * 3, "miou_avg": 250 / 3,
                      "per_class": {"car": [100] * 3, "road": [50] * 3, "ped": [100] * 3, "free": [50] * 3}},
    },
}


def test_horizons_follow_frame_rate_and_stride():
    assert E.horizon_steps((1, 2, 3), 2.0, 1, 6) == list(OCCWORLD_STEPS) == [1, 3, 5]
    assert E.horizon_steps((1, 2, 3), 2.0, 2, 3) == [0, 1, 2]  # 1 s per step
    assert E.horizon_steps((1, 2, 3), 10.0, 5, 6) == [1, 3, 5]
    assert E.horizon_steps((1, 2, 3), 10.0, 1, 30) == [9, 19, 29]
    assert E.horizon_steps((0.5, 1), 2.0, 1, 2) == [0, 1]
    with pytest.raises(WMError, match=r"eval horizon too short: data.future=2 .* reaches 1 s, but 2 s, 3 s "
                                      r"need data.future >= 6; evaluate with --set data.future=6"):
        E.horizon_steps((1, 2, 3), 2.0, 1, 2)
    with pytest.raises(WMError, match="1 s is not a whole number of future steps.*every 1.5 s"):
        E.horizon_steps((1, 2, 3), 2.0, 3, 6)


@pytest.mark.parametrize("mode", ["exclude", "occworld"])
def test_fabricated_forecast_matches_hand_computed_metrics(mode):
    rep, world = run_fake([window()], mode)
    assert rep["horizons"] == ["1s", "2s", "3s"] and rep["steps"] == [1, 3, 5]
    for part, want in EXPECTED[mode].items():
        close({k: rep[part][k] for k in want}, want)
    # the confusion matrices hold every voxel of every step once, [step][target][pred]
    conf = np.array(rep["forecast"]["confusion"])
    assert conf.shape == (6, 4, 4) and (conf.sum((1, 2)) == 4).all()
    assert conf[5].tolist() == [[0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    # the given future ego motion reached the rollout
    assert torch.equal(world.calls[0], window()["motion"][:, 1:])
    json.dumps(rep, allow_nan=False)  # strict JSON: undefined values are None


def test_counts_accumulate_over_batches_and_predicted_motion():
    one, _ = run_fake([window()], "exclude")
    three, world = run_fake([window(), window(), window()], "exclude", given=False)
    assert world.calls == [None] * 3  # ego motion left to the model
    for part in ("forecast", "copy_last"):
        a, b = dict(one[part]), dict(three[part])
        assert np.array_equal(np.array(b.pop("confusion")), 3 * np.array(a.pop("confusion")))
        close(b, a)  # IoU of summed counts: the same percentages


@pytest.mark.parametrize("mode", ["exclude", "occworld"])
def test_mask_leaves_unscored_voxels_out_of_forecast_and_copy_last(mode):
    rep, _ = run_fake([window(mask_voxel=2)], mode)  # voxel 2 (road, copy-last says free) not scored
    # by hand on voxels 0, 1, 3: target [car, road, free]
    #   1 s [car, road, free] perfect; 2 s [car, car, free]: car 1/2, road 0/1;
    #   3 s [road, road, ped]: car 0/1, road 1/2, ped one false positive, occupied 2 of 3 -> 2/3
    #   copy-last [car, road, free]: perfect
    ped = [None, None, 0] if mode == "exclude" else [100, 100, 100]
    f = rep["forecast"]
    close(f["iou"], [100, 100, 200 / 3])
    close(f["per_class"]["car"], [100, 50, 0])
    close(f["per_class"]["road"], [100, 0, 50])
    close(f["per_class"]["ped"], ped)
    close(f["miou"], [100, 25, 50 / 3] if mode == "exclude" else [100, 50, 50])
    close(rep["copy_last"]["iou"], [100] * 3)
    close(rep["copy_last"]["miou"], [100] * 3)
    assert (np.array(f["confusion"]).sum((1, 2)) == 3).all()
    assert (np.array(rep["copy_last"]["confusion"]).sum((1, 2)) == 3).all()


@pytest.mark.parametrize("mode", ["exclude", "occworld"])
def test_fabricated_reconstruction(mode):
    frames = {"occ": torch.tensor([TARGET], dtype=torch.uint8).view(1, 1, 4, 1, 1)}
    r = E.reconstruction(FakeTokenizer(swap=(1, 0)), [frames], ONE, torch.device("cpu"), None, 4, FREE)
    rep = E.recon_report(r, mode, NAMES)
    # decoded [car, car, car, free] against [car, road, road, free]: car 1/3, road 0/2, occupied 3/3
    close(rep["iou"], 100)
    close(rep["per_class"], {"car": T3, "road": 0, "ped": None if mode == "exclude" else 100, "free": 100})
    close(rep["miou"], T3 / 2 if mode == "exclude" else (T3 + 100) / 3)
    close(rep["code_usage"], 3 / 8)  # codes 0, 1, 3 of 8 used, 1:2:1
    assert rep["perplexity"] == pytest.approx(2 * math.sqrt(2), rel=1e-6)  # float32, as in training


# ---------------------------------------------------------------------------------------------
# the CLI on a trained tiny run (conftest: `ev`, a copy of trained_tiny's run folder)


def test_cli_reports_the_training_time_validation_numbers(ev, capsys, tmp_path):
    out = tmp_path / "report.json"
    assert T.main(ev.args("--mode", "exclude", "--horizons", "0.5,1", "--json", str(out))) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    for word in ("reconstruction", "IoU  forecast", "copy-last", "per-class IoU", "driveable_surface", "0.5s"):
        assert word in printed, printed
    assert f"wrote {out}" in printed

    tok_ckpt = ev.run / "tokenizer" / "checkpoints" / "best.pt"
    tv = load(tok_ckpt)["metrics"]  # the validation that ran right before this checkpoint was saved
    tok = rep["tokenizer"]
    assert tok["checkpoint"] == str(tok_ckpt) and tok["frames"] == 12
    assert (tok["iou"], tok["miou"]) == (tv["val/iou"], tv["val/miou"])
    assert (tok["code_usage"], tok["perplexity"]) == (tv["val/code_usage"], tv["val/perplexity"])

    wst = load(ev.run / "world" / "checkpoints" / "best.pt")
    wv, w = wst["metrics"], rep["world"]
    assert w["tokenizer_sha256"] == wst["tokenizer"]["sha256"] and w["steps"] == [0, 1]
    for key, pre in (("forecast", "val/"), ("copy_last", "val/copy_last_")):
        b = w[key]
        assert b["iou_all_steps"] == b["iou"] == [wv[f"{pre}iou_t1"], wv[f"{pre}iou_t2"]]
        assert b["miou_all_steps"] == b["miou"] == [wv[f"{pre}miou_t1"], wv[f"{pre}miou_t2"]]
        assert b["iou_avg"] == pytest.approx(wv[f"{pre}iou"], abs=1e-12)
        assert b["miou_all_steps_avg"] == pytest.approx(wv[f"{pre}miou"], abs=1e-12)
    assert w["forecast"]["iou"] != w["copy_last"]["iou"]
    assert rep["class_names"][17] == "free" and set(w["forecast"]["per_class"]) == set(rep["class_names"])
    assert (rep["mode"], rep["mask"], rep["split"], rep["protocol"]) == ("exclude", "none", "val", "custom")


def test_cli_subprocess_default_json_and_occworld_mode(ev):
    cmd = [sys.executable, "train.py", *ev.args("--horizons", "0.5,1")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    # horizons other than the protocol's name the report: it never takes the protocol report's name
    out = ev.run / "eval" / "tokenizer+world_val_occworld_h0.5s-1s.json"
    assert f"wrote {out}" in p.stdout and not (ev.run / "eval" / "tokenizer+world_val_occworld.json").exists()
    assert E.default_json(ev.run, ["tokenizer", "world"], "val", "occworld", "none", None, (1.0, 2.0, 3.0)) == \
        ev.run / "eval" / "tokenizer+world_val_occworld.json"
    assert E.default_json(ev.run, ["tokenizer"], "val", "exclude", "mask", None, (1.0,)).name == \
        "tokenizer_val_exclude_mask-mask.json"  # no forecast, no horizons in the name
    rep = json.loads(out.read_text())
    assert rep["mode"] == "occworld" and set(rep) >= {"tokenizer", "world", "data", "class_names"}
    # occworld mode: a class absent from the ground truth scores 100, never "undefined"
    per = rep["world"]["copy_last"]["per_class"]
    assert all(v is not None for vs in per.values() for v in vs)
    assert not list((ev.run / "eval").glob(".*tmp*"))  # written atomically


def test_mask_option_scores_only_visible_voxels(ev, tmp_path):
    reps = {}
    for mask in ("none", "mask"):
        out = tmp_path / f"{mask}.json"
        assert T.main(ev.args("--mask", mask, "--horizons", "0.5,1", "--json", str(out))) == 0
        reps[mask] = json.loads(out.read_text())
    cfg = load_config(None, [a for a in ev.args()[:-1] if a != "--set"])
    win = OccWindows(ev.t.data, "val", dataclasses.replace(cfg.data, use_mask=True))
    masks = np.stack([win[i]["mask"].numpy() for i in range(len(win))])  # (N, 4, X, Y, Z)
    visible = (masks[:, 2:] != 0).sum((0, 2, 3, 4))  # per future step
    assert 0 < visible.min() and visible.max() < masks[:, 0].size  # the mask hides something
    for key in ("forecast", "copy_last"):
        conf = np.array(reps["mask"]["world"][key]["confusion"])
        assert conf.sum((1, 2)).tolist() == visible.tolist()
        assert np.array(reps["none"]["world"][key]["confusion"]).sum((1, 2)).tolist() == [masks[:, 0].size] * 2
    frames = OccWindows(ev.t.data, "val", E.frames_config(cfg.data, use_mask=True))
    seen = sum(int((frames[i]["mask"] != 0).sum()) for i in range(len(frames)))
    assert np.array(reps["mask"]["tokenizer"]["confusion"]).sum() == seen
    assert reps["mask"]["world"]["copy_last"]["iou"] != reps["none"]["world"]["copy_last"]["iou"]


def test_moved_run_finds_its_tokenizer_by_hash(ev, tmp_path):
    ckpt_state = load(ev.run / "world" / "checkpoints" / "best.pt")
    ckpt_state["tokenizer"]["path"] = "/gone/runs/r/tokenizer/checkpoints/best.pt"  # where the run used to be
    moved = ev.run / "world" / "checkpoints" / "moved.pt"
    torch.save(ckpt_state, moved)
    try:
        out = tmp_path / "m.json"
        assert T.main(ev.args("--ckpt", str(moved), "--horizons", "0.5", "--json", str(out))) == 0
        rep = json.loads(out.read_text())
        assert rep["world"]["tokenizer_checkpoint"] == str(ev.run / "tokenizer" / "checkpoints" / "best.pt")
        assert "tokenizer" not in rep  # --ckpt: that checkpoint's stage only
    finally:
        moved.unlink()


@pytest.mark.slow
def test_torchrun_two_ranks_gives_the_same_counts(ev, tmp_path):
    from helpers import Proc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bs = dict(tokenizer_stage__batch_size=1, world_stage__batch_size=1)  # per-sample: same floats
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert T.main(ev.args("--horizons", "0.5,1", "--json", str(one), **bs)) == 0
    p = Proc([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
              "train.py", *ev.args("--horizons", "0.5,1", "--json", str(two), **bs)])
    assert p.finish(180) == 0, p.output
    assert p.output.count("wrote ") == 1  # rank 0 writes
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["world_size"] == 2
    assert a["tokenizer"]["confusion"] == b["tokenizer"]["confusion"]
    for key in ("forecast", "copy_last"):
        assert a["world"][key] == b["world"][key]


# ---------------------------------------------------------------------------------------------
# bad input: one line, exit status 2, nothing written


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    from wm.data.synthetic.generate import write_synthetic

    base = tmp_path_factory.mktemp("other")
    write_synthetic(base / "deep", train_scenes=1, val_scenes=1, frames=6, grid=(16, 16, 8))
    write_synthetic(base / "nomask", train_scenes=1, val_scenes=1, frames=6, grid=(16, 16, 4), with_mask=False)
    return base


def fails(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: T.main(args))
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def altered_tokenizer(ev, tmp_path) -> Path:
    """A world checkpoint naming a tokenizer file whose weights changed since it was trained."""
    tst = load(ev.run / "tokenizer" / "checkpoints" / "best.pt")
    k = next(k for k, v in tst["model"].items() if v.is_floating_point())
    tst["model"][k] = tst["model"][k] + 1
    torch.save(tst, tmp_path / "tokenizer.pt")
    wst = load(ev.run / "world" / "checkpoints" / "best.pt")
    wst["tokenizer"]["path"] = str(tmp_path / "tokenizer.pt")  # the recorded sha256 stays
    torch.save(wst, tmp_path / "world.pt")
    return tmp_path / "world.pt"


BAD = {
    "missing --ckpt": (lambda ev, tmp, od: ev.args("--ckpt", str(tmp / "nope.pt")),
                       r"--ckpt .*nope\.pt does not exist"),
    "run without checkpoints": (lambda ev, tmp, od: ev.args(run__name="never_trained"),
                                r"no tokenizer checkpoint in .*never_trained/tokenizer/checkpoints"),
    "wrong stage": (lambda ev, tmp, od: ev.args("--ckpt", str(ev.run / "tokenizer/checkpoints/best.pt"),
                                                "--stage", "world"),
                    r"best\.pt is a tokenizer checkpoint, but a world-model checkpoint is needed"),
    "not a wm checkpoint": (lambda ev, tmp, od: (torch.save({"w": torch.zeros(1)}, tmp / "x.pt"),
                                                 ev.args("--ckpt", str(tmp / "x.pt")))[1],
                            r"x\.pt is not a wm training checkpoint"),
    "tokenizer hash mismatch": (lambda ev, tmp, od: ev.args("--ckpt", str(altered_tokenizer(ev, tmp)),
                                                            "--horizons", "1"),
                                r"tokenizer hash mismatch: .*world\.pt was trained on tokenizer .*tokenizer\.pt "
                                r"with sha256 [0-9a-f]{12}, but .* has sha256 [0-9a-f]{12}"),
    "config vs checkpoint": (lambda ev, tmp, od: ev.args(tokenizer__widths="8,8,16"),
                             r"config mismatch: .*best\.pt was trained with tokenizer\.widths=\[8, 8, 8\] "
                             r"but the config has \[8, 8, 16\]"),
    "config vs data": (lambda ev, tmp, od: ev.args(data__root=str(od / "deep")),
                        r"deep/manifest\.json: grid \[16, 16, 8\] but data\.grid is \[16, 16, 4\]"),
    "missing data": (lambda ev, tmp, od: ev.args(data__root=str(tmp / "no_data")),
                     r"data\.root .*no_data does not exist"),
    "horizon too short": (lambda ev, tmp, od: ev.args("--horizons", "1,2,3"),
                          r"eval horizon too short: data\.future=2 at 2 Hz, stride 1 reaches 1 s"),
    "mask the data lacks": (lambda ev, tmp, od: ev.args("--mask", "mask", "--horizons", "1",
                                                        data__root=str(od / "nomask")),
                            r"--mask mask: the data set has no visibility mask"),
    "unknown mask": (lambda ev, tmp, od: ev.args("--mask", "radar", "--horizons", "1"),
                     r"--mask 'radar' is not known; this data set offers: none, mask"),
    "mask bits not in the manifest": (lambda ev, tmp, od: ev.args("--mask", "camera", "--horizons", "1"),
                                      r"--mask camera: the data set's manifest names no camera mask bits; "
                                      r"it offers: none, mask"),
    "unknown split": (lambda ev, tmp, od: ev.args("--split", "test", "--horizons", "1"),
                      r"no shards in split 'test' \(splits present: train, val\)"),
    "training flag": (lambda ev, tmp, od: ev.args("--fresh"), r"--fresh belongs to training"),
    "evaluation flag, training": (lambda ev, tmp, od: ev.args()[:-1] + ["--mode", "exclude"],
                                  r"--mode belongs to evaluation; add --eval-only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, ev, other_data, tmp_path, capsys):
    make, pattern = BAD[case]
    before = sorted(p.name for p in (ev.run / "eval").glob("*")) if (ev.run / "eval").is_dir() else []
    line = fails(make(ev, tmp_path, other_data), capsys)
    assert re.search(pattern, line), line
    after = sorted(p.name for p in (ev.run / "eval").glob("*")) if (ev.run / "eval").is_dir() else []
    assert after == before  # no report was written
    assert not (ev.base / "runs" / "never_trained").exists()  # evaluation makes no run folder



def test_mask_bits_select_one_of_two_masks(tmp_path):
    """Occ3D's camera and lidar masks live in one uint8 field as bits (camera 1, lidar 2);
    data.mask_bits picks one: visible where mask & bits != 0 (0: any nonzero)."""
    import numpy as np

    from wm.config.sections import DataConfig
    from wm.data.windows import OccWindows
    from wm.data.writer import ShardWriter
    from wm.data.shards import DatasetInfo, Manifest

    info = DatasetInfo(grid=(4, 4, 2), num_classes=3, free_class=2, class_names=("a", "b", "free"),
                       has_mask=True)
    rng = np.random.default_rng(0)
    occ = rng.integers(0, 3, (3, 4, 4, 2)).astype(np.uint8)
    mask = rng.integers(0, 4, (3, 4, 4, 2)).astype(np.uint8)  # 0..3: none, camera, lidar, both
    w = ShardWriter(tmp_path / "s.h5", "hdf5", info, compression="gzip1")
    w.add_scene("s0", occ, np.tile(np.eye(4), (3, 1, 1)), np.arange(3) * 500_000, mask=mask)
    Manifest(tmp_path, info, [dict(w.close(), split="val")]).write()
    for bits, want in ((0, mask), (1, (mask & 1) != 0), (2, (mask & 2) != 0)):
        cfg = DataConfig(grid=(4, 4, 2), num_classes=3, free_class=2, past=1, future=0, use_mask=True,
                         mask_bits=bits)
        ds = OccWindows(tmp_path, "val", cfg)
        got = np.stack([ds[i]["mask"].numpy()[0] for i in range(len(ds))])
        assert got.dtype == np.uint8 and np.array_equal(got, want.astype(np.uint8)), bits


# ---------------------------------------------------------------------------------------------
# other frame rates: horizons default to what the data's rate and the windows reach (the report
# says which and why), another stride than training is refused with the value to use, and the
# per-class table says its columns are averages


@pytest.mark.parametrize("hz, stride, future, want", [
    (2, 1, 6, (1.0, 2.0, 3.0)),       # OccWorld's protocol
    (2, 1, 11, (1.0, 2.0, 3.0)),      # longer windows still score 1/2/3 s
    (10, 5, 6, (1.0, 2.0, 3.0)),      # 10 Hz at stride 5 is 2 Hz: the protocol again
    (10, 1, 6, (0.2, 0.4, 0.6)),      # 10 Hz, stride 1: steps 2, 4, 6 of 6 (the protocol's shape)
    (10, 2, 6, (0.4, 0.8, 1.2)),
    (2, 1, 2, (0.5, 1.0)),            # two future frames: steps 1 and 2
    (10, 3, 4, (0.3, 0.9, 1.2)),      # 1 s is not a whole step of 0.3 s
])
def test_default_horizons_follow_rate_stride_and_window(hz, stride, future, want):
    hs, why = E.default_horizons(hz, stride, future)
    assert hs == pytest.approx(want)
    E.horizon_steps(hs, hz, stride, future)  # every default horizon is reachable
    if want == (1.0, 2.0, 3.0):
        assert why == ""
    else:
        assert f"{future} future frames at {hz:g} Hz, stride {stride}" in why and "OccWorld's 1 s, 2 s, 3 s" in why
    if (hz, stride, future) == (10, 1, 6):
        assert "need data.future >= 30 at this stride" in why


def test_eval_without_horizons_uses_what_the_windows_reach_and_says_so(ev, capsys, tmp_path):
    out = tmp_path / "r.json"
    assert T.main(ev.args("--json", str(out))) == 0  # 2 future frames at 2 Hz: OccWorld's 2 s, 3 s are out of reach
    printed = capsys.readouterr().out
    w = json.loads(out.read_text())["world"]
    assert w["horizons"] == ["0.5s", "1s"] and w["steps"] == [0, 1]
    assert w["horizons_why"].startswith("the default for these windows (2 future frames at 2 Hz, stride 1, reach 1 s)")
    assert "  horizons 0.5s, 1s: the default for these windows" in printed
    # the per-class columns say they are averages, and over which horizons
    assert re.search(r"per-class IoU +recon +forecast avg +copy-last avg", printed), printed
    assert "(forecast avg, copy-last avg: the mean over 0.5s, 1s;" in printed
    # asked horizons are reported as asked
    assert T.main(ev.args("--horizons", "1", "--json", str(out))) == 0
    assert json.loads(out.read_text())["world"]["horizons_why"] == "--horizons"


def test_eval_at_another_stride_than_training_is_refused_with_the_value(ev, capsys):
    with pytest.raises(WMError, match=r"was trained with data\.stride=1 \(one forecast step = 0\.5 s at 2 Hz\) "
                                      r"but the config has data\.stride=2; evaluate with --set data\.stride=1"):
        T.main(ev.args(data__stride=2))


def test_a_horizon_the_model_cannot_reach_by_more_frames_says_to_train_at_a_larger_stride():
    # 10 Hz, stride 1, a model of max_frames 16 with 5 past frames: 3 s needs 30 future frames, 12 fit
    with pytest.raises(WMError, match=r"need data\.future >= 30; this model takes data\.future <= 12 "
                                      r"\(world\.max_frames\), so those horizons need a model trained at a "
                                      r"larger data\.stride"):
        E.horizon_steps((1, 2, 3), 10, 1, 6, longest=12)
    with pytest.raises(WMError, match=r"evaluate with --set data\.future=30"):
        E.horizon_steps((1, 2, 3), 10, 1, 6, longest=40)


def test_evaluation_logs_progress_with_rate_and_eta(monkeypatch):
    """A validation says how far it is, its rate and ETA, at most every 10 s and once at the end;
    only rank 0 speaks."""
    import wm.utils.logs
    from wm.utils import distributed as D
    from wm.evaluation.evaluate import eval_batches

    clock = iter(range(0, 1000, 4))  # every batch takes 4 s
    monkeypatch.setattr(wm.utils.logs.time, "perf_counter", lambda: float(next(clock)))
    ds = [{"occ": torch.zeros(2)} for _ in range(9)]
    lines = []
    got = sum(len(b["occ"]) for b in eval_batches(ds, D.Dist(), 2, progress="world validation", log=lines.append))
    assert got == 9
    assert lines[-1].strip().startswith("world validation: 9/9 windows,") and "windows/s, ETA 0m00s" in lines[-1]
    assert 2 <= len(lines) < 5 and all("ETA" in ln for ln in lines)
    lines.clear()
    list(eval_batches(ds, D.Dist(rank=1, world_size=2), 2, progress="world validation", log=lines.append))
    assert lines == []
