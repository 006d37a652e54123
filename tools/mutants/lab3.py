"""Plausible student bugs in Lab 3's exercises (run: .venv/bin/python -m tools.mutants --lab 3)."""
from tools.mutants.mutant import Mutant

MUTANTS = [
    # ------------------------------------------------------------ 3.1 loss scaler
    Mutant("3.1", "loss_scaler.py", find="return loss * self._scale.to(device=loss.device)",
           replace="return loss * float(self._scale) ** 0.5",
           why="scales the loss by the wrong factor"),
    Mutant("3.1", "loss_scaler.py", find="p.grad.mul_(inv_scale.to(p.grad.device))",
           replace="p.grad.div_(self._scale)",
           why="divides by the scale instead of multiplying by its float32 reciprocal"),
    Mutant("3.1", "loss_scaler.py", find="if not torch.isfinite(p.grad).all():",
           replace="if torch.isinf(p.grad).any():",
           why="checks for inf but forgets NaN"),
    Mutant("3.1", "loss_scaler.py", find="""        if self._found_inf:
            return False
        optimizer.step()""", replace="""        optimizer.step()""",
           why="steps the optimizer even when a gradient is inf or NaN"),
    Mutant("3.1", "loss_scaler.py", find="""            self._scale = self._scale * self.backoff_factor
            self._growth_tracker = 0""", replace="""            self._scale = self._scale * self.backoff_factor""",
           why="forgets to reset the good-step count after a backoff"),
    Mutant("3.1", "loss_scaler.py", find="if self._growth_tracker == self.growth_interval:",
           replace="if self._growth_tracker > self.growth_interval:",
           why="grows one step late (off by one)"),
    Mutant("3.1", "loss_scaler.py", find="""                if torch.isfinite(grown):
                    self._scale = grown""", replace="""                self._scale = grown""",
           why="lets the scale grow to inf"),
    Mutant("3.1", "loss_scaler.py", find="""        if self._found_inf is None:
            self.unscale_(optimizer)""", replace="""        self._found_inf = None
        self.unscale_(optimizer)""",
           why="unscales again in step() after an explicit unscale_()"),
    # ------------------------------------------------------------ 3.2 mixed-precision Adam
    Mutant("3.2", "mixed_precision.py", find="""                master.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
                p.copy_(master)""", replace="""                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1 ** t))""",
           why="updates the 16-bit parameter directly; the master never moves"),
    Mutant("3.2", "mixed_precision.py", find='state["exp_avg"] = torch.zeros_like(state["master"])',
           replace='state["exp_avg"] = torch.zeros_like(p)', why="keeps the first moment in 16 bits"),
    Mutant("3.2", "mixed_precision.py", find="denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)",
           replace="denom = v.sqrt().add_(eps)", why="forgets the second moment's bias correction"),
    Mutant("3.2", "mixed_precision.py", find="                p.copy_(master)\n",
           replace="", why="never copies the master back into the 16-bit parameter"),
    Mutant("3.2", "mixed_precision.py", find='state["step"] = 0',
           replace='state["step"] = torch.tensor(0.0)', why="keeps the step count as a tensor (4 more bytes per parameter tensor)"),
    Mutant("3.2", "mixed_precision.py", find="g = p.grad.float()",
           replace="g = p.grad.float() * (1 - beta1)", why="scales the gradient twice by (1 − β1)"),
    # ------------------------------------------------------------ 3.4 tensor parallel
    Mutant("3.4", "tensor_parallel.py", find="""        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None""", replace="""        return grad, None""",
           why="f forgets the all-reduce in backward"),
    Mutant("3.4", "tensor_parallel.py", find="""        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out""", replace="""        return x.clone()""",
           why="g forgets the all-reduce in forward"),
    Mutant("3.4", "tensor_parallel.py", find="""        out = reduce_from_tp(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias""",
           replace="""        return reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)""",
           why="adds the row-parallel bias on every rank before the all-reduce (T times)"),
    Mutant("3.4", "tensor_parallel.py", find="self.weight = nn.Parameter(full.weight.detach()[:, r * per:(r + 1) * per].clone())",
           replace="self.weight = nn.Parameter(full.weight.detach()[r * per:(r + 1) * per].clone().T.contiguous() if full.weight.shape[0] == full.weight.shape[1] else full.weight.detach()[:, r * per:(r + 1) * per].clone())",
           why="slices rows instead of columns of a square row-parallel weight"),
    Mutant("3.4", "tensor_parallel.py", find="self.c_attn = ColumnParallelLinear(attn.c_attn, group, rows=torch.cat([own, C + own, 2 * C + own]))",
           replace="self.c_attn = ColumnParallelLinear(attn.c_attn, group)",
           why="takes a contiguous slice of the fused qkv weight instead of the same heads of q, k and v"),
    Mutant("3.4", "tensor_parallel.py", find="return self.c_proj(F.gelu(self.c_fc(copy_to_tp(x, self.group))))",
           replace="return self.c_proj(F.gelu(self.c_fc(x)))",
           why="leaves f out of the MLP"),
    Mutant("3.4", "tensor_parallel.py", find="self.weight = nn.Parameter(full.weight.detach()[rows].clone())",
           replace="self.weight = nn.Parameter(full.weight.detach().clone())",
           why="keeps the whole column-parallel weight on every rank"),
    # ------------------------------------------------------------ 3.5 pipeline schedules
    Mutant("3.5", "pipeline_schedule.py", find="warmup = min(P - s, M)", replace="warmup = min(P - s - 1, M)",
           why="one warm-up forward too few (then B before its F on the last stage)"),
    Mutant("3.5", "pipeline_schedule.py", find="warmup = min(P - s, M)", replace="warmup = min(P, M)",
           why="every stage warms up with P forwards"),
    Mutant("3.5", "pipeline_schedule.py", find="            order += [backwards[b], forwards[f]]",
           replace="            order += [forwards[f], backwards[b]]",
           why="alternates forward-then-backward in the steady state"),
    Mutant("3.5", "pipeline_schedule.py", find="            stages.append(forwards + backwards)",
           replace="            stages.append(forwards + backwards[::-1])",
           why="GPipe's backwards in reverse micro-batch order"),
    Mutant("3.5", "pipeline_schedule.py", find="                deps = [(s, \"F\", m)] + ([(s + 1, \"B\", m)] if s < P - 1 else [])\n            if any(d not in end for d in deps):",
           replace="                deps = [(s, \"F\", m)]\n            if any(d not in end for d in deps):",
           why="the simulator forgets that B waits for the next stage's B"),
    Mutant("3.5", "pipeline_schedule.py", find="start = max([free[s]] + [end[d] for d in deps])",
           replace="start = max([end[d] for d in deps] or [free[s]])",
           why="the simulator lets a stage run two actions at once"),
    Mutant("3.5", "pipeline_schedule.py", find="return Timeline(spans, makespan, 1 - Fraction(busy, P * makespan), in_flight)",
           replace="return Timeline(spans, makespan, Fraction(P - 1, makespan), in_flight)",
           why="bubble as idle time of one stage over the makespan"),
    Mutant("3.5", "pipeline_schedule.py", find="                elif sp.start < dep.end:",
           replace="                elif sp.start < dep.start:",
           why="the checker compares with the dependency's start instead of its end"),
    Mutant("3.5", "pipeline_schedule.py", find="            if b.start < a.end:",
           replace="            if False:",
           why="the checker ignores overlapping spans on one stage"),
    # ------------------------------------------------------------ 3.7 ZeRO-3
    Mutant("3.7", "zero3.py", find="        mine /= self.world_size\n",
           replace="", why="forgets to average the reduce-scattered gradient over the ranks"),
    Mutant("3.7", "zero3.py", find="u.shard = flat[shard_range(self.rank, u.shard_size)].clone()",
           replace="u.shard = flat[shard_range(0, u.shard_size)].clone()",
           why="every rank keeps rank 0's slice"),
    Mutant("3.7", "zero3.py", find="u.shard_size, u.padding = partition(u.numel, self.world_size)",
           replace="u.shard_size, u.padding = u.numel // self.world_size + 1, (u.numel // self.world_size + 1) * self.world_size - u.numel",
           why="S = floor(Ψ/N) + 1 instead of ceil(Ψ/N): one element too many when N divides Ψ"),
    Mutant("3.7", "zero3.py", find="        u.full.untyped_storage().resize_(0)\n",
           replace="        pass\n", why="never frees the gathered parameters"),
    Mutant("3.7", "zero3.py", find="            _all_gather_flat(u.full, u.shard, group=self.group)",
           replace="            u.full = torch.empty_like(u.full)\n            _all_gather_flat(u.full, u.shard, group=self.group)",
           why="gathers into a fresh buffer, which the parameters do not view"),
    Mutant("3.7", "zero3.py", find="denom = (u.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.eps)",
           replace="denom = u.exp_avg_sq.sqrt().add_(self.eps)",
           why="forgets Adam's bias correction of the second moment"),
    Mutant("3.7", "zero3.py", find="""        for p in u.params:
            p.grad = None
        self._free(u)""", replace="""        for p in u.params:
            p.grad = None""", why="keeps the unit gathered after its backward"),
]
