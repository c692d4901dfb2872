"""Every check that can fail a run runs before the first training step of the first stage: a
world-stage window that does not fit the scenes at data.stride, a batch larger than a stage's data,
a best_metric a stage does not report. And tools/inspect_data.py names its own flags when a window
does not fit."""

import subprocess
import sys

import pytest

from wm.checkpoint.files import latest_checkpoint
import wm.training.main as T
from wm.utils.errors import WMError

from helpers import ROOT  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_signals", "one_thread")

BOTH = dict(train__stages="tokenizer,world", tokenizer_stage__max_steps=2, world_stage__max_steps=2)


def nothing_trained(tiny) -> None:
    for stage in ("tokenizer", "world"):
        folder = tiny.run_dir() / stage / "checkpoints"
        assert not folder.is_dir() or latest_checkpoint(folder) is None, f"{stage} trained before the check"


@pytest.mark.parametrize("over, words", [
    # 12-frame scenes; 2 + 2 frames at stride 4 span 13: only the world stage's windows fail
    ({"data__stride": 4}, ["world stage", "data.stride=4", "spans 13 frames", "has 12"]),
    # 18 world windows per epoch, 24 tokenizer frames: a batch of 20 fits the tokenizer only
    ({"world_stage__batch_size": 20}, ["world stage", "18 training samples", "world_stage.batch_size"]),
    ({"world_stage__grad_accum": 10}, ["world stage", "grad_accum=10"]),
    ({"world_stage__best_metric": "val/recon_iou"}, ["world_stage.best_metric", "val/recon_iou", "val/iou_t2"]),
])
def test_a_world_stage_that_cannot_run_fails_before_the_tokenizer_trains(tiny, over, words):
    with pytest.raises(WMError) as e:
        T.main(tiny.args(**BOTH, **over))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    nothing_trained(tiny)


def test_inspect_data_names_its_own_flags(tiny):
    p = subprocess.run([sys.executable, "tools/inspect_data.py", str(tiny.data), "--png", str(tiny.base / "pics"),
                        "--past", "7", "--future", "7"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # 12-frame scenes hold no 14-frame window: it draws what fits, and its note names its own flags
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("note:"))
    assert "7 past + 7 future frames at stride 1" in line and "(--past, --future, --stride choose)" in line, line
    assert "data." not in line, line
