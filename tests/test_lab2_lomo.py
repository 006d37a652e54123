"""Graders of Lab 2, exercise 2.4 (labkit.lab2.lomo): LOMO against ``torch.optim.SGD`` after an
ordinary backward, and its gradient bytes measured by MemTracker (``labkit.measure``).

Tolerances: UPDATE_TOL (fp32 rounding of θ − lr·g); byte counts are exact.
"""

from __future__ import annotations


import pytest
import torch

from _lab2_helpers import (UPDATE_TOL, one_param, tiny_gpt, train)
from labkit.measure import measure_step
from labkit.models import SyntheticData


def assert_sgd_params(mine, ref, when):
    """LOMO's parameters must be torch.optim.SGD's θ − lr·g (UPDATE_TOL: fp32 rounding)."""
    for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **UPDATE_TOL, msg=lambda m, name=name: (
            f"{name} {when} differs from torch.optim.SGD's θ − lr·g: {m} — is the "
            "update applied once per parameter, with the complete (accumulated) gradient, and "
            "under torch.no_grad()?"))


@pytest.mark.exercise("2.4", points=1)
def test_lomo_params_match_sgd():
    """Check that 3 LOMO steps (update inside backward) give torch.optim.SGD's parameters
    after ordinary backward + step: the same θ − lr·g on the same g, to rounding."""
    from labkit.lab2.lomo import LOMO

    mine, ref = tiny_gpt(), tiny_gpt()
    data = SyntheticData(64, 32, 4, seed=1)
    lomo = LOMO(mine.parameters(), lr=0.1)
    train(mine, None, data, 3)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data, 3)
    assert_sgd_params(mine, ref, "after 3 LOMO steps")
    lomo.remove()
    before = [p.detach().clone() for p in mine.parameters()]
    train(mine, None, data, 1, start=3)
    assert all(torch.equal(a, p) for a, p in zip(before, mine.parameters())), \
        "parameters moved after lomo.remove(): remove() must take every hook handle off"


@pytest.mark.exercise("2.4", points=1)
def test_lomo_frees_every_gradient_inside_backward():
    """Check that when backward returns every .grad is None and every parameter has moved; and
    that with lr=0 every .grad is None too and no parameter moves."""
    from labkit.lab2.lomo import LOMO

    model = tiny_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    LOMO(model.parameters(), lr=0.1)
    x, y = SyntheticData(64, 32, 4, seed=1).batch(0)
    model(x, y).backward()
    kept = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not kept, (f"after backward {len(kept)} parameters still hold a .grad (e.g. {kept[0]}): "
                      "set param.grad = None in the hook, right after the update")
    still = [name for (name, p), a in zip(model.named_parameters(), before) if torch.equal(a, p)]
    assert not still, (f"{len(still)} parameters did not move in backward (e.g. {still[0]}): "
                       "is a hook registered on every parameter?")
    # lr = 0 (the class docstring: "0 only frees the gradients"): nothing moves, nothing is kept
    model = tiny_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    LOMO(model.parameters(), lr=0.0)
    model(x, y).backward()
    kept = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not kept, (f"with lr=0 {len(kept)} parameters still hold a .grad after backward (e.g. "
                      f"{kept[0]}): lr 0 still frees every gradient in its hook")
    moved = [name for (name, p), a in zip(model.named_parameters(), before) if not torch.equal(a, p)]
    assert not moved, f"with lr=0 {len(moved)} parameters moved (e.g. {moved[0]})"


