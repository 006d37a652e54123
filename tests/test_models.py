"""The course's GPT and its synthetic data: it learns, its batches are deterministic, its two
attentions agree; bad configurations, token ids, targets, devices and seeds are named (an empty
batch gives what torch's cross_entropy gives for no elements)."""
import math

import pytest
import torch
import torch.nn.functional as F

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


TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


@pytest.mark.parametrize("idx, targets, words", [
    (torch.full((2, 4), 32), None, r"idx holds token ids outside \[0, vocab_size=32\): min 32"),
    (torch.full((2, 4), -1), None, r"min -1"),
    (torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4), 40), r"targets hold ids outside"),
    (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4), r"int64 tensor shaped like idx .* torch.float32"),
    (torch.zeros(2, 4, dtype=torch.long, device="meta"), None, r"idx is on meta and the model on cpu"),
])
def test_gpt_names_bad_token_ids_and_devices(idx, targets, words):
    """Check out-of-vocabulary ids (IndexError "index out of range in self" before), float targets
    (a RuntimeError inside cross_entropy) and a meta idx (silently NaN logits) are named."""
    with pytest.raises(ValueError, match=words):
        GPT(TINY)(idx.long() if idx.dtype != torch.long and idx.device.type != "meta" else idx, targets)


def test_an_empty_batch_gives_torch_cross_entropy_of_nothing():
    """Check B·T = 0 gives what F.cross_entropy gives for no elements (NaN), not a reshape error."""
    idx = torch.zeros(0, 4, dtype=torch.long)
    want = F.cross_entropy(torch.zeros(0, 32), torch.zeros(0, dtype=torch.long))
    got = GPT(TINY)(idx, idx)
    assert got.isnan() and want.isnan()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_synthetic_data_on_cuda_without_a_gpu_is_refused_when_made():
    """Check device='cuda' on a CPU machine is a ValueError at construction (it was an
    AssertionError from torch at the first batch)."""
    with pytest.raises(ValueError, match="device='cuda', and CUDA is not available here"):
        SyntheticData(8, 4, 2, device="cuda")


def test_synthetic_data_seeds_are_bounded_and_large_batch_indices_work():
    """Check a seed past 2**63 is named (it was "Overflow when unpacking long long") and batch i
    of a large seed still returns a batch."""
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        SyntheticData(8, 4, 2, seed=2**70)
    x, y = SyntheticData(8, 4, 2, seed=2**62).batch(10**12)
    assert x.shape == y.shape == (2, 4)
    assert torch.equal(SyntheticData(8, 4, 2, seed=3).batch(5)[0], SyntheticData(8, 4, 2, seed=3).batch(5)[0])
