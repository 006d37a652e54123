"""The memory calculator as a self-contained HTML page element that runs in the reader's browser.

``labkit.widgets.MemoryCalculator`` (ipywidgets) needs a Python kernel to redraw, so on the
static site it shows only its starting state.  ``calculator_html()`` gives the book a calculator
that works without a kernel and without internet: plain HTML inputs, an inline SVG chart and
about a hundred lines of JavaScript.  The tables it computes with (bytes per parameter of every
precision recipe × optimizer × gradient buffer, the consumer colours) are written into the page
from ``labkit.memory_model`` and ``labkit.plot``.  The configuration arithmetic — ZeRO sharding
over D·C, T·P splitting the weights, Korthikanti et al.'s activations with tensor, sequence and
context parallelism, recomputation and the first 1F1B stage's micro-batches in flight — is the
JavaScript twin of ``labkit.widgets.calculator_bytes`` (``JS_MODEL``; a browser runs no Python).
``tests/test_page_calculator.py`` runs it under Node on thousands of combinations and requires it
to agree with ``calculator_bytes`` computed by the reference ``labkit.lab6.parallel_memory``, and
``tests/test_site_check.py`` moves every control in Chromium and compares the drawn bars.
Invalid settings (D·T·P·C ≠ N, T not dividing the heads, P not dividing the layers, ...) show
a message in place of the chart, the same check ``labkit.lab6.parallel_memory`` makes.

``moe_calculator_html()`` is a second calculator with expert parallelism (E) for published
mixture-of-experts models: the JavaScript twin (``JS_MOE``) of ``labkit.moe_memory.per_gpu_bytes``
(``tests/test_moe_calculator.py`` holds them equal under Node).

Chapters: book/01_where_the_memory_goes.md (data parallelism), book/06_system.md (D × T × P × C,
and E for mixture-of-experts models).
"""
from __future__ import annotations

import itertools
import json

from labkit import memory_model
from labkit.plot import COLORS
from labkit.widgets import CHECKPOINTING, STAGE_NAMES, settings

JS_CHECK = r"""
function wtmgCheck(v) {
  // The first problem with the settings v, as a sentence, or "" when they are valid.
  const ints = ["world_size", "dp", "tp", "pp", "cp", "n_micro", "n_layer", "hidden", "n_head",
                "batch_size", "seq_len", "vocab_size"];
  if (!(v.n_params > 0 && isFinite(v.n_params))) return "Ψ must be a positive number";
  for (const k of ints)
    if (!(Number.isInteger(v[k]) && v[k] > 0)) return k + " must be a positive whole number";
  const prod = v.dp * v.tp * v.pp * v.cp;
  if (prod !== v.world_size)
    return `D·T·P·C = ${v.dp}·${v.tp}·${v.pp}·${v.cp} = ${prod} must equal the GPUs N = ${v.world_size}`;
  if (v.hidden % v.n_head) return `the heads a = ${v.n_head} must divide hidden h = ${v.hidden}`;
  if (v.n_head % v.tp) return `T = ${v.tp} must divide the heads a = ${v.n_head} (each rank keeps whole heads)`;
  if (v.seq_len % v.cp) return `C = ${v.cp} must divide the sequence s = ${v.seq_len}`;
  if (v.n_layer % v.pp) return `P = ${v.pp} must divide the layers L = ${v.n_layer}`;
  return "";
}
"""

