"""Inputs real users give the converters: damaged or mislabelled label files, every
scene skipped, gt_paths from another machine, other data sets' formats, quaternions in another
order, and what a conversion leaves behind. Each through the CLI, as a user meets it."""

import io
import json
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from test_convert import G, ROOT, SCENES, _labels_file, cli, make_frames, make_occ3d, one_error_line, read_back


def convert_occ3d(src, out, *extra):
    return cli("convert_occ3d.py", "--root", src, "--out", out, "--grid", *G, "--workers", "1",
               "--scenes-per-shard", "1", *extra)


# ---------------------------------------------------------------------------------------------
# items 1-3: a labels.npz that is not what its name says


def damage_deflate_stream(path: Path) -> None:
    """Flip bytes inside the compressed 'semantics' member, keeping the zip directory intact, at
    the first place that makes zlib itself fail (the issue's 'invalid distance too far back' kind)."""
    raw = path.read_bytes()
    info = zipfile.ZipFile(io.BytesIO(raw)).getinfo("semantics.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for off in range(2, info.compress_size - 4):
        bad = bytearray(raw)
        for k in range(3):
            bad[start + off + k] ^= 0xFF
        try:
            with np.load(io.BytesIO(bytes(bad)), allow_pickle=False) as z:
                z["semantics"]
        except zlib.error:
            path.write_bytes(bytes(bad))
            return
        except Exception:
            continue
    raise AssertionError("no byte flip gave a zlib error")


def npy_named_npz(path: Path) -> None:
    with open(path, "wb") as f:
        np.save(f, np.zeros(G, np.uint8))


def html_named_npz(path: Path) -> None:
    path.write_text("<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>expired link</body></html>\n")


LABEL_FILE_CASES = {
    "damaged deflate stream": (damage_deflate_stream, "damaged"),
    "npy under an npz name": (npy_named_npz, ".npy"),
    "html page under an npz name": (html_named_npz, "not a NumPy .npz file"),
}


@pytest.mark.parametrize("case", list(LABEL_FILE_CASES))
def test_label_file_that_is_not_an_npz_is_one_line_and_skippable(tmp_path, case):
    src, out = tmp_path / "src", tmp_path / "out"
    truth = make_occ3d(src, SCENES)
    breaker, words = LABEL_FILE_CASES[case]
    bad = _labels_file(src, "scene-0002", 1)
    breaker(bad)
    line = one_error_line(convert_occ3d(src, out))
    assert str(bad) in line and "scene-0002" in line and words in line, line
    assert "pickle" not in line, line  # never a hint to load untrusted data unsafely
    p = convert_occ3d(src, out, "--skip-bad")
    assert p.returncode == 0, p.stderr
    skipped = json.loads((out / "skipped.json").read_text())
    assert [s["scene"] for s in skipped] == ["scene-0002"] and str(bad) in skipped[0]["error"]
    got = read_back(out)
    assert sorted(got) == ["scene-0001", "scene-0003", "scene-0004"]
    np.testing.assert_array_equal(got["scene-0004"]["occ"], truth["scene-0004"]["sem"])


def _npz_named_npy(path: Path) -> None:
    with open(path, "wb") as f:  # np.savez would add .npz to a name
        np.savez(f, semantics=np.zeros((6, 4, 3), np.uint8))


@pytest.mark.parametrize("frame, breaker, words", [
    ("drive_b/000001.npy", html_named_npz, "not a NumPy .npy file"),
    ("drive_b/000001.npy", _npz_named_npy, "an .npz archive"),
    ("drive_a/000000.npy", html_named_npz, "not a NumPy .npy file"),  # the frame the grid is read from
])
def test_own_recordings_frame_that_is_not_what_its_name_says_is_one_line(tmp_path, frame, breaker, words):
    rec = tmp_path / "rec"
    make_frames(rec)
    breaker(rec / frame)
    line = one_error_line(cli("convert_frames.py", "--root", rec, "--out", tmp_path / "out", "--classes",
                              "a,b,c,d,free", "--free", "free", "--val-fraction", "0", "--workers", "1"))
    assert str(rec / frame) in line and words in line and "pickle" not in line, line


# ---------------------------------------------------------------------------------------------
# --skip-bad when every scene (or every scene of a split) is bad


def test_skip_bad_with_every_scene_bad_names_the_errors_and_writes_skipped_json(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES)
    for name, *_ in SCENES:
        html_named_npz(_labels_file(src, name, 0))
    p = convert_occ3d(src, out, "--skip-bad")
    line = one_error_line(p)
    assert "all 4 scenes were skipped" in line and str(out / "skipped.json") in line, line
    assert str(_labels_file(src, "scene-0001", 0)) in line, line  # the first error, quoted
    skipped = json.loads((out / "skipped.json").read_text())
    assert sorted(s["scene"] for s in skipped) == [n for n, *_ in SCENES]
    for name, split, _ in SCENES:  # and each one is printed, not "see the errors above" with none above
        assert f"skipped {split} scene {name}:" in p.stdout, p.stdout
    assert not (out / "manifest.json").exists()


def test_skip_bad_that_empties_the_val_split_fails(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES)
    html_named_npz(_labels_file(src, "scene-0003", 2))  # the only val scene
    p = convert_occ3d(src, out, "--skip-bad")
    line = one_error_line(p)
    assert "val" in line and "scene-0003" in line and "skipped.json" in line, line
    assert not (out / "manifest.json").exists()  # no data set without its val split
    assert [s["scene"] for s in json.loads((out / "skipped.json").read_text())] == ["scene-0003"]


# ---------------------------------------------------------------------------------------------
# absolute gt_paths recorded on another machine


def _set_gt_paths(src: Path, fn) -> None:
    ann = json.loads((src / "annotations.json").read_text())
    for name, infos in ann["scene_infos"].items():
        for tok, fr in infos.items():
            fr["gt_path"] = fn(name, tok, fr["gt_path"])
    (src / "annotations.json").write_text(json.dumps(ann))


def test_absolute_gt_paths_of_another_machine_fall_back_to_the_root_layout(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    truth = make_occ3d(src, SCENES)
    _set_gt_paths(src, lambda n, t, gt: f"/mnt/elsewhere/Occ3D/{gt}")
    p = convert_occ3d(src, out)
    assert p.returncode == 0, p.stderr
    got = read_back(out)
    for name, t in truth.items():
        np.testing.assert_array_equal(got[name]["occ"], t["sem"])
    # where neither place has the file, the line names both
    _labels_file(src, "scene-0004", 1).unlink()
    line = one_error_line(convert_occ3d(src, tmp_path / "out2"))
    assert "/mnt/elsewhere/Occ3D/gts/scene-0004/" in line and str(src / "gts" / "scene-0004") in line, line


# ---------------------------------------------------------------------------------------------
# other data sets' formats, quaternions in another order


def _rewrite_labels(src: Path, fn) -> None:
    for f in sorted(src.glob("gts/*/*/labels.npz")):
        with np.load(f) as z:
            arrays = dict(z)
        arrays["semantics"] = fn(arrays["semantics"])
        np.savez_compressed(f, **arrays)


def test_int32_semantics_are_refused_naming_the_file(tmp_path):
    """OpenOcc stores int32 semantics (free = 16): not Occ3D's uint8."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES)
    _rewrite_labels(src, lambda s: np.where(s == 17, 16, s).astype(np.int32))
    line = one_error_line(convert_occ3d(src, out, "--mask", "none"))
    assert "labels.npz" in line and "int32" in line and "uint8" in line, line


def test_data_set_whose_most_common_class_is_not_free_is_flagged(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES)
    p = convert_occ3d(src, out)
    assert p.returncode == 0 and "warning" not in p.stdout + p.stderr, p.stdout + p.stderr
    # OpenOcc's numbering in uint8: its free (16) is Occ3D's vegetation
    _rewrite_labels(src, lambda s: np.where(s == 17, 16, s))
    p = convert_occ3d(src, tmp_path / "out2", "--mask", "none")
    assert p.returncode == 0, p.stderr
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "16 'vegetation'" in warn[0] and "17 'free'" in warn[0], p.stderr
    assert str(tmp_path / "out2") in warn[0]
    record = json.loads((tmp_path / "out2" / "conversion.json").read_text())
    assert record["warnings"] == [warn[0][len("warning: "):]]


def test_own_recordings_whose_most_common_class_is_not_free_are_flagged(tmp_path):
    make_frames(tmp_path / "rec")
    for f in (tmp_path / "rec" / "drive_c").glob("*.npy"):  # the largest scene: all 'road'
        np.save(f, np.zeros_like(np.load(f)))
    p = cli("convert_frames.py", "--root", tmp_path / "rec", "--out", tmp_path / "out", "--classes",
            "road,car,building,tree,free", "--free", "free", "--val-fraction", "0")
    assert p.returncode == 0, p.stderr
    assert "warning:" in p.stderr and "0 'road'" in p.stderr and "4 'free'" in p.stderr, p.stderr


def _xyzw(src: Path) -> None:
    ann = json.loads((src / "annotations.json").read_text())
    for infos in ann["scene_infos"].values():
        for fr in infos.values():
            w, x, y, z = fr["ego_pose"]["rotation"]
            fr["ego_pose"]["rotation"] = [x, y, z, w]
    (src / "annotations.json").write_text(json.dumps(ann))


def test_quaternions_in_xyzw_order_are_flagged_and_read_with_quat_order(tmp_path):
    src = tmp_path / "src"
    truth = make_occ3d(src, SCENES)
    p = convert_occ3d(src, tmp_path / "ok")
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr
    _xyzw(src)
    p = convert_occ3d(src, tmp_path / "wrong")
    assert p.returncode == 0, p.stderr
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "--quat-order xyzw" in warn[0] and "annotations.json" in warn[0], p.stderr
    p = convert_occ3d(src, tmp_path / "right", "--quat-order", "xyzw")
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr
    got = read_back(tmp_path / "right")
    for name, t in truth.items():
        np.testing.assert_allclose(got[name]["pose"], t["pose"], atol=1e-9)


# ---------------------------------------------------------------------------------------------
# loose ends


def test_no_lock_file_is_left_behind(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES[:2])
    assert convert_occ3d(src, out).returncode == 0
    assert not (out / ".convert.lock").exists()
    html_named_npz(_labels_file(src, "scene-0001", 0))
    one_error_line(convert_occ3d(src, tmp_path / "out2"))  # a failed run leaves none either
    assert not (tmp_path / "out2" / ".convert.lock").exists()


HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a POSIX record lock, as the run lock's
print("held", flush=True)
time.sleep(120)
"""


def test_a_conversion_into_a_folder_another_process_holds_is_refused_naming_it(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES[:2])
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out / ".convert.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        line = one_error_line(convert_occ3d(src, out))
        assert f"{out} is in use by pid {holder.pid} on host " in line and "choose another --out" in line, line
        assert sorted(p.name for p in out.iterdir()) == [".convert.lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_data_guide_names_the_files_a_memmap_shard_holds(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_occ3d(src, SCENES[:2])
    assert convert_occ3d(src, out, "--format", "memmap").returncode == 0
    shard = next(out.glob("*.mm"))
    held = sorted(p.name for p in shard.iterdir())
    guide = (ROOT / "docs" / "DATA.md").read_text()
    bullet = next(ln for ln in guide.split("\n- ") if ln.startswith("**memmap shard**"))
    for name in held:
        assert name in bullet, (name, bullet)
    assert "scene_names.npy" not in held
