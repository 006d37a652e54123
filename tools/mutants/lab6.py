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
    Mutant("6.1", CA, find="        i = free.lower_bound((stream, size, 0))\n        if i == len(free) or free[i].stream != stream:\n            return None\n        block = free[i]\n",
           replace="        block = min((b for b in free if b.stream == stream and b.size >= size), key=lambda b: b.addr, default=None)\n        if block is None:\n            return None\n",
           why="first fit (lowest address) instead of best fit"),
    Mutant("6.1", CA, find="        i = free.lower_bound((stream, size, 0))\n        if i == len(free) or free[i].stream != stream:\n            return None\n        block = free[i]\n",
           replace="        block = max((b for b in free if b.stream == stream and b.size >= size), key=lambda b: (b.size, -b.addr), default=None)\n        if block is None:\n            return None\n",
           why="worst fit: takes the largest cached block"),
    Mutant("6.1", CA, find="        if i == len(free) or free[i].stream != stream:\n",
           replace="        if i == len(free):\n", why="takes a cached block of another stream"),
    Mutant("6.1", CA, find="        if size == 0:\n            return None\n", replace="",
           why="serves a 0-byte request from a pool (a 512 B block, a 2 MiB segment)"),
    Mutant("6.1", CA, find="            if size < self.max_split_size and block.size >= self.max_split_size:\n                return None\n",
           replace="", why="lets small requests take oversize blocks under max_split_size"),
    Mutant("6.1", CA, find="        if self._should_split(block, size):", replace="        if block.size > size:",
           why="splits every remainder, even large-pool remainders of 1 MiB or less"),
    Mutant("6.1", CA, find="        return size < limit and remaining > SMALL_SIZE",
           replace="        return size < limit and remaining >= MIN_BLOCK_SIZE",
           why="uses the small pool's split rule in the large pool"),
    Mutant("6.1", CA, find="            free.add(rest)\n",
           replace="", why="forgets to cache the split-off remainder"),
    Mutant("6.1", CA, find="        self.allocated_bytes += block.size\n        self.requested_bytes += requested",
           replace="        self.allocated_bytes += requested\n        self.requested_bytes += requested",
           why="counts the request instead of the block as allocated"),
    Mutant("6.1", CA, find="        if nxt is not None and not nxt.allocated:\n",
           replace="        if False:\n", why="never merges with the next free block"),
    Mutant("6.1", CA, find="        if prev is not None and not prev.allocated:\n",
           replace="        if False:\n", why="never merges with the previous free block"),
    Mutant("6.1", CA, find="            free.discard(nxt)\n",
           replace="", why="merges but leaves the absorbed neighbour in the cache"),
    Mutant("6.1", CA, find="        if block is None:\n            self.num_alloc_retries += 1\n            self._release_cached()\n            block = self._new_block(pool, stream, rounded)\n",
           replace="", why="raises OOM without releasing cached segments and retrying"),
    Mutant("6.1", CA, find="            elif seg.head.next is None and not seg.head.allocated:",
           replace="            elif not seg.head.allocated:",
           why="releases a segment whose first block is free even if others are in use"),
    Mutant("6.1", CA, find="        while i >= 0 and released < target and free[i].size >= self.max_split_size and free[i].stream == stream:",
           replace="        while i >= 0 and released < target and free[i].stream == stream:",
           why="the OOM retry under max_split_size also releases blocks below max_split_size"),
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

