"""Horizons planned for a data set (wm/data/horizons.py): one window setting that reaches every horizon,
or one line saying which horizon cannot be reached and why. Numbers worked by hand below."""

import numpy as np
import pytest

from wm.data.horizons import describe, plan
from wm.utils.errors import WMError

# four drives of 24-30 frames at 10 Hz, one of them the validation drive
TRAIN, VAL = np.array([24, 26, 30]), np.array([27])


def test_plan_takes_the_step_nearest_half_a_second_that_fits_every_split():
    # 1 s, 2 s = 10, 20 frames ahead; strides dividing both: 1, 2, 5, 10. A window spans
    # (past - 1) x stride + 21 frames and must fit the 27-frame val drive: at stride 5 (0.5 s steps) 2 past
    # frames (26), at 2: 4 (27), at 1: 5 (25), at 10: 1 (21). Stride 5 is nearest 0.5 s.
    p = plan((1, 2), 10, {"train": TRAIN, "val": VAL}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride, p.max_frames, p.steps) == (2, 4, 5, 16, [2, 4])
    assert p.windows == {"train": 0 + 1 + 5, "val": 2} and p.span == 26
    # OccWorld's 2 Hz protocol on nuScenes-length scenes: stride 1, the config's 5 past + 6 future
    p = plan((1, 2, 3), 2, {"train": np.array([40]), "val": np.array([40])}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride, p.max_frames, p.steps) == (5, 6, 1, 16, [2, 4, 6])
    # at 10 Hz with 51-frame scenes: stride 5, OccWorld's windows again
    p = plan((1, 2, 3), 10, {"train": np.array([51]), "val": np.array([51])}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride) == (5, 6, 5)
    # 2 past frames at least before the step's length: with a 22-frame val drive stride 5 holds only one
    # past frame (21 frames), stride 1 two (22): 0.1 s steps, 20 of them, max_frames raised to 21
    p = plan((1, 2), 10, {"train": TRAIN, "val": np.array([22])}, past=5, max_frames=16)
    assert (p.past, p.future, p.stride, p.max_frames, p.steps) == (2, 20, 1, 21, [10, 20])


def test_plan_keeps_the_past_where_the_scenes_hold_it():
    p = plan((1, 2), 10, {"train": np.array([60]), "val": np.array([45])}, past=5, max_frames=16)
    # stride 5: 5 past frames span 41 <= 45, OccWorld's 5 past + 4 future at 0.5 s steps
    assert (p.past, p.future, p.stride, p.max_frames) == (5, 4, 5, 16)
    p = plan((1, 2), 10, {"train": TRAIN, "val": VAL}, past=5, max_frames=16)
    text = describe(p, (1, 2), 10, 5, "data/airside")
    assert "data.past=2 data.future=4 data.stride=5 world.max_frames=16" in text
    assert "one step = 0.5 s (5 frames); 1 s = t+2, 2 s = t+4; a window spans 26 frames: 6 train windows, " \
           "2 val windows" in text
    assert "data.past lowered from 5: at this stride 5 past frames would span 41 frames" in text
    assert "--set data.past=2 --set data.future=4 --set data.stride=5 --set world.max_frames=16 " \
           "--set data.horizons_s=1,2" in text


def test_an_unreachable_horizon_is_one_line_saying_why():
    with pytest.raises(WMError) as e:
        plan((1, 2, 3), 10, {"train": TRAIN, "val": VAL}, past=5, max_frames=16)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("horizon 3 s cannot be reached on this data set: at 10 Hz 3 s is 30 frames ahead, so a window "
                   "needs at least 31 frames (1 past frame + 30), but the longest val scene has 27; horizons up "
                   "to 2.6 s fit (or record longer scenes)")
    with pytest.raises(WMError, match=r"horizon 0\.25 s is not a whole number of frames at 2 Hz \(a frame every "
                                      r"0\.5 s\)"):
        plan((0.25, 1), 2, {"train": np.array([40]), "val": np.array([40])}, past=5, max_frames=16)
