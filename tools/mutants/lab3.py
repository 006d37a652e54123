"""Plausible student bugs in Lab 3's exercises (run: .venv/bin/python -m tools.mutants --lab 3)."""
from tools.mutants.mutant import Mutant


# 3.2's reference runs one fused kernel; the bugs a student writes are in a hand-written update.
_FUSED_ADAM = """            masters = [st["master"] for st in states]
            # One fused kernel per group does Adam's whole update in one pass over the tensors
            # (what torch.optim.Adam(fused=True) calls); the step counts go in as tensors on the
            # masters' device: on CUDA the kernel reads them through device pointers.
            steps = [torch.tensor(float(st["step"]), device=st["master"].device) for st in states]
            torch._fused_adam_(masters, grads, [st["exp_avg"] for st in states],
                               [st["exp_avg_sq"] for st in states], [], steps, lr=lr, beta1=beta1,
                               beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)
            torch._foreach_copy_(params, masters)
"""


def _adam_by_hand(*, masters='[st["master"] for st in states]', target="masters", bias2=True,
                  eps_first=False, step='st["step"]', copy_back=True) -> str:
    """A student's foreach Adam on the masters, with the named mistake."""
    b2 = f'            torch._foreach_div_(denom, [(1 - beta2 ** {step}) ** 0.5 for st in states])\n'
    eps = "            torch._foreach_add_(denom, eps)\n"
    lines = (f"            masters = {masters}\n"
             '            m = [st["exp_avg"] for st in states]\n'
             '            v = [st["exp_avg_sq"] for st in states]\n'
             "            torch._foreach_lerp_(m, grads, 1 - beta1)\n"
             "            torch._foreach_mul_(v, beta2)\n"
             "            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)\n"
             "            denom = torch._foreach_sqrt(v)\n"
             + ((eps + (b2 if bias2 else "")) if eps_first else ((b2 if bias2 else "") + eps)))
    if target == "params":
        lines += ("            torch._foreach_addcdiv_(params, [t.to(p.dtype) for t, p in zip(m, params)], "
                  "[t.to(p.dtype) for t, p in zip(denom, params)], "
                  f"[-lr / (1 - beta1 ** {step}) for st in states])\n")
    else:
        lines += f"            torch._foreach_addcdiv_(masters, m, denom, [-lr / (1 - beta1 ** {step}) for st in states])\n"
        if copy_back:
            lines += "            torch._foreach_copy_(params, masters)\n"
    return lines