# A second list for 6.1, 6.2 and 6.5, written from the solutions alone, before reading the graders
# or the list above.
INDEPENDENT = [
    # 6.1 the caching allocator: boundaries of every threshold, orders, memory held live
    Mutant("6.1", CA, find="return MIN_BLOCK_SIZE * math.ceil(size / MIN_BLOCK_SIZE)",
           replace="return MIN_BLOCK_SIZE * (size // MIN_BLOCK_SIZE + 1)",
           why="rounds up by adding one block, so an exact multiple of 512 B gets 512 B too many"),
    Mutant("6.1", CA, find='return "small" if round_size(size) <= SMALL_SIZE else "large"',
           replace='return "small" if round_size(size) < SMALL_SIZE else "large"',
           why="a request of exactly 1 MiB goes to the large pool"),
    Mutant("6.1", CA, find="    if size < MIN_LARGE_ALLOC:\n        return LARGE_BUFFER",
           replace="    if size <= MIN_LARGE_ALLOC:\n        return LARGE_BUFFER",
           why="a request of exactly 10 MiB gets a 20 MiB segment"),
    Mutant("6.1", CA, find="i = free.lower_bound((stream, size, 0))",
           replace="i = free.lower_bound((stream, size + 1, 0))",
           why="searches past blocks of exactly the request's size (a lower_bound key one too high)"),
    Mutant("6.1", CA, find="        i = free.lower_bound((stream, size, 0))\n        if i == len(free) or free[i].stream != stream:\n            return None\n        block = free[i]\n",
           replace="        block = min((b for b in free if b.stream == stream and b.size >= size), key=lambda b: (b.addr, b.size), default=None)\n        if block is None:\n            return None\n",
           why="first fit (lowest address) instead of best fit"),
    Mutant("6.1", CA, find="block.size >= size + LARGE_BUFFER:",
           replace="block.size > size + LARGE_BUFFER:",
           why="an oversize block exactly 20 MiB larger than the request is still taken"),
    Mutant("6.1", CA, find="if size < self.max_split_size and block.size >= self.max_split_size:",
           replace="if size < self.max_split_size and block.size > self.max_split_size:",
           why="a block of exactly max_split_size is handed to a smaller request"),
    Mutant("6.1", CA, find="        free.discard(block)\n        if self._should_split",
           replace="        if self._should_split",
           why="forgets to take the block out of the free set: the same block can be handed out twice"),
    Mutant("6.1", CA, find="            free.add(rest)\n",
           replace="",
           why="the split-off remainder is never cached, so it is never reused"),
    Mutant("6.1", CA, find="            if block.next is not None:\n                block.next.prev = rest\n            block.next = rest\n",
           replace="            block.next = rest\n",
           why="links the remainder after its block but leaves the old next block pointing back past it"),
    Mutant("6.1", CA, find="        self.allocated_bytes += block.size\n        self.requested_bytes += requested",
           replace="        self.allocated_bytes += requested\n        self.requested_bytes += requested",
           why="counts the request, not the rounded block, as allocated"),
    Mutant("6.1", CA, find="        while i >= 0 and released < target and free[i].size",
           replace="        while i >= 0 and free[i].size",
           why="the OOM retry under max_split_size releases every oversize free segment, not just enough"),
    Mutant("6.1", CA, find="            elif seg.head.next is None and not seg.head.allocated:",
           replace="            elif seg.head.next is None:",
           why="releases a segment whose one block still holds a tensor"),
    Mutant("6.1", CA, find="            if seg.expandable:\n                self._unmap_free_pages(seg)\n",
           replace="            if seg.expandable:\n                continue\n",
           why="expandable: empty_cache never unmaps the free pages"),
    Mutant("6.1", CA, find="return self._take(block, rounded, size).addr",
           replace="return self._take(block, rounded, rounded).addr",
           why="records the rounded size as the requested bytes"),
    Mutant("6.1", CA, find="        if prev is not None and not prev.allocated:",
           replace="        if False:",
           why="merges a freed block with the next block only, never with the previous"),
    Mutant("6.1", CA, find="            free.discard(nxt)\n",
           replace="",
           why="the merged next block stays in the free set: a stale block can be handed out"),
    Mutant("6.1", CA, find="        if block is None:\n            self.num_alloc_retries += 1",
           replace="        self.num_alloc_retries += 1\n        if block is None:",
           why="counts a retry on every malloc"),

    # 6.2 the static planner: exact-fit gaps, overlapping busy intervals, tie-breaks, orders
    Mutant("6.2", MP, find="if lo - offset >= t.size:",
           replace="if lo - offset > t.size:",
           why="a gap exactly the tensor's size is not used"),
    Mutant("6.2", MP, find="offset = max(offset, hi)",
           replace="offset = hi",
           why="a busy interval nested in an earlier one moves the offset back down (overlap)"),
    Mutant("6.2", MP, find="for p in placed if conflict(p, t))",
           replace="for p in placed)",
           why="avoids every placed tensor, not only those alive at the same time"),
    Mutant("6.2", MP, find="busy = sorted((offsets[p.id]",
           replace="busy = list((offsets[p.id]",
           why="scans the busy intervals in placement order, not by offset"),
    Mutant("6.2", MP, find="key=lambda t: (-t.size, -(t.end - t.start), t.id))",
           replace="key=lambda t: (-t.size, t.id))",
           why="largest first, ties by id only (the lifetime tie-break forgotten)"),
    Mutant("6.2", MP, find="key=lambda t: (-t.size, -(t.end - t.start), t.id))",
           replace="key=lambda t: (-t.size, t.end - t.start, t.id))",
           why="ties broken by the shorter lifetime first"),
    Mutant("6.2", MP, find="order = sorted(tensors, key=lambda t: (t.start, t.id))",
           replace="order = sorted(tensors, key=lambda t: t.id)",
           why="in order of allocation taken as the order of ids"),
    Mutant("6.2", MP, find="for order in itertools.permutations([t.id for t in tensors]):",
           replace="for order in ([t.id for t in tensors], [t.id for t in tensors][::-1]):",
           why="tries two orders instead of every order"),

    # 6.5 fusion: what is saved (memory held live), dtypes, the derivative, grad_out
    Mutant("6.5", FU, find="        ctx.save_for_backward(x)\n        t = torch.tanh(K * (x + A * x * x * x))\n",
           replace="        ctx.save_for_backward(x)\n        t = torch.tanh(K * (x + A * x * x * x))\n        ctx.t = t\n",
           why="keeps tanh's output on ctx as well \"to save backward the work\" (twice the memory)"),
    Mutant("6.5", FU, find="        ctx.save_for_backward(x)\n",
           replace="        ctx.save_for_backward(x.float())\n",
           why="saves an fp32 copy of x: right in fp32, twice the bytes in bf16"),
    Mutant("6.5", FU, find="* K * (1 + 3 * A * x * x)",
           replace="* K * (1 + A * x * x)",
           why="differentiates a·x³ as a·x²"),
    Mutant("6.5", FU, find="dy = 0.5 * (1 + t) + 0.5 * x * (1 - t * t)",
           replace="dy = 0.5 * (1 + t) + 0.5 * x * (1 - t)",
           why="tanh' taken as 1 − t instead of 1 − t²"),
    Mutant("6.5", FU, find="        return grad_out * dy\n",
           replace="        return dy\n",
           why="returns dy/dx without multiplying by grad_out"),
    Mutant("6.5", FU, find="        return 0.5 * x * (1 + t)\n",
           replace="        return torch.nn.functional.gelu(x)\n",
           why="forward uses the exact (erf) GELU instead of the tanh approximation"),
]

