"""The one rule for which revision judges a revision's traces, fed from the settings, a
saved state and the references topic."""

from __future__ import annotations

import pytest

from monitor.core.pins import Pins

PAIR = ("m", "canary")


def test_settings_pins_are_the_weakest_and_a_saved_pin_outlives_the_setting():
    saved = Pins({PAIR: "stable"}).to_list()
    assert Pins().judge_revision(*PAIR) == "canary"
    later = Pins()  # a later run without the setting
    later.merge(saved)
    assert later.judge_revision(*PAIR) == "stable" and later.in_force() == {PAIR: "stable"}
    overridden = Pins({PAIR: "other"})
    overridden.merge(saved)  # any saved decision overrides a pin from the settings
    assert overridden.judge_revision(*PAIR) == "stable"


def test_topic_decisions_apply_in_time_order_and_a_promotion_unpins():
    pins = Pins({PAIR: "stable"})
    assert pins.decide("m", "canary", None, at=10.0)  # promotion beats the settings
    assert pins.judge_revision(*PAIR) == "canary" and pins.in_force() == {}
    assert not pins.decide("m", "canary", "stable", at=5.0)  # older than the one held
    assert pins.decide("m", "canary", "stable", at=11.0)
    assert pins.judge_revision(*PAIR) == "stable" and pins.pinned_to("m", "stable") == {"stable", "canary"}
    saved = Pins()
    saved.merge([{"model": "m", "revision": "canary", "pinned_to": None, "source": "promote", "at": 12.0}])
    pins.merge(saved.to_list())
    assert pins.judge_revision(*PAIR) == "canary"


def test_a_revision_is_never_pinned_to_itself_and_changes_are_counted():
    pins = Pins()
    with pytest.raises(ValueError, match="promote it instead"):
        pins.pin("m", "r", "r", 1.0)
    pins.pin("m", "r", "s", 1.0)
    version = pins.version
    pins.pin("m", "r", "s", 1.0)  # the same decision again changes nothing
    assert pins.version == version
