"""The course's GPT and its synthetic data."""
import math

import pytest
import torch

from labkit.models import GPT, GPTConfig, SyntheticData, lab_batch_size, lab_config


def test_loss_falls_when_trained():
    """The synthetic chain is learnable: 60 AdamW steps take the loss well below ln(V)."""
    cfg = lab_config("cpu", n_layer=2, n_embd=64, n_head=4, block_size=32)
    model = GPT(cfg)
    data = SyntheticData(cfg.vocab_size, 32, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for i in range(60):
        loss = model(*data.batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(cfg.vocab_size)) < 0.3  # starts near uniform
    assert losses[-1] < losses[0] - 1.0


def test_synthetic_batches_are_deterministic_and_shifted():
    data = SyntheticData(64, 16, 4, seed=3)
    x1, y1 = data.batch(5)
    x2, y2 = SyntheticData(64, 16, 4, seed=3).batch(5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert x1.shape == (4, 16) and x1.dtype == torch.long


def test_head_is_tied_to_the_token_embedding():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))
    assert model.lm_head.weight is model.wte.weight


def test_sdpa_and_naive_attention_agree():
    torch.manual_seed(0)
    naive = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16))
    sdpa = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, attention="sdpa"))
    sdpa.load_state_dict(naive.state_dict())
    idx = torch.randint(256, (2, 16))
    torch.testing.assert_close(naive(idx), sdpa(idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, word", [
    (dict(n_embd=30, n_head=4), "n_head"),
    (dict(n_layer=0), "n_layer"),
    (dict(attention="flash"), "attention"),
    (dict(dropout=1.5), "dropout"),
])
def test_bad_config_names_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word):
        GPTConfig(**kwargs)


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_lab_config_is_small_on_cpu_and_takes_overrides():
    cfg = lab_config("cpu", n_layer=6)
    assert cfg.n_layer == 6 and cfg.n_embd <= 256
    assert lab_config("cuda").n_embd > cfg.n_embd


@pytest.mark.parametrize("call, name", [
    (lambda: GPTConfig(n_layer=True), "n_layer"),
    (lambda: GPTConfig(n_embd=128.0), "n_embd"),
    (lambda: GPTConfig(bias="no"), "bias"),
    (lambda: GPTConfig(dropout="0.1"), "dropout"),
    (lambda: GPT({"n_layer": 2}), "cfg"),
    (lambda: GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))(torch.zeros(2, 4)), "idx"),
    (lambda: GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))(torch.zeros(4, dtype=torch.long)), "idx"),
    (lambda: GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))(
        torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)), "targets"),
    (lambda: SyntheticData(64, 16, 0), "batch_size"),
    (lambda: SyntheticData(64, True, 4), "seq_len"),
    (lambda: SyntheticData(64, 16, 4, seed=-1), "seed"),
    (lambda: SyntheticData(3, 16, 4), "branching"),
    (lambda: SyntheticData(64, 16, 4).batch(-1), "i"),
    (lambda: lab_config("tpu"), "device"),
    (lambda: lab_config("cpu", n_layers=3), "n_layers"),
    (lambda: lab_batch_size(42), "device"),  # an int: refused on CPU and CUDA builds alike
    (lambda: lab_config(1.5), "device"),
])
def test_models_refuse_bad_input_naming_the_argument(call, name):
    with pytest.raises((ValueError, TypeError), match=name):
        call()


class _AnyRealDevice(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_DEVICE)


_REAL_DEVICE = torch.device


class _CudaBuildDevice(metaclass=_AnyRealDevice):
    """torch.device as a CUDA build of torch behaves: an int is an accelerator index, cuda:N."""

    def __new__(cls, spec, index=None):
        if isinstance(spec, int) and not isinstance(spec, bool):
            return _REAL_DEVICE("cuda", spec)
        return _REAL_DEVICE(spec) if index is None else _REAL_DEVICE(spec, index)


@pytest.mark.parametrize("call", [lambda: lab_batch_size(42), lambda: lab_config(0)])
def test_an_int_device_is_refused_on_a_cuda_build_too(monkeypatch, call):
    """Issue 28: on a CUDA build torch.device(42) is cuda:42, so a check that relies on torch
    refusing it passes on CPU machines only. Here torch.device behaves as on a CUDA build."""
    monkeypatch.setattr(torch, "device", _CudaBuildDevice)
    assert torch.device(42) == _REAL_DEVICE("cuda", 42)  # the fake does what a CUDA build does
    with pytest.raises(ValueError, match="device must be None, 'cpu', 'cuda' or a torch.device, got"):
        call()
