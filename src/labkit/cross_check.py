"""Per-rank bytes of the course's own ZeRO-2, ZeRO-3, tensor-parallel and pipeline code, measured
on real gloo ranks, for comparison with the per-GPU memory model ``labkit.lab6.parallel_memory``.

Chapter 6 checks its model of a configuration (exercise 6.4) against what the implementations
of Labs 3 and 4 actually keep on each rank: ``labkit.lab4.zero2.ZeRO2Adam`` (exercise 4.3),
``labkit.lab3.zero3.ZeRO3`` (3.7), ``labkit.lab3.tensor_parallel.TPAttention`` / ``TPMLP`` (3.4) and the
stages of ``labkit.lab3.pipeline`` (3.6). Each function below runs in one rank under
``labkit.ranks.launch``, takes one fp32 Adam step and returns this rank's bytes of
parameters, gradients and optimizer states (every storage counted once, Adam's step counters
excluded as the model excludes them), counted from the tensors themselves.

Infrastructure that *uses* exercise modules (imported inside each function): with the
solutions loaded it measures the references; in a student's edition it measures the student's
own Labs 3–4. It is not graded: ``tests/test_lab6_cross_check.py`` and Chapter 6 run it with
the solutions. Chapter: book/06_system.md.
"""
from __future__ import annotations

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped; a view counts its whole
    storage once, a freed storage 0)."""
    seen = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    return sum(seen.values())


def zero2_bytes(rank: int, world_size: int, model: torch.nn.Module, batch) -> dict:
    """One step of ``ZeRO2Adam`` (exercise 4.3) on this rank's ``batch[rank]``.

    Parameters: the full model (ZeRO-2 keeps them); gradients: the gradient shard plus any full
    ``.grad`` still alive after the step; optimizer states: the shard's states (m, v, and an
    fp32 master slice for 16-bit parameters)."""
    from labkit.lab4.zero2 import ZeRO2Adam

    torch.set_num_threads(1)
    params = list(model.parameters())
    opt = ZeRO2Adam(params, lr=1e-3)
    x, y = batch[rank]
    model(x, y).backward()
    opt.step()
    out = {"parameters": storage_bytes(params),
           "gradients": storage_bytes([opt.grad_shard] + [p.grad for p in params]),
           "optimizer states": storage_bytes(opt.state.values())}
    opt.remove()
    return out


def zero3_bytes(rank: int, world_size: int, model: torch.nn.Module, batch) -> dict:
    """One step of ``ZeRO3`` (exercise 3.7) on this rank's ``batch[rank]``.

    Parameters: the shards plus whatever gathered full buffers are still allocated after the
    step (none once every unit is freed); gradients: the averaged gradient slices after
    backward plus any full ``.grad`` left; optimizer states: m and v of the shards."""
    from labkit.lab3.zero3 import ZeRO3

    torch.set_num_threads(1)
    z = ZeRO3(model, lr=1e-3)
    x, y = batch[rank]
    model(x, y).backward()
    grads = storage_bytes([u.grad for u in z.units] + [p.grad for p in model.parameters()])
    z.step()
    return {"parameters": storage_bytes([u.shard for u in z.units] + [u.full for u in z.units]),
            "gradients": grads,
            "optimizer states": storage_bytes([t for u in z.units for t in (u.exp_avg, u.exp_avg_sq)])}


def tensor_parallel_bytes(rank: int, world_size: int, block: torch.nn.Module,
                          x: torch.Tensor) -> dict:
    """One Adam step of a GPT block's attention and MLP made tensor-parallel over all ranks with
    ``TPAttention`` and ``TPMLP`` (exercise 3.4), on the hidden states ``x`` (same on every rank).

    Returns this rank's bytes of their parameters, gradients and ``torch.optim.Adam`` states,
    and ``n_params``: the parameters of the unsplit attention and MLP (LayerNorms excluded)."""
    from labkit.lab3.tensor_parallel import TPAttention, TPMLP

    torch.set_num_threads(1)
    n_params = sum(p.numel() for m in (block.attn, block.mlp) for p in m.parameters())
    attn, mlp = TPAttention(block.attn), TPMLP(block.mlp)
    params = list(attn.parameters()) + list(mlp.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    h = x + attn(x)
    (h + mlp(h)).pow(2).mean().backward()
    opt.step()
    states = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    return {"n_params": n_params, "parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params),
            "optimizer states": storage_bytes(states)}


def pipeline_bytes(rank: int, world_size: int, cfg, state: dict, x: torch.Tensor,
                   y: torch.Tensor) -> dict:
    """One step of stage ``rank`` of ``world_size`` (``labkit.lab3.pipeline.split_gpt``, run by
    ``run_stage``, exercise 3.6; one micro-batch) with ``torch.optim.Adam`` on the stage.

    Returns this stage's bytes of parameters, gradients and Adam states."""
    from labkit.models import GPT
    from labkit.lab3.pipeline import run_stage, split_gpt

    torch.set_num_threads(1)
    model = GPT(cfg)
    model.load_state_dict(state)
    stage = split_gpt(model, world_size)[rank]
    params = list(stage.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    run_stage(stage, [("F", 0), ("B", 0)], [x], [y], rank=rank, world_size=world_size)
    opt.step()
    states = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    torch.distributed.barrier()
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
            "optimizer states": storage_bytes(states)}
