"""The calculators of Chapter 1 and Lab 1 (labkit.memory_model, labkit.widgets) and the plots:
infrastructure, not graded.  The numbers are the book's; bad input is refused by every public
function, naming the argument."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch

from labkit import memory_model as mm
from labkit import plot
from labkit.widgets import MemoryCalculator, calculator_bytes, settings

KEYS = ("parameters", "gradients", "optimizer states")
SHAPE = dict(n_layer=80, hidden=10240, n_head=80, batch_size=1, seq_len=2048)


def test_memory_model_reproduces_the_100B_numbers():
    """100B mixed-precision Adam is 1.6 TB static; on 64 GPUs ZeRO-1 leaves 12Ψ/64 = 18.75 GB
    (≈ 19 GB) of optimizer state, ZeRO-2 2Ψ + 14Ψ/64, ZeRO-3 16Ψ/64."""
    psi, n = 100e9, 64
    assert sum(mm.static_bytes_per_gpu(psi, "mixed", "adam", 0, n).values()) == 16 * psi == 1.6e12
    z1 = mm.static_bytes_per_gpu(psi, "mixed", "adam", 1, n)
    assert z1["optimizer states"] == 12 * psi / n == 18.75e9
    z2 = mm.static_bytes_per_gpu(psi, "mixed", "adam", 2, n)
    assert sum(z2.values()) == pytest.approx(2 * psi + 14 * psi / n)
    assert z2["gradients"] == pytest.approx(3.125e9)
    z3 = mm.static_bytes_per_gpu(psi, "mixed", "adam", 3, n)
    assert sum(z3.values()) == pytest.approx(16 * psi / n) == 25e9


def test_gradient_buffers_give_18_and_20_bytes_per_parameter():
    """Megatron-LM's fp32 main_grad replaces the 16-bit gradients; DeepSpeed keeps both."""
    assert sum(mm.bytes_per_parameter("mixed", "adam", "fp32").values()) == 18
    assert sum(mm.bytes_per_parameter("mixed", "adam", "16bit+fp32").values()) == 20
    z2 = mm.static_bytes_per_gpu(100e9, "mixed", "adam", 2, 64, "fp32")
    assert z2["gradients"] == pytest.approx(4 * 100e9 / 64)  # the buffer shards with gradients


def test_korthikanti_layer_and_fp32_logits():
    """Korthikanti's 16-bit layer; fp32 activations scale all but the 1-byte masks; the fp32
    logits add 4·s·b·V to the activations."""
    assert mm.activation_bytes_per_layer(2048, 1, 10240, 80) == 2048 * 10240 * (34 + 80)
    assert mm.activation_bytes_per_layer(16, 2, 64, 4, 4) == 16 * 2 * 64 * 66 + 9 * 4 * 16 * 16 * 2
    base = mm.per_gpu_bytes(100e9, "mixed", "adam", 1, 64, **SHAPE, vocab_size=50257)
    with_logits = mm.per_gpu_bytes(100e9, "mixed", "adam", 1, 64, **SHAPE, vocab_size=50257,
                                   fp32_logits=True)
    assert with_logits["activations"] - base["activations"] == 4 * 2048 * 1 * 50257
    assert mm.logits_bytes(2048, 1, 50257) == 4 * 2048 * 50257


def test_memory_calculator_widget_redraws_from_its_controls():
    """The calculator starts on the book's example and recomputes when a control moves."""
    calc = MemoryCalculator()
    assert calc.result["optimizer states"] == pytest.approx(18.75e9)
    assert "1.6 TB" in calc.summary.value
    calc.controls["zero_stage"].value = 3
    assert sum(calc.result[k] for k in KEYS) == pytest.approx(25e9)
    calc.controls["grad_buffer"].value = "16bit+fp32"
    assert sum(calc.result[k] for k in KEYS) == pytest.approx(20 * 100e9 / 64)
    acts = calc.result["activations"]
    calc.controls["fp32_logits"].value = True
    assert calc.result["activations"] - acts == 4 * 2048 * 50257
    calc.controls["n_head"].value = 7  # does not divide 10240: a message, not a traceback
    assert "n_head" in calc.summary.value and calc.result == {}
    plt.close("all")


