"""Lab 4's reference solutions next to PyTorch doing the same work (tools/bench).

The bench runs in one process, so the distributed rows use a one-rank gloo group (world size 1):
they time the mechanism (hooks, bucket copies, the collective calls, the sharded Adam) next to
``DistributedDataParallel`` and ``torch.optim.Adam``, not the network.
"""
from __future__ import annotations

import copy

import torch

from tools.bench.case import Case, one_rank_group


def _ddp_cases() -> list[Case]:
    from torch.nn.parallel import DistributedDataParallel

    from labkit.lab4.bucketed_ddp import BucketedDDP
    from labkit.lab4.grad_accumulation import accumulate_gradients
    from labkit.models import GPT, SyntheticData, lab_config
    from labkit.lab4.zero2 import ZeRO2Adam

    one_rank_group()
    torch.manual_seed(0)
    cfg = lab_config("cpu")
    base = GPT(cfg)
    x, y = SyntheticData(cfg.vocab_size, cfg.block_size, 8).batch(0)

    ours_model = copy.deepcopy(base)
    ours = BucketedDDP(ours_model)
    ref = DistributedDataParallel(copy.deepcopy(base))

    def ours_backward():
        ours(x, y).backward()
        ours.finish()
        ours_model.zero_grad(set_to_none=True)

    def ref_backward():
        ref(x, y).backward()
        ref.zero_grad(set_to_none=True)

    z_model = copy.deepcopy(base)
    z_opt = ZeRO2Adam(z_model.parameters(), lr=1e-3)
    a_model = copy.deepcopy(base)
    a_ddp = DistributedDataParallel(a_model)
    a_opt = torch.optim.Adam(a_model.parameters(), lr=1e-3)

    def zero2_step():
        z_model(x, y).backward()
        z_opt.step()
        z_opt.zero_grad()

    def ddp_adam_step():
        a_ddp(x, y).backward()
        a_opt.step()
        a_opt.zero_grad(set_to_none=True)

    acc_model, full_model = copy.deepcopy(base), copy.deepcopy(base)

    def accumulate():
        accumulate_gradients(acc_model, x, y, 4)
        acc_model.zero_grad(set_to_none=True)

    def full_batch():
        full_model(x, y).backward()
        full_model.zero_grad(set_to_none=True)

    return [
        Case(lab=4, label="BucketedDDP forward+backward+finish, lab GPT, 1 rank", ours=ours_backward,
             ref=ref_backward, ref_name="DistributedDataParallel"),
        Case(lab=4, label="ZeRO2Adam step (forward, backward, step), lab GPT, 1 rank", ours=zero2_step,
             ref=ddp_adam_step, ref_name="DDP + torch.optim.Adam"),
        Case(lab=4, label="accumulate_gradients k = 4 vs one backward, lab GPT", ours=accumulate,
             ref=full_batch, ref_name="one backward over the batch",
             target=None, note="context: k smaller passes, the time that accumulation trades for memory"),
    ]


def _hook_ddp(hook=None, state=None):
    """DDP around a gradient-heavy MLP (three 512×512 layers, batch 4: backward is cheap, so the
    time is mostly the communication hook's), one bucket, ``hook`` registered on the fresh DDP
    and two steps taken before the timing (both hook states all-reduce plainly until iteration 2,
    ``start_iter`` / ``start_powerSGD_iter``: across DDP's bucket rebuild)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    L = torch.nn.Linear
    ddp = DistributedDataParallel(torch.nn.Sequential(L(512, 512), torch.nn.ReLU(), L(512, 512),
                                                      torch.nn.ReLU(), L(512, 512)),
                                  bucket_cap_mb=1024)
    x = torch.randn(4, 512)
    if hook is not None:
        ddp.register_comm_hook(state, hook)

    def step():
        ddp(x).square().mean().backward()
        ddp.zero_grad(set_to_none=True)
    for _ in range(2):  # the plain iterations before the hooks compress
        step()
    return step


def _compression_cases() -> list[Case]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ref_psgd

    from labkit.lab4.compression import CompressionState, compression_hook
    from labkit.lab4.powersgd import PowerSGDState, powersgd_hook

    one_rank_group()
    ref_state = ref_psgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                       min_compression_rate=1, use_error_feedback=True,
                                       warm_start=True, random_seed=0)
    return [
        Case(lab=4, label="powersgd_hook r = 4, MLP 3×512², 1 rank",
             ours=_hook_ddp(powersgd_hook, PowerSGDState(4)),
             ref=_hook_ddp(ref_psgd.powerSGD_hook, ref_state), ref_name="PyTorch powerSGD_hook"),
        Case(lab=4, label="compression_hook int8 (chunk 256), MLP 3×512², 1 rank",
             ours=_hook_ddp(compression_hook, CompressionState("int8", chunk=256)),
             ref=_hook_ddp(default_hooks.fp16_compress_hook, None), ref_name="PyTorch fp16_compress_hook",
             target=None, note="context: int8 quantizes per chunk, all-gathers and decodes each rank's part; fp16 casts and all-reduces"),
        Case(lab=4, label="compression_hook int8 (chunk 256), MLP 3×512², 1 rank",
             ours=_hook_ddp(compression_hook, CompressionState("int8", chunk=256)),
             ref=_hook_ddp(default_hooks.allreduce_hook, None), ref_name="PyTorch allreduce_hook",
             target=None, note="context: the hook does more passes over the gradients than a plain all-reduce; it pays only where the network, not memory bandwidth, is the bottleneck"),
    ]


def _int8_case() -> list[Case]:
    """Decoding int8 codes with one scale per chunk (a bucket of 2²⁰ + 100 elements: the last
    chunk is short) next to PyTorch's dequantize of a per-channel quantized tensor (a cast and a
    multiply, fused)."""
    import warnings

    from labkit.lab4.compression import dequantize_int8, quantize_int8

    n, chunk = 2 ** 20 + 100, 256
    codes, scales = quantize_int8(torch.randn(n), chunk)
    chunks = scales.numel()
    padded = torch.cat([codes, codes.new_zeros(chunks * chunk - n)]).view(chunks, chunk)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13; still there
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(padded, scales.double(),
                                                     torch.zeros(chunks, dtype=torch.long), 0)
    return [Case(lab=4, label="dequantize_int8, 2²⁰ + 100 elements, chunk 256",
                 ours=lambda: dequantize_int8(codes, scales, chunk), ref=q.dequantize,
                 ref_name="torch per-channel dequantize")]


def cases() -> list[Case]:
    return _ddp_cases() + _compression_cases() + _int8_case()
