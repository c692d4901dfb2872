"""Evaluation at other frame rates (wm/evaluate.py): horizons default to what the data's rate and the
windows reach (and the report says which and why), another stride than training is refused with
the value to use, and the per-class table says its columns are averages."""

import json
import re
import shutil

import pytest

import wm.evaluate as E
import wm.train as T
from wm.errors import WMError


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


@pytest.fixture(scope="module")
def ev(trained_tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("evr")
    shutil.copytree(trained_tiny.run_dir(), base / "runs" / "r")

    def args(*flags, **over):
        return trained_tiny.args(train__stages="tokenizer,world", run__out_dir=str(base / "runs"),
                                 **over) + ["--eval-only", *flags]

    return args


def test_eval_without_horizons_uses_what_the_windows_reach_and_says_so(ev, capsys, tmp_path):
    out = tmp_path / "r.json"
    assert T.main(ev("--json", str(out))) == 0  # 2 future frames at 2 Hz: OccWorld's 2 s, 3 s are out of reach
    printed = capsys.readouterr().out
    w = json.loads(out.read_text())["world"]
    assert w["horizons"] == ["0.5s", "1s"] and w["steps"] == [0, 1]
    assert w["horizons_why"].startswith("the default for these windows (2 future frames at 2 Hz, stride 1, reach 1 s)")
    assert "  horizons 0.5s, 1s: the default for these windows" in printed
    # the per-class columns say they are averages, and over which horizons
    assert re.search(r"per-class IoU +recon +forecast avg +copy-last avg", printed), printed
    assert "(forecast avg, copy-last avg: the mean over 0.5s, 1s;" in printed
    # asked horizons are reported as asked
    assert T.main(ev("--horizons", "1", "--json", str(out))) == 0
    assert json.loads(out.read_text())["world"]["horizons_why"] == "--horizons"


def test_eval_at_another_stride_than_training_is_refused_with_the_value(ev, capsys):
    with pytest.raises(WMError, match=r"was trained with data\.stride=1 \(one forecast step = 0\.5 s at 2 Hz\) "
                                      r"but the config has data\.stride=2; evaluate with --set data\.stride=1"):
        T.main(ev(data__stride=2))