def _needs_6_4():
    try:
        calculator_bytes(**settings(world_size=64, tp=8))
    except NotImplementedError:
        pytest.skip("needs labkit.lab6.parallel_memory (exercise 6.4): run with LABKIT_SOLUTIONS")


def test_memory_calculator_widget_draws_a_3d_layout():
    """D, T, P, C, sequence parallelism, recomputation and m are controls; the widget shows
    labkit.lab6.parallel_memory's bytes for GPT-3 175B on 1024 GPUs = 16 × 8 × 8; an invalid layout
    is a message naming the product, not a chart."""
    from labkit.lab6.parallel_memory import per_gpu_bytes

    _needs_6_4()
    calc = MemoryCalculator(n_params=175e9, world_size=1024, tp=8, pp=8, n_layer=96,
                            hidden=12288, n_head=96)
    assert calc.controls["dp"].value == 16  # D fills the GPUs when only N is given
    calc.controls["sequence_parallel"].value = True
    calc.controls["n_micro"].value = 16
    calc.controls["checkpointing"].value = "selective"
    want = per_gpu_bytes(175e9, world_size=1024, dp=16, tp=8, pp=8, zero_stage=1, n_layer=96,
                         hidden=12288, n_head=96, seq_len=2048, micro_batch=1, n_micro=16,
                         checkpointing="selective", sequence_parallel=True)
    for c in mm.CONSUMERS:
        assert calc.result[c] == pytest.approx(want[c], rel=1e-12), c
    assert "first pipeline stage" in calc.summary.value
    calc.controls["dp"].value = 8  # 8·8·8 = 512 GPUs, not 1024
    assert calc.result == {} and "world_size" in calc.summary.value
    calc.controls["dp"].value = 16
    calc.controls["tp"].value = 5  # 16·5·8 ≠ 1024 and 5 does not divide 96 heads
    assert calc.result == {}
    calc.controls["world_size"].value = 640
    assert calc.result == {} and "n_head" in calc.summary.value
    plt.close("all")


def test_calculator_bytes_equals_memory_model_for_data_parallelism():
    """With T = P = C = 1 and no recomputation the calculator is labkit.memory_model, for every
    recipe × optimizer × gradient buffer × fp32 logits × ZeRO stage (the exact same bytes up to
    float rounding: relative 1e-12)."""
    import itertools

    for recipe, opt, buf, logits, stage in itertools.product(
            mm.RECIPES, mm.OPTIMIZERS, mm.GRAD_BUFFERS, (False, True), mm.ZERO_STAGES):
        v = settings(recipe=recipe, optimizer=opt, grad_buffer=buf, fp32_logits=logits,
                     zero_stage=stage)
        got = calculator_bytes(**v)
        want = mm.per_gpu_bytes(100e9, recipe, opt, stage, 64, **SHAPE, grad_buffer=buf,
                                vocab_size=50257, fp32_logits=logits)
        for c in mm.CONSUMERS:
            assert got[c] == pytest.approx(want[c], rel=1e-12), (recipe, opt, buf, logits, stage, c)


def test_calculator_works_while_exercise_6_4_is_a_stub(monkeypatch):
    """In the student edition labkit.lab6.parallel_memory raises NotImplementedError until 6.4 is
    written: data parallelism still computes (from labkit.memory_model), other layouts say
    that they need 6.4, and the widget shows that sentence instead of a chart."""
    from labkit.lab6 import parallel_memory

    def stub(*args, **kwargs):
        raise NotImplementedError("exercise 6.4: ...")

    monkeypatch.setattr(parallel_memory, "per_gpu_bytes", stub)
    assert calculator_bytes(**settings())["optimizer states"] == pytest.approx(18.75e9)
    with pytest.raises(NotImplementedError, match="6.4"):
        calculator_bytes(**settings(world_size=64, tp=8))
    calc = MemoryCalculator()
    assert calc.result["optimizer states"] == pytest.approx(18.75e9)
    calc.controls["checkpointing"].value = "full"
    assert calc.result == {} and "exercise 6.4" in calc.summary.value
    plt.close("all")


