"""Horizons planned for a data set (wm/horizons.py): one window setting that reaches every horizon,
or one line saying which horizon cannot be reached and why. Numbers worked by hand below."""

import numpy as np
import pytest

from wm.errors import WMError
from wm.horizons import describe, plan

# four drives of 24-30 frames at 10 Hz, one of them the validation drive
TRAIN, VAL = np.array([24, 26, 30]), np.array([27])


def test_plan_takes_the_step_nearest_half_a_second_that_fits_every_split():
    # 1 s, 2 s = 10, 20 frames ahead; strides dividing both: 1, 2, 5, 10; with 5 past frames a window spans
    # 4 x stride + 21 frames: 41 (stride 5) and 61 (10) fit no scene, 29 (stride 2) no val scene, 25 (stride 1) fits
    p = plan((1, 2), 10, {"train": TRAIN, "val": VAL}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride, p.max_frames, p.steps) == (5, 20, 1, 24, [10, 20])
    assert p.windows == {"train": 0 + 2 + 6, "val": 3} and p.span == 25
    # a 29-frame val drive takes stride 2 (0.2 s steps): 10 future steps, max_frames 16 is enough
    p = plan((1, 2), 10, {"train": TRAIN, "val": np.array([29])}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride, p.max_frames, p.steps) == (5, 10, 2, 16, [5, 10])
    assert p.windows == {"train": 2, "val": 1}
    # OccWorld's 2 Hz protocol on nuScenes-length scenes: stride 1, the config's 5 past + 6 future
    p = plan((1, 2, 3), 2, {"train": np.array([40]), "val": np.array([40])}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride, p.max_frames, p.steps) == (5, 6, 1, 16, [2, 4, 6])
    # at 10 Hz with 51-frame scenes: stride 5, OccWorld's windows again
    p = plan((1, 2, 3), 10, {"train": np.array([51]), "val": np.array([51])}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride) == (5, 6, 5)


def test_plan_lowers_the_past_only_when_no_stride_fits():
    p = plan((1, 2), 10, {"train": TRAIN, "val": np.array([24])}, past=5, max_frames=16)
    # 5 past frames need 25 frames even at stride 1; 4 past frames at stride 1 span 24
    assert (p.past, p.future, p.stride, p.max_frames) == (4, 20, 1, 23)
    text = describe(p, (1, 2), 10, 5, "data/airside")
    assert "data.past=4 data.future=20 data.stride=1 world.max_frames=23" in text
    assert "one step = 0.1 s (1 frame); 1 s = t+10, 2 s = t+20; a window spans 24 frames: 11 train windows, " \
           "1 val window" in text
    assert "data.past lowered from 5" in text
    assert "--set data.past=4 --set data.future=20 --set data.stride=1 --set world.max_frames=23 " \
           "--set data.horizons_s=1,2" in text


def test_an_unreachable_horizon_is_one_line_saying_why():
    with pytest.raises(WMError) as e:
        plan((1, 2, 3), 10, {"train": TRAIN, "val": VAL}, past=5, max_frames=16)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("horizon 3 s cannot be reached on this data set: at 10 Hz 3 s is 30 frames ahead, so a window "
                   "needs at least 31 frames (1 past frame + 30), but the longest train scene has 30; horizons up "
                   "to 2.9 s fit (or record longer scenes)")
    with pytest.raises(WMError, match=r"horizon 0\.25 s is not a whole number of frames at 2 Hz \(a frame every "
                                      r"0\.5 s\)"):
        plan((0.25, 1), 2, {"train": np.array([40]), "val": np.array([40])}, past=5, max_frames=16)
