"""The generated config reference (wm/config/reference.py, docs/CONFIG.md, train.py --help-config), one
meaning for each batch size, and the config refusals that say the value to use."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import wm.config.sections as C

from wm.config import loading as CL
from wm.config.reference import field_comments, reference, sections

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_the_generated_reference():
    assert (ROOT / "docs" / "CONFIG.md").read_text() == reference() + "\n", \
        "docs/CONFIG.md is stale: python train.py --help-config > docs/CONFIG.md"


def test_every_key_of_every_section_is_listed_with_type_default_and_meaning():
    cfg = C.Config()
    listed = {f"{sec}.{k}": (t, d, m) for sec, rows in sections() for k, t, d, m in rows}
    keys = [k for k in CL._all_keys(C.Config) if "." in k]
    assert sorted(listed) == sorted(keys)
    for key, (t, d, m) in listed.items():
        sec, k = key.split(".")
        assert m, f"{key} has no meaning: write a comment on its line in its dataclass"
        assert json.loads(d) == CL.to_dict(cfg)[sec][k]
        section = type(getattr(cfg, sec))
        assert t == CL._type_name(CL._hints(section)[CL._attr(section, k)])
    assert listed["tokenizer_stage.batch_size"][1] == "0" and listed["data.batch_size"][1] == "8"
    assert listed["world_stage.batch_size"][1] == "4"  # the demo world stage's own (small steps)


def test_meanings_come_from_the_comment_on_the_fields_line():
    @dataclasses.dataclass
    class Demo:
        a: int = 1  # the first
        # a comment above is not b's meaning
        b: str = "#not a comment"
        c: float = 2.0  # third: with # inside

    assert field_comments(Demo) == {"a": "the first", "c": "third: with # inside"}


def test_help_config_prints_it():
    p = subprocess.run([sys.executable, "train.py", "--help-config"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout == reference() + "\n"
    assert "| `data.stride` | int | `1` |" in p.stdout


def test_stages_inherit_data_batch_size_unless_they_set_their_own():
    cfg = CL.load(None, ["data.batch_size=3", "world_stage.batch_size=0"])
    from wm.training.batching import stage_batch

    def batch(cfg, stage):
        b = stage_batch(cfg, stage)
        return b.micro, b.words.split(" from ")[1].split(" ")[0]

    assert batch(cfg, "tokenizer") == (3, "data.batch_size")
    assert batch(cfg, "world") == (3, "data.batch_size")
    cfg = CL.load(None, ["data.batch_size=3", "world_stage.batch_size=5"])
    assert batch(cfg, "world") == (5, "world_stage.batch_size")
    assert batch(CL.load(None), "world") == (4, "world_stage.batch_size")  # the demo's own
    # a run folder written when the tokenizer stage had its own default of 8 is the same config
    old = CL.to_dict(C.Config())
    old["tokenizer_stage"]["batch_size"] = 8
    assert C.resolve_batch_sizes(old) == C.resolve_batch_sizes(CL.to_dict(C.Config()))


def test_the_log_says_where_the_batch_size_came_from(tiny, restore_signals, capsys):
    import wm.training.main as T

    args = tiny.args(tokenizer_stage__batch_size=0, data__batch_size=3, tokenizer_stage__max_steps=1)
    assert T.main(args) == 0
    out = capsys.readouterr().out
    assert "steps of 3 samples (batch 3 from data.batch_size [tokenizer_stage.batch_size is 0] x grad_accum 1 " \
           "x 1 rank)" in out, out


@pytest.mark.parametrize("over, words", [
    (["data.future=30"], "set --set world.max_frames=34"),
    (["data.grid=99,64,10"], "tools/convert_frames.py --crop or --pad"),
])
def test_refusals_say_the_value_to_use(over, words):
    with pytest.raises(C.ConfigError) as e:
        CL.load(None, over + ["synthetic.frames=60"])
    assert words in str(e.value)