def test_torch_optim_keeps_bf16_states_for_bf16_parameters():
    """Why "bf16-fp32-moments" cannot be realised with torch.optim.Adam: its moments take the
    parameter's dtype."""
    p = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = torch.optim.Adam([p])
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("call, name", [
    (lambda: mm.bytes_per_parameter("fp4", "adam"), "recipe"),
    (lambda: mm.bytes_per_parameter("mixed", "lion"), "optimizer"),
    (lambda: mm.bytes_per_parameter("mixed", "adam", "fp64"), "grad_buffer"),
    (lambda: mm.static_bytes_per_gpu(-1, "mixed", "adam"), "n_params"),
    (lambda: mm.static_bytes_per_gpu(float("nan"), "mixed", "adam"), "n_params"),
    (lambda: mm.static_bytes_per_gpu("100B", "mixed", "adam"), "n_params"),
    (lambda: mm.static_bytes_per_gpu(1e9, "mixed", "adam", 4, 8), "zero_stage"),
    (lambda: mm.static_bytes_per_gpu(1e9, "mixed", "adam", 1, 0), "world_size"),
    (lambda: mm.static_bytes_per_gpu(1e9, "mixed", "adam", 1, 2.5), "world_size"),
    (lambda: mm.activation_bytes_per_layer(0, 1, 64, 4), "seq_len"),
    (lambda: mm.activation_bytes_per_layer(16, 1, 64, 3), "n_head"),
    (lambda: mm.activation_bytes_per_layer(16, 1, 64, 4, 0), "element_bytes"),
    (lambda: mm.logits_bytes(16, 1, 0), "vocab_size"),
    (lambda: mm.per_gpu_bytes(1e9, **SHAPE | {"n_layer": 0}), "n_layer"),
    (lambda: mm.per_gpu_bytes(1e9, **SHAPE, fp32_logits="yes"), "fp32_logits"),
    (lambda: mm.per_gpu_bytes(1e9, **SHAPE, vocab_size=-3), "vocab_size"),
])
def test_memory_model_refuses_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("kwargs, name", [
    (dict(recipe="fp4"), "recipe"),
    (dict(zero_stage=5), "zero_stage"),
    (dict(world_size=0), "world_size"),
    (dict(grad_buffer="main"), "grad_buffer"),
    (dict(fp32_logits=1), "fp32_logits"),
    (dict(colour="red"), "colour"),
    (dict(gpu_bytes=-1), "gpu_bytes"),
    (dict(dp=32), "world_size"),
    (dict(world_size=64, dp=2, tp=32), "n_head"),
    (dict(checkpointing="some"), "checkpointing"),
    (dict(sequence_parallel=1), "sequence_parallel"),
    (dict(n_micro=0), "n_micro"),
])
def test_memory_calculator_refuses_bad_settings(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MemoryCalculator(**kwargs)


@pytest.mark.parametrize("call, name", [
    (lambda: plot.stacked_bars({"a": {"parameters": 1}}, unit="MB"), "unit"),
    (lambda: plot.stacked_bars({"a": {"weights": 1}}), "consumers"),
    (lambda: plot.stacked_bars({"a": {"parameters": -1}}), "bytes"),
    (lambda: plot.stacked_bars({"a": {"parameters": "1 MB"}}), "bytes"),
    (lambda: plot.stacked_bars({"a": 5}), "consumer"),
    (lambda: plot.stacked_bars([]), "bars"),
    (lambda: plot.stacked_bars({"a": {"parameters": 1}}, limit="80GB"), "limit"),
    (lambda: plot.timeline("step"), "step"),
    (lambda: plot.timeline(None), "step"),
])
def test_plot_refuses_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()
    plt.close("all")