# ---------------------------------------------------------------------------------------------
# 6.3 and 6.4: a second list, written from the solution modules before reading their graders
# (issue 25).
DM = "lab6/device_mesh.py"
INDEPENDENT += [
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

# ---------------------------------------------------------------------------------------------
# Session 5 (mut6): a third list, written from the solution modules and the lab's instructions
# before reading the graders or the lists above; the ones that duplicated a listed mutant's
# effect were dropped.
INDEPENDENT += [
    # ------------------------------------------------------------------ 6.1 the caching allocator
    Mutant("6.1", CA, find="            if size < self.max_split_size and block.size >= self.max_split_size:",
           replace="            if size <= self.max_split_size and block.size >= self.max_split_size:",
           why="a request of exactly max_split_size counted as below it: it never reuses a cached block"),
    Mutant("6.1", CA, find="            if nxt.next is not None:\n                nxt.next.prev = block\n", replace="",
           why="merging the next block leaves the block after it pointing back at the absorbed one"),
    Mutant("6.1", CA, find="        self.requested_bytes -= block.requested\n", replace="",
           why="free forgets to take the request off requested_bytes"),
    Mutant("6.1", CA, find="        return released >= target\n", replace="        return released > 0\n",
           why="reports success whenever it released anything, enough or not"),
    Mutant("6.1", CA, find="free[i].size >= self.max_split_size and free[i].stream == stream:",
           replace="free[i].size >= self.max_split_size:",
           why="the OOM release under max_split_size also frees other streams' segments"),
    Mutant("6.1", CA, find="        if block is None and not self.expandable and self._release_available(pool, stream, rounded):\n"
                           "            block = self._new_block(pool, stream, rounded)\n"
                           "        if block is None:\n"
                           "            self.num_alloc_retries += 1\n"
                           "            self._release_cached()\n"
                           "            block = self._new_block(pool, stream, rounded)\n",
           replace="        if block is None:\n"
                   "            self.num_alloc_retries += 1\n"
                   "            self._release_cached()\n"
                   "            block = self._new_block(pool, stream, rounded)\n",
           why="skips the just-enough release of oversize segments: frees the whole cache at once"),
    Mutant("6.1", CA, find="        free.discard(block)\n        if self._should_split(block, size):",
           replace="        free.discard(block)\n        self.allocated_bytes += block.size - size\n        if self._should_split(block, size):",
           why="counts the whole cached block as allocated before splitting it"),
    # ------------------------------------------------------------------ 6.2 the static planner
    Mutant("6.2", MP, find="            if lo - offset >= t.size:", replace="            if lo >= t.size:",
           why="compares the start of the next busy range, not the gap, with the tensor's size"),
    Mutant("6.2", MP, find="for p in placed if conflict(p, t))",
           replace="for p in placed if p.start < t.end and t.start < p.end)",
           why="lifetimes that touch (one freed at the event the other is allocated) taken as disjoint"),
    Mutant("6.2", MP, find="    order = sorted(tensors, key=lambda t: (-t.size, -(t.end - t.start), t.id))",
           replace="    order = sorted(tensors, key=lambda t: (-t.size, -t.end, t.id))",
           why="largest first, ties by the later end instead of the longer lifetime"),
    Mutant("6.2", MP, find="    for ident in order:\n", replace="    for ident in by_id:\n",
           why="places the tensors in the order they were given, ignoring the order argument"),
    # ------------------------------------------------------------------ 6.3 the device mesh
    Mutant("6.3", DM, find="    for rank in range(math.prod(shape)):\n        c = coords_of(rank, shape)\n",
           replace="    for rank in sorted(range(math.prod(shape)), key=lambda r: tuple(reversed(coords_of(r, shape)))):\n        c = coords_of(rank, shape)\n",
           why="groups listed with the other coordinates varying first-dimension-fastest, not by first rank"),
    Mutant("6.3", DM, find="    for size in reversed(shape):\n        rank, c = divmod(rank, size)\n",
           replace="    for size in reversed([s for s in shape if s > 1]):\n        rank, c = divmod(rank, size)\n",
           why="drops the dimensions of size 1 from the coordinates"),
    Mutant("6.3", DM, find="    dim = names.index(axis)\n",
           replace="    dim = names.index(axis)\n    if shape[dim] == 1:\n        return []\n",
           why="an axis of size 1 has no groups (it has world_size groups of one rank)"),
    # ------------------------------------------------------------------ 6.4 the parallel memory model
    Mutant("6.4", PM, find="    unsplit = sbh * (4 * e + 2 * masks)", replace="    unsplit = sbh * (4 * e + masks)",
           why="one dropout mask outside attention instead of two (after attention and after the MLP)"),
    Mutant("6.4", PM, find="    mlp = (3 if gated_mlp else 2) * e * s * b * ffn_hidden",
           replace="    mlp = (3 if gated_mlp else 2) * e * s * b * 4 * h",
           why="the MLP width taken as 4h even when ffn_hidden says otherwise"),
    Mutant("6.4", PM, find='    sharded = {"optimizer states": zero_stage >= 1,',
           replace='    sharded = {"optimizer states": zero_stage >= 2,',
           why="ZeRO-1 shards nothing (stage boundary off by one for the optimizer states)"),
    Mutant("6.4", PM, find="    s, b, h, a, e = seq_len // cp, micro_batch, hidden, n_head, element_bytes\n"
                           "    sbh = s * b * h\n    masks = 1 if dropout else 0\n"
                           "    if checkpointing == \"full\":\n        return sbh * e / tp if sequence_parallel else sbh * e\n",
           replace="    s, b, h, a, e = seq_len // cp, micro_batch, hidden, n_head, element_bytes\n"
                   "    sbh = s * b * h\n    masks = 1 if dropout else 0\n"
                   "    if checkpointing == \"full\":\n        return seq_len * b * h * e / tp if sequence_parallel else seq_len * b * h * e\n",
           why="full recomputation keeps the whole sequence's layer input on a context-parallel rank"),
    Mutant("6.4", PM, find="    in_flight = min(pp, n_micro)\n", replace="    in_flight = min(pp - 1, n_micro) or 1\n",
           why="the first stage keeps P − 1 micro-batches in flight (off by one)"),
    # ------------------------------------------------------------------ 6.5 fusion
    Mutant("6.5", FU, find="* K * (1 + 3 * A * x * x)", replace="* (1 + 3 * A * x * x)",
           why="forgets the k of the inner derivative"),
    Mutant("6.5", FU, find="        ctx.save_for_backward(x)\n        t = torch.tanh(K * (x + A * x * x * x))\n        return 0.5 * x * (1 + t)\n",
           replace="        x = x.float()\n        ctx.save_for_backward(x)\n        t = torch.tanh(K * (x + A * x * x * x))\n        return 0.5 * x * (1 + t)\n",
           why="computes (and returns) in fp32 whatever the input's dtype"),
    Mutant("6.5", FU, find="        t = torch.tanh(K * (x + A * x * x * x))\n        return 0.5 * x * (1 + t)\n",
           replace="        t = torch.tanh(K * (x + A * x * x * x))\n        return x.mul_(0.5).mul_(1 + t)\n",
           why="computes y in place in x to save memory (overwrites the input it saved)"),
    Mutant("6.5", FU, find="        (x,) = ctx.saved_tensors\n        t = torch.tanh(K * (x + A * x * x * x))\n",
           replace="        (x,) = ctx.saved_tensors\n        t = torch.tanh(x + A * x * x * x)\n",
           why="recomputes tanh without the k factor in backward"),
]


# ---- 6.6 expert parallelism (issue 39), from the solution (written after the graders: say so)
MUTANTS += [
    Mutant("6.6", "lab6/expert_parallel.py",
           find="    flat = expert_ids.T.reshape(-1)",
           replace="    flat = expert_ids.reshape(-1)",
           why="claims slots token by token (token 0's choices, then token 1's) instead of choice-major"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    return position.reshape(k, T).T",
           replace="    return position.reshape(T, k)",
           why="reads the choice-major slots back as if token-major"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    position = torch.where(position < capacity,",
           replace="    position = torch.where(position <= capacity,", why="lets each expert take capacity + 1 tokens"),
    Mutant("6.6", "lab6/expert_parallel.py",
           find="    where = expert_ids[kept] * capacity + slots[kept]  # row of the flattened (E·C, d) buffer",
           replace="    where = slots[kept] * n_expert + expert_ids[kept]", why="lays the buffer out slot-major (C, E) instead of (E, C)"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])",
           replace="    padded = torch.cat([x.detach(), x.new_zeros(1, x.shape[1])])", why="copies the tokens without their gradient"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    w = (weights * kept).to(expert_out.dtype)[..., None]",
           replace="    w = weights.to(expert_out.dtype)[..., None]", why="adds the (zero-padded slot 0) output of dropped choices"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    w = (weights * kept).to(expert_out.dtype)[..., None]",
           replace="    w = (weights.detach() * kept).to(expert_out.dtype)[..., None]", why="treats the router weights as constants"),
    Mutant("6.6", "lab6/expert_parallel.py",
           find="        received = received.view(W, E // W, C, d).transpose(0, 1)  # (E/W, W, C, d)",
           replace="        received = received.view(E // W, W, C, d)", why="reads the received blocks expert-major, not rank-major"),
    Mutant("6.6", "lab6/expert_parallel.py", find="        C = expert_capacity(T, E, self.top_k, self.capacity_factor)",
           replace="        C = expert_capacity(T * W, E, self.top_k, self.capacity_factor)",
           why="sizes the capacity for all ranks' tokens instead of this rank's"),
    Mutant("6.6", "lab6/expert_parallel.py", find="        received = all_to_all(send, self.group)",
           replace="        received = all_to_all(send)", why="sends over the default group instead of the expert-parallel one"),
    Mutant("6.6", "lab6/expert_parallel.py", find="        back = all_to_all(torch.stack(outs, 1).reshape(E, C, d), self.group)",
           replace="        back = all_to_all(torch.stack(outs, 0).reshape(E, C, d), self.group)",
           why="stacks the local experts' outputs expert-major before sending them back"),
    Mutant("6.6", "lab6/expert_parallel.py", find="        C = expert_capacity(T, E, self.top_k, self.capacity_factor)",
           replace="        C = T", why="ignores the capacity factor (a dropless-sized buffer of T slots per expert)"),
]

