"""wm.config.sections: strict JSON loading, --set overrides, section validation, save/load round trips.

Every refusal must be a ConfigError whose one-line message names the full key path; the tests
assert those words (key path, expected type, the value given, the suggestion), not whole sentences.
"""

import json

import pytest

from wm.config import sections as C

from wm.config import loading as CL
from wm.utils.errors import ConfigError, WMError


def refused(fn, *args, **kw) -> ConfigError:
    """Call fn, expect a ConfigError with a one-line message, return it."""
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kw)
    e = ei.value
    assert isinstance(e, WMError)
    assert "\n" not in str(e), f"message is not one line: {e!r}"
    return e


def write_cfg(tmp_path, d, name="cfg.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


def non_default() -> C.Config:
    cfg = C.Config()
    cfg.run.name, cfg.run.seed = "exp-7", 3
    cfg.data.grid = (32, 32, 4)
    cfg.loader.h5_cache_mib = 0.5
    cfg.data.use_mask, cfg.loader.pin_memory = True, False
    cfg.synthetic.format, cfg.synthetic.frames = "memmap", 17
    return cfg.validate()


# ---------------------------------------------------------------------------------------------
# defaults and round trips


def test_defaults_validate():
    cfg = C.Config()
    assert cfg.validate() is cfg
    assert CL.load() == C.Config()  # no file, no overrides: the defaults


def test_dict_json_round_trip_equals():
    cfg = non_default()
    d = json.loads(json.dumps(CL.to_dict(cfg)))
    assert d["data"]["grid"] == [32, 32, 4]  # tuples are lists in JSON
    back = CL.from_dict(C.Config, d)
    assert back == cfg
    assert back != C.Config()  # the round trip carried the non-defaults
    assert isinstance(back.data.grid, tuple) and back.data.grid == (32, 32, 4)
    assert isinstance(back.loader.h5_cache_mib, float)


def test_save_load_round_trip_ignores_meta(tmp_path):
    cfg = non_default()
    p = tmp_path / "config.json"
    CL.save(cfg, p, meta={"fingerprint": "ab" * 32, "versions": {"torch": "x"}})
    on_disk = json.loads(p.read_text())
    assert on_disk[C.META_KEY]["fingerprint"] == "ab" * 32
    assert on_disk["data"]["grid"] == [32, 32, 4]
    back = CL.load(p)
    assert back == cfg
    assert back.data.grid == (32, 32, 4) and isinstance(back.data.grid, tuple)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json"]  # no temp left


def test_save_overwrites_atomically_and_without_meta(tmp_path):
    p = tmp_path / "config.json"
    CL.save(non_default(), p, meta={"a": 1})
    CL.save(C.Config(), p)
    d = json.loads(p.read_text())
    assert C.META_KEY not in d
    assert CL.load(p) == C.Config()
    assert [f.name for f in tmp_path.iterdir()] == ["config.json"]


def test_partial_file_keeps_other_defaults(tmp_path):
    p = write_cfg(tmp_path, {"data": {"batch_size": 3}})
    cfg = CL.load(p)
    assert cfg.data.batch_size == 3
    expected = C.Config()
    expected.data.batch_size = 3
    assert cfg == expected


# ---------------------------------------------------------------------------------------------
# unknown keys


def test_unknown_nested_key_names_full_path_and_suggests():
    e = refused(CL.from_dict, C.Config, {"data": {"bach_size": 4}})
    assert e.key == "data.bach_size"
    assert "'data.bach_size'" in str(e) and "data.batch_size" in str(e)
    assert "unknown" in str(e)


def test_unknown_top_level_key_suggests_its_section():
    e = refused(CL.from_dict, C.Config, {"seed": 1})
    assert e.key == "seed" and "run.seed" in str(e)


@pytest.mark.parametrize("section,close", [("dat", "data"), ("synthetc", "synthetic"), ("runn", "run")])
def test_unknown_section_suggests_close_one(section, close):
    e = refused(CL.from_dict, C.Config, {section: {}})
    assert e.key == section
    assert f"did you mean '{close}'" in str(e)


def test_unknown_key_without_close_match_has_no_suggestion():
    e = refused(CL.from_dict, C.Config, {"data": {"zzzzqqq": 1}})
    assert "data.zzzzqqq" in str(e) and "did you mean" not in str(e)


def test_unknown_key_in_file_names_the_file(tmp_path):
    p = write_cfg(tmp_path, {"data": {"bach_size": 4}})
    e = refused(CL.load, p)
    assert "data.bach_size" in str(e) and "data.batch_size" in str(e) and str(p) in str(e)


# ---------------------------------------------------------------------------------------------
# types


@pytest.mark.parametrize("d,key,words", [
    ({"data": {"batch_size": "4"}}, "data.batch_size", ["int", "'4'"]),
    ({"data": {"batch_size": True}}, "data.batch_size", ["int", "bool", "True"]),  # bool is no int
    ({"data": {"batch_size": 4.5}}, "data.batch_size", ["int", "4.5"]),
    ({"data": {"batch_size": 4.0}}, "data.batch_size", ["int", "4.0"]),
    ({"data": {"batch_size": None}}, "data.batch_size", ["int", "None"]),
    ({"data": {"use_mask": 1}}, "data.use_mask", ["bool", "1"]),
    ({"data": {"use_mask": "true"}}, "data.use_mask", ["bool", "'true'"]),
    ({"loader": {"h5_cache_mib": "1"}}, "loader.h5_cache_mib", ["float", "'1'"]),
    ({"loader": {"h5_cache_mib": False}}, "loader.h5_cache_mib", ["float", "False"]),
    ({"run": {"name": 5}}, "run.name", ["str", "5"]),
    ({"data": {"grid": [64, "a", 8]}}, "data.grid[1]", ["int", "'a'"]),
    ({"data": {"grid": [64, 64.0, 8]}}, "data.grid[1]", ["int", "64.0"]),
    ({"data": {"grid": "64,64,8"}}, "data.grid", ["tuple", "'64,64,8'"]),
    ({"data": 5}, "data", ["object", "5"]),
])
def test_wrong_type_names_key_type_and_value(d, key, words):
    e = refused(CL.from_dict, C.Config, d)
    assert e.key == key
    msg = str(e)
    assert f"'{key}'" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_int_for_float_is_accepted_as_float():
    cfg = CL.from_dict(C.Config, {"loader": {"h5_cache_mib": 2}})
    assert cfg.loader.h5_cache_mib == 2.0 and type(cfg.loader.h5_cache_mib) is float


def test_list_for_tuple_becomes_tuple():
    cfg = CL.from_dict(C.Config, {"data": {"grid": [32, 16, 4]}})
    assert cfg.data.grid == (32, 16, 4) and type(cfg.data.grid) is tuple


# ---------------------------------------------------------------------------------------------
# --set overrides


def test_override_int_float_str():
    cfg = C.Config()
    CL.apply_override(cfg, "data.batch_size=16")
    CL.apply_override(cfg, "loader.h5_cache_mib=0.25")
    CL.apply_override(cfg, "run.name=exp1")
    assert cfg.data.batch_size == 16 and type(cfg.data.batch_size) is int
    assert cfg.loader.h5_cache_mib == 0.25
    assert cfg.run.name == "exp1"
    CL.apply_override(cfg, "loader.h5_cache_mib=3")  # an int spelling of a float key
    assert cfg.loader.h5_cache_mib == 3.0 and type(cfg.loader.h5_cache_mib) is float
    CL.apply_override(cfg, "run.name=123")  # a str key keeps digits as text
    assert cfg.run.name == "123"
    CL.apply_override(cfg, " data.batch_size = 7")
    assert cfg.data.batch_size == 7


@pytest.mark.parametrize("spelling,value", [
    ("true", True), ("True", True), ("1", True), ("yes", True), ("on", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False),
])
def test_override_bool_spellings(spelling, value):
    cfg = C.Config()
    cfg.data.use_mask = not value
    CL.apply_override(cfg, f"data.use_mask={spelling}")
    assert cfg.data.use_mask is value


@pytest.mark.parametrize("raw", ["32,32,4", "[32,32,4]", "32, 32, 4", "[32, 32, 4]"])
def test_override_tuple(raw):
    cfg = C.Config()
    CL.apply_override(cfg, f"data.grid={raw}")
    assert cfg.data.grid == (32, 32, 4) and type(cfg.data.grid) is tuple


def test_overrides_through_load_win_over_file(tmp_path):
    p = write_cfg(tmp_path, {"data": {"batch_size": 3, "grid": [16, 16, 4]}})
    cfg = CL.load(p, overrides=["data.batch_size=5", "data.grid=64,64,8", "loader.pin_memory=off"])
    assert cfg.data.batch_size == 5 and cfg.data.grid == (64, 64, 8) and cfg.loader.pin_memory is False


@pytest.mark.parametrize("item,key,words", [
    ("data.batch_size=abc", "data.batch_size", ["int", "'abc'"]),
    ("data.batch_size=4.0", "data.batch_size", ["int", "4.0"]),
    ("data.use_mask=maybe", "data.use_mask", ["bool", "'maybe'"]),
    ("data.grid=64,x,8", "data.grid[1]", ["int", "'x'"]),
    ("loader.h5_cache_mib=lots", "loader.h5_cache_mib", ["float", "'lots'"]),
])
def test_override_wrong_type(item, key, words):
    e = refused(CL.apply_override, C.Config(), item)
    assert e.key == key
    for w in words:
        assert w in str(e)


@pytest.mark.parametrize("item", ["data=5", "synthetic=x"])
def test_override_of_section_refused(item):
    section = item.split("=")[0]
    e = refused(CL.apply_override, C.Config(), item)
    assert e.key == section and "section" in str(e)
    assert f"{section}." in str(e)  # shows how to set one of its keys


def test_override_unknown_key_suggests():
    e = refused(CL.apply_override, C.Config(), "data.bach_size=3")
    assert e.key == "data.bach_size" and "data.batch_size" in str(e)
    e = refused(CL.apply_override, C.Config(), "dat.batch_size=3")
    assert "data.batch_size" in str(e)
    e = refused(CL.apply_override, C.Config(), "data.grid.x=1")  # below a leaf
    assert "data.grid.x" in str(e)


def test_override_without_equals_refused():
    e = refused(CL.apply_override, C.Config(), "data.batch_size")
    assert "data.batch_size" in str(e) and "=" in str(e)
    e = refused(CL.load, None, ["data.batch_size=4", "oops"])
    assert "oops" in str(e)


def test_refused_override_leaves_config_unchanged():
    cfg = C.Config()
    refused(CL.apply_override, cfg, "data.batch_size=abc")
    refused(CL.apply_override, cfg, "data.grid=1,x")
    assert cfg == C.Config()


def test_overrides_are_validated_by_load():
    e = refused(CL.load, None, ["data.num_classes=10"])  # free_class 17 is now out of range
    assert e.key == "data.free_class"


# ---------------------------------------------------------------------------------------------
# section validation


@pytest.mark.parametrize("overrides,key", [
    (["data.grid=31,32,8"], "data.grid"),
    (["data.grid=32,31,8"], "data.grid"),
    (["data.grid=64,64"], "data.grid"),
    (["data.grid=64,64,0"], "data.grid"),
    (["data.free_class=18"], "data.free_class"),
    (["data.free_class=-1"], "data.free_class"),
    (["data.num_classes=1", "data.free_class=0"], "data.num_classes"),
    (["data.num_classes=257"], "data.num_classes"),
    (["data.batch_size=0"], "data.batch_size"),
    (["data.past=0"], "data.past"),
    (["data.stride=0"], "data.stride"),
    (["loader.num_workers=-1"], "loader.num_workers"),
    (["loader.h5_cache_mib=-1"], "loader.h5_cache_mib"),
    (["data.val_split=train"], "data.val_split"),
    (["synthetic.format=zarr"], "synthetic.format"),
    (["synthetic.compression=zstd"], "synthetic.compression"),
    (["synthetic.val_scenes=0"], "synthetic.val_scenes"),
    (["synthetic.frames=1"], "synthetic.frames"),
    (["run.name=a/b"], "run.name"),
    (["run.name="], "run.name"),
])
def test_section_validation_names_full_key(overrides, key):
    e = refused(CL.load, None, overrides)
    assert e.key == key
    assert f"'{key}'" in str(e)


def test_section_validation_from_file(tmp_path):
    p = write_cfg(tmp_path, {"data": {"free_class": 18}})
    e = refused(CL.load, p)
    assert e.key == "data.free_class" and "18" in str(e)


def test_validation_messages_say_what_is_allowed():
    e = refused(CL.load, None, ["synthetic.format=zarr"])
    assert "'zarr'" in str(e) and "hdf5" in str(e) and "memmap" in str(e)
    e = refused(CL.load, None, ["data.grid=30,32,8", "tokenizer.widths=16,32,64"])
    assert e.key == "data.grid" and "divisible by 4" in str(e) and "tokenizer.widths" in str(e)
    assert CL.load(None, ["data.grid=30,32,8"]).tokenizer.downsample == 2  # the demo's 2 levels
    e = refused(CL.load, None, ["data.grid=31,32,8"])
    assert e.key == "data.grid" and "divisible by 2" in str(e)


def test_partial_section_in_a_file_keeps_the_demo_defaults(tmp_path):
    """A section a file sets in part starts from Config's defaults for it (the demo's stages and
    tokenizer), not from the section class's own: the same keys in a file and by --set agree."""
    p = write_cfg(tmp_path, {"world_stage": {"eval_every": 7}, "tokenizer": {"code_dim": 16}})
    from_file = CL.load(p)
    assert from_file == CL.load(None, ["world_stage.eval_every=7", "tokenizer.code_dim=16"])
    assert from_file.world_stage.epochs == C.Config().world_stage.epochs != C.StageConfig().epochs
    assert from_file.tokenizer.lovasz_weight == C.Config().tokenizer.lovasz_weight == 0.0


@pytest.mark.parametrize("overrides", [["synthetic.frames=10"], ["data.stride=4"],
                                       ["data.past=30", "data.future=11"]])
def test_window_longer_than_synthetic_scenes_refused(overrides):
    e = refused(CL.load, None, overrides)
    assert e.key == "data.past"
    assert "synthetic.frames" in str(e)


def test_window_fits_synthetic_scenes_exactly():
    cfg = CL.load(None, ["synthetic.frames=11"])  # default window 5 + 6 = 11 frames
    assert cfg.data.span == cfg.synthetic.frames == 11


def test_window_check_skipped_with_own_data_root():
    cfg = CL.load(None, ["synthetic.frames=10", "data.root=/some/data"])
    assert cfg.data.root == "/some/data"


# ---------------------------------------------------------------------------------------------
# load errors


def test_load_missing_file_names_it(tmp_path):
    p = tmp_path / "nope.json"
    e = refused(CL.load, p)
    assert str(p) in str(e) and "not exist" in str(e)


def test_load_invalid_json_names_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"data": {"batch_size": 4,}}')
    e = refused(CL.load, p)
    assert str(p) in str(e) and "JSON" in str(e)


