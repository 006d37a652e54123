"""labkit.flat_params: the padded flat partition under ZeRO-1/2/3 (checked against plain arithmetic,
exact for any integer size), and what it refuses."""
import numpy as np
import pytest
import torch

from labkit.flat_params import copy_from_flat, flatten_padded, partition, shard_range


@pytest.mark.parametrize("numel,world_size", [(1, 1), (605, 2), (605, 4), (8, 8), (7, 8), (10**9 + 7, 64)])
def test_partition_gives_equal_shards_covering_every_element(numel, world_size):
    shard, pad = partition(numel, world_size)
    assert shard * world_size == numel + pad and 0 <= pad < world_size
    assert (shard - 1) * world_size < numel  # no smaller equal shard would cover numel


def test_flatten_then_copy_back_round_trips_and_ranges_tile_the_vector():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    shard, pad = partition(30, 4)
    flat = flatten_padded(tensors, pad, torch.float64)
    assert flat.shape == (32,) and flat.dtype == torch.float64 and flat[30:].eq(0).all()
    pieces = [flat[shard_range(r, shard)] for r in range(4)]
    assert torch.equal(torch.cat(pieces), flat)
    out = [torch.empty_like(t) for t in tensors]
    copy_from_flat(flat.float(), out)
    for a, b in zip(out, tensors):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call,name", [
    (lambda: partition(0, 2), "numel"), (lambda: partition(5, 0), "world_size"),
    (lambda: partition(5.0, 2), "numel"), (lambda: partition(5, True), "world_size"),
    (lambda: shard_range(-1, 3), "rank"), (lambda: shard_range(0, 0), "shard_size"),
    (lambda: flatten_padded([], 0, torch.float32), "tensors"),
    (lambda: flatten_padded([torch.ones(2)], -1, torch.float32), "padding"),
    (lambda: copy_from_flat(torch.ones(2), [torch.ones(3)]), "flat"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


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
