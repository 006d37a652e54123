"""The memory calculator as a self-contained HTML page element that runs in the reader's browser.

``labkit.widgets.MemoryCalculator`` (ipywidgets) needs a Python kernel to redraw, so on the
static site it shows only its starting state.  ``calculator_html()`` gives the book a calculator
that works without a kernel and without internet: plain HTML inputs, an inline SVG chart and
about forty lines of JavaScript.  The tables it computes with (bytes per parameter of every
precision recipe × optimizer, the consumer colours) are written into the page from
``labkit.memory_model`` and ``labkit.plot``; the JavaScript only shards them by ZeRO stage and
adds Korthikanti et al.'s activation term, the same two lines as ``memory_model.per_gpu_bytes``.
``tests/test_page_calculator.py`` runs this JavaScript under Node on a grid of inputs and
requires it to agree with the Python model.

Chapter: book/01_where_the_memory_goes.md.
"""
from __future__ import annotations

import itertools
import json

from labkit import memory_model
from labkit.plot import COLORS
from labkit.widgets import DEFAULTS, STAGE_NAMES

JS_MODEL = r"""
function wtmgPerGpu(v, T) {
  // v: settings; T: tables from labkit.memory_model. Returns bytes per consumer on one GPU.
  const per = T.perParam[v.recipe + "|" + v.optimizer + "|" + v.grad_buffer];
  const N = v.world_size, st = v.zero_stage;
  const s = v.seq_len, b = v.batch_size, h = v.hidden, a = v.n_head;
  const e = T.activationBytes[v.recipe];
  return {
    "parameters": v.n_params * per["parameters"] / (st >= 3 ? N : 1),
    "gradients": v.n_params * per["gradients"] / (st >= 2 ? N : 1),
    "optimizer states": v.n_params * per["optimizer states"] / (st >= 1 ? N : 1),
    "activations": v.n_layer * (s * b * h * (16 * e + 2) + a * s * s * b * (2 * e + 1))
                   + (v.fp32_logits ? 4 * s * b * v.vocab_size : 0),
  };
}
"""

_WIDGET_JS = r"""
(function () {
  const root = document.getElementById("%(id)s");
  const T = JSON.parse(root.querySelector("script[type='application/json']").textContent);
  const GB = 1e9, W = 570, H = 250, PAD = 40;
  const get = (name) => root.querySelector("[name='" + name + "']");
  function settings() {
    const v = {};
    for (const k of ["world_size", "n_layer", "hidden", "n_head", "batch_size", "seq_len", "vocab_size"])
      v[k] = parseInt(get(k).value, 10);
    v.n_params = parseFloat(get("n_params").value) * 1e9;
    v.recipe = get("recipe").value; v.optimizer = get("optimizer").value;
    v.grad_buffer = get("grad_buffer").value; v.fp32_logits = get("fp32_logits").checked;
    v.zero_stage = parseInt(root.querySelector("[name='zero_stage']:checked").value, 10);
    return v;
  }
  function draw() {
    const v = settings(), msg = root.querySelector(".wtmg-msg");
    const bad = Object.entries(v).filter(([k, x]) => typeof x === "number" && k !== "zero_stage" && !(x > 0));
    if (bad.length || v.hidden %% v.n_head) {
      msg.textContent = bad.length ? bad[0][0] + " must be a positive number"
                                   : "n_head must divide hidden";
      return;
    }
    msg.textContent = "";
    const bars = [0, 1, 2, 3].map((st) => wtmgPerGpu(Object.assign({}, v, {zero_stage: st}), T));
    const totals = bars.map((c) => T.consumers.reduce((t, k) => t + c[k], 0));
    const top = Math.max(T.gpuBytes * 1.15, ...totals);
    const y = (x) => H - PAD - (H - 2 * PAD) * x / top;
    let svg = "";
    bars.forEach((c, i) => {
      let base = 0; const x = PAD + 20 + i * 100;
      for (const k of T.consumers) {
        svg += `<rect x="${x}" y="${y(base + c[k])}" width="60" height="${y(base) - y(base + c[k])}"` +
               ` fill="${T.colors[k]}"><title>${k}: ${(c[k] / GB).toFixed(2)} GB</title></rect>`;
        base += c[k];
      }
      const bold = i === v.zero_stage ? "font-weight:bold" : "";
      svg += `<text x="${x + 30}" y="${H - PAD + 15}" text-anchor="middle" style="${bold}">${T.stages[i]}</text>`;
      svg += `<text x="${x + 30}" y="${y(totals[i]) - 4}" text-anchor="middle" font-size="11">${(totals[i] / GB).toFixed(0)} GB</text>`;
    });
    svg += `<line x1="${PAD}" x2="${W}" y1="${y(T.gpuBytes)}" y2="${y(T.gpuBytes)}" stroke="black" stroke-dasharray="5,4"/>` +
           `<text x="${W}" y="${y(T.gpuBytes) - 4}" text-anchor="end" font-size="11">one GPU: ${T.gpuBytes / GB} GB</text>`;
    root.querySelector("svg").innerHTML = svg;
    const c = bars[v.zero_stage], total = totals[v.zero_stage];
    const per = T.perParam[v.recipe + "|" + v.optimizer + "|" + v.grad_buffer];
    const perSum = T.consumers.slice(0, 3).reduce((t, k) => t + per[k], 0);
    root.querySelector(".wtmg-summary").innerHTML =
      `Static state of the whole model: ${perSum} bytes/parameter × Ψ = <b>${(perSum * v.n_params / 1e12).toFixed(3)} TB</b>. ` +
      `On each of ${v.world_size} GPUs with ${T.stages[v.zero_stage]}: ` +
      T.consumers.map((k) => `${k} <b>${(c[k] / GB).toFixed(2)} GB</b>`).join(", ") +
      `; total <b>${(total / GB).toFixed(2)} GB</b>, which ` +
      (total <= T.gpuBytes ? "fits" : "does <b>not</b> fit") + ` in ${T.gpuBytes / GB} GB.`;
  }
  root.querySelectorAll("input, select").forEach((el) => el.addEventListener("input", draw));
  draw();
})();
"""