JS_MODEL = r"""
function wtmgPerGpu(v, T) {
  // v: valid settings; T: tables from labkit.memory_model. Bytes per consumer on the busiest
  // GPU (the first pipeline stage's): labkit.widgets.calculator_bytes in JavaScript.
  const per = T.perParam[v.recipe + "|" + v.optimizer + "|" + v.grad_buffer];
  const st = v.zero_stage, n = v.dp * v.cp;          // ZeRO shards over the D·C replicas
  const local = v.n_params / (v.tp * v.pp);          // T and P split the weights
  const s = v.seq_len / v.cp, b = v.batch_size;          // C splits the sequence
  const h = v.hidden, a = v.n_head, t = v.tp, e = T.activationBytes[v.recipe];
  const sbh = s * b * h;
  let layer;
  if (v.checkpointing === "full") {                  // only the layer's input is kept
    layer = v.sequence_parallel ? sbh * e / t : sbh * e;
  } else {
    const unsplit = sbh * (4 * e + 2);               // LayerNorm inputs, QKV/MLP inputs, 2 masks
    let split = sbh * 12 * e;                         // Q, K, V, projection input, GELU in/out
    // scores, softmax, dropout: this rank's s/C queries against all s keys (the s² term / C)
    if (v.checkpointing === "none") split += a * s * v.seq_len * b * (2 * e + 1);
    layer = v.sequence_parallel ? (unsplit + split) / t : unsplit + split / t;
  }
  let acts = (v.n_layer / v.pp) * Math.min(v.pp, v.n_micro) * layer;
  if (v.fp32_logits && v.pp === 1) acts += 4 * s * b * v.vocab_size / t;
  return {
    "parameters": local * per["parameters"] / (st >= 3 ? n : 1),
    "gradients": local * per["gradients"] / (st >= 2 ? n : 1),
    "optimizer states": local * per["optimizer states"] / (st >= 1 ? n : 1),
    "activations": acts,
  };
}
"""

_JS_OPEN = r"""
(function () {
  const root = document.getElementById("%(id)s");
  const T = JSON.parse(root.querySelector("script[type='application/json']").textContent);
  const GB = 1e9, W = 570, H = 250, PAD = 40;
  const get = (name) => root.querySelector("[name='" + name + "']");
  function refuse(problem) {
    // Show the settings' problem in place of the chart; true when there is one.
    root.classList.toggle("wtmg-invalid", problem !== "");
    root.querySelector(".wtmg-msg").textContent = problem;
    if (problem) {
      root.querySelector("svg").innerHTML = "";
      root.querySelector(".wtmg-summary").textContent = "Nothing drawn: " + problem + ".";
    }
    return problem !== "";
  }
  function drawBars(bars, labels, chosen) {
    // Stacked bars by consumer (one per entry of bars, labelled, the chosen one in bold) under
    // a dashed line at one GPU's memory; returns each bar's total.
    const totals = bars.map((c) => T.consumers.reduce((t, k) => t + c[k], 0));
    const top = Math.max(T.gpuBytes * 1.15, ...totals);
    const y = (x) => H - PAD - (H - 2 * PAD) * x / top;
    const step = Math.min(100, (W - PAD - 20) / bars.length), width = 0.6 * step;
    let svg = "";
    bars.forEach((c, i) => {
      let base = 0; const x = PAD + 20 + i * step;
      for (const k of T.consumers) {
        svg += `<rect x="${x}" y="${y(base + c[k])}" width="${width}" height="${y(base) - y(base + c[k])}"` +
               ` fill="${T.colors[k]}"><title>${k}: ${(c[k] / GB).toFixed(2)} GB</title></rect>`;
        base += c[k];
      }
      const bold = i === chosen ? "font-weight:bold" : "";
      svg += `<text x="${x + width / 2}" y="${H - PAD + 15}" text-anchor="middle" style="${bold}">${labels[i]}</text>`;
      svg += `<text x="${x + width / 2}" y="${y(totals[i]) - 4}" text-anchor="middle" font-size="11">${(totals[i] / GB).toFixed(0)} GB</text>`;
    });
    svg += `<line x1="${PAD}" x2="${W}" y1="${y(T.gpuBytes)}" y2="${y(T.gpuBytes)}" stroke="black" stroke-dasharray="5,4"/>` +
           `<text x="${W}" y="${y(T.gpuBytes) - 4}" text-anchor="end" font-size="11">one GPU: ${T.gpuBytes / GB} GB</text>`;
    root.querySelector("svg").innerHTML = svg;
    return totals;
  }
"""

_JS_CLOSE = r"""
  root.querySelectorAll("input, select").forEach((el) => el.addEventListener("input", draw));
  root.querySelectorAll("input, select").forEach((el) => el.addEventListener("change", draw));
  draw();
})();
"""