def test_load_non_object_json_refused(tmp_path):
    p = write_cfg(tmp_path, [1, 2])
    e = refused(CL.load, p)
    assert str(p) in str(e) and "object" in str(e)


def test_load_directory_refused(tmp_path):
    e = refused(CL.load, tmp_path)
    assert str(tmp_path) in str(e)


# ---------------------------------------------------------------------------------------------
# non-finite numbers


@pytest.mark.parametrize("raw", ["NaN", "Infinity"])
def test_non_finite_float_refused(raw):
    e = refused(CL.load, None, [f"loader.h5_cache_mib={raw}"])
    assert e.key == "loader.h5_cache_mib"


def test_a_saved_config_without_a_later_key_keeps_what_ran_before_it(tiny, restore_signals):
    """A run saved before tokenizer.mid_attention existed had the middle attention: its config.json
    and checkpoints, read back, still describe that model (the key's class default), while a partial
    config file takes the demo's default (no attention); the run resumes and its checkpoint loads."""
    import wm.training.main as T
    from wm.checkpoint.trained import load_trained

    d = CL.to_dict(C.Config())
    del d["tokenizer"]["mid_attention"]
    assert CL.from_saved(d).tokenizer.mid_attention is True
    assert CL.from_dict(C.Config, {"tokenizer": {"widths": [8, 8]}}, base=C.Config()).tokenizer.mid_attention is False
    assert T.main(tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=1,
                            world_stage__max_steps=1)) == 0
    run = tiny.run_dir()
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["tokenizer"].pop("mid_attention") is True  # the tiny models keep the attention
    (run / "config.json").write_text(json.dumps(cfg))
    assert T.main(tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=2,
                            world_stage__max_steps=1, flags=["--allow-changed", "tokenizer_stage.max_steps"])) == 0
    assert load_trained(run).cfg.tokenizer.mid_attention is True


@pytest.mark.parametrize("name", ["occworld", "occworld_20min", "occworld_nuscenes", "demo_blocks"])
def test_presets_keep_the_tokenizers_middle_attention(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.json"
    assert CL.load(str(path), []).tokenizer.mid_attention is True  # OccWorld's tokenizer has it


@pytest.mark.parametrize("name", ["occworld", "occworld_20min", "occworld_nuscenes"])
def test_the_gpu_presets_rank_the_lovasz_errors_by_histogram(name):
    # the exact sort runs the tokenizer without its fused head and Lovasz kernels: about half the speed on a GPU
    from pathlib import Path

    from wm.config.sections import model_options

    cfg = CL.load(str(Path(__file__).resolve().parents[2] / "configs" / f"{name}.json"), [])
    assert cfg.kernels.lovasz_impl == "histogram"
    assert model_options(cfg, "tokenizer")["lovasz_impl"] == "histogram"  # what the tokenizer is built with
