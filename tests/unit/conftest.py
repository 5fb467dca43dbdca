"""The fake worker group's fixtures (tests/unit/fake_group.py), for every unit test that steps the controller."""

from tests.unit.fake_group import controller, event_times, fake_cluster, make_controller

__all__ = ["controller", "event_times", "fake_cluster", "make_controller"]