_WIDGET_JS = _JS_OPEN + r"""
  function settings() {
    const v = {};
    for (const k of T.integers) v[k] = Number(get(k).value);
    v.n_params = parseFloat(get("n_params").value) * 1e9;
    for (const k of ["recipe", "optimizer", "grad_buffer", "checkpointing"]) v[k] = get(k).value;
    v.fp32_logits = get("fp32_logits").checked;
    v.sequence_parallel = get("sequence_parallel").checked;
    v.zero_stage = parseInt(root.querySelector("[name='zero_stage']:checked").value, 10);
    return v;
  }
  function draw() {
    const v = settings();
    if (refuse(wtmgCheck(v))) return;
    const bars = [0, 1, 2, 3].map((st) => wtmgPerGpu(Object.assign({}, v, {zero_stage: st}), T));
    const totals = drawBars(bars, T.stages, v.zero_stage);
    const c = bars[v.zero_stage], total = totals[v.zero_stage];
    const per = T.perParam[v.recipe + "|" + v.optimizer + "|" + v.grad_buffer];
    const perSum = T.consumers.slice(0, 3).reduce((t, k) => t + per[k], 0);
    const where = v.pp > 1
      ? `each GPU of the first pipeline stage (${v.n_layer / v.pp} layers, ${Math.min(v.pp, v.n_micro)} micro-batches in flight)`
      : `each of ${v.world_size} GPUs`;
    root.querySelector(".wtmg-summary").innerHTML =
      `Static state of the whole model: ${perSum} bytes/parameter × Ψ = <b>${(perSum * v.n_params / 1e12).toFixed(3)} TB</b>. ` +
      `On ${where}, D×T×P×C = ${v.dp}×${v.tp}×${v.pp}×${v.cp}, with ${T.stages[v.zero_stage]}: ` +
      T.consumers.map((k) => `${k} <b>${(c[k] / GB).toFixed(2)} GB</b>`).join(", ") +
      `; total <b>${(total / GB).toFixed(2)} GB</b>, which ` +
      (total <= T.gpuBytes ? "fits" : "does <b>not</b> fit") + ` in ${T.gpuBytes / GB} GB.` +
      (v.fp32_logits && v.pp > 1 ? " The fp32 logits are on the last stage, not counted here." : "");
  }
""" + _JS_CLOSE

INTEGERS = ("world_size", "dp", "tp", "pp", "cp", "n_micro", "n_layer", "hidden", "n_head",
            "batch_size", "seq_len", "vocab_size")
"""The whole-number inputs of the page, in the order they are laid out."""

LABELS = {"world_size": "GPUs N", "dp": "data D", "tp": "tensor T", "pp": "pipeline P",
          "cp": "context C", "n_micro": "micro-batches m", "n_layer": "layers L",
          "hidden": "hidden h", "n_head": "heads a", "batch_size": "micro-batch b",
          "seq_len": "sequence s", "vocab_size": "vocabulary V"}


def tables(gpu_bytes: float = 80e9) -> dict:
    """Everything the page's JavaScript needs, computed by ``labkit.memory_model``."""
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) \
            or not 0 < gpu_bytes < float("inf"):
        raise ValueError(f"gpu_bytes must be a positive, finite number, got {gpu_bytes!r}")
    per_param = {f"{r}|{o}|{g}": memory_model.bytes_per_parameter(r, o, g)
                 for r, o, g in itertools.product(memory_model.RECIPES, memory_model.OPTIMIZERS,
                                                  memory_model.GRAD_BUFFERS)}
    return {"perParam": per_param,
            "activationBytes": {r: rec.activation for r, rec in memory_model.RECIPES.items()},
            "consumers": list(memory_model.CONSUMERS), "colors": COLORS,
            "stages": [STAGE_NAMES[s] for s in memory_model.ZERO_STAGES], "gpuBytes": gpu_bytes,
            "integers": list(INTEGERS)}


def _number(name: str, label: str, value, step: str = "1") -> str:
    return (f"<label style='display:inline-block;width:15em'>{label} "
            f"<input name='{name}' type='number' min='1' step='{step}' value='{value}' "
            f"style='width:6.5em'></label>")


