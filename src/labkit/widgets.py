"""Interactive calculators for the book and the labs (ipywidgets).

    from labkit.widgets import MemoryCalculator
    MemoryCalculator()            # the last expression of a cell: the calculator shows itself

``MemoryCalculator`` draws the bytes one GPU needs, by consumer, for a model of Ψ parameters
trained with a precision recipe and an optimizer over N data-parallel GPUs under ZeRO stages
0–3, against the memory of one GPU (80 GB).  Its arithmetic is ``labkit.memory_model``; its
defaults reproduce the book's example: Ψ = 100B, mixed-precision Adam, 1.6 TB of static state,
and with ZeRO-1 on 64 GPUs 12Ψ/64 ≈ 19 GB of optimizer state on each.

In the built book the calculator shows its starting state (a static page runs no Python); run
the page as a notebook, or the lab on Colab, to move it.
"""
from __future__ import annotations

import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import memory_model
from labkit.plot import stacked_bars

GB = 10**9

DEFAULTS = dict(n_params=100e9, recipe="mixed", optimizer="adam", zero_stage=1, world_size=64,
                n_layer=80, hidden=10240, n_head=80, batch_size=1, seq_len=2048,
                grad_buffer="none", vocab_size=50257, fp32_logits=False)
"""The book's example: 100B parameters (12·80·10240² ≈ 100.7B), GPT-3-like shape, GPT-2's
vocabulary; no fp32 gradient buffer and 16-bit logits until you switch them on."""

