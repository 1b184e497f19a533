"""The service's garbage collector settings (monitor.garbage)."""

from __future__ import annotations

import gc

from monitor.garbage import YOUNG_THRESHOLD, collect_less


def test_collect_less_freezes_what_exists_and_collects_the_young_less_often():
    before = gc.get_threshold()
    try:
        survivor: list[object] = [[]]
        assert any(o is survivor for o in gc.get_objects())
        frozen = collect_less()
        assert frozen == gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        assert not any(o is survivor for o in gc.get_objects())  # out of every generation's reach
        cycle: list[object] = []
        cycle.append(cycle)
        assert any(o is cycle for o in gc.get_objects())  # what is made later is collected as before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
