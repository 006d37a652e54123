"""Interactive calculators for the book and the labs (ipywidgets).

    from labkit.widgets import MemoryCalculator
    MemoryCalculator()            # the last expression of a cell: the calculator shows itself

``MemoryCalculator`` draws the bytes one GPU needs, by consumer, for a model of Ψ parameters
trained with a precision recipe and an optimizer on N = D × T × P × C GPUs (data, tensor,
pipeline and context parallelism) under ZeRO stages 0–3, with sequence parallelism,
activation recomputation (none, selective, full) and m micro-batches, against the memory of one
GPU (80 GB).  Its defaults reproduce the book's example: Ψ = 100B, mixed-precision Adam, 1.6 TB
of static state, and with ZeRO-1 on D = 64 GPUs 12Ψ/64 ≈ 19 GB of optimizer state on each.

Where the arithmetic lives (``calculator_bytes``):

* the configuration (D, T, P, C, sequence parallelism, recomputation, micro-batches) is
  ``labkit.lab6.parallel_memory.per_gpu_bytes`` — Lab 6's exercise 6.4.  In the course's own
  edition that is the reference solution; in a student's it is the student's code, so the
  calculator shows the student's own model once 6.4 is written.  Until then (the stub raises
  ``NotImplementedError``) the calculator still computes every data-parallel configuration
  (T = P = C = 1, no recomputation: then ``parallel_memory`` equals ``labkit.memory_model``, which
  exercise 6.4's graders check) and says, for the others, that they need exercise 6.4.  A
  second Python copy of 6.4's answer inside the package would hand that answer to the student.
* the framework options of Chapter 1 come on top: a persistent fp32 gradient buffer
  (``grad_buffer``, sharded with the gradients) and fp32 logits, 4·(s/C)·b·V/T bytes (the
  output layer is vocabulary-parallel over T; with P > 1 the logits are on the last stage,
  not on the first stage whose bytes the bars show, and are not added).

The book's in-browser twin, ``labkit.page_calculator``, needs no kernel and so carries its own
JavaScript copy of the formulas; ``tests/test_page_calculator.py`` checks it against
``calculator_bytes`` on many combinations.  In the built book this widget shows its starting
state (a static page runs no Python); run the page as a notebook, or the lab on Colab, to move it.
"""
from __future__ import annotations

import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

from labkit import memory_model, validate
from labkit.plot import stacked_bars

GB = 10**9

CHECKPOINTING = ("none", "selective", "full")
"""Activation recomputation, as ``labkit.lab6.parallel_memory.CHECKPOINTING``."""

DEFAULTS = dict(n_params=100e9, recipe="mixed", optimizer="adam", zero_stage=1, world_size=64,
                dp=64, tp=1, pp=1, cp=1, sequence_parallel=False, checkpointing="none",
                n_micro=1, n_layer=80, hidden=10240, n_head=80, batch_size=1, seq_len=2048,
                grad_buffer="none", vocab_size=50257, fp32_logits=False)
"""The book's example: 100B parameters (12·80·10240² ≈ 100.7B), GPT-3-like shape, GPT-2's
vocabulary, data parallelism only (D = N = 64); no fp32 gradient buffer and 16-bit logits until
you switch them on."""

