"""Lab 7's parallel plans under torchrun: each rank's MemTracker peak next to ``run_plan.predict_peak``."""
from __future__ import annotations

from labkit.cluster.common import RANK, STEP_S, Demo, UsageError, gpt, key, rows as table_rows
from labkit.cluster.options import PlanRun
from labkit.comm_count import count_comm
from labkit.harness.lab7 import run_plans_worker
from labkit.lab7.run_plan import PLANS, Plan, predict_peak
from labkit.models import SyntheticData


def plan_from_config(config: str, world_size: int) -> Plan:
    """``--config`` → a ``run_plan.Plan`` of ``world_size`` ranks (UsageError if it cannot be).

    ``config`` is a name of ``run_plan.PLANS`` (``tp2xdp2``, ``pp2xdp2``, ``zero3x4``…) or tokens
    joined by ``x``: ``dpN``, ``tpN``, ``ppN``, ``zeroK``, ``mN`` (micro-batches), ``gpipe``,
    ``1f1b``, ``ckpt``; the data-parallel size is what the other axes leave."""
    if config in PLANS:
        plan = PLANS[config]
    else:
        fields, sizes = {}, {"dp": None, "tp": 1, "pp": 1}
        for token in config.replace(",", "x").split("x"):
            name = token.rstrip("0123456789")
            number = token[len(name):]
            if name in sizes and number:
                sizes[name] = int(number)
            elif name == "zero" and number:
                fields["zero_stage"] = int(number)
            elif name == "m" and number:
                fields["n_micro"] = int(number)
            elif token in ("gpipe", "1f1b"):
                fields["schedule"] = token
            elif token == "ckpt":
                fields["checkpointing"] = True
            else:
                raise UsageError(f"--config {config!r}: unknown part {token!r}; use dpN, tpN, ppN, "
                                 f"zeroK, mN, gpipe, 1f1b, ckpt joined by 'x', or one of {', '.join(PLANS)}")
        inner = sizes["tp"] * sizes["pp"]
        if sizes["dp"] is None:
            if inner < 1 or world_size % inner:
                raise UsageError(f"--config {config!r}: tp·pp = {inner} does not divide the world size {world_size}")
            sizes["dp"] = world_size // inner
        plan = Plan(**sizes, **fields)
    if plan.world_size != world_size:
        raise UsageError(f"--config {config!r} needs dp·pp·tp = {plan.world_size} ranks, the job has "
                         f"{world_size}: use --nproc-per-node (times nodes) = {plan.world_size}")
    return plan


def run(rank: int, world_size: int, o: PlanRun) -> dict:
    """The course GPT trained under a parallel plan (lab 7, ``--config``; ``--batch`` is
    sequences per replica): each rank's MemTracker peak next to ``run_plan.predict_peak``, bytes
    sent per step, and the loss per step."""
    plan = plan_from_config(o.config, world_size)
    cfg, model = gpt(o)  # the same initial model and batches on every rank
    data = SyntheticData(o.vocab_size, o.seq, o.batch * plan.dp, seed=0)
    batches = [data.batch(step) for step in range(o.steps)]
    with count_comm() as c:
        out = run_plans_worker(rank, world_size, [plan], cfg, model.state_dict(), batches)[0]
    return {"rank": rank, "plan": out["label"], "coords": out["coords"], "peak_bytes": out["peak"],
            "predicted_peak_bytes": predict_peak(plan, cfg, o.batch * plan.dp, rank),
            "at_peak": out["at_peak"], "bytes_sent_per_step": sum(c.bytes_sent.values()) // o.steps,
            "calls": dict(c.calls), "losses": out["losses"], "step_seconds": out["seconds"] / o.steps}


def rows(results) -> list[str]:
    def losses(r):
        return "-" if r["losses"][0] is None else " ".join(f"{v:.4f}" for v in r["losses"])

    def coords(r):
        c = r["coords"]
        return f"{c['dp']:>3},{c['pp']},{c['tp']:<3}"

    return [f"plan: {results[0]['plan']}; peak per rank (MemTracker) next to run_plan.predict_peak"] + table_rows(
        results, [RANK, ("dp,pp,tp", 9, "", coords), ("peak B", 12, ",", key("peak_bytes")),
                  ("predicted B", 12, ",", key("predicted_peak_bytes")),
                  ("gap", 7, "+.1%", lambda r: r["peak_bytes"] / r["predicted_peak_bytes"] - 1),
                  ("sent B/step", 12, ",", key("bytes_sent_per_step")), STEP_S, ("losses", 0, "", losses)])


def check(o: PlanRun, world_size: int) -> None:
    plan = plan_from_config(o.config, world_size)
    if o.n_head % plan.tp:
        raise UsageError(f"--config {o.config!r}: tp = {plan.tp} must divide --n-head {o.n_head}")
    if o.n_layer % plan.pp:
        raise UsageError(f"--config {o.config!r}: pp = {plan.pp} must divide --n-layer {o.n_layer}")
    if o.batch % plan.n_micro:
        raise UsageError(f"--config {o.config!r}: {plan.n_micro} micro-batches must divide --batch "
                         f"{o.batch} (sequences per replica)")


DEMO = Demo("plan", PlanRun, run, rows, check,
            cpu_reason="labkit.lab3.pipeline and labkit.lab3.zero3 keep their buffers on the CPU")
