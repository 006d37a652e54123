"""The book's MoE calculator (``labkit.page_calculator.moe_calculator_html``) computes in the
browser what ``labkit.moe_memory.per_gpu_bytes`` computes in Python.

Both sides compute in IEEE doubles with the same operations in possibly different orders: they
must agree to rounding (relative 1e-12). The page's check must refuse exactly the settings the
Python model refuses (E not dividing D, E not dividing the experts).
"""
import itertools
import json
import shutil
import subprocess

import pytest

from labkit import moe_memory
from labkit.page_calculator import JS_MOE, MOE_DEFAULTS, moe_calculator_html, moe_tables

NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript")
REL = 1e-12


def run_js(expression: str, cases: list) -> list:
    script = JS_MOE + "const T = %s; const cases = %s; console.log(JSON.stringify(%s));" % (
        json.dumps(moe_tables()), json.dumps(cases), expression)
    out = subprocess.run([NODE, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _grid():
    for model, (dp, ep), pp, stage, tokens, cf, m in itertools.product(
            moe_memory.MODELS, ((8, 1), (8, 8), (128, 64), (64, 32), (12, 3), (16, 16)), (1, 4, 16),
            (0, 1, 2, 3), (1024, 4096), (1.0, 1.25, 2.0), (1, 16)):
        yield dict(model=model, dp=dp, ep=ep, pp=pp, zero_stage=stage, tokens=tokens,
                   capacity_factor=cf, n_micro=m)


@needs_node
def test_javascript_equals_moe_memory_and_refuses_what_it_refuses():
    cases = list(_grid())
    got = run_js("cases.map((v) => [wtmgMoeCheck(v, T.models[v.model]), "
                 "wtmgMoeCheck(v, T.models[v.model]) ? null : wtmgMoePerGpu(v, T.models[v.model], T)])",
                 cases)
    checked = refused = 0
    for case, (problem, js) in zip(cases, got):
        model = moe_memory.MODELS[case["model"]]
        kwargs = {k: v for k, v in case.items() if k != "model"}
        try:
            py = moe_memory.per_gpu_bytes(model, **kwargs)
        except ValueError:
            assert problem, f"the page accepts what moe_memory refuses: {case}"
            refused += 1
            continue
        assert not problem, f"the page refuses ({problem}) what moe_memory accepts: {case}"
        for consumer, value in py.items():
            assert js[consumer] == pytest.approx(value, rel=REL), (consumer, case)
        checked += 1
    assert checked > 1000 and refused > 0


@needs_node
def test_javascript_parameter_counts_equal_moe_memory():
    names = list(moe_memory.MODELS)
    got = run_js("cases.map((n) => wtmgMoeParams(T.models[n]))", names)
    for name, js in zip(names, got):
        assert js == moe_memory.param_counts(moe_memory.MODELS[name])


def test_the_page_starts_at_deepseek_v3_and_refuses_bad_starts_naming_them():
    html = moe_calculator_html()
    assert "DeepSeek-V3" in html and f"value='{MOE_DEFAULTS['ep']}'" in html
    with pytest.raises(ValueError, match="ep"):
        moe_calculator_html(ep=3)
    with pytest.raises(ValueError, match="model"):
        moe_calculator_html(model="GPT-4")
    with pytest.raises(ValueError, match="unknown"):
        moe_calculator_html(tp=2)


# ---------------------------------------------------------------- in a real browser

def _browser_page(tmp_path):
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    import site_check  # noqa: E402  (a script of tools/)

    (tmp_path / "moe.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'></head><body><main><article>"
        f"{moe_calculator_html()}</article></main></body></html>", encoding="utf-8")
    return site_check


CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)

DRAWN = """(() => {
  const root = document.querySelector(".wtmg-calculator");
  return {titles: [...root.querySelectorAll("svg rect title")].map((t) => t.textContent),
          labels: [...root.querySelectorAll("svg text")].map((t) => t.textContent),
          msg: root.querySelector(".wtmg-msg").textContent,
          summary: root.querySelector(".wtmg-summary").textContent};
})()"""

SET = """((name, value) => {
  const el = document.querySelector(".wtmg-calculator [name='" + name + "']");
  el.value = value;
  el.dispatchEvent(new Event("input", {bubbles: true}));
})(%s, %s)"""


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (tools/ensure_chromium.sh)")
def test_the_page_draws_moe_memory_for_every_e_and_says_why_it_cannot(tmp_path):
    """In Chromium: at the start (DeepSeek-V3, D = 128, P = 16, ZeRO-1) one bar per E dividing
    D and the experts, each segment the rounding of moe_memory.per_gpu_bytes; after setting
    Mixtral and D = 8 the bars follow; E = 3 empties the chart and says why."""
    site_check = _browser_page(tmp_path)
    server, base = site_check.serve(tmp_path)
    browser = site_check.Browser(CHROMIUM)
    try:
        tab = site_check.Tab(browser)
        tab.set_view(site_check.DESKTOP)
        assert tab.visit(f"{base}/moe.html") == []
        for moves, model, dp in (([], "DeepSeek-V3", 128), ([("model", "Mixtral 8x7B"), ("dp", "8"), ("ep", "8")],
                                                             "Mixtral 8x7B", 8)):
            for name, value in moves:
                tab.evaluate(SET % (json.dumps(name), json.dumps(value)))
            drawn = tab.evaluate(DRAWN)
            assert drawn["msg"] == "", drawn["msg"]
            m = moe_memory.MODELS[model]
            eps = [e for e in moe_tables()["epChoices"] if dp % e == 0 and m.n_expert % e == 0]
            consumers = moe_tables()["consumers"]
            assert len(drawn["titles"]) == len(eps) * len(consumers)
            for i, title in enumerate(drawn["titles"]):
                e, consumer = eps[i // len(consumers)], consumers[i % len(consumers)]
                settings = {**MOE_DEFAULTS, **dict(moves), "dp": dp, "ep": e}
                want = moe_memory.per_gpu_bytes(m, **{k: int(v) if k in ("dp", "ep", "pp", "tokens", "n_micro", "zero_stage") else v
                                                      for k, v in settings.items() if k != "model"})[consumer] / 1e9
                label, gb = title.rsplit(": ", 1)
                assert label == consumer and abs(float(gb.split()[0]) - want) <= 0.005 + 1e-9 * want, (title, want)
        tab.evaluate(SET % (json.dumps("ep"), json.dumps("3")))
        drawn = tab.evaluate(DRAWN)
        assert "must divide" in drawn["msg"] and drawn["titles"] == [] and drawn["summary"].startswith("Nothing drawn")
    finally:
        browser.close()
        server.shutdown()
        server.server_close()