# Dodges of a measurement (issue 34, item 5): the code makes the measured bytes or collectives
# right and the result wrong (only while a measurement watches, where it can tell), so only a
# grader that checks the result of the very run it measured catches it.
MUTANTS += [
    Mutant("6.5", "lab6/fusion.py",
           find="        t = torch.tanh(K * (x + A * x * x * x))\n        return 0.5 * x * (1 + t)\n",
           replace="        t = torch.tanh(K * (x + A * x * x * x))\n"
                   "        if (torch._C._len_torch_dispatch_stack()\n"
                   "                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):\n"
                   "            return torch.zeros_like(x)  # measured: the right bytes, no GELU\n"
                   "        return 0.5 * x * (1 + t)\n",
           why="dodge: while bytes are measured (a dispatch mode or saved-tensor hooks), saves x "
               "and returns zeros"),
    Mutant("6.6", "lab6/expert_parallel.py",
           find="        return combine(back, expert_ids, slots, weights)\n        # END SOLUTION",
           replace="        return combine(send + 0 * back, expert_ids, slots, weights)  # the exchanges run; their result unused\n        # END SOLUTION",
           why="dodge: makes both all-to-alls each way (the counted bytes) but combines the tokens "
               "it sent instead of the experts' outputs"),
]


# A third independent list (written before reading the graders, with the mutants above in
# view so as not to repeat them): bucket and chunk boundaries, dtypes, scaling, stale buffers,
# group arguments.
INDEPENDENT += [
    Mutant("6.6", "lab6/expert_parallel.py", find="(onehot.cumsum(0) - 1)", replace="onehot.cumsum(0)",
           why="slots counted from 1: slot 0 stays empty and one token too few fits"),
    Mutant("6.6", "lab6/expert_parallel.py", find="rows = expert_ids * C + slots.clamp(min=0)",
           replace="rows = expert_ids * E + slots.clamp(min=0)",
           why="combine strides the flattened buffer by the expert count instead of the capacity"),
    Mutant("6.6", "lab6/expert_parallel.py", find="source = torch.full((n_expert * capacity,), T, device=x.device)",
           replace="source = torch.zeros(n_expert * capacity, dtype=torch.long, device=x.device)",
           why="empty slots copy token 0 instead of a row of zeros"),
    Mutant("6.6", "lab6/expert_parallel.py",
           find="token = torch.arange(T, device=x.device)[:, None].expand(T, k)[kept]",
           replace="token = torch.arange(T, device=x.device).repeat(k)[kept.reshape(-1)]",
           why="lists the (token, choice) pairs choice-major while the mask is token-major (wrong token in a slot)"),
]

