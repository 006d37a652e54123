"""What the demos of :mod:`labkit.cluster` share: the :class:`Demo` record, the usage error, the
course GPT built the same on every rank, timing, and the columns of a rank table."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from labkit.models import GPT, GPTConfig, SyntheticData


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


@dataclass(frozen=True)
class Demo:
    """One demo: ``run(rank, world_size, options)`` → this rank's figures (a dict),
    ``rows(results)`` → its table's lines, ``check(options, world_size)`` → UsageError if the
    job cannot run it. ``cpu_only``: its course modules keep their buffers on the CPU
    (``cpu_reason`` says which)."""

    name: str
    options: type
    run: Callable
    rows: Callable
    check: Callable | None = None
    cpu_reason: str | None = None
    defaults: dict = dataclasses.field(default_factory=dict)  # option defaults of this demo

    @property
    def cpu_only(self) -> bool:
        return self.cpu_reason is not None


def timed(device: str, fn, *args, **kwargs):
    """(seconds, result) of ``fn(*args, **kwargs)``, the GPU's queue drained at both ends."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def gpt(o):
    """(config, the course GPT of ``o``'s sizes), the same initial model on every rank."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=o.vocab_size, block_size=o.seq, n_layer=o.n_layer, n_head=o.n_head,
                    n_embd=o.n_embd)
    return cfg, GPT(cfg)


def gpt_and_batches(o, world_size: int):
    """The same initial course GPT on every rank (on ``o.device``) and ``batches[step][rank]``."""
    _, model = gpt(o)
    data = SyntheticData(o.vocab_size, o.seq, o.batch, seed=0, device=o.device)
    batches = [[data.batch(step * world_size + r) for r in range(world_size)] for step in range(o.steps)]
    return model.to(o.device), batches


def n_params(model: torch.nn.Module) -> int:
    """Ψ, the parameter count."""
    return sum(p.numel() for p in model.parameters())


def summed_calls(comms) -> dict:
    """The collective calls of several counts (``[{"calls": {op: n}}, ...]``), op by op."""
    calls = {}
    for c in comms:
        for op, n in c["calls"].items():
            calls[op] = calls.get(op, 0) + n
    return calls


def training_figures(o, psi: int, seconds: float, sent: int, calls: dict, losses: list) -> dict:
    """What every data-parallel training demo reports besides its own bytes: Ψ, bytes sent per
    step (and over the fp32 model, 4Ψ), the collective calls, the last loss, seconds per step."""
    return {"psi": psi, "bytes_sent_per_step": sent // o.steps, "sent_over_4psi": sent / o.steps / (4 * psi),
            "calls": calls, "final_loss": losses[-1], "step_seconds": seconds / o.steps}


def layer_figures(out: dict, seconds: float) -> dict:
    """What the one-layer demos (tensor and sequence parallelism) report besides their bytes: the
    collective calls of forward and of backward, and the seconds of the two."""
    return {"forward_calls": out["forward"]["calls"], "backward_calls": out["backward"]["calls"],
            "step_seconds": seconds}


def rows(results, columns) -> list[str]:
    """A header and one row per rank; ``columns``: (title, width, format, value(result)), the
    format after the width (``","``, ``".2f"``; a leading ``"+"`` is the sign)."""
    lines = [" ".join(f"{title:>{width}}" for title, width, _, _ in columns)]
    for r in results:
        lines.append(" ".join(format(value(r), f">{'+' if fmt.startswith('+') else ''}{width}{fmt.lstrip('+')}")
                              for _, width, fmt, value in columns))
    return lines


def key(name):
    """The column value ``result[name]``."""
    return lambda r: r[name]


RANK = ("rank", 4, "", key("rank"))
STEP_S = ("step s", 8, ".3f", key("step_seconds"))


def training_rows(results, what: Callable[[int], str], columns, *, calls: bool = True) -> list[str]:
    """A data-parallel training demo's table: a line on the model (Ψ, then ``what(Ψ)``, then the
    collective calls), then rank, ``columns``, bytes sent and step time."""
    psi = results[0]["psi"]
    line = f"model: {psi:,} parameters (Ψ); " + what(psi)
    line += f"; calls over all steps {results[0]['calls']}" if calls else ""
    return [line] + rows(results, [RANK, *columns, ("sent B/step", 12, ",", key("bytes_sent_per_step")),
                                   ("sent/(4Ψ)", 9, ".2f", key("sent_over_4psi")), STEP_S])
