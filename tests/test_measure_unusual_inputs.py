"""labkit.measure under models and step functions its main tests do not try.

Exact byte counts against the closed form (float32: 4 bytes an element) or against the same
measurement on a CPU model; refusals name the argument and what is allowed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from labkit import measure
from labkit.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _batch(device="cpu"):
    x = torch.zeros(2, 4, dtype=torch.long, device=device)
    return x, x


def _frozen_first_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    return model


def _backward_step(model, optimizer, batch):
    loss = model(batch).square().mean()
    loss.backward()
    return loss.detach()


def test_a_model_with_a_frozen_layer_is_measured_and_its_gradients_are_only_the_trainable_ones():
    """Check a frozen layer (fine-tuning) is measured: MemTracker raised "cannot register a hook
    on a tensor that doesn't require gradient". Parameters 4·(72 + 36) B; gradients only the
    trainable layer's 4·36 B."""
    model = _frozen_first_layer()
    step = measure.measure_step(model, None, torch.ones(3, 8), step_fn=_backward_step)
    assert step.at_peak["parameters"] == 4 * (8 * 8 + 8 + 8 * 4 + 4)
    assert step.after["gradients"] == 4 * (8 * 4 + 4)


@pytest.mark.parametrize("run", [
    lambda m: measure.peak_bytes(lambda: _backward_step(m, None, torch.ones(3, 8)))[0],
    lambda m: measure.peak_over_calls(m, lambda: [_backward_step(m, None, torch.ones(3, 8)) for _ in range(2)])[0],
], ids=["peak_bytes", "peak_over_calls"])
def test_every_tracker_accepts_frozen_parameters(run):
    """Check peak_bytes and peak_over_calls (same MemTracker underneath) accept a frozen layer."""
    assert run(_frozen_first_layer()) > 0


def test_a_meta_model_is_refused_since_its_shared_storages_would_count_twice():
    """Check a meta-device GPT is refused by name: measured, its tied embedding counted twice
    (parameters 17,856 B vs the CPU run's 15,808 B: meta tensors have no storage to share)."""
    with pytest.raises(ValueError, match="model is on the meta device.*Measure on 'cpu'"):
        measure.measure_step(GPT(TINY).to("meta"), None, _batch("meta"))


@pytest.mark.parametrize("step_fn, error, words", [
    (lambda m, o, b: None, TypeError, r"step_fn must return the step's loss .* got NoneType"),
    (lambda m, o, b: torch.ones(3), TypeError, r"got a tensor of shape \(3,\)"),
    (lambda m, o, b: m(*b) + m(*b), ValueError, "called the model more than once .*peak_over_calls"),
])
def test_a_step_fn_that_breaks_the_contract_is_named(step_fn, error, words):
    """Check step_fn returning no loss, a loss of many elements, or calling the model twice
    (MemTracker's NotImplementedError about "iterative calls") is a message about step_fn."""
    with pytest.raises(error, match=words):
        measure.measure_step(GPT(TINY), None, _batch(), step_fn=step_fn)


@pytest.mark.parametrize("batch, words", [(None, "got NoneType"), ((1, 2, 3), "a tuple of 3")])
def test_the_default_step_names_a_batch_that_is_not_a_pair(batch, words):
    with pytest.raises(TypeError, match=rf"batch must be an \(inputs, targets\) pair .*{words}"):
        measure.measure_step(GPT(TINY), None, batch)


def test_peak_of_refuses_a_phase_that_does_not_exist():
    """Check peak_of("activations", "fwd") is refused (it returned 0: no point has that phase)."""
    step = measure.measure_step(GPT(TINY), None, _batch())
    with pytest.raises(ValueError, match=r"phase must be None or one of \('forward', 'backward', 'optimizer'\)"):
        step.peak_of("activations", "fwd")
    assert step.peak_of("activations", "forward") > 0