# round 14 (session 14): written before reading the graders
INDEPENDENT += [
    Mutant("6.6", "lab6/expert_parallel.py",
           find="    flat = expert_ids.T.reshape(-1)  # (k·T,) choice-major: all first choices, then all second\n"
                "    onehot = torch.nn.functional.one_hot(flat, n_expert)  # (k·T, E)\n"
                "    position = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # claims before this one\n"
                "    position = torch.where(position < capacity, position, torch.full_like(position, -1))\n"
                "    return position.reshape(k, T).T\n",
           replace="    flat = expert_ids.reshape(-1)  # (T·k,) token-major\n"
                   "    onehot = torch.nn.functional.one_hot(flat, n_expert)\n"
                   "    position = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]\n"
                   "    position = torch.where(position < capacity, position, torch.full_like(position, -1))\n"
                   "    return position.reshape(T, k)\n",
           why="claims slots token by token (token 0's choices, then token 1's), consistently, not choice by choice"),
    Mutant("6.6", "lab6/expert_parallel.py", find="C = expert_capacity(T, E, self.top_k, self.capacity_factor)",
           replace="C = expert_capacity(T, E, 1, self.capacity_factor)", why="capacity without the top-k factor"),
    Mutant("6.6", "lab6/expert_parallel.py", find="C = expert_capacity(T, E, self.top_k, self.capacity_factor)",
           replace="C = max(1, int(self.capacity_factor * T * self.top_k / E))",
           why="rounds the capacity down instead of up"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    return (w * picked).sum(1)",
           replace="    return (w * picked).mean(1)", why="averages the weighted choices instead of summing them"),
    Mutant("6.6", "lab6/expert_parallel.py", find="kept = slots >= 0  # (T, k)", replace="kept = slots > 0  # (T, k)",
           why="dispatch treats slot 0 as dropped (off by one)"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    kept = slots >= 0\n", replace="    kept = slots > 0\n",
           why="combine treats slot 0 as dropped (off by one)"),
]

