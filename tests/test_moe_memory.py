"""labkit.moe_memory: the bytes of an MoE model by consumer (toolkit; not graded).

References: the parameter counts the model cards publish (Mixtral 8x7B: 46.7B total, 12.9B
active, Jiang et al. 2024 §2.1; DeepSeek-V3: 671B and 37B, arXiv 2412.19437), the course's own
``labkit.moe.MoELayer`` (its parameters counted by PyTorch), and the plain arithmetic of
sharding (the per-GPU static state of all ranks adds up to the whole model's once ZeRO-3
shards everything).
"""
from __future__ import annotations

import math

import pytest

from labkit import moe_memory as mm


@pytest.mark.parametrize("model,tol", [(mm.MIXTRAL_8X7B, 0.005), (mm.DEEPSEEK_V3, 0.02)])
def test_parameter_counts_reproduce_the_published_ones(model, tol):
    """Total within 0.5% of the published count for both; active within 0.5% (Mixtral's 12.9B)
    and 2% (DeepSeek-V3's "37B", a rounded figure: the config gives 37.5B)."""
    c = mm.param_counts(model)
    assert abs(c["total"] / model.published_total - 1) < 0.005, c
    assert abs(c["active"] / model.published_active - 1) < tol, c
    assert c["total"] == c["routed experts"] + c["other"]


def test_parameter_count_of_the_course_layer():
    """A gelu MoEModel with no attention, embedding or norms counts what MoELayer holds, apart
    from the terms the published models have and the course layer lacks."""
    import torch

    from labkit.moe import MoELayer

    layer = MoELayer(16, 8, 2, 32)
    model = mm.MoEModel(name="course", n_layer=1, hidden=16, vocab_size=1, attention_params=0,
                        dense_layers=0, dense_ffn=0, n_expert=8, top_k=2, expert_ffn=32, mlp="gelu")
    c = mm.param_counts(model)
    extra = 2 * 16 + 2 * 1 * 16 + 16  # two norms, embedding + output of V = 1, final norm
    assert c["total"] - extra == sum(p.numel() for p in layer.parameters())
    assert c["routed experts"] == sum(p.numel() for p in layer.experts.parameters())
    assert torch.is_tensor(next(layer.parameters()))


def test_static_bytes_shard_to_the_whole_model_under_zero_3():
    """dp·tp·pp ranks under ZeRO-3 (ep inside dp) hold 16 bytes × the total once between them."""
    model = mm.DEEPSEEK_V3
    total = 16 * mm.param_counts(model)["total"]
    for dp, ep, tp, pp in ((8, 8, 1, 1), (16, 4, 2, 2), (128, 64, 1, 16)):
        per = mm.per_gpu_static_bytes(model, dp=dp, ep=ep, tp=tp, pp=pp, zero_stage=3)
        assert math.isclose(sum(per.values()) * dp * tp * pp, total, rel_tol=1e-12)
    plain = mm.per_gpu_static_bytes(model)
    assert math.isclose(sum(plain.values()), total, rel_tol=1e-12)


def test_expert_parallelism_divides_only_the_experts():
    """E_p = 8 without ZeRO: the experts' bytes fall 8-fold, the dense part's stay."""
    model = mm.MIXTRAL_8X7B
    c = mm.param_counts(model)
    one = mm.per_gpu_static_bytes(model, dp=8, ep=1)["parameters"]
    eight = mm.per_gpu_static_bytes(model, dp=8, ep=8)["parameters"]
    assert one == 2 * c["total"]
    assert math.isclose(eight, 2 * (c["other"] + c["routed experts"] / 8))


def test_layer_activations_and_all_to_all_bytes_follow_the_capacity():
    """The received buffer is E·C·h·b with C = ⌈cf·T·k/E⌉ (labkit.moe.capacity); one
    all-to-all passes E·C·h·b; the experts' share grows with C, the combine's does not."""
    from labkit.moe import capacity

    model = mm.MIXTRAL_8X7B
    for cf in (1.0, 1.25, 2.0):
        C = capacity(4096, 8, 2, cf)
        got = mm.layer_activation_bytes(model, 4096, cf)
        assert got["dispatch"] == 8 * C * 4096 * 2
        assert got["combine"] == 4096 * 2 * 4096 * 2
        assert mm.all_to_all_bytes(4096, 8, 2, cf, 4096) == 8 * C * 4096 * 2


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="ep"):
        mm.per_gpu_static_bytes(mm.MIXTRAL_8X7B, dp=8, ep=3)
    with pytest.raises(ValueError, match="ep"):
        mm.per_gpu_static_bytes(mm.MIXTRAL_8X7B, dp=16, ep=16)
    with pytest.raises(ValueError, match="zero_stage"):
        mm.per_gpu_static_bytes(mm.MIXTRAL_8X7B, zero_stage=4)
    with pytest.raises(ValueError, match="capacity_factor"):
        mm.layer_activation_bytes(mm.MIXTRAL_8X7B, 10, 0)
    with pytest.raises(ValueError, match="tokens"):
        mm.all_to_all_bytes(0, 8, 2, 1.0, 16)
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        mm.gqa_attention_params(64, 4, 3, 16)
    with pytest.raises(ValueError, match="n_kv_head must be an integer >= 1"):
        mm.gqa_attention_params(64, 4, 0, 16)  # counted 8192 weights: no K, no V
    with pytest.raises(ValueError, match="kv_rank must be an integer >= 1"):
        mm.mla_attention_params(7168, 128, 1536, 0.5, 128, 64, 128)
