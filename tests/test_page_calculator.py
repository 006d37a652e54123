"""The book's in-browser calculator computes what the Python calculator computes.

Two references: ``labkit.memory_model`` (infrastructure) for data parallelism, and
``labkit.widgets.calculator_bytes`` — ``labkit.lab6.parallel_memory`` (exercise 6.4's reference
solution, loaded with LABKIT_SOLUTIONS) plus Chapter 1's framework options — for every
D × T × P × C layout, sequence parallelism, recomputation and micro-batch count.  Both sides
compute in IEEE doubles with the same operations in possibly different orders: they must agree
to rounding (relative 1e-12).  The page's validity check must refuse exactly what the Python
model refuses.
"""
import itertools
import json
import shutil
import subprocess

import pytest

from labkit import memory_model
from labkit.page_calculator import JS_CHECK, JS_MODEL, calculator_html, tables
from labkit.widgets import DEFAULTS, calculator_bytes, settings

NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript")
REL = 1e-12  # float rounding only


def run_js(expression_of_cases: str, cases: list) -> list:
    """Evaluate ``expression_of_cases`` (JavaScript, over ``cases`` and the tables ``T``) in Node."""
    script = JS_CHECK + JS_MODEL + "const T = %s; const cases = %s; console.log(JSON.stringify(%s));" % (
        json.dumps(tables()), json.dumps(cases), expression_of_cases)
    out = subprocess.run([NODE, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def needs_6_4():
    """Skip where labkit.lab6.parallel_memory is the student's unwritten stub."""
    try:
        calculator_bytes(**settings(world_size=64, tp=8))
    except NotImplementedError:
        pytest.skip("needs labkit.lab6.parallel_memory (exercise 6.4): run with LABKIT_SOLUTIONS")


def _data_parallel_grid():
    shapes = [dict(n_layer=80, hidden=10240, n_head=80, batch_size=1, seq_len=2048,
                   vocab_size=50257),
              dict(n_layer=4, hidden=128, n_head=4, batch_size=8, seq_len=64, vocab_size=256)]
    for recipe, optimizer, buffer, logits, stage, n, shape, psi in itertools.product(
            memory_model.RECIPES, memory_model.OPTIMIZERS, memory_model.GRAD_BUFFERS,
            (False, True), memory_model.ZERO_STAGES, (1, 64), shapes, (100e9, 7.3e6)):
        yield dict(n_params=psi, recipe=recipe, optimizer=optimizer, zero_stage=stage,
                   world_size=n, grad_buffer=buffer, fp32_logits=logits, **shape)


@needs_node
def test_javascript_model_equals_memory_model_for_data_parallelism():
    """Every recipe × optimizer × gradient buffer × fp32 logits × ZeRO stage, two shapes, with
    D = N and T = P = C = 1: the page equals labkit.memory_model (no exercise involved)."""
    cases = list(_data_parallel_grid())
    got = run_js("cases.map((v) => wtmgPerGpu(v, T))", [settings(**c) for c in cases])
    assert len(got) == len(cases) == 4 * 5 * 3 * 2 * 4 * 2 * 2 * 2
    for case, js in zip(cases, got):
        py = memory_model.per_gpu_bytes(**case)
        for consumer in memory_model.CONSUMERS:
            assert js[consumer] == pytest.approx(py[consumer], rel=REL), (
                f"{consumer}: JavaScript {js[consumer]:,} B, memory_model {py[consumer]:,} B for {case}")


LAYOUTS = [  # (N, D, T, P, C) — GPT-3-like shape below: 96 layers, 96 heads, s = 2048
    (64, 64, 1, 1, 1), (1024, 16, 8, 8, 1), (1024, 1024, 1, 1, 1), (512, 8, 8, 4, 2),
    (8, 1, 8, 1, 1), (16, 2, 2, 2, 2), (96, 1, 1, 96, 1), (256, 4, 4, 4, 4),
]


def _parallel_grid():
    shape = dict(n_params=175e9, n_layer=96, hidden=12288, n_head=96, seq_len=2048,
                 vocab_size=50257)
    for (n, d, t, p, c), sp, ckpt, m, stage, recipe, buffer, logits, b in itertools.product(
            LAYOUTS, (False, True), ("none", "selective", "full"), (1, 4, 16),
            memory_model.ZERO_STAGES, ("mixed", "fp32"), ("none", "16bit+fp32"), (False, True),
            (1, 3)):
        yield dict(shape, world_size=n, dp=d, tp=t, pp=p, cp=c, sequence_parallel=sp,
                   checkpointing=ckpt, n_micro=m, zero_stage=stage, recipe=recipe,
                   optimizer="adam", grad_buffer=buffer, fp32_logits=logits, batch_size=b)


@needs_node
def test_javascript_model_equals_parallel_memory_on_every_layout():
    """8 layouts × SP × recomputation × m ∈ {1, 4, 16} × ZeRO stage × recipe × gradient buffer ×
    fp32 logits × b ∈ {1, 3}: the page equals labkit.widgets.calculator_bytes, which is
    labkit.lab6.parallel_memory.per_gpu_bytes plus the buffer and the logits."""
    needs_6_4()
    cases = [settings(**c) for c in _parallel_grid()]
    got = run_js("cases.map((v) => wtmgPerGpu(v, T))", cases)
    assert len(got) == len(cases) == 8 * 2 * 3 * 3 * 4 * 2 * 2 * 2 * 2
    for case, js in zip(cases, got):
        py = calculator_bytes(**case)
        for consumer in memory_model.CONSUMERS:
            assert js[consumer] == pytest.approx(py[consumer], rel=REL), (
                f"{consumer}: JavaScript {js[consumer]:,} B, calculator_bytes {py[consumer]:,} B "
                f"for {case}: is JS_MODEL out of step with labkit.lab6.parallel_memory?")


INVALID = [  # (changes to DEFAULTS, a word the page's message and Python's error both contain)
    (dict(dp=32), "world_size"), (dict(tp=8), "world_size"), (dict(world_size=63), "world_size"),
    (dict(world_size=64, dp=8, tp=8, n_head=12, hidden=768), "n_head"),  # 8 ∤ 12
    (dict(world_size=64, dp=2, tp=32), "n_head"),                        # 32 ∤ 80
    (dict(world_size=64, dp=16, pp=4, n_layer=30), "n_layer"),
    (dict(world_size=64, dp=32, cp=2, seq_len=2047), "seq_len"),
    (dict(n_head=7), "n_head"), (dict(n_micro=0), "n_micro"), (dict(batch_size=0), "batch_size"),
    (dict(vocab_size=0), "vocab_size"), (dict(n_params=-1.0), "n_params"),
    (dict(world_size=64, dp=32, tp=2, n_layer=2.5), "n_layer"),
]


@needs_node
@pytest.mark.parametrize("changes, word", INVALID)
def test_page_refuses_what_the_python_model_refuses(changes, word):
    """An invalid combination is a message on the page (no chart), and a ValueError naming the
    setting in Python."""
    v = {**DEFAULTS, **changes}
    with pytest.raises(ValueError, match=word):
        calculator_bytes(**v)
    msg, = run_js("cases.map(wtmgCheck)", [v])
    names = {"world_size": "N", "n_head": "heads", "n_layer": "layers", "seq_len": "sequence",
             "n_params": "Ψ"}
    assert msg and (word in msg or names.get(word, "@") in msg), \
        f"the page says {msg!r} for {changes}, expected a message about {word}"


@needs_node
def test_page_accepts_every_valid_layout():
    needs_6_4()
    cases = [settings(**c) for c in itertools.islice(_parallel_grid(), 0, None, 97)]
    assert run_js("cases.map(wtmgCheck)", cases) == [""] * len(cases)


def test_default_page_reproduces_the_100b_example():
    """Defaults: Ψ = 100B, mixed-precision Adam, ZeRO-1 on D = N = 64 GPUs → 12Ψ/64 = 18.75 GB."""
    page = calculator_html()
    assert "value='100'" in page and "value='64'" in page
    t = tables()
    assert t["perParam"]["mixed|adam|none"] == {"parameters": 2, "gradients": 2,
                                                "optimizer states": 12}
    assert calculator_bytes(**DEFAULTS)["optimizer states"] == pytest.approx(18.75e9)


def test_page_offers_the_layout_controls_and_starts_where_asked():
    """D, T, P, C, m, sequence parallelism and recomputation are controls; a start is honoured."""
    page = calculator_html(world_size=1024, dp=16, tp=8, pp=8, n_micro=16, sequence_parallel=True,
                           checkpointing="selective")
    for name in ("world_size", "dp", "tp", "pp", "cp", "n_micro"):
        assert f"name='{name}'" in page, name
    assert 'name="sequence_parallel" checked' in page
    assert "<option value='selective' selected>" in page
    assert "name='dp' type='number' min='1' step='1' value='16'" in page


def test_page_offers_the_gradient_buffers_and_fp32_logits():
    """The two framework options of Chapter 1 are controls of the page: 18 and 20 B/param."""
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
    (dict(colour="red"), "colour"),
    (dict(dp=3), "world_size"),
    (dict(checkpointing="some"), "checkpointing"),
])
def test_bad_input_is_refused_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        calculator_html(**kwargs)


@pytest.mark.parametrize("gpu_bytes", [0, float("nan"), "80e9"])
def test_tables_refuse_a_gpu_size_that_is_not_a_positive_number(gpu_bytes):
    with pytest.raises(ValueError, match="gpu_bytes must be a positive, finite number"):
        tables(gpu_bytes)
