"""labkit.widgets: the memory calculator's settings are checked before a widget sees them."""
from __future__ import annotations

import pytest

from labkit import widgets


@pytest.mark.parametrize("setting, words", [
    ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
    ({"n_params": float("nan")}, r"n_params must be a finite number in \(0, inf\), got nan"),
    ({"recipe": "fp7"}, "recipe must be one of 'mixed'"),
    ({"zero_stage": 4}, "zero_stage must be one of 0, 1, 2, 3; got 4"),
    ({"checkpointing": "some"}, "checkpointing must be one of 'none', 'selective', 'full'"),
    ({"fp32_logits": 1}, "fp32_logits must be a bool"),
])
def test_calculator_settings_name_a_bad_value_before_a_widget_clamps_it(setting, words):
    """Check settings() (behind MemoryCalculator(**values)) refuses what it passed through: a
    widget box with min=1 would have clamped world_size=0 or shown NaN."""
    with pytest.raises(ValueError, match=words):
        widgets.settings(**setting)
