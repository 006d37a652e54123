"""Per exercise, the library functions it rebuilds: refused while that exercise is graded.

An exercise that rebuilds something PyTorch ships (FlashAttention, GradScaler, Adafactor, DDP…)
is graded against that very implementation; a student who calls it earns the points and learns
nothing. :data:`REBUILDS` lists, per exercise, those functions (dotted paths; an entry that is a
package or module blocks everything under it) and why. The static scan
(:mod:`labkit.grade.scan`) names them in the student's code; at run time
(:mod:`labkit.grade.guard`) each one is wrapped so that a call made while one of the exercise's
tests runs raises, if the student's code is on the call stack. References in
``labkit.reference`` and the tests call them freely: no student frame is on their stack.

The lists were made from each exercise's contract and reference solution: what a solution
legitimately uses is not here (5.2's contract requires ``torch.utils.checkpoint.checkpoint``;
5.7 attends each block with ``aten._scaled_dot_product_flash_attention_for_cpu``, so those are
refused for 5.6 only; 3.3's contract is "one ``_scaled_mm``"; 2.6 steps ``torch.optim.Adam`` on
the host, which is the exercise's design, so Adam is refused for 2.3, 2.7, 3.2, 3.7 and 4.3 only).
"""
from __future__ import annotations

SDPA_OPS = ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
            "_scaled_dot_product_attention_math_for_mps",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
            "_scaled_dot_product_fused_attention_overrideable",
            "_scaled_dot_product_fused_attention_overrideable_backward",
            "_flash_attention_forward", "_flash_attention_backward",
            "_efficient_attention_forward", "_efficient_attention_backward", "_fused_sdp_choice")
ADAM = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.adam", "torch.optim.adamw",
        "torch._fused_adam_", "torch._fused_adamw_", "torch.ops.aten._fused_adam_",
        "torch.ops.aten._fused_adamw_")


def _op(name: str) -> tuple[str, ...]:
    """Every Python spelling of aten op ``name``: torch.ops.aten.X, torch.X, torch._C._nn.X…"""
    return (f"torch.ops.aten.{name}", f"torch.{name}", f"torch._C._VariableFunctions.{name}",
            f"torch._C._nn.{name}", f"torch.nn.functional.{name}")


def _entry(why: str, *names: str) -> dict:
    return {"why": why, "names": tuple(dict.fromkeys(names))}


