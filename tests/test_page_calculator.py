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
    shapes = [dict(n_layer=80, hidden=10240, n_head=80, batch_size=1, seq_len=2048),
              dict(n_layer=4, hidden=128, n_head=4, batch_size=8, seq_len=64)]
    for recipe, optimizer, stage, n, shape, psi in itertools.product(
            memory_model.RECIPES, memory_model.OPTIMIZERS, memory_model.ZERO_STAGES,
            (1, 64), shapes, (100e9, 7.3e6)):
        yield dict(n_params=psi, recipe=recipe, optimizer=optimizer, zero_stage=stage,
                   world_size=n, **shape)


@pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript")
def test_javascript_model_equals_the_python_model():
    cases = list(_grid())
    script = JS_MODEL + (
        "const T = %s; const cases = %s;"
        "console.log(JSON.stringify(cases.map((v) => wtmgPerGpu(v, T))));"
    ) % (json.dumps(tables()), json.dumps(cases))
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got) == len(cases) == 2 * 4 * 5 * 4 * 2 * 2
    for case, js in zip(cases, got):
        py = memory_model.per_gpu_bytes(**case)
        for consumer in memory_model.CONSUMERS:
            # both sides compute in IEEE doubles with the same operations: agree to rounding
            assert js[consumer] == pytest.approx(py[consumer], rel=1e-12), (case, consumer)


def test_default_page_reproduces_the_100b_example():
    """Defaults: Ψ = 100B, mixed-precision Adam, ZeRO-1 on 64 GPUs → 12Ψ/64 = 18.75 GB of state."""
    page = calculator_html()
    assert "value='100.0'" in page and "value='64'" in page
    t = tables()
    assert t["perParam"]["mixed|adam"] == {"parameters": 2, "gradients": 2, "optimizer states": 12}
    static = memory_model.static_bytes_per_gpu(100e9, "mixed", "adam", 1, 64)
    assert static["optimizer states"] == pytest.approx(18.75e9)


def test_page_loads_nothing_from_outside():
    page = calculator_html()
    assert "http://" not in page and "https://" not in page and "src=" not in page


def test_bad_element_id_is_refused():
    with pytest.raises(ValueError, match="element_id"):
        calculator_html(element_id="x'><script>")