STAGE_NAMES = {0: "no ZeRO", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

LAYOUT = ("dp", "tp", "pp", "cp")
"""The four parallel sizes D, T, P, C; their product must be ``world_size``."""

NEEDS_6_4 = ("T, P, C > 1 and recomputation are computed by labkit.lab6.parallel_memory, exercise 6.4 "
             "(labs/06_system.ipynb), which is not written yet: set T = P = C = 1 and no "
             "recomputation, or write 6.4")


def settings(**values) -> dict:
    """The calculator's settings: ``DEFAULTS`` updated with ``values``.

    Given ``world_size`` without ``dp``, D fills the GPUs: D = world_size / (T·P·C) when that
    divides (otherwise D stays and the product check of ``calculator_bytes`` says why).
    Raises ``ValueError`` naming an unknown setting.
    """
    unknown = set(values) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; allowed: {list(DEFAULTS)}")
    v = {**DEFAULTS, **values}
    _check_settings(v)
    if "world_size" in values and "dp" not in values:
        rest = v["tp"] * v["pp"] * v["cp"] if all(
            isinstance(v[k], int) and v[k] > 0 for k in ("tp", "pp", "cp")) else 0
        if rest and isinstance(v["world_size"], int) and v["world_size"] % rest == 0:
            v["dp"] = v["world_size"] // rest
    return v


def _check_settings(v: dict) -> None:
    """Each setting of the right kind, named when not (a widget clamps or refuses it later)."""
    validate.positive_number("n_params", v["n_params"])
    for name in ("world_size", "dp", "tp", "pp", "cp", "n_micro", "n_layer", "hidden", "n_head",
                 "batch_size", "seq_len", "vocab_size"):
        validate.positive_int(name, v[name])
    validate.one_of("recipe", v["recipe"], memory_model.RECIPES)
    validate.one_of("optimizer", v["optimizer"], memory_model.OPTIMIZERS)
    validate.one_of("grad_buffer", v["grad_buffer"], memory_model.GRAD_BUFFERS)
    validate.one_of("zero_stage", v["zero_stage"], memory_model.ZERO_STAGES)
    validate.one_of("checkpointing", v["checkpointing"], CHECKPOINTING)
    for name in ("sequence_parallel", "fp32_logits"):
        if not isinstance(v[name], bool):
            raise ValueError(f"{name} must be a bool (True or False), got {v[name]!r}")


def calculator_bytes(*, n_params, recipe, optimizer, zero_stage, world_size, dp, tp, pp, cp,
                     sequence_parallel, checkpointing, n_micro, n_layer, hidden, n_head,
                     batch_size, seq_len, grad_buffer, vocab_size, fp32_logits) -> dict[str, float]:
    """Bytes of the four consumers (``memory_model.CONSUMERS``) on the busiest GPU.

    ``labkit.lab6.parallel_memory.per_gpu_bytes`` for the configuration (``batch_size`` is its
    micro-batch), plus the gradient buffer and the fp32 logits as the module docstring says.
    Raises ``ValueError`` naming the setting for bad input (a layout whose product is not
    ``world_size``, T not dividing the heads, ...), and ``NotImplementedError`` (saying so)
    for a configuration beyond data parallelism while exercise 6.4 is a stub.
    """
    from labkit.lab6 import parallel_memory

    validate.positive_number("n_params", n_params)
    for name, flag in (("sequence_parallel", sequence_parallel), ("fp32_logits", fp32_logits)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool (True or False), got {flag!r}")
    per = memory_model.bytes_per_parameter(recipe, optimizer, grad_buffer)  # names the bad one
    memory_model.logits_bytes(seq_len, batch_size, vocab_size)  # checks vocab_size
    kwargs = dict(world_size=world_size, dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero_stage,
                  recipe=recipe, optimizer=optimizer, n_layer=n_layer, hidden=hidden,
                  n_head=n_head, seq_len=seq_len, micro_batch=batch_size, n_micro=n_micro,
                  checkpointing=checkpointing, sequence_parallel=sequence_parallel)
    try:
        out = parallel_memory.per_gpu_bytes(n_params, **kwargs)
    except NotImplementedError:
        if (tp, pp, cp, checkpointing) != (1, 1, 1, "none"):
            raise NotImplementedError(NEEDS_6_4) from None
        # data parallelism only: labkit.memory_model computes the same (6.4's graders check it)
        out = memory_model.per_gpu_bytes(n_params, recipe, optimizer, zero_stage, dp,
                                         n_layer=n_layer, hidden=hidden, n_head=n_head,
                                         batch_size=batch_size, seq_len=seq_len)
    plain = memory_model.bytes_per_parameter(recipe, optimizer)["gradients"]
    if per["gradients"] != plain:  # the buffer is a gradient: sharded as the gradients are
        out["gradients"] = out["gradients"] / plain * per["gradients"]
    if fp32_logits and pp == 1:
        out["activations"] += 4 * (seq_len // cp) * batch_size * vocab_size / tp
    return {c: out[c] for c in memory_model.CONSUMERS}


def _int_box(value: int, description: str, maximum: int = 10**7) -> widgets.BoundedIntText:
    return widgets.BoundedIntText(value=value, min=1, max=maximum, description=description,
                                  style={"description_width": "9em"},
                                  layout=widgets.Layout(width="17em"))


class MemoryCalculator(widgets.VBox):
    """Bytes per GPU by consumer under ZeRO 0–3, for a model, a recipe and a D×T×P×C layout.

    Args (keywords, defaults in ``DEFAULTS``; see ``settings``): n_params (Ψ), recipe
    (``memory_model.RECIPES``), optimizer (``memory_model.OPTIMIZERS``), zero_stage (0–3),
    world_size (N), dp, tp, pp, cp (D, T, P, C with D·T·P·C = N), sequence_parallel,
    checkpointing (``CHECKPOINTING``), n_micro (m), n_layer, hidden, n_head, batch_size
    (micro-batch b), seq_len, grad_buffer, vocab_size, fp32_logits; gpu_bytes (80 GB).
    Attributes: ``controls`` (name → widget), ``summary`` (HTML), ``chart`` (Output),
    ``result`` (bytes by consumer of the selected stage after each redraw; ``{}`` when the
    settings are invalid, and the summary says why).
    """

    def __init__(self, gpu_bytes: float = 80 * GB, **values):
        if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) \
                or not 0 < gpu_bytes < float("inf"):
            raise ValueError(f"gpu_bytes must be a positive, finite number, got {gpu_bytes!r}")
        v = settings(**values)
        try:
            calculator_bytes(**v)  # bad settings fail here, with the argument's name
        except NotImplementedError:
            pass  # exercise 6.4 not written: the summary says so
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
            "checkpointing": widgets.ToggleButtons(
                options=[(f"recompute: {c}", c) for c in CHECKPOINTING],
                value=v["checkpointing"], description="recomputation", style=wide),
            "sequence_parallel": widgets.Checkbox(
                value=v["sequence_parallel"], description="sequence parallelism (with T)",
                style=wide),
            "world_size": _int_box(v["world_size"], "GPUs (N)"),
            "dp": _int_box(v["dp"], "data (D)"),
            "tp": _int_box(v["tp"], "tensor (T)"),
            "pp": _int_box(v["pp"], "pipeline (P)"),
            "cp": _int_box(v["cp"], "context (C)"),
            "n_micro": _int_box(v["n_micro"], "micro-batches (m)"),
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
        grid = lambda names: widgets.GridBox(  # noqa: E731
            [self.controls[k] for k in names],
            layout=widgets.Layout(grid_template_columns="repeat(2, 18em)"))
        left = widgets.VBox(
            [self.controls[k] for k in ("n_params", "recipe", "optimizer", "grad_buffer",
                                        "fp32_logits", "zero_stage")]
            + [grid(("world_size", "dp", "tp", "pp", "cp", "n_micro"))]
            + [self.controls[k] for k in ("sequence_parallel", "checkpointing")]
            + [grid(("n_layer", "hidden", "n_head", "batch_size", "seq_len", "vocab_size"))])
        super().__init__([left, self.summary, self.chart])
        for control in self.controls.values():
            control.observe(self._redraw, names="value")
        self._redraw()

    def values(self) -> dict:
        """The current settings, as keyword arguments of ``calculator_bytes``."""
        return {name: control.value for name, control in self.controls.items()}

    def _redraw(self, change=None) -> None:
        v = self.values()
        self.chart.clear_output(wait=True)
        try:
            bars = {STAGE_NAMES[s]: calculator_bytes(**{**v, "zero_stage": s})
                    for s in memory_model.ZERO_STAGES}
        except (ValueError, TypeError, NotImplementedError) as error:
            self.result = {}
            self.summary.value = f"<b style='color:#C44E52'>{html.escape(str(error))}</b>"
            return
        self.result = bars[STAGE_NAMES[v["zero_stage"]]]
        self.summary.value = self._summary_html(v)
        layout = " × ".join(f"{k} {v[n]}" for k, n in zip("DTPC", LAYOUT))
        with self.chart:
            fig = stacked_bars(bars, unit="GB", limit=self.gpu_bytes,
                               limit_label=f"one GPU: {self.gpu_bytes / GB:.0f} GB",
                               title=f"bytes per GPU, N = {v['world_size']} GPUs = {layout}")
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
        which = (f"the first pipeline stage's GPUs ({v['n_layer'] // v['pp']} layers, "
                 f"{min(v['pp'], v['n_micro'])} micro-batches in flight)" if v["pp"] > 1
                 else f"each of the {v['world_size']} GPUs")
        note = ("<p>The fp32 logits are on the last stage, not counted here.</p>"
                if v["fp32_logits"] and v["pp"] > 1 else "")
        return (
            f"<p>Static state of the whole model: {sum(per.values()):g} bytes per parameter × "
            f"Ψ = <b>{static_total / 1e12:,.3g} TB</b> "
            f"({static_total / self.gpu_bytes:,.1f} GPUs' worth before any activation).</p>"
            f"<p>On {which} with {STAGE_NAMES[v['zero_stage']]}:</p>"
            f"<table>{rows}<tr><td><b>total</b></td><td style='text-align:right'><b>"
            f"{total / GB:,.2f} GB</b></td></tr></table>{note}"
            f"<p style='color:{'#2E7D32' if fits else '#C44E52'}'><b>{verdict}</b></p>")
