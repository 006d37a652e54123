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
