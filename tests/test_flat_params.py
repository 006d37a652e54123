"""labkit.flat_params: the padded flat partition under ZeRO-1/2/3 (checked against plain arithmetic)."""
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
