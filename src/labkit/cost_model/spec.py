"""What the cost model is asked about: a model's shape (``ModelSpec``) and one configuration of
a run (``Config``: precision, optimizer, ZeRO, offload, the layout D × T × P × C, recomputation,
the attention kernel, micro-batches, sequence parallelism, the pipeline's virtual stages).

Chapter 7 (book/07_panorama.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import validate


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
        if self.n_params < self.block_weights / 2:  # a shape that contradicts Ψ (Ψ in billions?)
            raise ValueError(
                f"n_params={self.n_params:.4g} is less than half the {self.block_weights:.4g} "
                f"weights of the layers alone (n_layer={self.n_layer} × the attention's and the "
                f"MLP's matrices of hidden={self.hidden}): Ψ counts every parameter, e.g. 7e9 for 7B")

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
        output projection h², K and V h²·g/a each, the MLP 2·h·f (3·h·f gated)."""
        h, a, g, f = self.hidden, self.n_head, self.kv_heads, self.ffn
        return float(self.n_layer * (2 * h * h + 2 * h * h * g // a + (3 if self.gated_mlp else 2) * h * f))

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

    @property
    def zero_label(self) -> str:
        return f"ZeRO-{self.zero_stage}" + ("" if self.reshard_after_forward or self.zero_stage != 3
                                            else " (no reshard)")

    def label(self) -> str:
        parts = [f"D{self.dp}·T{self.tp}·P{self.pp}·C{self.cp}", self.zero_label, self.recipe,
                 self.optimizer, f"ckpt {self.checkpointing}", f"{self.attention} attn",
                 f"b={self.micro_batch}×m={self.n_micro}"]
        parts += ["SP"] if self.sequence_parallel else []
        parts += [f"v={self.virtual_stages}"] if self.virtual_stages > 1 else []
        return ", ".join(parts + (["offload"] if self.offload else []))
