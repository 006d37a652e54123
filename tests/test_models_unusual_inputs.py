"""labkit.models and labkit.flat_params under inputs their main tests do not try.

What works is checked against the plain computation (integer ceiling, torch's cross_entropy);
what cannot work is refused with a ValueError/TypeError naming the argument and what is allowed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from labkit.flat_params import copy_from_flat, flatten_padded, partition, shard_range
from labkit.models import GPT, GPTConfig, SyntheticData

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


@pytest.mark.parametrize("numel, world_size", [(10**20, 3), (2**53 + 1, 2), (7, 3)])
def test_partition_is_exact_for_any_integer_size(numel, world_size):
    """Check S = ceil(Ψ/N) in integers: a float division gave padding -4,096 at Ψ = 10**20, N = 3."""
    shard, padding = partition(numel, world_size)
    assert shard == -(-numel // world_size) and 0 <= padding < world_size
    assert shard * world_size == numel + padding


def test_numpy_integers_are_sizes_too():
    """Check np.int64 sizes (from numpy arithmetic) work like ints."""
    assert partition(np.int64(5), np.int64(2)) == (3, 1)
    assert shard_range(np.int64(1), np.int64(3)) == slice(3, 6)


@pytest.mark.parametrize("call, error, words", [
    (lambda: flatten_padded([1, 2], 0, torch.float32), TypeError, "tensors must hold only tensors, got int"),
    (lambda: flatten_padded(torch.ones(3), 0, torch.float32), TypeError, "single Tensor"),
    (lambda: flatten_padded([torch.ones(3)], 0, "float32"), TypeError, "dtype must be a torch.dtype"),
    (lambda: flatten_padded([torch.ones(3), torch.ones(2, device="meta")], 0, torch.float32),
     ValueError, r"one device .*\['cpu', 'meta'\]"),
    (lambda: copy_from_flat([1.0, 2.0], [torch.ones(2)]), TypeError, "flat must be a 1-D tensor, got list"),
    (lambda: copy_from_flat(torch.ones(2, 2), [torch.ones(2), torch.ones(2)]), TypeError, r"shape \(2, 2\)"),
    (lambda: copy_from_flat(torch.ones(4), torch.ones(4)), TypeError, "single Tensor"),
])
def test_flat_vectors_refuse_what_is_not_a_list_of_tensors(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_flatten_and_copy_back_handle_non_contiguous_bf16_and_empty_tensors():
    """Check a transposed bf16 tensor and an empty one round-trip, element for element."""
    src = [torch.arange(12.0).reshape(3, 4).t().to(torch.bfloat16), torch.empty(0), torch.arange(2.0)]
    flat = flatten_padded(src, 3, torch.float32)
    assert flat.tolist() == src[0].reshape(-1).float().tolist() + [0.0, 1.0] + [0.0] * 3
    dst = [torch.zeros(4, 3, dtype=torch.bfloat16), torch.empty(0), torch.zeros(2)]
    copy_from_flat(flat, dst)
    assert all(torch.equal(a, b) for a, b in zip(src, dst))


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
