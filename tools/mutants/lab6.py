"""Plausible student bugs in Lab 6's exercises; the graders must catch them (python -m tools.mutants --lab 6)."""
from tools.mutants.mutant import Mutant

CA, MP, DM, FU = "lab6/caching_allocator.py", "lab6/memory_planner.py", "lab6/device_mesh.py", "lab6/fusion.py"
PM = "lab6/parallel_memory.py"

MUTANTS = [
    # ------------------------------------------------------------------ 6.1 allocator
    Mutant("6.1", CA, find="    if size < MIN_BLOCK_SIZE:\n        return MIN_BLOCK_SIZE\n", replace="",
           why="forgets the 512 B minimum (a 0-byte request gets a 0-byte block)"),
    Mutant("6.1", CA, find="return MIN_BLOCK_SIZE * math.ceil(size / MIN_BLOCK_SIZE)",
           replace="return MIN_BLOCK_SIZE * (size // MIN_BLOCK_SIZE + 1)",
           why="rounds a multiple of 512 up to the next block (off by one)"),
    Mutant("6.1", CA, find="    if size < MIN_LARGE_ALLOC:\n        return LARGE_BUFFER",
           replace="    if size <= MIN_LARGE_ALLOC:\n        return LARGE_BUFFER",
           why="gives a request of exactly 10 MiB a 20 MiB segment (<= instead of <)"),
    Mutant("6.1", CA, find="return ROUND_LARGE * math.ceil(size / ROUND_LARGE)", replace="return size",
           why="does not round large segments up to 2 MiB"),
    Mutant("6.1", CA, find="block = min(candidates, key=lambda b: (b.size, b.addr))",
           replace="block = min(candidates, key=lambda b: b.addr)",
           why="first fit (lowest address) instead of best fit"),
    Mutant("6.1", CA, find="block = min(candidates, key=lambda b: (b.size, b.addr))",
           replace="block = max(candidates, key=lambda b: (b.size, -b.addr))",
           why="worst fit: takes the largest cached block"),
    Mutant("6.1", CA, find="            if size < self.max_split_size and block.size >= self.max_split_size:\n                return None\n",
           replace="", why="lets small requests take oversize blocks under max_split_size"),
    Mutant("6.1", CA, find="        if self._should_split(block, size):", replace="        if block.size > size:",
           why="splits every remainder, even large-pool remainders of 1 MiB or less"),
    Mutant("6.1", CA, find="        return size < limit and remaining > SMALL_SIZE",
           replace="        return size < limit and remaining >= MIN_BLOCK_SIZE",
           why="uses the small pool's split rule in the large pool"),
    Mutant("6.1", CA, find="            self.free_blocks[block.pool].add(rest)\n",
           replace="", why="forgets to cache the split-off remainder"),
    Mutant("6.1", CA, find="        self.allocated_bytes += block.size\n        self.requested_bytes += requested",
           replace="        self.allocated_bytes += requested\n        self.requested_bytes += requested",
           why="counts the request instead of the block as allocated"),
    Mutant("6.1", CA, find="""        if i + 1 < len(blocks) and not blocks[i + 1].allocated:
            nxt = blocks.pop(i + 1)
            self.free_blocks[block.pool].discard(nxt)
            block.size += nxt.size
""", replace="", why="never merges with the next free block"),
    Mutant("6.1", CA, find="""        if i > 0 and not blocks[i - 1].allocated:
            prev = blocks[i - 1]
            self.free_blocks[block.pool].discard(prev)
            prev.size += block.size
            blocks.pop(i)
            block = prev
""", replace="", why="never merges with the previous free block"),
    Mutant("6.1", CA, find="            self.free_blocks[block.pool].discard(nxt)\n",
           replace="", why="merges but leaves the absorbed neighbour in the cache"),
    Mutant("6.1", CA, find="        if block is None:\n            self.num_alloc_retries += 1\n            self._release_cached()\n            block = self._new_block(pool, rounded)\n",
           replace="", why="raises OOM without releasing cached segments and retrying"),
    Mutant("6.1", CA, find="            if len(seg.blocks) == 1 and not seg.blocks[0].allocated:",
           replace="            if not seg.blocks[0].allocated:",
           why="releases a segment whose first block is free even if others are in use"),
    Mutant("6.1", CA, find="                keep = page * math.ceil(start / page) - start  # the free part of a still-used page",
           replace="                keep = 0", why="expandable: unmaps a page that still holds a tensor"),
    # ------------------------------------------------------------------ 6.2 planner
    Mutant("6.2", MP, find="busy = sorted((offsets[p.id], offsets[p.id] + p.size) for p in placed if conflict(p, t))",
           replace="busy = sorted((offsets[p.id], offsets[p.id] + p.size) for p in placed)",
           why="avoids every placed tensor, even those not alive at the same time"),
    Mutant("6.2", MP, find="busy = sorted((offsets[p.id], offsets[p.id] + p.size) for p in placed if conflict(p, t))",
           replace="busy = [(offsets[p.id], offsets[p.id] + p.size) for p in placed if conflict(p, t)]",
           why="scans the gaps without sorting the busy ranges by offset"),
    Mutant("6.2", MP, find="            if lo - offset >= t.size:\n                break",
           replace="            if lo - offset > t.size:\n                break",
           why="refuses a gap of exactly the tensor's size"),
    Mutant("6.2", MP, find="            offset = max(offset, hi)", replace="            offset = hi",
           why="moves the candidate offset down when a busy range ends below it"),
    Mutant("6.2", MP, find="order = sorted(tensors, key=lambda t: (-t.size, -(t.end - t.start), t.id))",
           replace="order = sorted(tensors, key=lambda t: (t.size, t.id))",
           why="greedy by size, smallest first"),
    Mutant("6.2", MP, find="order = sorted(tensors, key=lambda t: (t.start, t.id))",
           replace="order = sorted(tensors, key=lambda t: (t.end, t.id))",
           why="orders by the end of life instead of allocation"),
    Mutant("6.2", MP, find="        if best_size is None or size < best_size:",
           replace="        if best_size is None or size > best_size:", why="keeps the largest arena"),
    Mutant("6.2", MP, find="    for order in itertools.permutations([t.id for t in tensors]):",
           replace="    for order in [[t.id for t in tensors]]:", why="tries only the given order"),
    # ------------------------------------------------------------------ 6.3 mesh
    Mutant("6.3", DM, find="    for size in reversed(shape):\n        rank, c = divmod(rank, size)",
           replace="    for size in shape:\n        rank, c = divmod(rank, size)",
           why="takes the digits from the first dimension (dp innermost)"),
    Mutant("6.3", DM, find="    return tuple(reversed(coords))\n", replace="    return tuple(coords)\n",
           why="forgets to reverse the digits"),
    Mutant("6.3", DM, find="        rank = rank * size + c", replace="        rank = rank * size + c * size",
           why="multiplies the coordinate by its own size"),
    Mutant("6.3", DM, find="        groups.append([rank_of(c[:dim] + (k,) + c[dim + 1:], shape) for k in range(shape[dim])])",
           replace="        groups.append([rank_of(c[:dim] + (k,) + c[dim + 1:], shape) for k in range(shape[dim])][::-1])",
           why="lists a group's ranks in reverse coordinate order"),
    Mutant("6.3", DM, find="    dim = names.index(axis)", replace="    dim = len(names) - 1 - names.index(axis)",
           why="counts the axis from the innermost dimension"),
    Mutant("6.3", DM, find="        if c[dim] != 0:\n            continue\n", replace="",
           why="emits one group per rank (duplicates)"),
    # ------------------------------------------------------------------ 6.4 parallel memory model
    Mutant("6.4", PM, find="    local = n_params / (tp * pp)", replace="    local = n_params / tp",
           why="forgets that pipeline parallelism splits the layers (parameters ÷ T only)"),
    Mutant("6.4", PM, find="    n = dp * cp\n", replace="    n = world_size\n",
           why="shards ZeRO over all GPUs instead of the ranks that hold the same weights"),
    Mutant("6.4", PM, find='"gradients": zero_stage >= 2', replace='"gradients": zero_stage >= 1',
           why="shards the gradients from stage 1 (stage 1 = stage 2)"),
    Mutant("6.4", PM, find='"parameters": zero_stage >= 3', replace='"parameters": zero_stage >= 2',
           why="shards the parameters already at stage 2"),
    Mutant("6.4", PM, find="    unsplit = sbh * (4 * e + 2 * masks)",
           replace="    unsplit = sbh * e if checkpointing == \"full\" else sbh * 5 * e",
           why="counts the dropout masks at the activation element size instead of 1 byte"),
    Mutant("6.4", PM, find="        split += a * s * seq_len * b * (e + masks * (e + 1))", replace="        split += a * s * seq_len * b * (e + masks * e)",
           why="forgets the attention-dropout mask (1 byte per score)"),
    Mutant("6.4", PM, find="    return (unsplit + split) / tp if sequence_parallel else unsplit + split / tp",
           replace="    return (unsplit + split) / tp",
           why="divides everything by T even without sequence parallelism"),
    Mutant("6.4", PM, find="    if checkpointing == \"none\" and attention == \"naive\":", replace="    if checkpointing != \"full\" and attention == \"naive\":",
           why="selective recomputation still keeps the attention scores"),
    Mutant("6.4", PM, find="    s, b, h, a, e = seq_len // cp,", replace="    s, b, h, a, e = seq_len,",
           why="context parallelism does not split the sequence"),
    Mutant("6.4", PM, find="    in_flight = min(pp, n_micro)", replace="    in_flight = n_micro",
           why="keeps all m micro-batches in flight (GPipe, not 1F1B)"),
    Mutant("6.4", PM, find="    in_flight = min(pp, n_micro)", replace="    in_flight = 1",
           why="forgets the micro-batches in flight under 1F1B"),
    Mutant("6.4", PM, find="    out[\"activations\"] = (n_layer // pp) * in_flight * per_layer",
           replace="    out[\"activations\"] = n_layer * in_flight * per_layer",
           why="counts all layers on every pipeline stage"),
    # ------------------------------------------------------------------ 6.5 fusion
    # issue 26: the old model's mistakes, each a plausible student reading
    Mutant("6.4", PM, find="        split += a * s * seq_len * b * (e + masks * (e + 1))",
           replace="        split += a * s * s * b * (e + masks * (e + 1))",
           why="context parallelism divides the s² term by C² (a rank's queries against its own keys only)"),
    Mutant("6.4", PM, find="    if checkpointing == \"none\" and attention == \"naive\":",
           replace="    if checkpointing == \"none\":",
           why="fused attention still stores the a·s² scores"),
    Mutant("6.4", PM, find="    kv = 2 * e * sbh * n_kv_head / n_head\n", replace="    kv = 2 * e * sbh\n",
           why="grouped-query attention ignored: K and V as large as Q"),
    Mutant("6.4", PM, find="    mlp = (3 if gated_mlp else 2) * e * s * b * ffn_hidden\n",
           replace="    mlp = 2 * e * s * b * ffn_hidden\n",
           why="a gated (SwiGLU) MLP keeps two f-wide tensors, not three"),
    Mutant("6.4", PM, find="    masks = 1 if dropout else 0\n", replace="    masks = 1\n",
           why="dropout masks counted for a model without dropout"),
    Mutant("6.5", FU, find=("        ctx.save_for_backward(x)\n        t = torch.tanh(K * (x + A * x * x * x))\n"
                            "        return 0.5 * x * (1 + t)\n        # END SOLUTION\n\n    @staticmethod\n"
                            "    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:\n"
                            "        \"\"\"Return grad_out · dy/dx, recomputing what forward did not save.\"\"\"\n"
                            "        # BEGIN SOLUTION 6.5: recompute tanh from the saved input, then the chain rule of y\n"
                            "        (x,) = ctx.saved_tensors\n        t = torch.tanh(K * (x + A * x * x * x))\n"),
           replace=("        t = torch.tanh(K * (x + A * x * x * x))\n        ctx.save_for_backward(x, t)\n"
                    "        return 0.5 * x * (1 + t)\n        # END SOLUTION\n\n    @staticmethod\n"
                    "    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:\n"
                    "        # BEGIN SOLUTION 6.5: recompute tanh from the saved input, then the chain rule of y\n"
                    "        x, t = ctx.saved_tensors\n"),
           why="saves tanh's output as well as x (and does not recompute it)"),
    Mutant("6.5", FU, find="        (x,) = ctx.saved_tensors\n        t = torch.tanh(K * (x + A * x * x * x))",
           replace="        (x,) = ctx.saved_tensors\n        t = torch.tanh(K * (x + A * x))",
           why="drops the cubic term in the recomputed tanh"),
    Mutant("6.5", FU, find="K * (1 + 3 * A * x * x)", replace="K * (1 + A * x * x)",
           why="forgets the 3 of d(x³)/dx"),
    Mutant("6.5", FU, find="        dy = 0.5 * (1 + t) + 0.5 * x", replace="        dy = (1 + t) + 0.5 * x",
           why="forgets the 0.5 of the first term of the product rule"),
    Mutant("6.5", FU, find="(1 - t * t)", replace="(1 - t)", why="tanh' = 1 − t instead of 1 − t²"),
    Mutant("6.5", FU, find="        return grad_out * dy", replace="        return dy",
           why="forgets to multiply by the incoming gradient"),
    Mutant("6.5", FU, find="        return 0.5 * x * (1 + t)\n        # END SOLUTION\n\n    @staticmethod",
           replace="        return x * (1 + t)\n        # END SOLUTION\n\n    @staticmethod",
           why="forgets the 0.5 in forward"),
]

