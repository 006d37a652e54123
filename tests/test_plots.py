"""The toolkit's figures (labkit.plot, plot_optim, plot_activations): each bad input is a
ValueError naming the argument (it was an AttributeError, an unpacking error, a figure drawn from
NaN, or a 10,000-rank grid that never finished drawing), and what the labs pass still draws."""
from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

from labkit import plot, plot_activations, plot_optim  # noqa: E402


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
])
def test_bad_figure_input_is_named(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_loss_curves_take_numpy_values_and_a_diverged_nan():
    """Check what the lab passes still draws: numpy floats, and NaN for a step that diverged."""
    assert plot_optim.loss_curves({"Adam": [float(x) for x in np.linspace(3, 1, 5)], "bad": [3.0, float("nan")]})


@pytest.mark.parametrize("timeline", [None, [[("F", 0), ("B", 0)]]], ids=["None", "a schedule"])
def test_gantt_names_what_is_not_a_timeline(timeline):
    """gantt(schedule) instead of gantt(simulate(schedule)) was "'list' object has no attribute
    'spans'"; now a TypeError naming ``timeline`` and what to pass."""
    from labkit.plot_pipeline import gantt

    with pytest.raises(TypeError, match="timeline must be what simulate"):
        gantt(timeline)
