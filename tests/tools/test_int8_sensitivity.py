"""tools/int8_sensitivity.py: which layers of the INT8 world step cost its accuracy."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("int8_sensitivity", ROOT / "tools" / "int8_sensitivity.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "int8_sensitivity.py"), *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_group_keys_fold_the_layer_indices_and_their_patterns_name_the_group_alone():
    T = _tool()
    assert T.group_key("world.dec_levels.1.temporal.0.ffn.2") == "world.dec_levels.N.temporal.N.ffn.2"
    assert T.group_key("world.downs.0") == "world.downs.0"  # the last index names the layer
    pat = re.compile(T.group_pattern("world.dec_levels.N.temporal.N.ffn.2"))
    assert pat.search("world.dec_levels.12.temporal.3.ffn.2")
    for other in ("world.dec_levels.1.temporal.0.ffn.0", "world.enc_levels.1.temporal.0.ffn.2",
                  "world.dec_levels.1.temporal.0.ffn.2.x", "xworld.dec_levels.1.temporal.0.ffn.2"):
        assert not pat.search(other), other
    assert T.float_pattern(r"tok\.", ["world.out"]) == r"tok\.|^world\.out$"


def test_a_copy_rebuilt_from_the_export_thresholds_computes_what_the_exported_file_does(trained_tiny, tiny_export,
                                                                                      tmp_path):
    """The variants start from the export's own thresholds and float set: with nothing more kept
    float, the rebuilt copy's rollout equals the exported .int8-ort.onnx's, code for code."""
    from wm.export.int8 import kept_float
    from wm.checkpoint.trained import load_trained

    T = _tool()
    out = tiny_export.out
    trained = load_trained(trained_tiny.run_dir())
    feeds, n = T._encode(trained, 4, 2, tmp_path, lambda s: None)
    assert n == 4
    calib = json.loads((out / "world_step.calib.json").read_text())["tensors"]
    kept = json.loads((out / "report.json").read_text())["int8"]["calibration"]["kept_float"]
    common = {"fp32": str(out / "world_step.onnx"), "products": False, "pose": False, "work": str(tmp_path), "feeds": str(feeds),
              "cfg": trained.cfg, "steps": 2, "threads": 1,
              "thresholds": {t: v["amax"] for t, v in calib.items()},
              "exclude": kept_float({"world_step": onnx.load(str(out / "world_step.onnx"))}, kept,
                                    require_match=False)["world_step"]}
    _, rebuilt, _ = T._variant({**common, "name": "rebuilt", "file": None})
    _, exported, _ = T._variant({**common, "name": "exported", "file": str(out / "world_step.int8-ort.onnx")})
    assert rebuilt.shape == (4, 2, *rebuilt.shape[2:])
    assert np.array_equal(rebuilt, exported)
    assert [p.name for p in tmp_path.iterdir()] == ["feeds.npz"]  # the variant's copy is gone


def test_sensitivity_tool_keeps_groups_float_until_the_codes_equal_the_fp32_file(trained_tiny, tiny_export, tmp_path,
                                                                                subprocess_tmpdir):
    """Every group kept float is the FP32 graph again: with --target 1 and room for every group,
    the set found agrees on every code; its pattern names exactly its groups' layers."""
    from wm.export.int8 import kept_float

    js = tmp_path / "s.json"
    p = _run("--run", trained_tiny.run_dir(), "--export", tiny_export.out, "--windows", 3, "--steps", 2,
             "--max-groups", 99, "--target", 1, "--workers", 2, "--threads", 1, "--json", js)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(js.read_text())
    assert d["windows"] == 3 and d["steps"] == 2 and d["reached"]
    groups = d["groups"]
    assert len(d["together"]) == len(groups)  # one set per size, the last every group
    assert d["together"][-1]["agreement"] == [1.0, 1.0]
    assert abs(sum(g["weights_fraction"] for g in groups.values()) - 1) < 1e-9
    first = next(i for i, t in enumerate(d["together"]) if min(t["agreement"]) >= 1.0)
    chosen = d["together"][first]["groups"]
    fp32 = onnx.load(str(tiny_export.out / "world_step.onnx"))
    named = kept_float({"world_step": fp32}, d["int8_float"])["world_step"]
    before = kept_float({"world_step": fp32}, d["kept_float"], require_match=False)["world_step"]
    assert len(named) == sum(groups[k]["nodes"] for k in chosen) + len(before)
    assert f"--int8-float '{d['int8_float']}'" in p.stdout and "as exported" in p.stdout
    assert not list(subprocess_tmpdir.glob("wm-int8-sensitivity-*"))  # its copies and feeds are gone


def test_sensitivity_tool_refuses_an_export_without_int8_files_in_one_line(trained_tiny, tmp_path):
    p = _run("--run", trained_tiny.run_dir(), "--export", tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"{tmp_path / 'world_step.onnx'} does not exist; run export.py --run" in p.stderr
    from helpers import cli_in_process  # the same main and one-line error, without a second process start

    p = cli_in_process(ROOT / "tools" / "int8_sensitivity.py", "--run", trained_tiny.run_dir(), "--export", tmp_path,
                       "--windows", 0)
    assert p.returncode == 2 and "--windows must be >= 1, got 0" in p.stderr