# ---------------------------------------------------------------------------------------------
# 6.3 and 6.4: a second list, written from the solution modules before reading their graders
# (issue 25). Appended to any INDEPENDENT list of the other exercises of lab 6.
DM = "lab6/device_mesh.py"
_INDEPENDENT_63_64 = [
    # ------------------------------------------------------------------ 6.3 the device mesh
    Mutant("6.3", DM, find="    for size in reversed(shape):\n        rank, c = divmod(rank, size)\n"
                           "        coords.append(c)\n    return tuple(reversed(coords))",
           replace="    for size in shape:\n        rank, c = divmod(rank, size)\n"
                   "        coords.append(c)\n    return tuple(coords)",
           why="column-major coordinates (first dimension fastest)"),
    Mutant("6.3", DM, find="        coords.append(c)\n    return tuple(reversed(coords))",
           replace="        coords.append(c)\n    return tuple(coords)",
           why="forgets to reverse the digits (innermost coordinate first)"),
    Mutant("6.3", DM, find="        rank = rank * size + c\n",
           replace="        rank = rank * shape[-1] + c\n",
           why="uses the innermost size as every stride (right only when all sizes are equal)"),
    Mutant("6.3", DM, find="        groups.append([rank_of(c[:dim] + (k,) + c[dim + 1:], shape) for k in range(shape[dim])])",
           replace="        groups.append([rank + k * math.prod(shape[:dim]) for k in range(shape[dim])])",
           why="the stride of an axis taken as the product of the sizes before it, not after it"),
    Mutant("6.3", DM, find="        groups.append([rank_of(c[:dim] + (k,) + c[dim + 1:], shape) for k in range(shape[dim])])",
           replace="        groups.append(list(range(rank, rank + shape[dim])))",
           why="every group as consecutive ranks (right for the innermost axis only)"),
    Mutant("6.3", DM, find="        if c[dim] != 0:\n            continue\n", replace="",
           why="one group per rank: every group listed shape[axis] times"),
    # ------------------------------------------------------------------ 6.4 the parallel memory model
    Mutant("6.4", PM, find="    n = dp * cp\n", replace="    n = dp\n",
           why="ZeRO shards over the D data-parallel ranks only, not D·C"),
    Mutant("6.4", PM, find="    n = dp * cp\n", replace="    n = world_size\n",
           why="ZeRO shards over every GPU (T and P ranks hold different weights)"),
    Mutant("6.4", PM, find="    local = n_params / (tp * pp)\n", replace="    local = n_params / tp\n",
           why="forgets that a pipeline stage holds only its layers' parameters"),
    Mutant("6.4", PM, find='"gradients": zero_stage >= 2', replace='"gradients": zero_stage > 2',
           why="ZeRO-2 leaves the gradients whole (stage boundary off by one)"),
    Mutant("6.4", PM, find="    in_flight = min(pp, n_micro)\n", replace="    in_flight = pp\n",
           why="the first stage holds P micro-batches even when there are fewer"),
    Mutant("6.4", PM, find="    in_flight = min(pp, n_micro)\n", replace="    in_flight = n_micro\n",
           why="every micro-batch in flight (GPipe's count, not 1F1B's)"),
    Mutant("6.4", PM, find="    unsplit = sbh * (4 * e + 2 * masks)",
           replace="    unsplit = sbh * (4 * e + e * masks)",
           why="dropout masks counted at e bytes (right only for 16-bit activations)"),
    Mutant("6.4", PM, find="        return sbh * e / tp if sequence_parallel else sbh * e\n",
           replace="        return sbh * e\n",
           why="full recomputation's kept inputs not split by sequence parallelism"),
    Mutant("6.4", PM, find="    if checkpointing == \"none\" and attention == \"naive\":",
           replace="    if checkpointing != \"full\" and attention == \"naive\":",
           why="selective recomputation still keeps the attention scores"),
]
INDEPENDENT = globals().get("INDEPENDENT", []) + _INDEPENDENT_63_64
