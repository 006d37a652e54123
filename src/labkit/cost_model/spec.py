"""What the cost model is asked about: a model's shape (``ModelSpec``, dense or a mixture of
experts) and one configuration of a run (``Config``: precision, optimizer, ZeRO, offload, the
layout D × T × P × C and the expert-parallel E carved out of D, recomputation, the attention
kernel, micro-batches, sequence parallelism, the pipeline's virtual stages).

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import validate
from labkit.moe_memory import MoEModel


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: Ψ parameters, L layers of hidden size h with a heads, s tokens.

    GPT-style by default (multi-head attention, a 4h GELU MLP, dropout). Llama-style models set
    ``n_kv_head`` (grouped-query attention: K and V have n_kv_head heads), ``ffn_hidden`` and
    ``gated_mlp=True`` (SwiGLU: three ffn-wide tensors), ``dropout=False``; RMSNorm and the
    absence of biases change no activation the model counts (a norm keeps its input either way).
    Ψ is given, not derived; ``vocab_size`` (optional) sizes the output layer's matmul, which
    otherwise takes every parameter outside the layers (``extra_weights``) as one matrix of h rows.
    ``ModelSpec.llama(...)`` builds a Llama-style one.

    **Mixture of experts** (``n_expert`` set; chapter 6, "Mixture of experts"): ``moe_layers`` of
    the L layers (the last ones; all by default) replace the MLP by ``n_expert`` routed experts of
    width ``expert_ffn`` (the MLP's ``ffn`` by default), ``top_k`` of them per token, plus
    ``n_shared`` shared experts every token uses, and a router (an h × n_expert matrix). Ψ counts
    every expert (the static state scales with it); a token's FLOPs scale with the active
    parameters (``active_params``). Tokens reach the experts in capacity-padded buffers of
    ⌈``capacity_factor``·tokens·k/n_expert⌉ slots per expert (``labkit.moe.capacity``; 1.0 is a
    dropless run with balanced routing). ``ModelSpec.from_moe(...)`` builds one from
    ``labkit.moe_memory``'s published configurations.
    """

    n_params: float
    n_layer: int
    hidden: int
    n_head: int
    seq_len: int
    name: str = "model"
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    dropout: bool = True
    vocab_size: int | None = None
    n_expert: int | None = None
    top_k: int = 1
    expert_ffn: int | None = None
    n_shared: int = 0
    moe_layers: int | None = None
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        validate.positive_number("n_params", self.n_params)
        for name in ("n_layer", "hidden", "n_head", "seq_len"):
            validate.positive_int(name, getattr(self, name))
        if self.hidden % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide hidden={self.hidden}")
        if self.n_kv_head is not None:
            validate.positive_int("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        for name in ("ffn_hidden", "vocab_size"):
            if getattr(self, name) is not None:
                validate.positive_int(name, getattr(self, name))
        validate.boolean("gated_mlp", self.gated_mlp)
        validate.boolean("dropout", self.dropout)
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {self.name!r}")
        self._check_experts()
        if self.n_params < self.block_weights / 2:  # a shape that contradicts Ψ (Ψ in billions?)
            raise ValueError(
                f"n_params={self.n_params:.4g} is less than half the {self.block_weights:.4g} "
                f"weights of the layers alone (n_layer={self.n_layer} × the attention's and the "
                f"MLP's matrices of hidden={self.hidden}): Ψ counts every parameter, e.g. 7e9 for 7B")

    def _check_experts(self) -> None:
        if self.n_expert is None:
            given = [n for n, dense in (("top_k", 1), ("expert_ffn", None), ("n_shared", 0),
                                        ("moe_layers", None), ("capacity_factor", 1.0))
                     if getattr(self, n) != dense]
            if given:
                raise ValueError(f"{', '.join(given)} describe experts: set n_expert (the routed "
                                 f"experts of an MoE layer) too, or leave them out for a dense model")
            return
        validate.positive_int("n_expert", self.n_expert)
        validate.positive_int("top_k", self.top_k)
        if self.top_k > self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be at most n_expert={self.n_expert}")
        validate.non_negative_int("n_shared", self.n_shared)
        if self.expert_ffn is not None:
            validate.positive_int("expert_ffn", self.expert_ffn)
        if self.moe_layers is not None and not 0 < validate.positive_int("moe_layers", self.moe_layers) <= self.n_layer:
            raise ValueError(f"moe_layers must be in 1..n_layer={self.n_layer}, got {self.moe_layers}")
        validate.positive_number("capacity_factor", self.capacity_factor)
        if self.routed_params > self.n_params:
            raise ValueError(f"n_params={self.n_params:.4g} is less than the {self.routed_params:.4g} "
                             f"parameters of the routed experts alone: Ψ counts every expert")

    @property
    def is_moe(self) -> bool:
        return self.n_expert is not None

    @property
    def n_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts: 0 for a dense model."""
        if self.n_expert is None:
            return 0
        return self.n_layer if self.moe_layers is None else self.moe_layers

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.ffn

    @property
    def expert_weights(self) -> int:
        """One expert's matrices: 3·h·f gated (SwiGLU), 2·h·f otherwise."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.expert_width

    @property
    def routed_params(self) -> float:
        """Parameters of the routed experts of every MoE layer (what E shards); 0.0 if dense."""
        return float(self.n_moe_layers * (self.n_expert or 0) * self.expert_weights)

    @property
    def active_params(self) -> float:
        """Parameters one token uses: Ψ less the routed experts it is not sent to."""
        return self.n_params - self.n_moe_layers * ((self.n_expert or 0) - self.top_k) * self.expert_weights

    @property
    def moe(self) -> MoEModel:
        """The MoE layer as ``labkit.moe_memory`` describes it (its bytes by part)."""
        if self.n_expert is None:
            raise ValueError(f"{self.name} is dense (n_expert=None): it has no MoE layer")
        return MoEModel(name=self.name, n_layer=self.n_layer, hidden=self.hidden, vocab_size=self.vocab_size or 1,
                        attention_params=0, dense_layers=self.n_layer - self.n_moe_layers,
                        dense_ffn=self.ffn, n_expert=self.n_expert, top_k=self.top_k,
                        expert_ffn=self.expert_width, n_shared=self.n_shared,
                        mlp="swiglu" if self.gated_mlp else "gelu")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def block_weights(self) -> float:
        """The weight matrices of the L layers (no biases, norms or embeddings): Q and the
        output projection h², K and V h²·g/a each, the MLP 2·h·f (3·h·f gated); an MoE layer
        holds, in place of its MLP, the router (h·n_expert) and every routed and shared expert."""
        h, a, g, f = self.hidden, self.n_head, self.kv_heads, self.ffn
        if self.n_expert is None:
            return float(self.n_layer * (2 * h * h + 2 * h * h * g // a + (3 if self.gated_mlp else 2) * h * f))
        attention, moe = 2 * h * h + 2 * h * h * g // a, self.n_moe_layers
        experts = (self.n_expert + self.n_shared) * self.expert_weights + h * self.n_expert  # + router
        return float(self.n_layer * attention + (self.n_layer - moe) * (3 if self.gated_mlp else 2) * h * f
                     + moe * experts)

    @property
    def extra_weights(self) -> float:
        """The output layer's matrix: V·h with ``vocab_size``, else every parameter outside the
        layers (embeddings, norms, biases), never negative."""
        if self.vocab_size is not None:
            return float(self.vocab_size * self.hidden)
        return max(0.0, self.n_params - self.block_weights)

    @classmethod
    def llama(cls, n_params: float, n_layer: int, hidden: int, n_head: int, n_kv_head: int,
              ffn_hidden: int, seq_len: int, name: str = "llama", vocab_size: int | None = None) -> "ModelSpec":
        """A Llama-style spec: GQA with ``n_kv_head`` heads, SwiGLU of ``ffn_hidden``, no dropout."""
        return cls(n_params, n_layer, hidden, n_head, seq_len, name, n_kv_head=n_kv_head,
                   ffn_hidden=ffn_hidden, gated_mlp=True, dropout=False, vocab_size=vocab_size)

    @classmethod
    def from_moe(cls, m: MoEModel, seq_len: int, n_head: int, n_kv_head: int | None = None,
                 capacity_factor: float = 1.0) -> "ModelSpec":
        """The spec of a ``labkit.moe_memory.MoEModel`` (Ψ its computed total; SwiGLU experts:
        Llama-style, no dropout), with the attention's heads it does not record."""
        from labkit.moe_memory import param_counts

        return cls(float(param_counts(m)["total"]), m.n_layer, m.hidden, n_head, seq_len, m.name,
                   n_kv_head=n_kv_head, ffn_hidden=m.dense_ffn or None, gated_mlp=m.mlp == "swiglu",
                   dropout=False, vocab_size=m.vocab_size, n_expert=m.n_expert, top_k=m.top_k,
                   expert_ffn=m.expert_ffn, n_shared=m.n_shared, moe_layers=m.moe_layers,
                   capacity_factor=capacity_factor)

    @classmethod
    def from_gpt_config(cls, cfg, name: str = "lab model") -> "ModelSpec":
        """The spec of ``labkit.models.GPT(cfg)``: Ψ counted on the meta device (no memory used)."""
        import torch

        from labkit.models import GPT

        with torch.device("meta"):
            n = sum(p.numel() for p in GPT(cfg).parameters())
        return cls(float(n), cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, name,
                   vocab_size=cfg.vocab_size)


@dataclass(frozen=True, order=True)
class Config:
    """One point of the search space. Ordered field by field (the planner's last tie-break).

    ``sequence_parallel``: with T > 1, the norms, dropouts and residuals run on 1/T of the
    tokens per rank (Korthikanti et al. 2022): their activations and their time split by T, at
    no extra traffic (TP's all-reduce becomes a reduce-scatter and an all-gather).
    ``virtual_stages`` v: the interleaved 1F1B schedule (Narayanan et al. 2021, §2.2.2), each GPU
    holding v chunks of L/(P·v) layers: the bubble divided by v, more activations in flight and
    v times the point-to-point traffic. ``reshard_after_forward`` (ZeRO-3 only): False is
    FSDP's ``reshard_after_forward=False`` — the gathered parameters stay from a micro-batch's
    forward to its backward, one all-gather per micro-batch instead of two, the stage's whole
    16-bit parameters held meanwhile (what Llama 3 ran).
    """

    recipe: str
    optimizer: str
    zero_stage: int
    offload: bool
    dp: int
    tp: int
    pp: int
    cp: int
    checkpointing: str
    micro_batch: int
    n_micro: int
    attention: str = "naive"
    sequence_parallel: bool = False
    virtual_stages: int = 1
    reshard_after_forward: bool = True
    ep: int = 1

    @property
    def layout_label(self) -> str:
        return f"D{self.dp}·T{self.tp}·P{self.pp}·C{self.cp}" + (f"·E{self.ep}" if self.ep > 1 else "")

    @property
    def zero_label(self) -> str:
        return f"ZeRO-{self.zero_stage}" + ("" if self.reshard_after_forward or self.zero_stage != 3
                                            else " (no reshard)")

    def label(self) -> str:
        parts = [self.layout_label, self.zero_label, self.recipe,
                 self.optimizer, f"ckpt {self.checkpointing}", f"{self.attention} attn",
                 f"b={self.micro_batch}×m={self.n_micro}"]
        parts += ["SP"] if self.sequence_parallel else []
        parts += [f"v={self.virtual_stages}"] if self.virtual_stages > 1 else []
        return ", ".join(parts + (["offload"] if self.offload else []))


def check_expert_parallel(model: ModelSpec, cfg: Config) -> None:
    """Refuse an E that the model or the layout cannot take (ValueError naming ``ep``)."""
    if cfg.ep == 1:
        return
    validate.positive_int("ep", cfg.ep)
    if model.n_expert is None:
        raise ValueError(f"ep={cfg.ep}: {model.name} is dense (n_expert=None); expert parallelism "
                         f"needs experts, allowed: ep=1")
    if cfg.dp % cfg.ep or model.n_expert % cfg.ep:
        raise ValueError(f"ep={cfg.ep} must divide dp={cfg.dp} (the expert-parallel group is carved "
                         f"out of the data-parallel ranks) and the n_expert={model.n_expert} experts")
