"""The toolkit's figures, page calculator and state counter under inputs their tests do not try.

Each bad input is a ValueError naming the argument (it was an AttributeError, an unpacking error,
a figure drawn from NaN, or a 10,000-rank grid that never finished drawing).
"""
from __future__ import annotations

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labkit import optimizer_states, page_calculator, plot, plot_activations, plot_optim  # noqa: E402


@pytest.mark.parametrize("call, words", [
    (lambda: plot.stacked_bars({"a": {"parameters": float("nan")}}), "finite number >= 0, got nan"),
    (lambda: plot.stacked_bars({"a": {"parameters": float("inf")}}), "finite number >= 0, got inf"),
    (lambda: plot_optim.zero1_partition([3, 4], 2), r"sizes must be .* pairs, got \[3, 4\]"),
    (lambda: plot_optim.zero1_partition([("w", 2.5)], 2), r"pairs, got \[\('w', 2.5\)\]"),
    (lambda: plot_optim.code_entries(None), "codes must be a non-empty dict"),
    (lambda: plot_optim.code_entries({"zeros": torch.zeros(256)}), "with positive entries"),
    (lambda: plot_optim.loss_curves({"a": None}), r"curves must be .* of numbers, got \{'a': 'NoneType'\}"),
    (lambda: plot_activations.ring_schedule_grid(10**4), r"n_ranks must be an int in \[2, 32\]"),
    (lambda: plot_activations.curves_side_by_side([1, 2], {"p": {"a": [1, 2]}}, xlabel="x"),
     r"panels must map .* \(ylabel, \{label: ys\}\), got \{'p': 'dict'\}"),
    (lambda: page_calculator.tables(0), "gpu_bytes must be a positive, finite number, got 0"),
    (lambda: page_calculator.tables(float("nan")), "gpu_bytes must be a positive, finite number"),
    (lambda: page_calculator.tables("80e9"), "gpu_bytes must be a positive, finite number"),
])
def test_bad_figure_and_page_input_is_named(call, words):
    with pytest.raises(ValueError, match=words):
        call()


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
    from labkit import widgets

    with pytest.raises(ValueError, match=words):
        widgets.settings(**setting)


def test_loss_curves_take_numpy_values_and_a_diverged_nan():
    """Check what the lab passes still draws: numpy floats, and NaN for a step that diverged."""
    import numpy as np

    assert plot_optim.loss_curves({"Adam": [float(x) for x in np.linspace(3, 1, 5)], "bad": [3.0, float("nan")]})


def test_state_bytes_counts_each_meta_storage_once():
    """Check two meta tensors of 4 float32 are 32 bytes, and a view of one adds nothing: every
    meta storage has address 0, so they were counted as one (16 bytes)."""
    m = torch.empty(4, device="meta")

    class Optimizer:
        state = {"p": {"exp_avg": m, "exp_avg_sq": torch.empty(4, device="meta"), "view": m[:2]}}

    assert optimizer_states.state_bytes(Optimizer()) == 32
