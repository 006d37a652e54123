"""Lab 4's reference solutions next to PyTorch doing the same work (tools/bench).

The bench runs in one process, so the distributed rows use a one-rank gloo group (world size 1):
they time the mechanism (hooks, bucket copies, the collective calls, the sharded Adam) next to
``DistributedDataParallel`` and ``torch.optim.Adam``, not the network.
"""
from __future__ import annotations

import copy

import torch

from tools.bench.case import Case, one_rank_group


def cases() -> list[Case]:
    from torch.nn.parallel import DistributedDataParallel

    from labkit.bucketed_ddp import BucketedDDP
    from labkit.grad_accumulation import accumulate_gradients
    from labkit.models import GPT, SyntheticData, lab_config
    from labkit.zero2 import ZeRO2Adam

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
             note="k smaller passes: the time that accumulation trades for memory"),
    ]
