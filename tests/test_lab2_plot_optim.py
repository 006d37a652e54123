"""Lab 2's figures (labkit.plot_optim): each draws, and refuses bad input naming it. Not graded."""
from __future__ import annotations

import pytest


def test_plot_optim_figures_draw_and_refuse_bad_input():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit import plot_optim

    figs = [
        plot_optim.quantization_errors([64, 256], {"linear": [0.1, 0.2]}, {"linear": [1.0, 2.0]}),
        plot_optim.loss_curves({"Adam": [3.0, 2.0]}, ylim=(0, 4)),
        plot_optim.shard_deviation({2: {"your ZeRO1": [8, 8], "ZeroRedundancyOptimizer": [6, 10]}}, {2: 8}),
        plot_optim.offload_events([("grad to host", "lm_head"), ("backward starts", "h.1"),
                                   ("grad to host", "h.1.mlp.c_fc.weight")]),
        plot_optim.came_vs_adafactor({"Adam": [3.0, 2.0], "CAME": [3.0, 1.9]}, {"Adam": 80, "CAME": 40}, 10),
    ]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    for f in figs:
        plt.close(f)
    for call, word in [
        (lambda: plot_optim.quantization_errors([64], {}, {}), "errors"),
        (lambda: plot_optim.loss_curves({}), "curves"),
        (lambda: plot_optim.shard_deviation({2: {}}, {4: 8}), "world sizes"),
        (lambda: plot_optim.offload_events([]), "events"),
        (lambda: plot_optim.came_vs_adafactor({"A": [1.0]}, {"B": 1}, 10), "names"),
        (lambda: plot_optim.came_vs_adafactor({"A": [1.0]}, {"A": 1}, 0), "psi"),
    ]:
        with pytest.raises(ValueError, match=word):
            call()
