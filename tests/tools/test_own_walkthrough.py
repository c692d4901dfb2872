"""The walkthrough of docs/OWN_RECORDINGS.md, its essential path, on fabricated airside recordings:
12 classes with free = 0, five of them moving, 10 Hz, four drives of 24-30 frames, poses as CSV and
JSON. Convert, plan the horizons (train.py --horizons 1,2), train both stages at the planned setting,
evaluate: 1 s and 2 s are reached without a refusal, and the custom moving classes are in the final
table, summary.json, --eval-only's table and the pictures. Tiny grid and models (numbers meaningless).

`fabricate` also makes the guide-sized recordings (96 x 64 x 10, 0.5 m voxels) for a manual run."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import wm.training.loop as L
import wm.training.main as T
from wm.utils.errors import ConfigError, WMError

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ["free", "apron", "marking", "aircraft", "tug", "baggage_cart", "belt_loader", "person", "cone",
           "building", "pole", "fence"]
MOVING = ["aircraft", "tug", "baggage_cart", "belt_loader", "person"]
DRIVES = {"drive_01": 24, "drive_02": 26, "drive_03": 30, "drive_04": 27}  # frames; drive_04 validates


def fabricate(root: Path, grid=(16, 16, 4), hz: float = 10.0, t0: float = 1.533e9) -> Path:
    """Scene folders in the guide's layout and classes.json: an apron with a marking, a building,
    poles, a fence and cones; an aircraft taxiing, a tug towing a baggage cart, a belt loader, a
    person walking; the ego creeping forward. drive_01 and drive_03 write poses.csv (x, y, z, yaw),
    the others poses.json (4x4 matrices), timestamps in seconds (Unix time)."""
    X, Y, Z = grid
    u = max(1, min(X, Y) // 16)  # objects grow with the grid: one voxel at 16 x 16
    c = {n: i for i, n in enumerate(CLASSES)}
    for k, (name, n) in enumerate(DRIVES.items()):
        d = root / name
        d.mkdir(parents=True)
        base = np.zeros(grid, np.uint8)
        base[:, :, 0] = c["apron"]
        base[:, Y // 2, 0] = c["marking"]
        base[:u, :, 1:] = c["building"]
        base[:, -1, 1:2] = c["fence"]
        base[X // 2, 1, 1:] = c["pole"]
        base[X - 2 * u, (2 + k % 3) * u, 1] = c["cone"]
        for i in range(n):
            occ = base.copy()
            ax = u * (1 + (k + i // 4) % (X // u - 6))  # aircraft: 4 x 3 x 2 units, one unit every 4 frames
            occ[ax:ax + 4 * u, 2 * u:5 * u, 1:3] = c["aircraft"]
            ty = u * ((3 * k + i // 2) % (Y // u - 4))  # tug and cart along y, a unit every 2 frames
            occ[X - 3 * u:X - 2 * u, ty:ty + u, 1] = c["tug"]
            occ[X - 3 * u:X - 2 * u, ty + u:ty + 3 * u, 1] = c["baggage_cart"]
            occ[ax + u:ax + 2 * u, (5 + (i // 6) % 2) * u:(6 + (i // 6) % 2) * u, 1] = c["belt_loader"]
            p = 2 + (k + i // 3) % (min(X, Y) // u - 5)
            occ[p * u, Y - (3 + p % 3) * u, 1:min(Z, 3)] = c["person"]
            np.save(d / f"{i:06d}.npy", occ)
        t = t0 + 100 * k + np.arange(n) / hz
        x = 0.05 * np.arange(n)
        if k % 2 == 0:
            rows = [f"{float(t[i])!r},{float(x[i])!r},0.0,0.0,0.01" for i in range(n)]
            (d / "poses.csv").write_text("timestamp,x,y,z,yaw\n" + "\n".join(rows) + "\n")
        else:
            recs = [{"timestamp": float(t[i]), "frame": f"{i:06d}",
                     "matrix": [[1, 0, 0, float(x[i])], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]} for i in range(n)]
            (d / "poses.json").write_text(json.dumps(recs))
    cj = root.parent / "classes.json"
    cj.write_text(json.dumps({"class_names": CLASSES, "free_class": "free", "voxel_size": 0.5,
                              "frame_rate_hz": 10, "moving_classes": MOVING}))
    return cj


@pytest.fixture(scope="module")
def air(tmp_path_factory):
    base = tmp_path_factory.mktemp("air")
    cj = fabricate(base / "recordings")
    p = subprocess.run([sys.executable, "tools/convert_frames.py", "--root", str(base / "recordings"), "--out",
                        str(base / "data"), "--classes-json", str(cj), "--val-scenes", "drive_04", "--quiet",
                        "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "10 Hz" in p.stdout and f"moving classes: {', '.join(MOVING)}" in p.stdout, p.stdout
    return base


def settings(base: Path, **over) -> list[str]:
    s = {"data.root": base / "data", "data.grid": "16,16,4", "data.num_classes": 12, "data.free_class": 0,
         "loader.num_workers": 0, "tokenizer.widths": "8,8", "tokenizer.codebook_size": 16,
         "tokenizer.code_dim": 8, "world.widths": "8,16", "world.heads": 2, "train.device": "cpu",
         "train.amp": "fp32", "logging.tensorboard": "false", "logging.every": 1, "train.world_crop": 0,
         "tokenizer_stage.batch_size": 2, "tokenizer_stage.max_steps": 2, "tokenizer_stage.warmup_steps": 1,
         "world_stage.batch_size": 2, "world_stage.max_steps": 2, "world_stage.warmup_steps": 1,
         "run.out_dir": base / "runs", "run.name": "airside", **over}
    return [a for k, v in s.items() for a in ("--set", f"{k}={v}")]


PLAN = {"data.past": 2, "data.future": 4, "data.stride": 5, "world.max_frames": 16}


def test_horizons_are_planned_for_the_data_set(air, capsys):
    # 1 s, 2 s at 10 Hz = 10, 20 frames ahead; at stride 5 (0.5 s steps) the 27-frame val drive holds 2 past
    # frames (a 26-frame span), not data.past's 5: drives of 26 and 30 frames train (1 + 5 windows), 2 val windows
    assert T.main(settings(air) + ["--horizons", "1,2"]) == 0
    out = capsys.readouterr().out
    assert " ".join(f"{k}={v}" for k, v in PLAN.items()) in out, out
    assert "1 s = t+2, 2 s = t+4; a window spans 26 frames: 6 train windows, 2 val windows" in out, out
    assert "data.past lowered from 5" in out
    assert not (air / "runs" / "airside").exists()  # nothing trained
    with pytest.raises(WMError, match=r"^horizon 3 s cannot be reached on this data set: at 10 Hz 3 s is 30 frames "
                                      r"ahead, so a window needs at least 31 frames \(1 past frame \+ 30\), but the "
                                      r"longest val scene has 27; horizons up to 2\.6 s fit"):
        T.main(settings(air) + ["--horizons", "1,2,3"])


def test_training_refuses_windows_that_miss_data_horizons_s_naming_the_plan(air, restore_signals):
    with pytest.raises(ConfigError, match=r"'data\.horizons_s': 1 s, 2 s are not reached by data\.past=5 "
                                          r"data\.future=2 data\.stride=5 at 10 Hz .*--set data\.past=2 --set "
                                          r"data\.future=4 --set data\.stride=5 --set world\.max_frames=16$"):
        T.main(settings(air, **{"data.future": 2, "data.stride": 5, "data.horizons_s": "1,2",
                                "run.name": "short"}))
    assert not (air / "runs" / "short" / "tokenizer" / "checkpoints").exists()  # before the first step


def test_walkthrough_reaches_1s_and_2s_and_shows_the_moving_classes(air, restore_signals, capsys, monkeypatch):
    pictures = []
    real = L.bev_pair
    monkeypatch.setattr(L, "bev_pair", lambda frames, info, moving=None, labels=None: (
        pictures.append((moving, labels)), real(frames, info, moving, labels))[1])
    planned = {**PLAN, "data.horizons_s": "1,2", "train.stages": "tokenizer,world"}
    assert T.main(settings(air, **planned)) == 0
    out = capsys.readouterr().out
    assert "t+2 (1s)" in out and "t+4 (2s)" in out, out
    table = out[out.index("moving classes, IoU per future step"):].splitlines()
    assert {ln.split()[0] for ln in table[2:] if ln.strip()} >= {"aircraft", "tug", "baggage_cart", "person"}, out
    run = air / "runs" / "airside"
    summary = json.loads((run / "summary.json").read_text())["world"]
    assert list(summary["class_iou"]) == MOVING and summary["seconds"] == [0.5, 1.0, 1.5, 2.0]
    # the pictures: moving objects drawn on top, the forecast's frames labelled with their steps
    assert (tuple(MOVING), None) in pictures
    assert (tuple(MOVING), ["t+1 (0.5s)", "t+2 (1s)", "t+3 (1.5s)", "t+4 (2s)"]) in pictures
    # --eval-only scores data.horizons_s, 1 s and 2 s, without a refusal, under its own report name
    assert T.main(settings(air, **planned) + ["--eval-only"]) == 0
    out = capsys.readouterr().out
    rep = json.loads((run / "eval" / "tokenizer+world_val_occworld_h1s-2s.json").read_text())
    assert rep["world"]["horizons"] == ["1s", "2s"] and rep["world"]["steps"] == [1, 3]
    assert rep["world"]["horizons_why"] == "data.horizons_s" and rep["moving_classes"] == MOVING
    assert "1s (t+2)" in out and "moving classes, IoU per horizon" in out and "baggage_cart" in out


def test_the_guides_say_what_the_tools_do():
    """The own-recordings guide and the Occ3D guide against the code (behaviour: tests/export/test_int8.py
    for --eval-windows beyond the split, tests/data/test_convert.py for the chain ends)."""
    from wm.data.convert.occ3d import CHAIN_END

    pages = (ROOT / "docs" / "OWN_RECORDINGS.md", ROOT / "docs" / "OCC3D.md")
    text = " ".join(" ".join(p.read_text() for p in pages).split())
    assert "is refused when the validation split has fewer" not in text
    assert "the default, 64, also takes all of them, with a note, when the validation split has fewer" in text
    assert set(CHAIN_END) == {None, "", "EOF"}
    assert ("a scene's first frame's `prev` and its last frame's `next` are `\"EOF\"` (nuScenes' own sample table "
            "writes `\"\"` there); the converter takes either, or `null`, as the scene's end") in text
    # the worked example's commands and files are the ones this module runs
    for cmd in ("python tools/convert_frames.py --root recordings --out data/airside --classes-json classes.json "
                "--val-scenes drive_04 --verify", "python train.py --cfg airside.json --horizons 1,2",
                "python train.py --cfg airside.json --eval-only", '"moving_classes": ["aircraft", "tug", '
                '"baggage_cart", "belt_loader", "person"]', "Four drives of 24, 26, 30 and 27 frames at 10 Hz"):
        assert cmd in text, cmd
    assert list(DRIVES.values()) == [24, 26, 30, 27]