def calculator_html(element_id: str = "wtmg-calculator", gpu_bytes: float = 80e9,
                    **values) -> str:
    """The calculator as one HTML string (inputs, an SVG chart, its script).

    It starts at ``labkit.widgets.settings(**values)`` (``DEFAULTS``: the book's 100B example);
    a start the model refuses raises its ``ValueError`` (naming the setting) here.
    """
    if not isinstance(element_id, str) or not element_id.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"element_id must be letters, digits, '-' or '_', got {element_id!r}")
    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) \
            or not 0 < gpu_bytes < float("inf"):
        raise ValueError(f"gpu_bytes must be a positive, finite number, got {gpu_bytes!r}")
    d = settings(**values)
    try:
        from labkit.widgets import calculator_bytes

        calculator_bytes(**d)
    except NotImplementedError:
        pass  # the page computes in JavaScript; only the Python check needs exercise 6.4
    options = lambda table, chosen: "".join(  # noqa: E731
        f"<option value='{k}'{' selected' if k == chosen else ''}>"
        f"{getattr(v, 'label', v)}</option>" for k, v in table.items())
    stages = "".join(
        f"<label style='margin-right:1em'><input type='radio' name='zero_stage' value='{s}'"
        f"{' checked' if s == d['zero_stage'] else ''}> {STAGE_NAMES[s]}</label>"
        for s in memory_model.ZERO_STAGES)
    recompute = {c: f"recompute: {c}" for c in CHECKPOINTING}
    numbers = lambda names: "".join(_number(k, LABELS[k], d[k]) for k in names)  # noqa: E731
    n_params = f"{d['n_params'] / 1e9:.12g}"
    return f"""
<div id="{element_id}" class="wtmg-calculator" style="border:1px solid #ddd;padding:0.8em;border-radius:6px">
<script type="application/json">{json.dumps(tables(gpu_bytes))}</script>
<div>{_number("n_params", "Ψ (billions)", n_params, "any")}
<label>precision <select name="recipe">{options(memory_model.RECIPES, d["recipe"])}</select></label></div>
<div><label>optimizer <select name="optimizer">{options(memory_model.OPTIMIZERS, d["optimizer"])}</select></label>
<label>gradients <select name="grad_buffer">{options(memory_model.GRAD_BUFFERS, d["grad_buffer"])}</select></label>
<label><input type="checkbox" name="fp32_logits"{" checked" if d["fp32_logits"] else ""}> fp32 logits (4·s·b·V)</label></div>
<div style="margin:0.4em 0">{stages}</div>
<div>{numbers(("world_size", "dp", "tp", "pp", "cp", "n_micro"))}</div>
<div><label><input type="checkbox" name="sequence_parallel"{" checked" if d["sequence_parallel"] else ""}> sequence parallelism (with T)</label>
<label style="margin-left:1em">recomputation <select name="checkpointing">{options(recompute, d["checkpointing"])}</select></label></div>
<div>{numbers(("n_layer", "hidden", "n_head", "batch_size", "seq_len", "vocab_size"))}</div>
<div class="wtmg-msg" role="status" style="color:{COLORS['activations']};font-weight:bold"></div>
<svg width="580" height="250" role="img" aria-label="bytes per GPU by consumer for ZeRO stages 0 to 3"></svg>
<div>{"".join(f"<span style='margin-right:1em'><span style='display:inline-block;width:0.9em;height:0.9em;background:{COLORS[c]}'></span> {c}</span>" for c in memory_model.CONSUMERS)}</div>
<p class="wtmg-summary"></p>
<script>{JS_CHECK}{JS_MODEL}{_WIDGET_JS % {"id": element_id}}</script>
</div>"""


def show(**kwargs):
    """Display the calculator in a notebook (or a book page) as HTML; ``calculator_html``'s
    arguments."""
    from IPython.display import HTML

    return HTML(calculator_html(**kwargs))


# ---------------------------------------------------------------- the MoE calculator (E)