# round 14b (session 14): written before reading the graders
INDEPENDENT += [
    Mutant("6.3", "lab6/device_mesh.py", find="dim = names.index(axis)",
           replace="dim = AXES.index(axis)",
           why="looks the axis up in the course's fixed order instead of the mesh's names"),
    Mutant("6.3", "lab6/device_mesh.py", find="rank, c = divmod(rank, size)",
           replace="c, rank = divmod(rank, size)",
           why="swaps quotient and remainder of divmod"),
]

# round 14c (session 14): written before reading the graders
INDEPENDENT += [
    # (dropped: target = size instead of max(size, max_split_size) in _release_available is
    # equivalent — it runs only after best fit failed, so for size < max_split_size no cached
    # block of the stream lies in [size, max_split_size): lower_bound finds the same oversize
    # block either way, and when there is none no block passes the loop's oversize test)
    Mutant("6.1", "lab6/caching_allocator.py", find="        self.allocated_bytes += block.size\n",
           replace="        self.allocated_bytes += size\n",
           why="allocated_bytes adds the rounded request, not the block taken (larger when not split)"),
    Mutant("6.2", "lab6/memory_planner.py", find="key=lambda t: (t.start, t.id)",
           replace="key=lambda t: t.start",
           why="orders by start only: ties keep the input's order, not the ids'"),
    Mutant("6.5", "lab6/fusion.py", find="dy = 0.5 * (1 + t) + 0.5 * x", replace="dy = 0.5 * (1 + t) + x",
           why="forgets the 0.5 of the second term of the product rule"),
]