@pytest.mark.exercise("2.4", points=2)
def test_lomo_peak_gradient_bytes_is_the_largest_gradient():
    """Measure gradient bytes with MemTracker (labkit.measure): with LOMO the peak is the
    largest single gradient, exactly; with ordinary backward + SGD it is every gradient, 4Ψ.
    The measured LOMO steps must also be SGD's: the same 2 steps of the reference run, measured
    beside them (freeing gradients without the update costs nothing and earns nothing)."""
    from labkit.harness.lab2 import lomo_step
    from labkit.lab2.lomo import LOMO

    model = tiny_gpt()
    batch = SyntheticData(64, 32, 4, seed=1).batch(0)
    LOMO(model.parameters(), lr=0.1)
    fused = measure_step(model, None, batch, steps=2, step_fn=lomo_step)
    largest = max(4 * p.numel() for p in model.parameters())
    assert fused.peak_of("gradients") == largest, (
        f"peak gradient bytes with LOMO {fused.peak_of('gradients'):,}, expected the largest single "
        f"gradient {largest:,}: is each gradient freed inside its own hook, before the next one "
        "is made?")
    plain_model = tiny_gpt()
    plain = measure_step(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1), batch,
                         steps=2)
    every = 4 * sum(p.numel() for p in plain_model.parameters())
    assert plain.peak_of("gradients") == every, (
        f"reference run: backward + SGD held {plain.peak_of('gradients'):,} B of gradients, "
        f"expected 4Ψ = {every:,} (this line checks the measurement, not your code)")
    # Nor kept under another name: beside parameters and activations, LOMO's backward may hold
    # what plain backward holds besides gradients (autograd's temporaries) plus a gradient and a
    # temporary of its size (lr·g); gradients cloned and applied at the end are temporaries that
    # pass the check above (every clone alive at the last hook: 4Ψ more).
    side, temps = (max(sum(b for k, b in t.bytes.items() if k in kinds) for t in m.timeline
                       if t.phase == "backward")
                   for m, kinds in ((fused, ("gradients", "temporaries", "other")),
                                    (plain, ("temporaries", "other"))))
    assert side <= temps + 2 * largest, (
        f"LOMO's backward held {side:,} B beside parameters and activations, plain backward "
        f"{temps:,} B of temporaries: more than 2 × the largest gradient ({2 * largest:,} B) on top — "
        "are gradients kept (cloned, stacked) until the end of backward instead of applied?")
    assert_sgd_params(model, plain_model, "after the 2 measured LOMO steps")


# =================================================================== 2.5 ZeRO-1

# Ψ = 605 (vocab 38, n_embd 5, no biases): odd, so neither 2, 3 nor 4 ranks divide it.
ZERO_CFG = dict(vocab_size=38, block_size=8, n_layer=1, n_head=1, n_embd=5, bias=False)
ZERO_STEPS, ZERO_LR = 3, 1e-2
# the parameter-group case: embeddings at another lr without weight decay, the rest AdamW's
# decay, one matrix frozen
ZERO_GROUPS = [{"params": ["wte.weight", "wpe.weight"], "lr": 3e-2, "weight_decay": 0.0}]
ZERO_FROZEN = ("h.0.attn.c_proj.weight",)


@pytest.mark.parametrize("call,word", [
    (lambda m: m.LOMO(one_param(), lr="fast"), "lr"),
    (lambda m: m.LOMO(one_param(), lr=-0.1), "lr"),
    (lambda m: m.LOMO([], lr=0.1), "params"),
    (lambda m: m.LOMO([torch.zeros(3)], lr=0.1), "params"),
    (lambda m: m.LOMO(torch.nn.Parameter(torch.zeros(3)), lr=0.1), "params"),
])
def test_lomo_refuses_bad_input(call, word):
    import labkit.lab2.lomo as m

    with pytest.raises((ValueError, TypeError), match=word):
        call(m)


def test_lomo_with_a_tied_parameter_listed_twice_is_sgd():
    """A parameter listed twice (tied weights gathered by hand) gets one hook and one update."""
    from labkit.lab2.lomo import LOMO

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4))
    w_ref = torch.nn.Parameter(w.detach().clone())
    LOMO([w, w], lr=0.1)
    x = torch.randn(2, 4)
    (x @ w @ w).sum().backward()
    (x @ w_ref @ w_ref).sum().backward()
    torch.optim.SGD([w_ref], lr=0.1).step()
    torch.testing.assert_close(w.detach(), w_ref.detach())
    assert w.grad is None


@pytest.mark.exercise("2.4", points=1)
def test_lomo_applies_each_groups_lr():
    """Parameter groups as ``torch.optim.SGD`` takes them (the embeddings at lr 0.3, the rest at
    the default 0.1): 2 LOMO steps against SGD with the same groups. Tolerance: UPDATE_TOL."""
    from labkit.lab2.lomo import LOMO

    mine, ref = tiny_gpt(), tiny_gpt()
    batches = SyntheticData(64, 32, 4, seed=1)

    def groups(model):
        emb = [model.wte.weight, model.wpe.weight]
        rest = [p for p in model.parameters() if all(p is not e for e in emb)]
        return [{"params": emb, "lr": 0.3}, {"params": rest}]

    LOMO(groups(mine), lr=0.1)
    train(mine, None, batches, 2)
    train(ref, torch.optim.SGD(groups(ref), lr=0.1), batches, 2)
    for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **UPDATE_TOL, msg=lambda m, name=name: (
            f"{name} after 2 steps vs torch.optim.SGD with groups: {m} — use the parameter's "
            "group's lr (self.lr_of(param))"))