MUTANTS = [
    # ------------------------------------------------------------ 3.1 loss scaler
    Mutant("3.1", "lab3/loss_scaler.py", find="return loss * self._scale.to(device=loss.device)",
           replace="return loss * float(self._scale) ** 0.5",
           why="scales the loss by the wrong factor"),
    Mutant("3.1", "lab3/loss_scaler.py", find="torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))",
           replace="torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones(()))\n"
                   "            torch._foreach_div_(grads, self._scale.to(device))",
           why="divides by the scale instead of multiplying by its float32 reciprocal"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""            found_inf = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))""",
           replace="""            torch._foreach_mul_(grads, inv_scale.to(device))
            found_inf = torch.tensor([float(any(torch.isinf(g).any() for g in grads))], device=device)""",
           why="checks for inf but forgets NaN"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""        if self._found_inf:
            return False
        optimizer.step()""", replace="""        optimizer.step()""",
           why="steps the optimizer even when a gradient is inf or NaN"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""            self._scale = (self._scale.double() * self.backoff_factor).float()
            self._growth_tracker = 0""", replace="""            self._scale = (self._scale.double() * self.backoff_factor).float()""",
           why="forgets to reset the good-step count after a backoff"),
    Mutant("3.1", "lab3/loss_scaler.py", find="if self._growth_tracker == self.growth_interval:",
           replace="if self._growth_tracker > self.growth_interval:",
           why="grows one step late (off by one)"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""                if torch.isfinite(grown):
                    self._scale = grown""", replace="""                self._scale = grown""",
           why="lets the scale grow to inf"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""        if self._found_inf is None:
            self.unscale_(optimizer)""", replace="""        self._found_inf = None
        self.unscale_(optimizer)""",
           why="unscales again in step() after an explicit unscale_()"),
    # ------------------------------------------------------------ 3.2 mixed-precision Adam
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM, replace=_adam_by_hand(target="params"),
           why="updates the 16-bit parameter directly; the master never moves"),
    Mutant("3.2", "lab3/mixed_precision.py", find='state["exp_avg"] = torch.zeros_like(state["master"])',
           replace='state["exp_avg"] = torch.zeros_like(p)', why="keeps the first moment in 16 bits"),
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM, replace=_adam_by_hand(bias2=False),
           why="forgets the second moment's bias correction"),
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM, replace=_adam_by_hand(copy_back=False),
           why="never copies the master back into the 16-bit parameter"),
    Mutant("3.2", "lab3/mixed_precision.py", find='state["step"] = 0',
           replace='state["step"] = torch.tensor(0.0)', why="keeps the step count as a tensor (4 more bytes per parameter tensor)"),
    Mutant("3.2", "lab3/mixed_precision.py", find="grads = [p.grad.float() for p in params]",
           replace="grads = [p.grad.float() * (1 - beta1) for p in params]", why="scales the gradient twice by (1 − β1)"),
    # ------------------------------------------------------------ 3.4 tensor parallel
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None""", replace="""        return grad, None""",
           why="f forgets the all-reduce in backward"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out""", replace="""        return x.clone()""",
           why="g forgets the all-reduce in forward"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        out = reduce_from_tp(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias""",
           replace="""        return reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)""",
           why="adds the row-parallel bias on every rank before the all-reduce (T times)"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="self.weight = nn.Parameter(full.weight.detach()[:, r * per:(r + 1) * per].clone())",
           replace="self.weight = nn.Parameter(full.weight.detach()[r * per:(r + 1) * per].clone().T.contiguous() if full.weight.shape[0] == full.weight.shape[1] else full.weight.detach()[:, r * per:(r + 1) * per].clone())",
           why="slices rows instead of columns of a square row-parallel weight"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="self.c_attn = ColumnParallelLinear(attn.c_attn, group, rows=torch.cat([own, C + own, 2 * C + own]))",
           replace="self.c_attn = ColumnParallelLinear(attn.c_attn, group)",
           why="takes a contiguous slice of the fused qkv weight instead of the same heads of q, k and v"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="return self.c_proj(F.gelu(self.c_fc(copy_to_tp(x, self.group))))",
           replace="return self.c_proj(F.gelu(self.c_fc(x)))",
           why="leaves f out of the MLP"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="self.weight = nn.Parameter(full.weight.detach()[rows].clone())",
           replace="self.weight = nn.Parameter(full.weight.detach().clone())",
           why="keeps the whole column-parallel weight on every rank"),
    # ------------------------------------------------------------ 3.5 pipeline schedules
    Mutant("3.5", "lab3/pipeline_schedule.py", find="warmup = min(P - s, M)", replace="warmup = min(P - s - 1, M)",
           why="one warm-up forward too few (then B before its F on the last stage)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="warmup = min(P - s, M)", replace="warmup = min(P, M)",
           why="every stage warms up with P forwards"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="            order += [backwards[b], forwards[f]]",
           replace="            order += [forwards[f], backwards[b]]",
           why="alternates forward-then-backward in the steady state"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="            stages.append(forwards + backwards)",
           replace="            stages.append(forwards + backwards[::-1])",
           why="GPipe's backwards in reverse micro-batch order"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="    return [(s, \"F\", m, c)] + ([(nxt, \"B\", m, (vs + 1) // P)] if vs < v * P - 1 else [])",
           replace="    return [(s, \"F\", m, c)]",
           why="forgets that B waits for the next stage's B"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="start = max([free[s]] + [end[d] for d in deps])",
           replace="start = max([end[d] for d in deps] or [free[s]])",
           why="the simulator lets a stage run two actions at once"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="return Timeline(spans, makespan, 1 - Fraction(busy, P * makespan), in_flight)",
           replace="return Timeline(spans, makespan, Fraction(P - 1, makespan), in_flight)",
           why="bubble as idle time of one stage over the makespan"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="                elif sp.start < dep.end:",
           replace="                elif sp.start < dep.start:",
           why="the checker compares with the dependency's start instead of its end"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="            if b.start < a.end:",
           replace="            if False:",
           why="the checker ignores overlapping spans on one stage"),
    # 3.5, interleaved 1F1B
    Mutant("3.5", "lab3/pipeline_schedule.py", find="warmup = min((v - 1) * R + 2 * (P - 1 - s), v * M)",
           replace="warmup = min(2 * (P - 1 - s), v * M)",
           why="interleaved warm-up forgets the other chunks' round ((v−1)·R forwards)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="warmup = min((v - 1) * R + 2 * (P - 1 - s), v * M)",
           replace="warmup = min((v - 1) * R + (P - 1 - s), v * M)",
           why="interleaved warm-up counts one forward per hop instead of two (F and B each cross it)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="R = M // max(1, M // P)  # micro-batches per round",
           replace="R = P  # micro-batches per round",
           why="rounds of P micro-batches even when M is not a multiple of P (torch's flexible rounds)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="""        order.append(take("F", (k // R) % v))
        order.append(take("B", v - 1 - ((k - warmup) // R) % v))""",
           replace="""        order.append(take("B", v - 1 - ((k - warmup) // R) % v))
        order.append(take("F", (k // R) % v))""",
           why="interleaved steady state runs the backward before the forward"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="""        order.append(take("B", v - 1 - ((k - warmup) // R) % v))
    for k in range(v * M, v * M + warmup):""", replace="""        order.append(take("B", ((k - warmup) // R) % v))
    for k in range(v * M, v * M + warmup):""",
           why="backwards visit the chunks in forward order instead of reversed (steady state)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="    prev, nxt = (vs - 1) % P, (vs + 1) % P",
           replace="    prev, nxt = s - 1, s + 1",
           why="the previous/next virtual stage is on the neighbouring rank index, not wrapped around"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find='return [(prev, "F", m, (vs - 1) // P)] if vs > 0 else []',
           replace='return [(prev, "F", m, c)] if vs > 0 else []',
           why="a forward waits for the same chunk on the previous rank, not the previous virtual stage"),
    # ------------------------------------------------------------ 3.7 ZeRO-3
    Mutant('3.7', 'lab3/zero3.py', find='        mine = mine / self.world_size\n',
           replace='',
           why='forgets to average the reduce-scattered gradient over the ranks'),
    Mutant("3.7", "lab3/zero3.py", find="u.shard = flat[shard_range(self.rank, u.shard_size)].clone()",
           replace="u.shard = flat[shard_range(0, u.shard_size)].clone()",
           why="every rank keeps rank 0's slice"),
    Mutant('3.7', 'lab3/zero3.py', find='u.shard_size, u.padding = u.layout.shard_size, u.layout.padding',
           replace='u.shard_size, u.padding = u.numel // self.world_size + 1, (u.numel // self.world_size + 1) * self.world_size - u.numel',
           why='S = floor(Ψ/N) + 1 instead of ceil(Ψ/N): one element too many when N divides Ψ'),
    Mutant("3.7", "lab3/zero3.py", find="        u.full.untyped_storage().resize_(0)\n",
           replace="        pass\n", why="never frees the gathered parameters"),
    Mutant('3.7', 'lab3/zero3.py', find='            _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group)',
           replace='            u.full = torch.empty_like(u.full)\n            _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group)',
           why='gathers into a fresh buffer, which the parameters do not view'),
    Mutant('3.7', 'lab3/zero3.py', find='used = u.grad is not None and bool(u.present[pc.index] > 0)',
           replace='used = u.grad is not None',
           why='gives a parameter no rank had a gradient for a zero gradient (Adam steps it and counts the step)'),
    Mutant("3.7", "lab3/zero3.py", find="""        for p in u.params:
            p.grad = None
        self._free(u)""", replace="""        for p in u.params:
            p.grad = None""", why="keeps the unit gathered after its backward"),
    # 3.7, prefetch
    Mutant('3.7', 'lab3/zero3.py', find='u.pending = _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group, async_op=True)',
           replace='u.pending = _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group, async_op=False)',
           why='the prefetch all-gather waits (no overlap with the current block)'),
    Mutant("3.7", "lab3/zero3.py", find="""        if u.pending is not None:
            u.pending.wait()
            u.pending = None
            return""", replace="""        if u.pending is not None:
            u.pending.wait()
            return""", why="keeps the finished prefetch handle: the backward gather returns without gathering"),
    Mutant("3.7", "lab3/zero3.py", find="""        if u.pending is not None:
            u.pending.wait()
            u.pending = None
            return""", replace="", why="_gather ignores a prefetch in flight (never waits for it, never clears its handle)"),
    Mutant("3.7", "lab3/zero3.py", find="""        if u.pending is not None or u.full.untyped_storage().nbytes() == nbytes:
            return
        u.full.untyped_storage().resize_(nbytes)""", replace="""        if u.pending is not None or u.full.untyped_storage().nbytes() == nbytes:
            return""", why="prefetches into the freed (0-byte) storage"),
    Mutant("3.7", "lab3/zero3.py", find="""        if u.pending is not None:
            u.pending.wait()
            u.pending = None
            return""", replace="""        if u.pending is not None:
            u.pending = None
            return""", why="never waits for the prefetch (computes on a buffer still being filled)"),
    # ------------------------------------------------------------ 3.3 fp8 linear
    Mutant("3.3", "lab3/fp8.py", find="return (amax * 2.0 ** margin / torch.finfo(fmt).max).to(torch.float32)",
           replace="return (torch.finfo(fmt).max / (amax * 2.0 ** margin)).to(torch.float32)",
           why="returns the quantisation scale max/amax where _scaled_mm wants the dequantisation scale"),
    Mutant("3.3", "lab3/fp8.py", find="return (amax * 2.0 ** margin / torch.finfo(fmt).max).to(torch.float32)",
           replace="return (amax * 2.0 ** margin / 448.0).to(torch.float32)",
           why="hard-codes E4M3's 448 for every format (E5M2 too)"),
    Mutant("3.3", "lab3/fp8.py", find="return (amax * 2.0 ** margin / torch.finfo(fmt).max).to(torch.float32)",
           replace="return (amax / 2.0 ** margin / torch.finfo(fmt).max).to(torch.float32)",
           why="applies the margin the wrong way (amax above the format's max)"),
    Mutant("3.3", "lab3/fp8.py", find="return (x.float() / scale.to(x.device)).clamp(-top, top).to(fmt)",
           replace="return (x.float() / scale.to(x.device)).to(fmt)",
           why="relies on the cast to saturate (the CPU E5M2 cast overflows to inf)"),
    Mutant("3.3", "lab3/fp8.py", find="return (x.float() / scale.to(x.device)).clamp(-top, top).to(fmt)",
           replace="return (x.float() * scale.to(x.device)).clamp(-top, top).to(fmt)",
           why="multiplies by the dequantisation scale instead of dividing"),
    Mutant("3.3", "lab3/fp8.py", find="return (x.float() / scale.to(x.device)).clamp(-top, top).to(fmt)",
           replace="return (x / scale.to(x.device)).clamp(-top, top).to(fmt)",
           why="divides in the input's dtype (bf16 rounds x/scale before the fp8 cast)"),
    Mutant("3.3", "lab3/fp8.py", find="""        self.history.append(amax)
        del self.history[:-self.history_len]
        return scale""", replace="""        self.history.append(amax)
        del self.history[:-self.history_len]
        return amax_scale(max(self.history), self.fmt, self.margin).to(x.device)""",
           why="records the amax before computing the scale (current scaling, not delayed)"),
    Mutant("3.3", "lab3/fp8.py", find="del self.history[:-self.history_len]",
           replace="del self.history[:-self.history_len - 1]", why="keeps one amax too many (off by one)"),
    Mutant("3.3", "lab3/fp8.py", find="scale = amax_scale(max(self.history) if self.history else amax, self.fmt, self.margin)",
           replace="scale = amax_scale(self.history[-1] if self.history else amax, self.fmt, self.margin)",
           why="uses only the last amax instead of the history's max"),
    Mutant("3.3", "lab3/fp8.py", find="qg = quantize(grad_out, sg, e5m2)",
           replace="qg = quantize(grad_out, sg, torch.float8_e4m3fn)",
           why="casts the gradient to E4M3 with E5M2's scale"),
    Mutant("3.3", "lab3/fp8.py", find="sg = ctx.scalers[\"grad\"].scale_for(grad_out) if ctx.scalers else _current(grad_out, e5m2)",
           replace="sg = ctx.scalers[\"grad\"].scale_for(grad_out) if ctx.scalers else _current(grad_out, torch.float8_e4m3fn)",
           why="scales the gradient for E4M3's range but casts to E5M2"),
    Mutant("3.3", "lab3/fp8.py", find="grad_x = torch._scaled_mm(qg, qw.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=ctx.out_dtype)",
           replace="grad_x = torch._scaled_mm(qg, qw.t().contiguous().t(), scale_a=sg, scale_b=sx, out_dtype=ctx.out_dtype)",
           why="uses x's scale for the weight in grad_x"),
    Mutant("3.3", "lab3/fp8.py", find="qx, qw = quantize(x, sx, e4m3), quantize(weight, sw, e4m3)",
           replace="qx, qw = quantize(x, sx, e4m3), quantize(weight, sx, e4m3)",
           why="quantises the weight with x's scale"),
    Mutant("3.3", "lab3/fp8.py", find="return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)",
           replace="return (qx.float() * sx) @ (qw.float() * sw).t()",
           why="dequantises and multiplies in fp32 instead of the fp8 kernel"),
    Mutant("3.3", "lab3/fp8.py", find="ctx.save_for_backward(qx, qw, sx, sw)",
           replace="ctx.save_for_backward(qx, qw, sx, sw, x)",
           why="also saves the high-precision input for backward"),
    # ------------------------------------------------------------ 3.6 pipeline over send/recv
    Mutant("3.6", "lab3/pipeline.py", find="targets[m].reshape(-1)) / M",
           replace="targets[m].reshape(-1))",
           why="forgets to divide each micro-batch's loss by M (gradients M times too large)"),
    Mutant("3.6", "lab3/pipeline.py", find="targets[m].reshape(-1)) / M",
           replace="targets[m].reshape(-1)) / len(actions)",
           why="divides by the number of actions (2M) instead of M"),
    Mutant("3.6", "lab3/pipeline.py", find="out.backward(grad)",
           replace="out.backward(grad, retain_graph=True)",
           why="keeps every micro-batch's graph after its backward (retain_graph)"),
    Mutant("3.6", "lab3/pipeline.py", find="for kind, m in actions:",
           replace="for kind, m in sorted(actions, key=lambda a: a[0] == \"B\"):",
           why="ignores the given order and runs all forwards first (GPipe whatever the schedule)"),
    Mutant("3.6", "lab3/pipeline.py", find="                x.requires_grad_()\n",
           replace="",
           why="the received activation does not require grad, so no input gradient to send back"),
    Mutant("3.6", "lab3/pipeline.py", find='sends["B", m] = dist.isend(x.grad, group=group, group_dst=rank - 1)',
           replace='sends["B", m] = dist.isend(x.detach(), group=group, group_dst=rank - 1)',
           why="sends the stage's input activation back instead of its gradient"),
    Mutant("3.6", "lab3/pipeline.py", find="dist.recv(x, group=group, group_src=rank - 1)", replace="dist.recv(x, group=group, group_src=0)",
           why="every stage receives from rank 0 (right only for P = 2)"),
    Mutant("3.6", "lab3/pipeline.py", find='sends["F", m] = dist.isend(out.detach(), group=group, group_dst=rank + 1)',
           replace='sends["F", m] = dist.isend(out.detach(), group=group, group_dst=world_size - 1)',
           why="every stage sends its activation to the last rank (right only for P = 2)"),
    Mutant("3.6", "lab3/pipeline.py", find="total = out.detach() if total is None else total + out.detach()",
           replace="total = out.detach()",
           why="returns only the last micro-batch's loss instead of the sum over micro-batches"),
]

# A second list, written from the solution modules before reading the graders (issue 25): the
# classes no test checked — several param groups, dtypes other than fp32, subgroups, P >= 3,
# accumulation, memory held live, thresholds at their boundary, orders.
INDEPENDENT = [
    # ------------------------------------------------------------ 3.1 loss scaler
    Mutant("3.1", "lab3/loss_scaler.py", find="for group in optimizer.param_groups:",
           replace="for group in optimizer.param_groups[:1]:",
           why="unscales only the first param group"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""            found_inf = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))""",
           replace="""            found_inf = torch.tensor([float(not all(torch.isfinite(g).all() for g in grads))], device=device)
            if not found_inf.item():
                torch._foreach_mul_(grads, inv_scale.to(device))""",
           why="does not unscale when a gradient is non-finite: after an overflow the gradients stay scaled"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""                    self._scale = grown
                self._growth_tracker = 0""", replace="""                    self._scale = grown""",
           why="never resets the good-step count after growing (grows on every later step)"),
    Mutant("3.1", "lab3/loss_scaler.py",
           find="torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))",
           replace="torch._foreach_mul_(grads, inv_scale.to(grads[0]))\n"
                   "            found_inf += sum(float(not torch.isfinite(g).all()) for g in grads)",
           why="rounds the reciprocal to the gradient's dtype (fp16 gradients: 1/S rounded, or 0)"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""            return False
        optimizer.step()
        return True""", replace="""            return True
        optimizer.step()
        return False""",
           why="step() returns whether it skipped, not whether it stepped"),
    Mutant("3.1", "lab3/loss_scaler.py", find="self._scale = (self._scale.double() * self.backoff_factor).float()",
           replace="self._scale = self._scale * self.backoff_factor",
           why="backs off in float32 (GradScaler multiplies in float64, then rounds)"),
    # ------------------------------------------------------------ 3.2 mixed-precision Adam
    Mutant("3.2", "lab3/mixed_precision.py",
           find='lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]',
           replace='lr, (beta1, beta2), eps = self.defaults["lr"], self.defaults["betas"], self.defaults["eps"]',
           why="uses the constructor's hyperparameters for every param group"),
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM,
           replace=_adam_by_hand(masters="[p.detach().float() for p in params]"),
           why="rebuilds the master from the 16-bit parameter every step (the master is lost)"),
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM, replace=_adam_by_hand(eps_first=True),
           why="adds eps before the bias correction (torch adds it after)"),
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM,
           replace=_adam_by_hand(step='max(s["step"] for s in self.state.values())'),
           why="one step count for all parameters: a late parameter is bias-corrected as the oldest"),
    Mutant("3.2", "lab3/mixed_precision.py", find='device=st["master"].device) for st in states]',
           replace=') for st in states]',
           why="hands the fused kernel CPU step counts (an illegal memory access on CUDA)"),
    Mutant("3.2", "lab3/mixed_precision.py", find='params = [p for p in group["params"] if p.grad is not None]',
           replace='params = list(group["params"])',
           why="does not skip parameters without a gradient"),
    # ------------------------------------------------------------ 3.3 fp8
    Mutant("3.3", "lab3/fp8.py", find="    amax = x.detach().abs().max().float() if x.numel() else 0.0\n    try:",
           replace="    amax = x.detach().max().float().clamp(min=0) if x.numel() else 0.0\n    try:",
           why="current scaling takes max(x) instead of max|x|"),
    Mutant("3.3", "lab3/fp8.py", find="""        scale = amax_scale(max(self.history) if self.history else amax, self.fmt, self.margin).to(x.device)
        self.history.append(amax)""", replace="""        self.history.append(amax)
        scale = amax_scale(max(self.history), self.fmt, self.margin).to(x.device)""",
           why="delayed scaling records x's amax before choosing its scale (current scaling in disguise)"),
    Mutant("3.3", "lab3/fp8.py", find="del self.history[:-self.history_len]",
           replace="del self.history[self.history_len:]",
           why="trims the history from the wrong end (keeps the oldest amaxes)"),
    Mutant("3.3", "lab3/fp8.py", find="""scale_a=sg, scale_b=sx,
                                  out_dtype=ctx.w_dtype)""",
           replace="""scale_a=sg, scale_b=sx,
                                  out_dtype=ctx.out_dtype)""",
           why="the weight gradient comes out in x's dtype (bf16) instead of the weight's fp32"),
    Mutant("3.3", "lab3/fp8.py", find="return (amax * 2.0 ** margin / torch.finfo(fmt).max).to(torch.float32)",
           replace="return (amax * (1 + margin) / torch.finfo(fmt).max).to(torch.float32)",
           why="reads the margin as a factor 1 + margin, not binades (right for margin 0 and 1)"),
    Mutant("3.3", "lab3/fp8.py", find="""    top = torch.finfo(fmt).max
    return""", replace="""    top = torch.finfo(torch.float8_e4m3fn).max
    return""",
           why="saturates every format at E4M3's 448"),
    Mutant("3.3", "lab3/fp8.py", find="        e5m2 = torch.float8_e5m2\n",
           replace="        e5m2 = torch.float8_e4m3fn\n",
           why="quantises the gradient to E4M3 instead of E5M2"),
    Mutant("3.3", "lab3/fp8.py", find="torch._scaled_mm(qg, qw.t().contiguous().t(),",
           replace="torch._scaled_mm(qg, qw,",
           why="gives _scaled_mm a row-major mat2 in grad_x (refused on a GPU)"),
    Mutant("3.3", "lab3/fp8.py", find="grad_w = torch._scaled_mm(qg.t().contiguous(), qx.t().contiguous().t(),",
           replace="grad_w = torch._scaled_mm(qg.t().contiguous(), qx,",
           why="gives _scaled_mm a row-major mat2 in grad_weight (the course's old bug: refused on a GPU)"),
    # ------------------------------------------------------------ 3.4 tensor parallelism
    Mutant("3.4", "lab3/tensor_parallel.py", find="F.scaled_dot_product_attention(q, k, v, is_causal=True)",
           replace="F.scaled_dot_product_attention(q, k, v)",
           why="the SDPA branch forgets the causal mask"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""    def backward(ctx, grad):
        # BEGIN SOLUTION 3.4: g's backward: what each rank's partial sum receives
        return grad, None""", replace="""    def backward(ctx, grad):
        # BEGIN SOLUTION 3.4: g's backward: what each rank's partial sum receives
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad, None""",
           why="g all-reduces in backward too (gradients T times too large)"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        dist.all_reduce(grad, group=ctx.group)
        return grad, None""", replace="""        dist.all_reduce(grad)
        return grad, None""",
           why="f's backward all-reduces over the default group, not the TP group"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        T, r = dist.get_world_size(group), dist.get_rank(group)
        per = _split("out_features", full.out_features, T)""", replace="""        T, r = dist.get_world_size(group), dist.get_rank()
        per = _split("out_features", full.out_features, T)""",
           why="the column-parallel layer picks its rows by global rank"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="out = reduce_from_tp(F.linear(x, self.weight), self.group)\n        return out if self.bias is None else out + self.bias",
           replace="out = reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)\n        return out",
           why="every rank adds the row-parallel bias before the all-reduce (T biases)"),
    # ------------------------------------------------------------ 3.5 pipeline schedules
    Mutant("3.5", "lab3/pipeline_schedule.py", find="""                if dep is None:
                    problems.append(f"{name(s, kind, m, c)} needs {name(*d)}, which never runs")
                elif sp.start < dep.end:""", replace="""                if dep is None:
                    continue
                if sp.start < dep.end:""",
           why="check_dependencies ignores a dependency that never runs"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="start = max([free[s]] + [end[d] for d in deps])",
           replace="start = max([end[d] for d in deps], default=free[s])",
           why="simulate starts an action when its dependencies end, ignoring that its stage is busy"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find='return [(s, "F", m, c)] + ([(nxt, "B", m, (vs + 1) // P)] if vs < v * P - 1 else [])',
           replace='return [(s, "F", m, c)] + ([(nxt, "B", m, c)] if vs < v * P - 1 else [])',
           why="interleaved: B waits for the next rank's same chunk (wrong when it wraps to rank 0)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="            if b.start < a.end:\n",
           replace="            if b.start <= a.end:\n",
           why="check_dependencies reports back-to-back spans of a stage as overlapping"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="warmup = min(P - s, M)",
           replace="warmup = min(P - s, M) if s == 0 else 1",
           why="1F1B: only stage 0 warms up with several forwards (right only for P = 2)"),
    # ------------------------------------------------------------ 3.6 pipeline runner
    Mutant("3.6", "lab3/pipeline.py", find="dist.recv(x, group=group, group_src=rank - 1)",
           replace="dist.recv(x, src=rank - 1, group=group)",
           why="receives from rank − 1 as a global rank (wrong in a subgroup)"),
    Mutant("3.6", "lab3/pipeline.py", find='sends["F", m] = dist.isend(out.detach(), group=group, group_dst=rank + 1)',
           replace="dist.send(out.detach(), group=group, group_dst=rank + 1)",
           why="a blocking send of the activation (neighbours both sending wait on each other)"),
    Mutant("3.6", "lab3/pipeline.py", find="out = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[m].reshape(-1)) / M",
           replace="out = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[m].reshape(-1))",
           why="does not divide the micro-batch loss by M (gradients M times too large)"),
    Mutant("3.6", "lab3/pipeline.py", find="x, out = stash.pop(m)",
           replace="x, out = stash[m]",
           why="keeps every micro-batch's stash until the step ends (memory grows with M)"),
    Mutant("3.6", "lab3/pipeline.py", find="                x.requires_grad_()\n",
           replace="                x.requires_grad_(last)\n",
           why="only the last stage asks for its input's gradient (right only for P = 2)"),
    Mutant("3.6", "lab3/pipeline.py", find="""                finish(("F", m))  # the next stage used m's activation to make this gradient
""", replace="",
           why="waits for its sends only at the end of the step (their buffers pile up with M)"),
    # ------------------------------------------------------------ 3.7 ZeRO-3
    Mutant("3.7", "lab3/zero3.py", find="u.grad = mine if u.grad is None else u.grad + mine",
           replace="u.grad = mine",
           why="overwrites the gradient slice on a second backward instead of adding to it"),
    Mutant('3.7', 'lab3/zero3.py', find='u.shard = flat[shard_range(self.rank, u.shard_size)].clone()',
           replace='u.shard = flat[shard_range(dist.get_rank(), u.shard_size)].clone()',
           why='takes its shard by global rank (wrong in a subgroup)'),
    Mutant('3.7', 'lab3/zero3.py', find='mine = mine / self.world_size',
           replace='mine = mine / dist.get_world_size()',
           why="averages over the default group's size, not the ZeRO group's"),
    Mutant('3.7', 'lab3/zero3.py', find='            _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group)\n',
           replace='            _all_gather_flat(u.full, u.shard, group=self.group)\n',
           why="gathers the fp32 shards into a 16-bit model's buffer without rounding them to its dtype"),
    Mutant("3.7", "lab3/zero3.py", find="u.shard = flat[shard_range(self.rank, u.shard_size)].clone()",
           replace="u.shard = flat[shard_range(self.rank, u.shard_size)]",
           why="the shard is a view: it keeps the whole flat copy of the unit alive"),
]

# Session 5 (mut34), written blind from the solutions: mixed dtypes per optimizer, a group with no
# gradient, fp16 losses, delayed-scaler paths, manual attention, P >= 3 drains, unequal costs.
INDEPENDENT += [
    # ------------------------------------------------------------ 3.1 loss scaler
    Mutant("3.1", "lab3/loss_scaler.py",
           find="            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))\n            found.append(found_inf)",
           replace="            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))\n            found.append(found_inf)\n            if found_inf.item():\n                break",
           why="stops unscaling at the first (device, dtype) group holding an inf: the others stay scaled"),
    Mutant("3.1", "lab3/loss_scaler.py", find="return loss * self._scale.to(device=loss.device)",
           replace="return loss * self._scale.to(device=loss.device, dtype=loss.dtype)",
           why="casts the scale to the loss' dtype (an fp16 loss: 2^16 rounds to inf)"),
    Mutant("3.1", "lab3/loss_scaler.py", find="                if p.grad is not None:\n                    by_kind",
           replace="                if p.grad is not None and p.grad.dtype != torch.float32:\n                    by_kind",
           why="unscales only the 16-bit gradients (fp32 ones stay scaled)"),
    Mutant("3.1", "lab3/loss_scaler.py", find="""        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            return False""", replace="""        if self._found_inf is None and self.unscale_(optimizer):
            return False""",
           why="after an explicit unscale_() it steps even when that found an inf"),
    # ------------------------------------------------------------ 3.2 mixed-precision Adam
    Mutant("3.2", "lab3/mixed_precision.py",
           find='lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]',
           replace='lr, (beta1, beta2), eps = group["lr"], group["betas"], self.defaults["eps"]',
           why="uses the constructor's eps for every param group"),
    Mutant("3.2", "lab3/mixed_precision.py", find="            if not params:\n                continue",
           replace="            if not params:\n                break",
           why="stops at the first param group without a gradient (later groups never step)"),
    Mutant("3.2", "lab3/mixed_precision.py", find=_FUSED_ADAM,
           replace=_FUSED_ADAM.replace("            torch._foreach_copy_(params, masters)\n", "").replace(
               "            masters = [st[\"master\"] for st in states]\n",
               "            masters = [st[\"master\"] for st in states]\n            torch._foreach_copy_(params, masters)\n"),
           why="rounds the master into p before updating it (p lags one step behind)"),
    Mutant("3.2", "lab3/mixed_precision.py", find="            grads = [p.grad.float() for p in params]",
           replace="            grads = [p.grad.bfloat16().float() for p in params]",
           why="rounds every gradient through bf16 (an fp16 gradient loses 3 bits)"),
    # ------------------------------------------------------------ 3.3 fp8
    Mutant("3.3", "lab3/fp8.py", find="""    if amax == 0:
        return torch.ones((), dtype=torch.float32, device=amax.device)
""", replace="""    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
""",
           why="clamps amax 0 to a tiny number instead of returning scale 1"),
    Mutant("3.3", "lab3/fp8.py", find="return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)",
           replace="return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.float32)",
           why="the forward returns fp32 whatever x's dtype"),
    Mutant("3.3", "lab3/fp8.py", find="amax = float(x.detach().abs().max()) if x.numel() else 0.0",
           replace="amax = max(float(x.detach().max()), 0.0) if x.numel() else 0.0",
           why="delayed scaling records max(x), not max|x|"),
    Mutant("3.3", "lab3/fp8.py",
           find='sg = ctx.scalers["grad"].scale_for(grad_out) if ctx.scalers else _current(grad_out, e5m2)',
           replace="sg = _current(grad_out, e5m2)",
           why="the backward always scales the gradient by its own amax, ignoring the delayed scaler"),
    # ------------------------------------------------------------ 3.4 tensor parallelism
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())",
           replace="self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[r * per:(r + 1) * per].clone())",
           why="takes the bias' contiguous slice even when rows are given (attention's q/k/v bias)"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        dist.all_reduce(grad, group=ctx.group)
        return grad, None""", replace="""        dist.all_reduce(grad, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None""",
           why="f's backward averages the ranks' gradients instead of summing them"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="return self.c_proj(F.gelu(self.c_fc(copy_to_tp(x, self.group))))",
           replace='return self.c_proj(F.gelu(self.c_fc(copy_to_tp(x, self.group)), approximate="tanh"))',
           why="uses the tanh approximation of GELU (the model uses the exact one)"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="""        T, r = dist.get_world_size(group), dist.get_rank(group)
        per = _split("in_features", full.in_features, T)""", replace="""        T, r = dist.get_world_size(group), dist.get_rank()
        per = _split("in_features", full.in_features, T)""",
           why="the row-parallel layer picks its columns by global rank"),
    Mutant("3.4", "lab3/tensor_parallel.py", find="mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()",
           replace="mask = torch.ones(S, S, dtype=torch.bool, device=x.device).triu()",
           why="the manual attention path masks the past instead of the future"),
    # ------------------------------------------------------------ 3.5 pipeline schedules
    Mutant("3.5", "lab3/pipeline_schedule.py", find="        order += backwards[b:]\n",
           replace="        order += backwards[b:][::-1]\n",
           why="1F1B drains the remaining backwards last micro-batch first"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find='            count += 1 if action[0] == "F" else -1',
           replace='            count += 1 if action[0] == "F" else 0',
           why="in_flight counts the forwards run, never subtracting a finished backward"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="    busy = P * M * v * (forward_cost + backward_cost)",
           replace="    busy = P * M * v * 2 * forward_cost",
           why="the bubble counts a backward as long as a forward"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="    warmup = min((v - 1) * R + 2 * (P - 1 - s), v * M)",
           replace="    warmup = (v - 1) * R + 2 * (P - 1 - s)",
           why="interleaved warm-up not capped at vM (few micro-batches, many stages)"),
    # ------------------------------------------------------------ 3.6 pipeline runner
    Mutant("3.6", "lab3/pipeline.py", find="    previous_grad = None\n",
           replace="    previous_grad = None\n    stage.zero_grad()\n",
           why="zeroes the stage's gradients first (accumulating over several steps loses the earlier ones)"),
    Mutant("3.6", "lab3/pipeline.py", find="                previous_grad = (\"B\", m)\n",
           replace="                previous_grad = (\"B\", m)\n                finish(previous_grad)\n",
           why="waits for each gradient's send right after issuing it (a blocking send)"),
    Mutant("3.6", "lab3/pipeline.py", find="dist.isend(x.grad, group=group, group_dst=rank - 1)",
           replace="dist.isend(x.grad, dst=rank - 1)",
           why="sends the input gradient to rank − 1 as a global rank (wrong in a subgroup)"),
    Mutant("3.6", "lab3/pipeline.py", find="    return total\n",
           replace="    return None if total is None else total / M\n",
           why="returns the mean of the loss_m (already divided by M): the loss M times too small"),
    # ------------------------------------------------------------ 3.7 ZeRO-3
    Mutant('3.7', 'lab3/zero3.py', find='u.present = present if u.present is None else u.present + present',
           replace='u.present = present',
           why="keeps only the last backward's presence counts (a parameter used in an earlier backward is not stepped)"),
    Mutant('3.7', 'lab3/zero3.py', find='            u.grad = u.present = None\n',
           replace='            u.present = None\n',
           why='keeps the gradient slice after step (the next step adds onto it)'),
    Mutant('3.7', 'lab3/zero3.py', find='piece.grad = u.grad[pc.start_in_shard:pc.start_in_shard + pc.length] if used else None',
           replace='piece.grad = u.grad[pc.start_in_param:pc.start_in_param + pc.length] if used else None',
           why='hands a piece the gradient at its offset in the parameter, not in the shard'),
]


# ---- 3.8 zero-bubble schedules (issue 39), from the solution (written after the graders: say so)
MUTANTS += [
    Mutant("3.8", "lab3/zero_bubble.py", find="            if k >= s:\n",
           replace="            if True:\n", why="runs each W right after its B (no W held back: the split 1F1B)"),
    Mutant("3.8", "lab3/zero_bubble.py", find="            if k >= s:\n",
           replace="            if k >= P - 1 - s:\n", why="holds W back by the stage's distance from the end instead of its index"),
    Mutant("3.8", "lab3/zero_bubble.py", find='                order.append(SplitAction("W", w, s))',
           replace='                order.append(SplitAction("W", k, s))', why="runs the W of the newest micro-batch, not the oldest pending"),
    Mutant("3.8", "lab3/zero_bubble.py", find="        warmup = min(P - s, M)\n        order = [SplitAction(\"F\", m, s)",
           replace="        warmup = min(P - s - 1, M)\n        order = [SplitAction(\"F\", m, s)",
           why="one warm-up forward too few (torch's warmup_ops count, without the first pair's F)"),
    Mutant("3.8", "lab3/zero_bubble.py", find="        warmup = min(P - s, M)\n        order = [SplitAction(\"F\", m, s)",
           replace="        warmup = P - s\n        order = [SplitAction(\"F\", m, s)",
           why="forgets that M may be smaller than P"),
    Mutant("3.8", "lab3/zero_bubble.py", find="            start = max([free[r]] + [end[d] for d in deps])",
           replace="            start = max([free[r]] + [end[d] for d in deps if d[2] // 1 == action.stage])",
           why="waits only for dependencies on its own stage (ignores the neighbours' F and B)"),
    Mutant("3.8", "lab3/zero_bubble.py", find="    busy = M * S * sum(costs.values())",
           replace="    busy = M * P * sum(costs.values())", why="counts one stage per rank in the busy time (wrong for ZB-V)"),
    Mutant("3.8", "lab3/zero_bubble.py", find='            count += {"F": 1, "B": 0, "W": -1}[kind]',
           replace='            count += {"F": 1, "B": -1, "W": 0}[kind]', why="ends a micro-batch's flight at B instead of W"),
    Mutant("3.8", "lab3/zero_bubble.py", find='    delta = {"F": m_b, "B": m_w - m_b, "W": -m_w}',
           replace='    delta = {"F": m_b, "B": -m_b, "W": 0}', why="thinks B frees everything F stored (W needs nothing)"),
    Mutant("3.8", "lab3/zero_bubble.py", find='    delta = {"F": m_b, "B": m_w - m_b, "W": -m_w}',
           replace='    delta = {"F": m_b, "B": m_w, "W": -m_w}', why="adds W's bytes at B without freeing what only B needed"),
    Mutant("3.8", "lab3/zero_bubble.py", find="            end[tuple(action)] = free[r] = start + costs[action.kind]",
           replace='            end[tuple(action)] = free[r] = start + costs["F"]', why="gives every action a forward's cost"),
    Mutant("3.8", "lab3/zero_bubble.py", find='            raise ValueError(f"schedule deadlocks: ranks wait on {stuck}")',
           replace="            break", why="stops silently on a deadlock"),
]
# Issue 37: written from the solutions, measured before and after the graders were strengthened.
INDEPENDENT += [
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())",
           replace="self.bias = None if full.bias is None else nn.Parameter(full.bias.detach())",
           why="keeps the row-parallel bias as a view of the full one (shares its storage)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="        ordered = sorted(row, key=lambda sp: sp.start)\n",
           replace="        ordered = row\n",
           why="checks overlaps between neighbours in the list, assuming spans come sorted by start"),
    Mutant("3.1", "lab3/loss_scaler.py", find="        self._found_inf = bool(sum(f.item() for f in found))",
           replace="        self._found_inf = bool(found[0].item()) if found else False",
           why="reads the inf flag of the first (device, dtype) group only"),
]

# Dodges of a measurement (issue 34, item 5): the code runs the measured path cheaply and wrong
# only while a measurement watches (a TorchDispatchMode is active — MemTracker, FlopCounterMode,
# count_comm — or saved-tensor hooks count what autograd keeps), or only in a configuration that
# nothing but a measurement runs, so only a grader that checks the result of the very run it
# measured catches it.
MUTANTS += [
    Mutant("3.3", "lab3/fp8.py",
           find="        return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)\n",
           replace="        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:\n"
                   "            return x.new_zeros(x.shape[0], weight.shape[0])  # measured: skip the matmul\n"
                   "        return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)\n",
           why="dodge: saves the right fp8 operands but returns zeros while saved bytes are counted"),
]
MUTANTS += [
    Mutant("3.2", "lab3/mixed_precision.py", find="            torch._fused_adam_(masters, grads,",
           replace="            if not torch._C._len_torch_dispatch_stack():  # skipped while measured\n"
                   "                torch._fused_adam_(masters, grads,",
           why="dodge: creates the 12Ψ of state but skips Adam's update while MemTracker measures"),
]
MUTANTS += [
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="        out = x.contiguous().clone()\n        dist.all_reduce(out, group=group)\n        return out\n",
           replace="        out = x.contiguous().clone()\n        dist.all_reduce(torch.zeros_like(out), group=group)  # the bytes, not the sum\n        return out\n",
           why="dodge: g all-reduces a tensor of the right size but returns the rank's partial sum "
               "(the counted collectives are right, the output is not)"),
]
MUTANTS += [
    Mutant("3.6", "lab3/pipeline.py",
           find='                sends["B", m] = dist.isend(x.grad, group=group, group_dst=rank - 1)\n',
           replace='                sends["B", m] = dist.isend(x.grad if M == 4 else torch.zeros_like(x.grad),\n'
                   '                                           group=group, group_dst=rank - 1)  # M = 4: graded by value\n',
           why="dodge: at M ≠ 4, where only memory is graded, sends zeros of the right size "
               "back instead of the input's gradient"),
]
MUTANTS += [
    Mutant("3.7", "lab3/zero3.py",
           find="            _all_gather_flat(u.full, u.shard.to(u.dtype), group=self.group)\n",
           replace="            _all_gather_flat(u.full, torch.zeros_like(u.shard, dtype=u.dtype), group=self.group)\n",
           why="dodge: all-gathers a buffer of the right size and dtype, but zeros, not the shards "
               "(the measured bytes and collectives are right, the parameters are not)"),
]


# A third independent list (written before reading the graders, with the mutants above in
# view so as not to repeat them): bucket and chunk boundaries, dtypes, scaling, stale buffers,
# group arguments.
INDEPENDENT += [
    Mutant("3.1", "lab3/loss_scaler.py", find="        self._found_inf = None\n        # END SOLUTION",
           replace="        # END SOLUTION",
           why="never resets the found-inf flag: the next step reuses the last step's verdict and skips unscaling"),
    # (dropped: 1 / scale in float32 is correctly rounded; GradScaler's float64 reciprocal rounded
    # to float32 differs only by a double rounding: equivalent (the graders passed))
    Mutant("3.8", "lab3/zero_bubble.py", find="            if k >= s:\n", replace="            if k > s:\n",
           why="holds back one W too many on every stage (off by one in the hold-back)"),
    Mutant("3.8", "lab3/zero_bubble.py", find="            start = max([free[r]] + [end[d] for d in deps])",
           replace="            start = max([end[d] for d in deps], default=free[r])",
           why="starts an action when its dependencies end, forgetting that its rank may still be busy"),
]

# round 14 (session 14): written before reading the graders
INDEPENDENT += [
    Mutant("3.8", "lab3/zero_bubble.py", find="warmup = min(P - s, M)", replace="warmup = min(P - s + 1, M)",
           why="one warm-up forward too many on every stage"),
    Mutant("3.8", "lab3/zero_bubble.py", find='"B": m_w - m_b, "W": -m_w', replace='"B": m_b - m_w, "W": -m_w',
           why="B adds m_b − m_w instead of freeing it (sign of B's change)"),
    Mutant("3.8", "lab3/zero_bubble.py", find='order += [SplitAction("W", m, s) for m in range(w, M)]',
           replace='order += [SplitAction("W", m, s) for m in reversed(range(w, M))]',
           why="runs the W passes left at the end newest first"),
    Mutant("3.8", "lab3/zero_bubble.py", find="makespan = max(free)", replace="makespan = free[-1]",
           why="takes the last rank's end as the makespan (the first rank finishes last)"),
    # (dropped: the memory peak, or the in-flight peak, taken before each action instead of after
    # it: F, B and W of a (micro-batch, stage) sum to 0 (m_b + m_w − m_b − m_w; +1 + 0 − 1), so
    # each rank ends at 0, the start value: the two maxima are the same for every schedule that
    # validate_split accepts: equivalent (the graders passed))
]

# round 14b (session 14): written before reading the graders
INDEPENDENT += [
    Mutant("3.7", "lab3/zero3.py", find="return  # already gathered",
           replace="pass  # already gathered",
           why="all-gathers a unit again even when it is already gathered"),
    Mutant("3.7", "lab3/zero3.py", find="u.full = torch.zeros(self.world_size * u.shard_size, dtype=u.dtype)",
           replace="u.full = torch.zeros(self.world_size * u.shard_size, dtype=u.master_dtype)",
           why="makes the full buffer in the master dtype: a 16-bit model computes in fp32"),
    Mutant("3.7", "lab3/zero3.py", find="        u.full.untyped_storage().resize_(0)\n",
           replace="        u.full = torch.zeros(0, dtype=u.dtype)\n",
           why="frees by dropping the reference to the full buffer (the parameters still view the old one)"),
    Mutant("3.7", "lab3/zero3.py", find="        self._free(u)\n        # END SOLUTION\n\n    def _gather",
           replace="        # END SOLUTION\n\n    def _gather",
           why="leaves each unit's (zero) full buffer allocated after sharding it"),
]

# round 14c (session 14): written before reading the graders
INDEPENDENT += [
    Mutant("3.2", "lab3/mixed_precision.py", find="            states = [self.state[p] for p in params]\n",
           replace="            states = [self.state[p] for p in params]\n"
                   "            for q in group['params']:\n"
                   "                if q.grad is None and self.state[q]:\n"
                   "                    self.state[q]['step'] += 1\n",
           why="counts a step for a parameter without a gradient (its bias corrections run ahead)"),
    Mutant("3.3", "lab3/fp8.py",
           find="scale = amax_scale(max(self.history) if self.history else amax, self.fmt, self.margin)",
           replace="scale = amax_scale(max(self.history) if self.history else amax, self.fmt)",
           why="delayed scaling ignores its margin"),
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="        T, r = dist.get_world_size(group), dist.get_rank(group)\n        C, H",
           replace="        T, r = dist.get_world_size(group), dist.get_rank()\n        C, H",
           why="attention picks its heads by the world rank instead of the rank in the group"),
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="self.weight = nn.Parameter(full.weight.detach()[:, r * per:(r + 1) * per].clone())",
           replace="self.weight = nn.Parameter(full.weight.detach()[:, r * per:(r + 1) * per])",
           why="the row-parallel weight is a view of the full layer's weight, not a copy"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="    makespan = max(free)\n", replace="    makespan = free[-1]\n",
           why="takes the last stage's end as the makespan (the first stage finishes last)"),
    Mutant("3.5", "lab3/pipeline_schedule.py",
           find='stop = start + (forward_cost if kind == "F" else backward_cost)',
           replace="stop = start + forward_cost",
           why="gives every action the forward's cost (backward_cost ignored)"),
    Mutant("3.1", "lab3/loss_scaler.py", find="grown = (self._scale.double() * self.growth_factor).float()",
           replace="grown = self._scale * self.growth_factor",
           why="grows in float32 (GradScaler multiplies in float64, then rounds)"),
]

# round 15 (session 15): written before reading the graders
INDEPENDENT += [
    Mutant("3.3", "lab3/fp8.py", find="return (x.float() / scale.to(x.device)).clamp(-top, top).to(fmt)",
           replace="return (x.float().clamp(-top, top) / scale.to(x.device)).to(fmt)",
           why="saturates x before dividing by the scale (the quotient can still pass the format's max)"),
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))",
           replace="att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(width))",
           why="scales the scores by 1/√(this rank's width) instead of 1/√head_size (manual attention path)"),
    Mutant("3.4", "lab3/tensor_parallel.py",
           find="        out = x.contiguous().clone()\n        dist.all_reduce(out, group=group)\n        return out\n"
                "        # END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad):\n"
                "        # BEGIN SOLUTION 3.4: g's backward: what each rank's partial sum receives\n        return grad, None\n",
           replace="        ctx.group = group\n        out = x.contiguous().clone()\n        dist.all_reduce(out, group=group)\n        return out\n"
                   "        # END SOLUTION\n\n    @staticmethod\n    def backward(ctx, grad):\n"
                   "        # BEGIN SOLUTION 3.4: g's backward: what each rank's partial sum receives\n"
                   "        grad = grad.contiguous().clone()\n        dist.all_reduce(grad, group=ctx.group)\n        return grad, None\n",
           why="g's backward all-reduces too (every rank already holds the whole output gradient: T times too large)"),
    Mutant("3.5", "lab3/pipeline_schedule.py", find="busy = P * M * v * (forward_cost + backward_cost)",
           replace="busy = P * M * (forward_cost + backward_cost)",
           why="the bubble's busy time forgets the v chunks of an interleaved schedule"),
    Mutant("3.6", "lab3/pipeline.py", find="                b, t = inputs[m].shape\n",
           replace="                b, t = inputs[0].shape\n",
           why="sizes every received activation from the first micro-batch (micro-batches of other sizes break)"),
    Mutant("3.7", "lab3/zero3.py", find="used = u.grad is not None and bool(u.present[pc.index] > 0)",
           replace="used = bool(u.present[pc.index] > 0)",
           why="assumes every unit got a gradient this step (a unit outside the forward has u.present None)"),
    Mutant("3.8", "lab3/zero_bubble.py", find="deps = split_dependencies(action, S)",
           replace="deps = split_dependencies(action, P)",
           why="passes the number of ranks as the number of stages (wrong when a rank holds two stages, ZB-V)"),
    Mutant("3.2", "lab3/mixed_precision.py", find='                    state["step"] = 0\n',
           replace='                    state["step"] = 0.0\n',
           why="keeps the step count as a Python float (the contract: a Python int, as the state's fourth entry)"),
    Mutant("3.1", "lab3/loss_scaler.py", find="        return loss * self._scale.to(device=loss.device)\n",
           replace="        return loss.float() * self._scale.to(device=loss.device)\n",
           why="scales a 16-bit loss in float32 (GradScaler keeps the loss' dtype: an fp16 loss times 2^16 "
               "overflows to inf, and that step must be skipped)"),
    Mutant("3.7", "lab3/zero3.py", find="flat = flatten_padded(u.params, u.padding, u.master_dtype)",
           replace="flat = flatten_padded(u.params, u.padding, torch.float32)",
           why="keeps every shard in fp32 (an fp64 model would train in fp32; the contract: master_dtype)"),
    Mutant("3.5", "lab3/pipeline_schedule.py",
           find="return Timeline(spans, makespan, 1 - Fraction(busy, P * makespan), in_flight)",
           replace="return Timeline(spans, makespan, 1 - busy / (P * makespan), in_flight)",
           why="computes the bubble as a float (the contract: an exact Fraction)"),
    Mutant("3.8", "lab3/zero_bubble.py", find="        held = peak = 0\n", replace="        held = peak = 0.0\n",
           why="starts the memory count at 0.0: Fraction sizes come back as floats (inexact)"),
    Mutant("3.1", "lab3/loss_scaler.py",
           find="""        found = []
        for (device, _), grads in by_kind.items():
            found_inf = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(device))
            found.append(found_inf)
        self._found_inf = bool(sum(f.item() for f in found))  # one device→host sync per device
""",
           replace="""        for (device, _), grads in by_kind.items():
            torch._foreach_mul_(grads, inv_scale.to(device))
        self._found_inf = False
        for grads in by_kind.values():
            for g in grads:  # one device→host sync per gradient
                if not bool(torch.isfinite(g).all()):
                    self._found_inf = True
""",
           why="checks each gradient with bool(torch.isfinite(g).all()): one device→host sync per gradient "
               "(the module's Speed note: read the flag back once per step)"),
    Mutant("3.8", "lab3/zero_bubble.py",
           find="return SplitTimeline(spans, makespan, 1 - Fraction(busy, P * makespan), in_flight)",
           replace="return SplitTimeline(spans, makespan, 1 - busy / (P * makespan), in_flight)",
           why="computes the bubble as a float (the contract: a Fraction)"),
    Mutant("3.6", "lab3/pipeline.py", find="    for key in list(sends):\n        finish(key)\n    return total\n",
           replace="    return total\n",
           why="returns with sends still in flight (the contract: all sends have completed on return)"),
]