JS_MOE = r"""
function wtmgMoeCheck(v, m) {
  // The first problem with the MoE settings v for model m, as a sentence, or "".
  for (const k of ["dp", "ep", "pp", "tokens", "n_micro"])
    if (!(Number.isInteger(v[k]) && v[k] > 0)) return k + " must be a positive whole number";
  if (!(v.capacity_factor > 0 && isFinite(v.capacity_factor))) return "the capacity factor must be a positive number";
  if (v.dp % v.ep) return `E = ${v.ep} must divide D = ${v.dp} (the expert-parallel group is carved out of the data-parallel ranks)`;
  if (m.n_expert % v.ep) return `E = ${v.ep} must divide the ${m.n_expert} experts of ${m.name}`;
  return "";
}
function wtmgMoeParams(m) {
  // labkit.moe_memory.param_counts in JavaScript.
  const h = m.hidden, mats = m.mlp === "swiglu" ? 3 : 2, expert = mats * h * m.expert_ffn;
  const moeLayers = m.n_layer - m.dense_layers;
  let other = m.n_layer * (m.attention_params + 2 * h) + m.dense_layers * mats * h * m.dense_ffn;
  other += moeLayers * (h * m.n_expert + m.n_shared * expert);
  other += 2 * m.vocab_size * h + h;
  const routed = moeLayers * m.n_expert * expert;
  return {"routed experts": routed, "other": other, "total": routed + other,
          "active": other + moeLayers * m.top_k * expert};
}
function wtmgMoePerGpu(v, m, T) {
  // labkit.moe_memory.per_gpu_bytes in JavaScript (no tensor parallelism).
  const c = wtmgMoeParams(m), per = T.perParam, st = v.zero_stage;
  const dense = c["other"] / v.pp, experts = c["routed experts"] / (v.ep * v.pp);
  const shards = [3, 2, 1], out = {};
  T.consumers.slice(0, 3).forEach((k, i) => {
    const shard = st >= shards[i];
    out[k] = per[i] * (dense / (shard ? v.dp : 1) + experts / (shard ? v.dp / v.ep : 1));
  });
  const h = m.hidden, f = m.expert_ffn, E = m.n_expert, k = m.top_k, b = 2;
  const C = Math.ceil(v.capacity_factor * v.tokens * k / E - 1e-9);
  const inner = (m.mlp === "swiglu" ? 4 : 2) * f * b;
  const layer = v.tokens * h * b + v.tokens * E * 4 + E * C * h * b + E * C * inner
              + m.n_shared * v.tokens * (h * b + inner) + v.tokens * k * h * b;
  out["activations"] = layer * (m.n_layer - m.dense_layers) / v.pp * Math.min(v.pp, v.n_micro);
  return out;
}
"""

_MOE_WIDGET_JS = _JS_OPEN + r"""
  function settings() {
    const v = {};
    for (const k of ["dp", "ep", "pp", "tokens", "n_micro"]) v[k] = Number(get(k).value);
    v.capacity_factor = parseFloat(get("capacity_factor").value);
    v.zero_stage = parseInt(get("zero_stage").value, 10);
    return [v, T.models[get("model").value]];
  }
  function draw() {
    const [v, m] = settings();
    if (refuse(wtmgMoeCheck(v, m))) return;
    const eps = T.epChoices.filter((e) => v.dp %% e === 0 && m.n_expert %% e === 0);
    const bars = eps.map((e) => wtmgMoePerGpu(Object.assign({}, v, {ep: e}), m, T));
    drawBars(bars, eps.map((e) => `E = ${e}`), eps.indexOf(v.ep));
    const c = wtmgMoePerGpu(v, m, T), p = wtmgMoeParams(m);
    const total = T.consumers.reduce((t, k) => t + c[k], 0);
    root.querySelector(".wtmg-summary").innerHTML =
      `${m.name}: <b>${(p.total / 1e9).toFixed(1)}B</b> parameters, <b>${(p.active / 1e9).toFixed(1)}B</b> active per token. ` +
      `On each GPU of the first pipeline stage with D×P = ${v.dp}×${v.pp}, expert parallelism E = ${v.ep}, ZeRO-${v.zero_stage}: ` +
      T.consumers.map((k) => `${k} <b>${(c[k] / GB).toFixed(2)} GB</b>`).join(", ") +
      ` (activations: the MoE layers only); total <b>${(total / GB).toFixed(2)} GB</b>, which ` +
      (total <= T.gpuBytes ? "fits" : "does <b>not</b> fit") + ` in ${T.gpuBytes / GB} GB.`;
  }
""" + _JS_CLOSE

MOE_DEFAULTS = dict(model="DeepSeek-V3", dp=128, ep=64, pp=16, zero_stage=1, tokens=4096,
                    capacity_factor=1.25, n_micro=16)
