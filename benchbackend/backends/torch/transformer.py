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


class Attention(nn.Module):
    """Multi-head self-attention on (N, T, d): per head ``softmax(q k^T / sqrt(head_dim)) v``, the
    heads concatenated in head order, then the output projection; ``fused`` computes the core with
    ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, head_dim: int, fused: bool = False):
        super().__init__()
        inner = heads * head_dim
        self.q, self.k, self.v = (nn.Linear(width, inner) for _ in range(3))
        self.o = nn.Linear(inner, width)
        self.heads, self.head_dim, self.fused = heads, head_dim, fused
        self.scale = 1.0 / math.sqrt(head_dim)

    def split(self, a: torch.Tensor) -> torch.Tensor:
        """(N, T, heads * head_dim) -> (N, heads, T, head_dim): heads-major columns."""
        n, t, _ = a.shape
        return a.view(n, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        if self.fused:
            mixed = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        else:
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (N, heads, T, T): queries x keys
            # The softmax accumulates in float32 under autocast too (as the reference does), then
            # mixes the values in their own dtype.
            mixed = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ v
        n, _, t, _ = mixed.shape
        return self.o(mixed.transpose(1, 2).reshape(n, t, self.heads * self.head_dim))

    def arrays(self) -> list[torch.Tensor]:
        """The canonical eight arrays: ``(in, out)`` kernels, views of the ``nn.Linear`` weights."""
        return [t for lin in (self.q, self.k, self.v, self.o) for t in (lin.weight.T, lin.bias)]


#: Modules whose weights are their ``arrays()``, in canonical order and layout.
WEIGHTED = (ClassToken, PositionEmbedding, Attention)
