"""The book's in-browser calculator computes what labkit.memory_model computes."""
import itertools
import json
import shutil
import subprocess

import pytest

from labkit import memory_model
from labkit.page_calculator import JS_MODEL, calculator_html, tables

NODE = shutil.which("node")


def _grid():
    shapes = [dict(n_layer=80, hidden=10240, n_head=80, batch_size=1, seq_len=2048,
                   vocab_size=50257),
              dict(n_layer=4, hidden=128, n_head=4, batch_size=8, seq_len=64, vocab_size=256)]
    for recipe, optimizer, buffer, logits, stage, n, shape, psi in itertools.product(
            memory_model.RECIPES, memory_model.OPTIMIZERS, memory_model.GRAD_BUFFERS,
            (False, True), memory_model.ZERO_STAGES, (1, 64), shapes, (100e9, 7.3e6)):
        yield dict(n_params=psi, recipe=recipe, optimizer=optimizer, zero_stage=stage,
                   world_size=n, grad_buffer=buffer, fp32_logits=logits, **shape)


@pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript")
def test_javascript_model_equals_the_python_model():
    """Every recipe × optimizer × gradient buffer × fp32 logits × ZeRO stage, two shapes."""
    cases = list(_grid())
    script = JS_MODEL + (
        "const T = %s; const cases = %s;"
        "console.log(JSON.stringify(cases.map((v) => wtmgPerGpu(v, T))));"
    ) % (json.dumps(tables()), json.dumps(cases))
    out = subprocess.run([NODE, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got) == len(cases) == 4 * 5 * 3 * 2 * 4 * 2 * 2 * 2
    for case, js in zip(cases, got):
        py = memory_model.per_gpu_bytes(**case)
        for consumer in memory_model.CONSUMERS:
            # both sides compute in IEEE doubles with the same operations: agree to rounding
            assert js[consumer] == pytest.approx(py[consumer], rel=1e-12), (
                f"{consumer}: JavaScript {js[consumer]:,} B, Python {py[consumer]:,} B for {case}")


def test_default_page_reproduces_the_100b_example():
    """Defaults: Ψ = 100B, mixed-precision Adam, ZeRO-1 on 64 GPUs → 12Ψ/64 = 18.75 GB of state."""
    page = calculator_html()
    assert "value='100.0'" in page and "value='64'" in page
    t = tables()
    assert t["perParam"]["mixed|adam|none"] == {"parameters": 2, "gradients": 2,
                                                "optimizer states": 12}
    static = memory_model.static_bytes_per_gpu(100e9, "mixed", "adam", 1, 64)
    assert static["optimizer states"] == pytest.approx(18.75e9)


def test_page_offers_the_gradient_buffers_and_fp32_logits():
    """The two framework options of the chapter are controls of the page: 18 and 20 B/param."""
    page = calculator_html()
    assert "name='grad_buffer'" in page or 'name="grad_buffer"' in page
    assert 'name="fp32_logits"' in page and "name='vocab_size'" in page
    per = tables()["perParam"]
    assert sum(per["mixed|adam|fp32"].values()) == 18  # Megatron-LM's main_grad
    assert sum(per["mixed|adam|16bit+fp32"].values()) == 20  # DeepSpeed


def test_page_loads_nothing_from_outside():
    page = calculator_html()
    assert "http://" not in page and "https://" not in page and "src=" not in page


@pytest.mark.parametrize("kwargs, name", [
    (dict(element_id="x'><script>"), "element_id"),
    (dict(element_id=7), "element_id"),
    (dict(gpu_bytes=0), "gpu_bytes"),
    (dict(gpu_bytes="80GB"), "gpu_bytes"),
    (dict(gpu_bytes=float("inf")), "gpu_bytes"),
])
def test_bad_input_is_refused_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        calculator_html(**kwargs)