# round 15 (session 15): written before reading the graders
INDEPENDENT += [
    Mutant("6.1", "lab6/caching_allocator.py",
           find="            prev.next = block.next\n            if block.next is not None:\n                block.next.prev = prev\n",
           replace="            prev.next = block.next\n",
           why="merging into the previous free block forgets to point the next block back at it (a stale prev link)"),
    Mutant("6.1", "lab6/caching_allocator.py", find="block.allocated, block.requested = True, requested",
           replace="block.allocated, block.requested = True, size",
           why="records the rounded size as the block's requested bytes (requested_bytes on free goes wrong)"),
    Mutant("6.2", "lab6/memory_planner.py",
           find="order = sorted(tensors, key=lambda t: (-t.size, -(t.end - t.start), t.id))",
           replace="order = sorted(tensors, key=lambda t: (-t.size * (t.end - t.start), t.id))",
           why="greedy by size orders by size × lifetime (the area), not by size with the lifetime as tie-break"),
    Mutant("6.3", "lab6/device_mesh.py", find="        if c[dim] != 0:\n            continue\n",
           replace="        if rank % shape[dim] != 0:\n            continue\n",
           why="takes the groups' first ranks as the multiples of the axis size (right for the innermost axis only)"),
    Mutant("6.4", "lab6/parallel_memory.py", find="    kv = 2 * e * sbh * n_kv_head / n_head\n",
           replace="    kv = 2 * e * sbh * n_head / n_kv_head\n",
           why="inverts the grouped-query ratio (K and V grow with fewer KV heads)"),
    Mutant("6.5", "lab6/fusion.py", find="        t = torch.tanh(K * (x + A * x * x * x))\n        return 0.5 * x * (1 + t)\n",
           replace="        t = torch.tanh(K * x + A * x * x * x)\n        return 0.5 * x * (1 + t)\n",
           why="the forward applies √(2/π) to x only, not to the cubic term (a misplaced parenthesis)"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    w = (weights * kept).to(expert_out.dtype)[..., None]\n",
           replace="    w = weights * kept\n    w = (w / w.sum(1, keepdim=True).clamp(min=1e-9)).to(expert_out.dtype)[..., None]\n",
           why="renormalises each token's kept router weights to sum to 1 after dropping choices"),
    Mutant("6.1", "lab6/caching_allocator.py", find="            self.num_ooms += 1\n", replace="",
           why="raises SimulatedOOM without counting it in num_ooms"),
    Mutant("6.3", "lab6/device_mesh.py", find="    return tuple(reversed(coords))\n",
           replace="    return list(reversed(coords))\n",
           why="returns the coordinates as a list (the contract: a tuple, usable as a key)"),
    Mutant("6.6", "lab6/expert_parallel.py", find="    return position.reshape(k, T).T\n",
           replace="    return position.reshape(k, T).T.to(torch.int32)\n",
           why="returns the slots as int32 to save memory (the contract: int64)"),
    Mutant("6.5", "lab6/fusion.py", find="        ctx.save_for_backward(x)\n",
           replace="        ctx.save_for_backward(x.detach().clone())\n",
           why="saves a copy of x \"to be safe\" (the input is already kept by the graph: twice its bytes)"),
    Mutant("6.6", "lab6/expert_parallel.py",
           find="    onehot = torch.nn.functional.one_hot(flat, n_expert)  # (k·T, E)\n"
                "    position = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # claims before this one\n",
           replace="    taken = [0] * n_expert\n    claims = []\n    for e in flat.tolist():  # one claim at a time\n"
                   "        claims.append(taken[e])\n        taken[e] += 1\n"
                   "    position = torch.tensor(claims, dtype=torch.int64, device=flat.device)\n",
           why="claims the slots in a Python loop over the (token, choice) pairs (the contract: no Python loop over tokens)"),
    Mutant("6.6", "lab6/expert_parallel.py",
           find="    picked = expert_out.reshape(E * C, d)[rows.reshape(-1)].view(*rows.shape, d)  # (T, k, d)\n"
                "    w = (weights * kept).to(expert_out.dtype)[..., None]\n    return (w * picked).sum(1)\n",
           replace="    flat_out = expert_out.reshape(E * C, d)\n"
                   "    return torch.stack([sum(weights[t, j].to(expert_out.dtype) * flat_out[rows[t, j]]\n"
                   "                            for j in range(rows.shape[1]) if kept[t, j]) + flat_out.new_zeros(d)\n"
                   "                        for t in range(rows.shape[0])])\n",
           why="combines token by token in a Python loop (the contract: no Python loop over tokens)"),
    Mutant("6.4", "lab6/parallel_memory.py", find="    local = n_params / (tp * pp)\n",
           replace="    local = n_params // (tp * pp)\n",
           why="floors this GPU's share of the parameters (integer division: bytes lost when tp·pp does not divide Ψ)"),
]
