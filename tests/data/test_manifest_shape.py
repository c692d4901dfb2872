"""A manifest.json whose shard entries (or whose top level) have the wrong shape is one DataError line
naming manifest.json, the entry and the field: when training opens the data set and in
tools/inspect_data.py --verify, never a TypeError."""

import importlib.util
import json
import subprocess
import sys

import pytest

from wm.config.sections import DataConfig
from wm.data.synthetic.generate import write_synthetic
from wm.data.windows import OccWindows
from wm.utils.errors import DataError

from helpers import ROOT  # noqa: E402

GRID = (16, 16, 4)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("m") / "d"
    write_synthetic(root, train_scenes=1, val_scenes=1, frames=4, grid=GRID, kind="memmap")
    return json.loads((root / "manifest.json").read_text()), root


@pytest.fixture
def broken(pristine, tmp_path):
    """A copy of the data set with its manifest changed in place by fn(manifest), or replaced by `top`."""
    import shutil

    d, src = pristine

    def make(fn=None, **top):
        root = tmp_path / "d"
        shutil.copytree(src, root)
        m = json.loads(json.dumps(d))
        if fn is not None:
            fn(m)
        (root / "manifest.json").write_text(json.dumps(top["top"] if top else m))
        return root

    return make


def inspect_main():
    spec = importlib.util.spec_from_file_location("inspect_data", ROOT / "tools" / "inspect_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def one_line(fn, *a) -> str:
    with pytest.raises(DataError) as e:
        fn(*a)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def entry(k, v):
    return lambda m: m["shards"][0].update({k: v})


ENTRY_CASES = [
    ("path-int", entry("path", 5), "'path'", "5"),
    ("path-empty", entry("path", ""), "'path'", "''"),
    ("split-list", entry("split", ["train"]), "'split'", "['train']"),
    ("kind-list", entry("kind", ["memmap"]), "'kind'", "['memmap']"),
    ("frames-str", entry("frames", "4"), "'frames'", "'4'"),
    ("frames-bool", entry("frames", True), "'frames'", "True"),
    ("scenes-float", entry("scenes", 1.5), "'scenes'", "1.5"),
    ("bytes-negative", entry("bytes", -1), "'bytes'", "-1"),
    ("bytes-null", entry("bytes", None), "'bytes'", "None"),
    ("sha256-int", entry("sha256", 5), "'sha256'", "5"),
    ("sha256-short", entry("sha256", "abc"), "'sha256'", "'abc'"),
    ("missing-frames", lambda m: m["shards"][0].pop("frames"), "has no field 'frames'", None),
    ("missing-sha256", lambda m: m["shards"][0].pop("sha256"), "has no field 'sha256'", None),
]


@pytest.mark.parametrize("case, change, field, shown", ENTRY_CASES, ids=[c[0] for c in ENTRY_CASES])
def test_a_mistyped_shard_entry_is_one_line_in_training_and_in_inspect_data(broken, case, change, field, shown):
    root = broken(change)
    for msg in (one_line(OccWindows, root, "train", DataConfig(grid=GRID, past=1, future=1)),
                one_line(inspect_main(), [str(root), "--verify"])):
        assert str(root / "manifest.json") in msg and "shards[0]" in msg and field in msg, msg
        if shown is not None:
            assert f"is {shown}, expected" in msg, msg
        if case != "path-int" and case != "path-empty":  # the entry is named by its path where it has one
            assert "train-00000.mm" in msg, msg


TOP_CASES = [("list", [1, 2], "a list"), ("null", None, "null"), ("string", "manifest", "a string"),
             ("number", 7, "a number")]


@pytest.mark.parametrize("case, value, kind", TOP_CASES, ids=[c[0] for c in TOP_CASES])
def test_a_manifest_that_is_no_object_is_one_line(broken, case, value, kind):
    root = broken(top=value)
    for msg in (one_line(OccWindows, root, "train", DataConfig(grid=GRID, past=1, future=1)),
                one_line(inspect_main(), [str(root), "--verify"])):
        assert str(root / "manifest.json") in msg and f"the top level is {kind}" in msg, msg


def test_an_entry_that_is_no_object_is_named(broken):
    root = broken(lambda m: m["shards"].__setitem__(1, ["val-00000.mm"]))
    msg = one_line(OccWindows, root, "train", DataConfig(grid=GRID, past=1, future=1))
    assert str(root / "manifest.json") in msg and "shards[1] is a list" in msg, msg


def test_inspect_data_cli_prints_the_one_line_and_exits_2(broken):
    root = broken(entry("split", {"name": "train"}))
    p = subprocess.run([sys.executable, "tools/inspect_data.py", str(root), "--verify"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == (f"error: {root / 'manifest.json'}: shards[0] (train-00000.mm) field 'split' is "
                                "{'name': 'train'}, expected a split name (a string); the manifest is damaged, "
                                "re-create the data set"), p.stderr
    assert "Traceback" not in p.stderr


def test_the_pristine_manifest_still_loads(broken):
    root = broken()
    assert len(OccWindows(root, "train", DataConfig(grid=GRID, past=1, future=1))) == 3
