"""Python's garbage collector at the same steps on every rank (wm/training/host_gc.py, ddp.gc_every): off
while a stage trains, the young generations collected every N steps, everything at validations."""

import gc
import weakref

import pytest

from wm.training.host_gc import GCPauses, StepGC


class Node:
    pass


def cycle():
    """Unreachable garbage that only the collector frees (a reference cycle), and a weak
    reference that says whether it has been."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def collections():
    """Collections by generation from now on (gc.callbacks), as a list to read later."""
    seen = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and seen.append(info["generation"]))
    return seen


@pytest.fixture
def clean_callbacks():
    before = list(gc.callbacks)
    yield
    gc.callbacks[:] = before


def test_step_collects_every_n_steps_and_full_at_validation(clean_callbacks):
    assert gc.isenabled()
    with StepGC(3) as g:
        assert not gc.isenabled()  # no automatic collection inside
        seen = collections()
        ref = cycle()
        for _ in range(5000):  # far past the automatic threshold (700 allocations): nothing runs
            cycle()
        assert seen == [] and ref() is not None
        g.step(1)
        g.step(2)
        assert seen == [] and ref() is not None
        g.step(3)  # a multiple of 3: the young generations
        assert seen == [1] and ref() is None
        g.step(4)
        g.full()  # at a validation: every generation
        assert seen == [1, 2]
    assert gc.isenabled()  # as it was before


def test_zero_leaves_the_collector_alone(clean_callbacks):
    gc.disable()
    try:
        with StepGC(0) as g:
            seen = collections()
            g.step(50)
            g.full()
            assert seen == [] and not gc.isenabled()
        assert not gc.isenabled()  # it was off and stays off
    finally:
        gc.enable()
    with StepGC(0):
        assert gc.isenabled()


def test_a_collector_that_was_off_stays_off_after(clean_callbacks):
    gc.disable()
    try:
        with StepGC(2):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pauses_count_the_time_in_the_collector(clean_callbacks):
    with GCPauses() as p:
        assert p.take() == 0.0
        junk = [cycle() for _ in range(20000)]
        gc.collect()
        first = p.take()
        assert first > 0 and p.take() == 0.0
        del junk
    n = len(gc.callbacks)
    gc.collect()
    assert len(gc.callbacks) == n and p.take() == 0.0  # its callback is gone with the block


def test_fit_collects_at_the_configured_steps_and_validations(tiny, monkeypatch):
    """train.py's loop: one StepGC per stage with ddp.gc_every, told every step (1, 2, ... in
    order) and a full collection after each validation."""
    import wm.training.loop as L
    import wm.training.main as T

    made = []

    class Recorder(StepGC):
        def __init__(self, every):
            super().__init__(every)
            self.steps, self.fulls = [], []
            made.append(self)

        def step(self, n):
            self.steps.append(n)
            super().step(n)

        def full(self):
            self.fulls.append(self.steps[-1])
            super().full()

    monkeypatch.setattr(L, "StepGC", Recorder)
    args = tiny.args(train__stages="tokenizer,world", tokenizer_stage__max_steps=4, world_stage__max_steps=3,
                     tokenizer_stage__eval_every=2, ddp__gc_every=2)
    assert T.main(args) == 0
    assert [r.every for r in made] == [2, 2]
    assert made[0].steps == [1, 2, 3, 4] and made[0].fulls == [2, 4]
    assert made[1].steps == [1, 2, 3] and made[1].fulls[-1] == 3
    assert gc.isenabled()


def test_a_negative_gc_every_is_refused():
    from wm.config.loading import load
    from wm.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=r"ddp.gc_every.*-1 must be >= 0"):
        load(None, ["ddp.gc_every=-1"])


def test_what_is_alive_at_the_start_is_frozen_and_what_training_makes_is_still_collected():
    """train.py freezes its imports: a full collection then skips them, and a cycle made afterwards
    is still freed."""
    from wm.training.host_gc import freeze_imports

    alive = Node()
    frozen = gc.get_freeze_count()
    freeze_imports()
    try:
        assert gc.get_freeze_count() > frozen and not any(o is alive for o in gc.get_objects())
        made = cycle()
        with StepGC(every=1) as g:
            g.full()
        assert made() is None
    finally:  # this worker's objects back in sight (conftest freezes anew at the next file)
        gc.unfreeze()
