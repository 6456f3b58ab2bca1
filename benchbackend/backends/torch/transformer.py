"""The transformer layers (``layers.TOKEN_LAYERS``) as ``torch.nn`` modules, for ``torch_graph.GraphNet``.

Token sequences are (N, T, d), batch first (``nn.MultiheadAttention``'s default is sequence first,
and it needs ``heads * head_dim == d``, which the spec does not: attention here is built from its
own four projections). Where torch's defaults differ from the NumPy reference, this module converts:

- ``tokens``: the NCHW conv output becomes (N, H*W, C) in row-major (h, w) order, as the NHWC
  reference reshapes it (not torch's ``flatten(2)`` order, which is (N, C, H*W));
- layernorm takes the spec's ``epsilon`` (torch's default is 1e-5; the spec's 1e-6);
- GELU is exact (``approximate='none'``) unless the spec asks for the tanh form;
- attention: the canonical q/k/v/o kernels are ``(in, out)`` (Keras-dense order); an ``nn.Linear``
  holds ``(out, in)``, so :meth:`Attention.arrays` shows each kernel transposed. Columns are
  heads-major (column ``i * head_dim + j`` is head i's dimension j) and the scores are scaled by
  1/sqrt(head_dim), the width of one head, not of the model.

The decoder's layers (``layers.py`` states the conventions; each is converted here): ``embedding``
casts the float32 token ids to int64; ``rmsnorm`` takes the spec's epsilon and scale form (``w`` or
``1 + w``) and runs in float32; attention's causal mask (token t sees 0..t), grouped key/value heads
expanded in blocks (query head h reads h // (heads // kv_heads)) and rotary positions (``half`` or
``interleaved`` pairs, the spec's base) on q and k after their projection; a dense layer tied to an
embedding reads its table (:class:`TiedDense`). Under bf16 autocast the norms and the attention's
softmax stay in float32.

Attention's core is the plain matmul chain (``q k^T``, softmax, ``p v``) or, with ``fused``,
``F.scaled_dot_product_attention`` (torch's fused kernel: flash or memory-efficient attention on a
GPU, a fused flash kernel on a CPU), given the same scale explicitly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def gelu(approximate: bool) -> nn.Module:
    """GELU: exact (erf, torch's default) unless ``approximate`` asks for the tanh form."""
    return nn.GELU(approximate="tanh" if approximate else "none")


def layernorm(width: int, epsilon: float) -> nn.Module:
    """Layer normalization over the last axis with the spec's ``epsilon`` (never torch's 1e-5);
    ``weight, bias`` are the canonical ``gamma, beta``."""
    return nn.LayerNorm(width, eps=epsilon)


class ImageLayerNorm(nn.Module):
    """Layernorm over the channels of an NCHW image: the reference normalizes an NHWC image's last axis."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class TokenChannels(nn.Module):
    """A module of NCHW-style channels (axis 1) applied to tokens (N, T, d): batchnorm on a sequence."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.transpose(1, 2)).transpose(1, 2)


class Tokens(nn.Module):
    """(N, C, H, W) -> (N, H*W, C), the tokens in row-major (h, w) order (the NHWC reshape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1).flatten(1, 2)


class ClassToken(nn.Module):
    """A learned token prepended to the sequence (token 0)."""

    def __init__(self, width: int):
        super().__init__()
        self.token = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.token.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)

    def arrays(self) -> list[torch.Tensor]:
        return [self.token]


class PositionEmbedding(nn.Module):
    """A learned (T, d) table added to every sample's tokens."""

    def __init__(self, tokens: int, width: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(tokens, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table

    def arrays(self) -> list[torch.Tensor]:
        return [self.table]


class SelectToken(nn.Module):
    """(N, T, d) -> (N, d): the token at ``index`` (0: the class token)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.index]


def causal_mask(tokens: int, device: torch.device) -> torch.Tensor:
    """(T, T) booleans, True where query i must not see key j: every j > i (token t sees 0..t)."""
    return torch.ones(tokens, tokens, dtype=torch.bool, device=device).triu(1)


def rope_tables(tokens: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, head_dim/2) float32: position p, pair i turns by ``p * base ** (-2i / head_dim)``
    (the angles in float64, as the reference takes them)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.outer(torch.arange(tokens, dtype=torch.float64), inv_freq)
    return angle.cos().float(), angle.sin().float()


def rope(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """Queries or keys (N, heads, T, head_dim) turned by their positions: pairs (i, i + head_dim/2)
    (``half``, ``rotate_half``) or (2i, 2i + 1) (``interleaved``)."""
    if pairing == "half":
        x1, x2 = a.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    x1, x2 = a[..., 0::2], a[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def expand_kv(a: torch.Tensor, share: int) -> torch.Tensor:
    """(N, kv_heads, T, head_dim) -> (N, kv_heads * share, T, head_dim) in blocks: query head h reads
    key/value head ``h // share`` (Hugging Face's ``repeat_kv``), not ``h % kv_heads``."""
    return a if share == 1 else a.repeat_interleave(share, dim=1)


class Attention(nn.Module):
    """Multi-head self-attention on (N, T, d): per head ``softmax(q k^T / sqrt(head_dim)) v``, the
    heads concatenated in head order, then the output projection; ``fused`` computes the core with
    ``F.scaled_dot_product_attention``.

    The decoder's fields: ``causal`` (query i sees keys 0..i: a -inf score above the diagonal, or
    sdpa's ``is_causal``, whose mask is the same top-left one for T queries on T keys);
    ``kv_heads`` (the key/value projections ``kv_heads * head_dim`` wide, expanded to the query
    heads in blocks by :func:`expand_kv`); ``rope`` (:func:`rope` on q and k after their
    projection, positions 0..T-1 of the ``tokens`` the layer is built for); ``use_bias``.
    """

    def __init__(self, width: int, heads: int, head_dim: int, fused: bool = False, causal: bool = False,
                 kv_heads: int | None = None, rope_: tuple[float, str] | None = None, use_bias: bool = True,
                 tokens: int = 0):
        super().__init__()
        inner, groups = heads * head_dim, kv_heads or heads
        self.q = nn.Linear(width, inner, bias=use_bias)
        self.k, self.v = (nn.Linear(width, groups * head_dim, bias=use_bias) for _ in range(2))
        self.o = nn.Linear(inner, width, bias=use_bias)
        self.heads, self.groups, self.head_dim, self.fused = heads, groups, head_dim, fused
        self.causal, self.use_bias = causal, use_bias
        self.scale = 1.0 / math.sqrt(head_dim)
        self.pairing = rope_[1] if rope_ is not None else None
        if rope_ is not None:
            cos, sin = rope_tables(tokens, head_dim, rope_[0])
            # Not persistent, not among ``arrays()``: tables of the positions, never trained.
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def split(self, a: torch.Tensor) -> torch.Tensor:
        """(N, T, heads * head_dim) -> (N, heads, T, head_dim): heads-major columns (the query heads,
        or the key/value heads)."""
        n, t, width = a.shape
        return a.view(n, t, width // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        t = x.shape[1]
        if self.pairing is not None:
            cos, sin = self.cos[:t], self.sin[:t]
            # Turned in float32 (the tables are), then back to the values' dtype for the products.
            q, k = rope(q, cos, sin, self.pairing).to(v.dtype), rope(k, cos, sin, self.pairing).to(v.dtype)
        share = self.heads // self.groups
        if self.fused:  # sdpa: its own causal mask (no other mask is given) and its own GQA grouping
            # ``enable_gqa`` repeats the key/value heads with ``repeat_interleave``: in blocks, as
            # ``expand_kv`` (tests/test_decoder_torch.py holds it to that), without materializing them.
            mixed = F.scaled_dot_product_attention(q, k, v, scale=self.scale, is_causal=self.causal,
                                                   enable_gqa=share > 1)
        else:
            k, v = expand_kv(k, share), expand_kv(v, share)
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (N, heads, T, T): queries x keys
            if self.causal:
                scores = scores.masked_fill(causal_mask(t, scores.device), float("-inf"))
            # The softmax accumulates in float32 under autocast too (as the reference does), then
            # mixes the values in their own dtype.
            mixed = softmax(scores).to(v.dtype) @ v
        n = mixed.shape[0]
        return self.o(mixed.transpose(1, 2).reshape(n, t, self.heads * self.head_dim))

    def arrays(self) -> list[torch.Tensor]:
        """The canonical arrays: ``(in, out)`` kernels, views of the ``nn.Linear`` weights, each
        followed by its bias unless ``use_bias`` is off."""
        return [t for lin in (self.q, self.k, self.v, self.o)
                for t in ((lin.weight.T, lin.bias) if self.use_bias else (lin.weight.T,))]


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """The attention's softmax over the keys, in float32 whatever the scores' dtype (bf16 under autocast)."""
    return torch.softmax(scores, dim=-1, dtype=torch.float32)


class Embedding(nn.Module):
    """Token ids (N, T), held as float32 whole numbers, -> (N, T, width): rows of the (vocab, width)
    table. The ids are cast to int64 here (``F.embedding`` indexes with integers)."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(vocab, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.long(), self.table)

    def arrays(self) -> list[torch.Tensor]:
        return [self.table]


class TiedDense(nn.Module):
    """A dense layer whose kernel is an embedding's table, transposed: ``x @ table.T (+ bias)``.
    The table is the embedding's own parameter, handed in by ``GraphNet.forward`` (one array: both
    uses' gradients sum in it); this module holds the bias alone, if any."""

    def __init__(self, units: int, use_bias: bool):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(units)) if use_bias else None

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.linear(x, table, self.bias)  # (vocab, width) is nn.Linear's (out, in)

    def arrays(self) -> list[torch.Tensor]:
        return [] if self.bias is None else [self.bias]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + epsilon) * s`` over the last axis, ``s = w`` or ``1 + w``
    (``one_plus``), in float32 whatever the input's dtype (as autocast keeps layernorm)."""

    def __init__(self, width: int, epsilon: float, one_plus: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width) if one_plus else torch.ones(width))
        self.epsilon, self.one_plus = epsilon, one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        xhat = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.epsilon)
        return xhat * (1.0 + self.weight if self.one_plus else self.weight)

    def arrays(self) -> list[torch.Tensor]:
        return [self.weight]


#: Modules whose weights are their ``arrays()``, in canonical order and layout.
WEIGHTED = (ClassToken, PositionEmbedding, Attention, Embedding, TiedDense, RMSNorm)
