"""The course's GPT and the synthetic data it learns from.

A small nanoGPT-style decoder (token + position embeddings, pre-LayerNorm blocks of causal
self-attention and a GELU MLP, a head tied to the token embedding) written so that every
tensor it saves for backward is easy to name: the labs count those bytes by hand and compare
with what ``labkit.measure`` sees.  ``lab_config()`` is the one place that decides sizes: tiny on
a CPU, larger on a GPU.  ``SyntheticData`` is a fixed random Markov chain over the vocabulary, so
there is nothing to download and the loss really falls (from ln V towards the chain's entropy).

Parameters of one block: 12·n_embd² + 13·n_embd (Chapter 1, book/01_where_the_memory_goes.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ATTENTION_KINDS = ("naive", "sdpa")


@dataclass
class GPTConfig:
    """Sizes of the course's GPT; names follow nanoGPT."""

    vocab_size: int = 256
    """Tokens in the vocabulary (V)."""
    block_size: int = 64
    """Longest sequence the position embedding covers (the largest seq_len)."""
    n_layer: int = 4
    """Transformer blocks (L)."""
    n_head: int = 4
    """Attention heads (a); must divide n_embd."""
    n_embd: int = 128
    """Hidden size (h)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps every step deterministic and saves no masks."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as in GPT-2."""
    attention: str = "naive"
    """"naive" materialises the (T, T) attention matrix; "sdpa" calls F.scaled_dot_product_attention."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias must be a bool (True or False), got {self.bias!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"GPTConfig.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused qkv projection, softmax(QKᵀ/√d)V, output projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd, self.attention = cfg.n_head, cfg.n_embd, cfg.attention
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The feed-forward sublayer: h → 4h, GELU, 4h → h."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The course's GPT.  ``model(idx)`` returns logits (B, T, V); ``model(idx, targets)`` the mean loss."""

    def __init__(self, cfg: GPTConfig):
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a labkit.models.GPTConfig, got {type(cfg).__name__}")
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: counted once
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError("idx must be a (batch_size, seq_len) int64 tensor of token ids, got "
                             + (f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor)
                                else type(idx).__name__))
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.dtype != torch.long
                                    or targets.shape != idx.shape):
            raise ValueError(f"targets must be None or an int64 tensor shaped like idx "
                             f"{tuple(idx.shape)}, got "
                             + (f"{tuple(targets.shape)} {targets.dtype}" if isinstance(targets, torch.Tensor)
                                else type(targets).__name__))
        where = self.wte.weight.device
        for name, t in (("idx", idx), ("targets", targets)):
            if t is not None and t.device != where:
                raise ValueError(f"{name} is on {t.device} and the model on {where}: move it with "
                                 f"{name}.to({str(where)!r}) (a meta idx into a CPU model gave NaN logits)")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"seq_len={T} is longer than GPTConfig.block_size={self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)
        V = self.config.vocab_size
        try:
            tok = self.wte(idx)  # (B, T, C)
        except IndexError:  # on a CPU; CUDA reports it later, as a device-side assert
            raise ValueError(f"idx holds token ids outside [0, vocab_size={V}): min "
                             f"{int(idx.min())}, max {int(idx.max())}") from None
        x = self.drop(tok + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        try:  # V, not -1: an empty batch (B·T = 0) has no size to infer
            return F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T))
        except IndexError:
            raise ValueError(f"targets hold ids outside [0, vocab_size={V}) (other than -100, which "
                             f"cross_entropy ignores): min {int(targets.min())}, max "
                             f"{int(targets.max())}") from None


class SyntheticData:
    """Deterministic token sequences from a fixed random Markov chain; nothing to download.

    Each token has ``branching`` likely successors (drawn once from ``seed``), so a model that
    learns the chain's transition table drives the loss from ln(V) down to about
    ln(branching).  ``batch(i)`` always returns the same (inputs, targets) pair for the same i.
    """

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, *,
                 branching: int = 4, seed: int = 0, device: str | torch.device = "cpu"):
        for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len),
                            ("batch_size", batch_size), ("branching", branching)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SyntheticData: {name} must be a positive int, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"SyntheticData: seed must be an int in [0, 2**63), got {seed!r}")
        if branching > vocab_size:
            raise ValueError(f"SyntheticData: branching={branching} exceeds vocab_size={vocab_size}")
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.seed, self.device = seed, _usable_device(device)
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.stack(
            [torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)]
        )  # (V, branching)

    def batch(self, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th batch: inputs and next-token targets, each (batch_size, seq_len) int64."""
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"SyntheticData.batch: i must be a non-negative int, got {i!r}")
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + i) % 2**63)  # same for small seeds
        B, T = self.batch_size, self.seq_len
        tokens = torch.empty(B, T + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (B,), generator=g)
        choice = torch.randint(self.successors.shape[1], (B, T), generator=g)
        for t in range(T):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        tokens = tokens.to(self.device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def entropy(self) -> float:
        """The chain's entropy per token in nats: the loss a perfect model reaches."""
        return math.log(self.successors.shape[1])


def default_device() -> torch.device:
    """CUDA when present (Colab), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device(device) -> torch.device:
    """None (the default device), a device string or a ``torch.device``; anything else is refused
    the same way on every build (a CUDA build of torch reads ``torch.device(42)`` as cuda:42)."""
    if device is None:
        return default_device()
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            pass
    raise ValueError(f"device must be None, 'cpu', 'cuda' or a torch.device, got {device!r}")


def _usable_device(device) -> torch.device:
    """``_device(device)``, refused with a ValueError if this machine cannot put a tensor there
    (``'cuda'`` on a machine without CUDA failed later, inside torch, as an AssertionError)."""
    device = _device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, and CUDA is not available here: use 'cpu' or None "
                         "(None picks CUDA when there is a GPU)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}, and this machine has {torch.cuda.device_count()} "
                         "GPU(s): use 'cuda' or an index below that")
    return device


def lab_config(device: str | torch.device | None = None, **overrides) -> GPTConfig:
    """The one place that sizes the labs' model: tiny on a CPU, larger on a GPU.

    Keyword overrides replace single fields, e.g. ``lab_config(n_layer=8)``.
    """
    device = _device(device)
    unknown = set(overrides) - set(GPTConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"lab_config: unknown overrides {sorted(unknown)}; "
                         f"allowed: {list(GPTConfig.__dataclass_fields__)}")
    if device.type == "cuda":
        base = dict(vocab_size=512, block_size=256, n_layer=8, n_head=8, n_embd=512)
    else:
        base = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    base.update(overrides)
    return GPTConfig(**base)


def lab_batch_size(device: str | torch.device | None = None) -> int:
    """The labs' batch size on this device (8 on a CPU, 16 on a GPU)."""
    device = _device(device)
    return 16 if device.type == "cuda" else 8