"""The MoE calculator's start: DeepSeek-V3's training layout (arXiv 2412.19437 §3.2: 2048
GPUs, 16-way pipeline, 64-way expert parallelism inside ZeRO-1 data parallelism)."""


def moe_tables(gpu_bytes: float = 80e9) -> dict:
    """What the MoE calculator's JavaScript needs: the models of ``labkit.moe_memory`` and
    mixed-precision Adam's bytes per parameter (2 + 2 + 12) from ``labkit.memory_model``."""
    import dataclasses

    from labkit import moe_memory

    if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, (int, float)) \
            or not 0 < gpu_bytes < float("inf"):
        raise ValueError(f"gpu_bytes must be a positive, finite number, got {gpu_bytes!r}")
    per = memory_model.bytes_per_parameter("mixed", "adam")
    return {"models": {name: dataclasses.asdict(m) for name, m in moe_memory.MODELS.items()},
            "perParam": [per[c] for c in memory_model.CONSUMERS[:3]],
            "consumers": list(memory_model.CONSUMERS), "colors": COLORS, "gpuBytes": gpu_bytes,
            "epChoices": [1, 2, 4, 8, 16, 32, 64, 128, 256]}


def moe_calculator_html(element_id: str = "wtmg-moe-calculator", gpu_bytes: float = 80e9,
                        **values) -> str:
    """The MoE calculator as one HTML string: a published MoE model (``labkit.moe_memory``),
    D, E (expert parallelism), P, ZeRO stage, tokens per micro-batch, capacity factor and
    micro-batches; bars per GPU for every E that fits the model, the chosen one in bold.
    ``values`` override ``MOE_DEFAULTS``; a start the model refuses raises its ValueError."""
    from labkit import moe_memory

    if not isinstance(element_id, str) or not element_id.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"element_id must be letters, digits, '-' or '_', got {element_id!r}")
    unknown = set(values) - set(MOE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; allowed: {sorted(MOE_DEFAULTS)}")
    d = {**MOE_DEFAULTS, **values}
    if d["model"] not in moe_memory.MODELS:
        raise ValueError(f"model must be one of {sorted(moe_memory.MODELS)}, got {d['model']!r}")
    moe_memory.per_gpu_bytes(moe_memory.MODELS[d["model"]], **{k: v for k, v in d.items() if k != "model"})
    models = "".join(f"<option value='{n}'{' selected' if n == d['model'] else ''}>{n}</option>"
                     for n in moe_memory.MODELS)
    stages = "".join(f"<option value='{s}'{' selected' if s == d['zero_stage'] else ''}>{STAGE_NAMES[s]}</option>"
                     for s in memory_model.ZERO_STAGES)
    labels = {"dp": "data D", "ep": "experts E", "pp": "pipeline P", "tokens": "tokens / micro-batch",
              "n_micro": "micro-batches m"}
    numbers = "".join(_number(k, labels[k], d[k]) for k in ("dp", "ep", "pp", "tokens", "n_micro"))
    return f"""
<div id="{element_id}" class="wtmg-calculator" style="border:1px solid #ddd;padding:0.8em;border-radius:6px">
<script type="application/json">{json.dumps(moe_tables(gpu_bytes))}</script>
<div><label>model <select name="model">{models}</select></label>
<label style="margin-left:1em">ZeRO <select name="zero_stage">{stages}</select></label>
{_number("capacity_factor", "capacity factor", d["capacity_factor"], "any")}</div>
<div>{numbers}</div>
<div class="wtmg-msg" role="status" style="color:{COLORS['activations']};font-weight:bold"></div>
<svg width="580" height="250" role="img" aria-label="bytes per GPU by consumer for each expert-parallel size E"></svg>
<div>{"".join(f"<span style='margin-right:1em'><span style='display:inline-block;width:0.9em;height:0.9em;background:{COLORS[c]}'></span> {c}</span>" for c in memory_model.CONSUMERS)}</div>
<p class="wtmg-summary"></p>
<script>{JS_MOE}{_MOE_WIDGET_JS % {"id": element_id}}</script>
</div>"""


def show_moe(**kwargs):
    """Display the MoE calculator (``moe_calculator_html``'s arguments)."""
    from IPython.display import HTML

    return HTML(moe_calculator_html(**kwargs))
