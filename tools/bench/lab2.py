"""Lab 2's reference solutions next to the library implementations of the same work.

Run with the solutions: ``LABKIT_SOLUTIONS=$PWD/solutions .venv/bin/python -m tools.bench --lab 2``.
Optimizer rows time one ``step()`` on gradients computed once beforehand (the optimizers' own
work); LOMO's row times forward + backward (its update runs inside backward) against forward +
backward + ``SGD.step()``; ZeRO-1's rows time a whole ``launch`` of 2 gloo ranks doing 3 steps,
so process start-up (the same for both) dilutes the ratio. ZeRO-Offload's row times forward +
backward + step (its gradient copies run inside backward) against the same with
``torch.optim.Adam``; on a CPU "device" and "host" are one memory, so the row measures the
mechanism's overhead (hooks, copies, master weights), not PCIe. NVMe's row times one step that
streams the state from files in a temporary directory (the page cache, on this machine) against
in-memory Adam. CAME's row is set next to ``torch.optim.Adafactor``, the closest library
optimizer: CAME does more per step (a first moment and the instability's factors), so its
ratio includes that extra work.
"""
from __future__ import annotations

import copy
import importlib

import torch

from tools.bench.case import Case


def _model_with_grads():
    from labkit.models import GPT, SyntheticData, lab_config

    torch.manual_seed(0)
    model = GPT(lab_config("cpu"))
    data = SyntheticData(model.config.vocab_size, model.config.block_size, 4)
    x, y = data.batch(0)
    model(x, y).backward()
    return model, (x, y)


def _step_case(label, make_ours, make_ref, ref_name, repeat=15, **extra):
    model, _ = _model_with_grads()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    for p, q, r in zip(model.parameters(), a.parameters(), b.parameters()):
        q.grad, r.grad = p.grad.clone(), p.grad.clone()
    ours, ref = make_ours(a.parameters()), make_ref(b.parameters())
    return Case(lab=2, label=label, ours=ours.step, ref=ref.step, ref_name=ref_name, repeat=repeat,
                **extra)


def cases() -> list[Case]:
    from labkit.lab2.adafactor import Adafactor
    from labkit.lab2.adam8bit import Adam8bit
    from labkit.lab2.lomo import LOMO

    rows = []
    try:
        import bitsandbytes as bnb

        rows.append(_step_case("Adam8bit step, lab GPT", lambda p: Adam8bit(p, lr=1e-3),
                               lambda p: bnb.optim.Adam8bit(p, lr=1e-3, min_8bit_size=0),
                               "bitsandbytes Adam8bit"))
    except ImportError:  # pragma: no cover - optional
        pass
    rows.append(_step_case("Adam8bit step, lab GPT", lambda p: Adam8bit(p, lr=1e-3),
                           lambda p: torch.optim.Adam(p, lr=1e-3), "torch Adam (fp32 states)",
                           target=None, note="context: what 4x smaller states cost in time (each "
                           "step dequantizes and requantizes every state; fp32 Adam does neither)"))
    rows.append(_step_case("Adafactor step, lab GPT", lambda p: Adafactor(p, lr=1e-2),
                           lambda p: torch.optim.Adafactor(p, lr=1e-2), "torch Adafactor"))

    model, batch = _model_with_grads()
    lomo_model, sgd_model = copy.deepcopy(model), copy.deepcopy(model)
    for m in (lomo_model, sgd_model):
        m.zero_grad(set_to_none=True)
    LOMO(lomo_model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=1e-3)

    def lomo_step():
        lomo_model(*batch).backward()

    def sgd_step():
        sgd_model(*batch).backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)

    rows.append(Case(lab=2, label="LOMO fwd+bwd (update in bwd), lab GPT", ours=lomo_step,
                     ref=sgd_step, ref_name="fwd+bwd+torch SGD step"))

    rows.extend(_offload_cases())

    importlib.import_module("torch.distributed.optim")  # once here, inherited by the forked ranks

    from labkit.ranks import launch
    from labkit.models import GPT, SyntheticData, lab_config
    from labkit.harness.lab2 import train_data_parallel

    torch.manual_seed(0)
    zmodel = GPT(lab_config("cpu"))
    zdata = SyntheticData(zmodel.config.vocab_size, zmodel.config.block_size, 4)
    batches = [[zdata.batch(2 * s + r) for r in range(2)] for s in range(3)]

    def run(kind):
        return lambda: launch(train_data_parallel, 2, zmodel, batches, optimizer=kind, lr=1e-3,
                              timeout=300)

    for kind, name in (("zero_redundancy", "ZeroRedundancyOptimizer + Adam"), ("ddp", "DDP + Adam")):
        rows.append(Case(lab=2, label="ZeRO-1 Adam, 2 ranks × 3 steps (launch)", ours=run("zero1"),
                         ref=run(kind), ref_name=name, repeat=3,
                         note="includes process start-up"))
    return rows


def _offload_cases() -> list[Case]:
    import tempfile

    from labkit.lab2.came import CAME
    from labkit.lab2.nvme_offload import NVMeAdam
    from labkit.lab2.zero_offload import ZeROOffload

    rows = [_step_case("CAME step, lab GPT", lambda p: CAME(p), lambda p: torch.optim.Adafactor(p, lr=1e-2),
                       "torch Adafactor", )]
    rows[-1].note = "CAME also keeps m and the instability's factors"

    model, batch = _model_with_grads()
    off_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    for m in (off_model, ref_model):
        m.zero_grad(set_to_none=True)
    offload = ZeROOffload(off_model, lr=1e-3)
    adam = torch.optim.Adam(ref_model.parameters(), lr=1e-3)

    def offload_step():
        off_model(*batch).backward()
        offload.step()

    def adam_step():
        ref_model(*batch).backward()
        adam.step()
        adam.zero_grad(set_to_none=True)

    rows.append(Case(lab=2, label="ZeRO-Offload fwd+bwd+step, lab GPT (CPU)", ours=offload_step,
                     ref=adam_step, ref_name="fwd+bwd+torch Adam step",
                     note="on a CPU host = device: the hooks' and master's overhead"))

    nvme_model, mem_model = copy.deepcopy(model), copy.deepcopy(model)
    for p, q, r in zip(model.parameters(), nvme_model.parameters(), mem_model.parameters()):
        q.grad, r.grad = p.grad.clone(), p.grad.clone()  # deepcopy does not copy .grad
    tmp = tempfile.mkdtemp(prefix="labkit-bench-nvme-")
    nvme = NVMeAdam(nvme_model.parameters(), tmp, lr=1e-3, read_ahead=1)
    mem = torch.optim.Adam(mem_model.parameters(), lr=1e-3)
    rows.append(Case(lab=2, label="NVMe Adam step (state in files), lab GPT", ours=nvme.step,
                     ref=mem.step, ref_name="torch Adam (state in memory)",
                     target=None, note="context: reads and writes 8Ψ bytes through the page "
                     "cache each step; torch Adam keeps them in memory"))
    return rows