REBUILDS: dict[str, dict] = {
    "1.1": _entry("counts the parameters from the config alone: building the model and "
                  "counting its tensors is the reference here",
                  "labkit.models.GPT", "torch.nn.Module.parameters", "torch.nn.Module.named_parameters"),
    "1.3": _entry("adds up the saved activations op by op: measuring them with saved-tensor "
                  "hooks or MemTracker is the reference here",
                  "torch.autograd.graph.saved_tensors_hooks",
                  "torch.distributed._tools.mem_tracker", "labkit.measure"),
    "2.1": _entry("writes Adafactor's step itself: torch.optim.Adafactor is the reference here",
                  "torch.optim.Adafactor", "torch.optim._adafactor"),
    "2.2": _entry("quantizes block-wise itself: bitsandbytes' kernels are the reference here",
                  "bitsandbytes"),
    "2.3": _entry("takes the 8-bit Adam step itself: bitsandbytes' Adam8bit and torch's Adam "
                  "are the references here", "bitsandbytes", *ADAM),
    "2.5": _entry("shards the optimizer itself: ZeroRedundancyOptimizer is the reference here",
                  "torch.distributed.optim.ZeroRedundancyOptimizer",
                  "torch.distributed.optim.zero_redundancy_optimizer",
                  "torch.distributed.fsdp", "torch.distributed._composable.fsdp"),
    "2.7": _entry("streams Adam over the groups itself: torch's Adam is the reference here", *ADAM),
    # 3.1 may unscale with torch._amp_foreach_non_finite_check_and_unscale_ (one fused kernel per
    # device and dtype, what the reference solution shows: issue 29); the scale's state machine is
    # the exercise, so GradScaler and the kernel that updates the scale are refused.
    "3.1": _entry("keeps the scale itself: GradScaler and its scale-update kernel are the "
                  "reference here",
                  "torch.amp.GradScaler", "torch.amp.grad_scaler", "torch.cuda.amp.GradScaler",
                  "torch.cpu.amp.GradScaler", *_op("_amp_update_scale_")),
    # 3.2 is the fp32 master around Adam (state, dtypes, copying back): its update may use the
    # fused kernel torch._fused_adam_ on the masters (the reference does: issue 29); torch's Adam
    # optimizer classes, which would own the masters' state, are refused.
    "3.2": _entry("keeps the fp32 master and its state itself: torch's Adam optimizer is the "
                  "reference here", *ADAM[:4]),
    "3.4": _entry("splits the layers over the ranks itself: torch.distributed.tensor.parallel "
                  "(parallelize_module, ColwiseParallel, RowwiseParallel) is the reference here",
                  "torch.distributed.tensor.parallel"),
    "3.5": _entry("builds the pipeline schedules itself: torch.distributed.pipelining is the "
                  "reference here", "torch.distributed.pipelining"),
    "3.6": _entry("runs the pipeline stage itself: torch.distributed.pipelining is the reference "
                  "here", "torch.distributed.pipelining"),
    "3.7": _entry("shards the parameters itself: FSDP2's fully_shard is the reference here",
                  "torch.distributed.fsdp", "torch.distributed._composable.fsdp",
                  "torch.distributed._composable.fully_shard", *ADAM),
    "4.2": _entry("buckets and all-reduces the gradients itself: DistributedDataParallel is the "
                  "reference here", "torch.nn.parallel.DistributedDataParallel",
                  "torch.nn.parallel.distributed", "torch.distributed.algorithms.ddp_comm_hooks"),
    "4.3": _entry("reduce-scatters the gradients and shards the optimizer itself: "
                  "ZeroRedundancyOptimizer, FSDP and torch's Adam are the references here",
                  "torch.distributed.optim.ZeroRedundancyOptimizer",
                  "torch.distributed.optim.zero_redundancy_optimizer",
                  "torch.distributed.fsdp", "torch.distributed._composable.fsdp",
                  "torch.nn.parallel.DistributedDataParallel", *ADAM),
    "4.4": _entry("compresses the gradients itself: DDP's compression comm hooks are the "
                  "reference here", "torch.distributed.algorithms.ddp_comm_hooks"),
    "4.5": _entry("runs PowerSGD itself: torch's powerSGD_hook is the reference here",
                  "torch.distributed.algorithms.ddp_comm_hooks"),
    "5.1": _entry("builds the √L schedule itself: checkpoint_sequential is the reference here",
                  "torch.utils.checkpoint.checkpoint_sequential"),
    "5.2": _entry("applies the schedule to the model itself (torch.utils.checkpoint.checkpoint "
                  "per segment is allowed): checkpoint_sequential is the reference here",
                  "torch.utils.checkpoint.checkpoint_sequential"),
    "5.3": _entry("searches the schedule itself: checkpoint_sequential is the reference here",
                  "torch.utils.checkpoint.checkpoint_sequential"),
    "5.5": _entry("moves the saved activations itself: torch.autograd.graph.save_on_cpu is the "
                  "reference here", "torch.autograd.graph.save_on_cpu"),
    "5.6": _entry("computes attention itself: PyTorch's SDPA and flash kernels are the reference "
                  "here", *[n for op in SDPA_OPS for n in _op(op)],
                  "torch.nn.functional.multi_head_attention_forward", "torch.nn.MultiheadAttention",
                  "torch.nn.attention.flex_attention"),
    "5.7": _entry("passes the key/value blocks round the ring itself: torch's context-parallel "
                  "ring attention is the reference here",
                  "torch.distributed.tensor.experimental"),
    "5.8": _entry("splits the sequence over the ranks itself: torch.distributed.tensor.parallel "
                  "(SequenceParallel) is the reference here", "torch.distributed.tensor.parallel"),
    "6.3": _entry("computes the mesh's coordinates and groups itself: DeviceMesh and "
                  "unravel_index are the reference here", "torch.distributed.device_mesh",
                  "torch.unravel_index", "numpy.unravel_index", "numpy.ravel_multi_index"),
    "6.5": _entry("fuses GELU's forward and backward itself: PyTorch's gelu kernels are the "
                  "reference here", *_op("gelu"), *_op("gelu_backward"), *_op("gelu_"),
                  "torch.nn.GELU"),
    "3.8": _entry("builds the zero-bubble schedule itself: torch.distributed.pipelining is the "
                  "reference here", "torch.distributed.pipelining"),
    "6.6": _entry("dispatches the tokens to the experts itself: the single-device layer of the "
                  "reference is what it is compared with", "labkit.reference.lab6.moe_reference"),
}
"""exercise id -> {"why": what the exercise must do itself, "names": the functions refused}."""


def blocked_for(exercises) -> dict[str, str]:
    """{dotted name: exercise} of the functions refused for any of ``exercises``."""
    out = {}
    for ex in exercises:
        for name in REBUILDS.get(ex, {}).get("names", ()):
            out.setdefault(name, ex)
    return out


def reason(exercise: str, name: str) -> str:
    """The message of a refusal: "exercise 5.6 computes attention itself: …"."""
    return (f"exercise {exercise} {REBUILDS[exercise]['why']} and is blocked while it is graded "
            f"({name})")


def private_leaves(blocked: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The distinctive last components (private kernels such as ``_amp_update_scale_``) of the
    blocked names: the scan refuses them however they are reached."""
    out = {}
    for name, ex in blocked.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("_") and len(leaf) > 8:
            out.setdefault(leaf, (ex, name))
    return out


def table() -> str:
    """The registry as Markdown, one row per exercise (for the README and the report)."""
    rows = ["| exercise | refused while it is graded |", "|---|---|"]
    for ex, entry in sorted(REBUILDS.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))):
        rows.append(f"| {ex} | {', '.join(f'`{n}`' for n in entry['names'])} |")
    return "\n".join(rows)