STAGE_NAMES = {0: "no ZeRO", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _int_box(value: int, description: str, maximum: int = 10**7) -> widgets.BoundedIntText:
    return widgets.BoundedIntText(value=value, min=1, max=maximum, description=description,
                                  style={"description_width": "9em"},
                                  layout=widgets.Layout(width="17em"))


class MemoryCalculator(widgets.VBox):
    """Bytes per GPU by consumer under ZeRO 0–3, for a model, a recipe and a cluster.

    Args (keywords, defaults in ``DEFAULTS``): n_params (Ψ), recipe (``memory_model.RECIPES``),
    optimizer (``memory_model.OPTIMIZERS``), zero_stage (0–3), world_size (N), n_layer,
    hidden, n_head, batch_size (micro-batch per GPU), seq_len; gpu_bytes (80 GB).
    Attributes: ``controls`` (name → widget), ``summary`` (HTML), ``chart`` (Output),
    ``result`` (bytes by consumer of the selected stage, after each redraw).
    """

    def __init__(self, gpu_bytes: float = 80 * GB, **values):
        if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) \
                or not 0 < gpu_bytes < float("inf"):
            raise ValueError(f"gpu_bytes must be a positive, finite number, got {gpu_bytes!r}")
        unknown = set(values) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}; allowed: {list(DEFAULTS)}")
        v = {**DEFAULTS, **values}
        memory_model.per_gpu_bytes(**v)  # bad settings fail here, with the argument's name
        self.gpu_bytes = gpu_bytes
        wide = {"description_width": "9em"}
        self.controls = {
            "n_params": widgets.FloatLogSlider(
                value=v["n_params"], base=10, min=6, max=13, step=0.05, description="Ψ (params)",
                readout_format=".3s", style=wide, layout=widgets.Layout(width="34em")),
            "recipe": widgets.Dropdown(
                options=[(r.label, name) for name, r in memory_model.RECIPES.items()],
                value=v["recipe"], description="precision", style=wide,
                layout=widgets.Layout(width="34em")),
            "optimizer": widgets.Dropdown(
                options=[(label, name) for name, label in memory_model.OPTIMIZERS.items()],
                value=v["optimizer"], description="optimizer", style=wide,
                layout=widgets.Layout(width="34em")),
            "grad_buffer": widgets.Dropdown(
                options=[(label, name) for name, label in memory_model.GRAD_BUFFERS.items()],
                value=v["grad_buffer"], description="gradients", style=wide,
                layout=widgets.Layout(width="34em")),
            "fp32_logits": widgets.Checkbox(
                value=v["fp32_logits"], description="fp32 logits (4·s·b·V bytes)", style=wide),
            "zero_stage": widgets.ToggleButtons(
                options=[(STAGE_NAMES[s], s) for s in memory_model.ZERO_STAGES],
                value=v["zero_stage"], description="ZeRO stage", style=wide),
            "world_size": _int_box(v["world_size"], "GPUs (N)"),
            "n_layer": _int_box(v["n_layer"], "layers (L)"),
            "hidden": _int_box(v["hidden"], "hidden (h)"),
            "n_head": _int_box(v["n_head"], "heads (a)"),
            "batch_size": _int_box(v["batch_size"], "micro-batch (b)"),
            "seq_len": _int_box(v["seq_len"], "sequence (s)"),
            "vocab_size": _int_box(v["vocab_size"], "vocabulary (V)"),
        }
        self.summary = widgets.HTML()
        self.chart = widgets.Output()
        self.result: dict[str, float] = {}
        shape = widgets.GridBox(
            [self.controls[k] for k in ("world_size", "n_layer", "hidden", "n_head",
                                        "batch_size", "seq_len", "vocab_size")],
            layout=widgets.Layout(grid_template_columns="repeat(2, 18em)"))
        left = widgets.VBox([self.controls[k] for k in
                             ("n_params", "recipe", "optimizer", "grad_buffer", "fp32_logits",
                              "zero_stage")] + [shape])
        super().__init__([left, self.summary, self.chart])
        for control in self.controls.values():
            control.observe(self._redraw, names="value")
        self._redraw()

    def values(self) -> dict:
        """The current settings, as keyword arguments of ``memory_model.per_gpu_bytes``."""
        return {name: control.value for name, control in self.controls.items()}

    def _redraw(self, change=None) -> None:
        v = self.values()
        self.chart.clear_output(wait=True)
        try:
            bars = {STAGE_NAMES[s]: memory_model.per_gpu_bytes(**{**v, "zero_stage": s})
                    for s in memory_model.ZERO_STAGES}
        except ValueError as error:
            self.result = {}
            self.summary.value = f"<b style='color:#C44E52'>{html.escape(str(error))}</b>"
            return
        self.result = bars[STAGE_NAMES[v["zero_stage"]]]
        self.summary.value = self._summary_html(v)
        with self.chart:
            fig = stacked_bars(bars, unit="GB", limit=self.gpu_bytes,
                               limit_label=f"one GPU: {self.gpu_bytes / GB:.0f} GB",
                               title=f"bytes per GPU, N = {v['world_size']} data-parallel GPUs")
            ax = fig.axes[0]
            for label in ax.get_xticklabels():
                if label.get_text() == STAGE_NAMES[v["zero_stage"]]:
                    label.set_fontweight("bold")
            display(fig)
            plt.close(fig)

    def _summary_html(self, v: dict) -> str:
        per = memory_model.bytes_per_parameter(v["recipe"], v["optimizer"], v["grad_buffer"])
        static_total = v["n_params"] * sum(per.values())
        rows = "".join(
            f"<tr><td>{c}</td><td style='text-align:right'>{self.result[c] / GB:,.2f} GB</td></tr>"
            for c in memory_model.CONSUMERS)
        total = sum(self.result.values())
        fits = total <= self.gpu_bytes
        verdict = ("fits" if fits else "does not fit") + f" in {self.gpu_bytes / GB:.0f} GB"
        return (
            f"<p>Static state of the whole model: {sum(per.values()):g} bytes per parameter × "
            f"Ψ = <b>{static_total / 1e12:,.3g} TB</b> "
            f"({static_total / self.gpu_bytes:,.1f} GPUs' worth before any activation).</p>"
            f"<p>On each of the {v['world_size']} GPUs with {STAGE_NAMES[v['zero_stage']]}:</p>"
            f"<table>{rows}<tr><td><b>total</b></td><td style='text-align:right'><b>"
            f"{total / GB:,.2f} GB</b></td></tr></table>"
            f"<p style='color:{'#55A868' if fits else '#C44E52'}'><b>{verdict}</b></p>")
