"""The Ray fences refuse a Ray that moved a private symbol with one line naming both versions.

python -m pytest tests/unit/test_ray_compat.py -q
"""

from __future__ import annotations

import importlib
import sys

import pytest
import ray
import ray._private.state

from orchestrator.errors import UserError
from workers import ray_compat as rank_compat


def test_the_installed_ray_has_every_symbol_the_fences_need():
    from orchestrator.driver import ray_compat

    assert rank_compat.missing_symbols(rank_compat.REQUIRED + ray_compat.REQUIRED) == []


def test_a_missing_symbol_is_one_line_naming_the_supported_and_the_found_ray(monkeypatch):
    monkeypatch.setattr(ray, "__version__", "2.61.0")
    monkeypatch.delattr(ray._private.state, "available_resources_per_node")
    # Import the driver's fence afresh, as a driver started against this Ray would.
    monkeypatch.delitem(sys.modules, "orchestrator.driver.ray_compat", raising=False)
    with pytest.raises(UserError) as caught:
        importlib.import_module("orchestrator.driver.ray_compat")
    assert str(caught.value) == (
        "meshpilot supports Ray 2.60.x, but Ray 2.61.0 is installed and lacks "
        "ray._private.state.available_resources_per_node: install ray==2.60.* (as pyproject.toml pins it)"
    )


def test_a_missing_keyword_is_named_like_a_call(monkeypatch):
    def placement_group(bundles, strategy=None):
        return None

    module = type(sys)("fake_ray_module")
    module.placement_group = placement_group
    monkeypatch.setitem(sys.modules, "fake_ray_module", module)
    assert rank_compat.missing_symbols(
        ["fake_ray_module.placement_group(_soft_target_node_id)", "fake_ray_module.placement_group(strategy)"]
    ) == ["fake_ray_module.placement_group(_soft_target_node_id)"]


def test_the_rank_fence_raises_its_own_error_outside_the_driver(monkeypatch):
    monkeypatch.setattr(ray, "__version__", "2.59.1")
    with pytest.raises(
        rank_compat.UnsupportedRay,
        match=r"^meshpilot supports Ray 2\.60\.x, but Ray 2\.59\.1 is "
        r"installed and lacks ray\._raylet\.NoSuchThing:",
    ):
        rank_compat.require(["ray._raylet.NoSuchThing"])