def tables(gpu_bytes: float = 80e9) -> dict:
    """Everything the page's JavaScript needs, computed by ``labkit.memory_model``."""
    per_param = {f"{r}|{o}|{g}": memory_model.bytes_per_parameter(r, o, g)
                 for r, o, g in itertools.product(memory_model.RECIPES, memory_model.OPTIMIZERS,
                                                  memory_model.GRAD_BUFFERS)}
    return {"perParam": per_param,
            "activationBytes": {r: rec.activation for r, rec in memory_model.RECIPES.items()},
            "consumers": list(memory_model.CONSUMERS), "colors": COLORS,
            "stages": [STAGE_NAMES[s] for s in memory_model.ZERO_STAGES], "gpuBytes": gpu_bytes}


def _number(name: str, label: str, value, step: str = "1") -> str:
    return (f"<label style='display:inline-block;width:15em'>{label} "
            f"<input name='{name}' type='number' min='1' step='{step}' value='{value}' "
            f"style='width:6.5em'></label>")


def calculator_html(element_id: str = "wtmg-calculator", gpu_bytes: float = 80e9) -> str:
    """The calculator as one HTML string (inputs, an SVG chart, its script), defaults as DEFAULTS."""
    if not isinstance(element_id, str) or not element_id.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"element_id must be letters, digits, '-' or '_', got {element_id!r}")
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) \
            or not 0 < gpu_bytes < float("inf"):
        raise ValueError(f"gpu_bytes must be a positive, finite number, got {gpu_bytes!r}")
    d = DEFAULTS
    options = lambda table, chosen: "".join(  # noqa: E731
        f"<option value='{k}'{' selected' if k == chosen else ''}>"
        f"{getattr(v, 'label', v)}</option>" for k, v in table.items())
    stages = "".join(
        f"<label style='margin-right:1em'><input type='radio' name='zero_stage' value='{s}'"
        f"{' checked' if s == d['zero_stage'] else ''}> {STAGE_NAMES[s]}</label>"
        for s in memory_model.ZERO_STAGES)
    numbers = "".join(_number(k, label, d[k]) for k, label in (
        ("world_size", "GPUs N"), ("n_layer", "layers L"), ("hidden", "hidden h"),
        ("n_head", "heads a"), ("batch_size", "micro-batch b"), ("seq_len", "sequence s"),
        ("vocab_size", "vocabulary V")))
    return f"""
<div id="{element_id}" class="wtmg-calculator" style="border:1px solid #ddd;padding:0.8em;border-radius:6px">
<script type="application/json">{json.dumps(tables(gpu_bytes))}</script>
<div>{_number("n_params", "Ψ (billions)", d["n_params"] / 1e9, "any")}
<label>precision <select name="recipe">{options(memory_model.RECIPES, d["recipe"])}</select></label></div>
<div><label>optimizer <select name="optimizer">{options(memory_model.OPTIMIZERS, d["optimizer"])}</select></label>
<label>gradients <select name="grad_buffer">{options(memory_model.GRAD_BUFFERS, d["grad_buffer"])}</select></label>
<label><input type="checkbox" name="fp32_logits"{" checked" if d["fp32_logits"] else ""}> fp32 logits (4·s·b·V)</label></div>
<div style="margin:0.4em 0">{stages}</div>
<div>{numbers}</div>
<div class="wtmg-msg" style="color:{COLORS['activations']};font-weight:bold"></div>
<svg width="580" height="250" role="img" aria-label="bytes per GPU by consumer for ZeRO stages 0 to 3"></svg>
<div>{"".join(f"<span style='margin-right:1em'><span style='display:inline-block;width:0.9em;height:0.9em;background:{COLORS[c]}'></span> {c}</span>" for c in memory_model.CONSUMERS)}</div>
<p class="wtmg-summary"></p>
<script>{JS_MODEL}{_WIDGET_JS % {"id": element_id}}</script>
</div>"""


def show(**kwargs):
    """Display the calculator in a notebook (or a book page) as HTML."""
    from IPython.display import HTML

    return HTML(calculator_html(**kwargs))
