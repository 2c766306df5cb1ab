"""Settings and limits (speculation/settings.py): the `speculation:` block's validators."""
from __future__ import annotations

import pytest


def test_restart_and_bridge_chains_are_one_choice():
    from speculation.settings import SpeculationSettings

    with pytest.raises(ValueError, match="set one of them to 0"):
        SpeculationSettings(bridge_depth=2, restart_depth=1)
    assert SpeculationSettings(bridge_depth=2, restart_depth=0).bridge_depth == 2
