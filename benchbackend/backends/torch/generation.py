"""Greedy generation with a static key/value cache on the torch adapter's ``GraphNet`` (its own
modules and weights: nothing is copied), the cache's conventions as ``numpy/generation.py`` states them.

- The cache: per attention layer, keys and values (B, kv_heads, positions, head_dim) in the spec's
  ``generation.cache`` dtype (float32 by default; under bf16 autocast the projections come out in
  bfloat16 and are stored widened), allocated once per prompt length (``start``).
- ``prefill``: the prompt at positions 0..P-1 with the causal mask (the plain chain's ``-inf`` above
  the diagonal, or sdpa's ``is_causal``), its keys and values written at 0..P-1.
- ``decode``: one token at ``position``: its rotary angle and position-embedding row are those of
  ``position``, its key and value go to ``position`` (``index_copy_``), and it attends to 0..position.
  Eager and sdpa slice the cache to ``position + 1`` keys (a shape per step: nothing compiles);
  ``compile`` keeps every shape static (Hugging Face's ``StaticCache`` way): the position is a
  0-d tensor, the query attends to all ``positions`` keys with the ones past it masked, so
  ``torch.compile`` traces the step once and reuses it at every position.
- The output layer runs on the last position only; its argmax is the next token (no softmax).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from . import transformer as tt
from .graph import GraphNet

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rows(table: torch.Tensor, start: Any, t: int) -> torch.Tensor:
    """Rows ``start .. start + t - 1`` of ``table``: a slice for an int, a gather for a 0-d tensor."""
    if isinstance(start, torch.Tensor):
        return table.index_select(0, start.reshape(1) + torch.arange(t, device=table.device))
    return table[start:start + t]


def write(cache: torch.Tensor, where: torch.Tensor, a: torch.Tensor) -> None:
    """``a`` (B, kv_heads, T, head_dim) into ``cache`` at positions ``where``, in the cache's dtype."""
    cache.index_copy_(2, where, a.to(cache.dtype))


def later(n: int, where: torch.Tensor) -> torch.Tensor:
    """(T, n) booleans, True where key position j lies past query position ``where[i]`` (hidden)."""
    return torch.arange(n, device=where.device)[None, :] > where[:, None]


def attention(mod: tt.Attention, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], start: Any,
              static: bool) -> torch.Tensor:
    """``mod``'s attention on the new tokens ``x`` (B, T, d) at positions ``start ..``, reading and
    extending ``cache``; ``static``: attend over every cached position with the later ones masked."""
    keys, values = cache
    q, k, v = mod.split(mod.q(x)), mod.split(mod.k(x)), mod.split(mod.v(x))
    t = x.shape[1]
    if mod.pairing is not None:
        cos, sin = _rows(mod.cos, start, t), _rows(mod.sin, start, t)
        q, k = tt.rope(q, cos, sin, mod.pairing).to(v.dtype), tt.rope(k, cos, sin, mod.pairing).to(v.dtype)
    where = (start.reshape(1) if isinstance(start, torch.Tensor) else torch.tensor([start], device=x.device)) \
        + torch.arange(t, device=x.device)
    write(keys, where, k)
    write(values, where, v)
    share = mod.heads // mod.groups
    if static:
        kc, vc = keys.to(v.dtype), values.to(v.dtype)
        mask = later(keys.shape[2], where)  # (T, positions)
    else:
        end = start + t
        kc, vc = keys[:, :, :end].to(v.dtype), values[:, :, :end].to(v.dtype)
        mask = later(end, where) if mod.causal and t > 1 else None
    if mod.fused:
        mixed = F.scaled_dot_product_attention(q, kc, vc, attn_mask=None if mask is None else ~mask,
                                               scale=mod.scale, enable_gqa=share > 1)
    else:
        kc, vc = tt.expand_kv(kc, share), tt.expand_kv(vc, share)
        scores = (q @ kc.transpose(-2, -1)) * mod.scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        mixed = tt.softmax(scores).to(vc.dtype) @ vc
    n = mixed.shape[0]
    return mod.o(mixed.transpose(1, 2).reshape(n, t, mod.heads * mod.head_dim))


class Generator:
    """The cached forward of ``net``; ``compiled``: the decode step under ``torch.compile``."""

    def __init__(self, net: GraphNet, autocast: Callable[[], Any], compiled: bool):
        self.net, self.autocast, self.static = net, autocast, compiled
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prefill = torch.compile(self._prefill_eager, dynamic=False) if compiled else self._prefill_eager
        self._decode = torch.compile(self._decode_eager, dynamic=False) if compiled else self._decode_eager

    def start(self, batch: int, positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.caches = {i: tuple(torch.zeros(batch, mod.groups, positions, mod.head_dim, dtype=dtype, device=device)
                                for _ in range(2))
                       for i, mod in enumerate(self.net.nodes) if isinstance(mod, tt.Attention)}

    def nbytes(self) -> tuple[int, int]:
        arrays = [a for pair in self.caches.values() for a in pair]
        return int(sum(a.numel() * a.element_size() for a in arrays)), int(arrays[0].shape[2]) if arrays else 0

    def _next(self, ids: torch.Tensor, start: Any, static: bool) -> torch.Tensor:
        def cached(i: int, mod: Any, ins: list[torch.Tensor]) -> Optional[torch.Tensor]:
            if isinstance(mod, tt.Attention):
                return attention(mod, ins[0], self.caches[i], start, static)
            if isinstance(mod, tt.PositionEmbedding):
                return ins[0] + _rows(mod.table, start, ins[0].shape[1])
            return None  # every other node as the network computes it

        with self.autocast():
            out = self.net(ids, cached, last_only=True)
        return out[:, -1].argmax(dim=-1).to(torch.int32)

    def _prefill_eager(self, ids: torch.Tensor) -> torch.Tensor:
        return self._next(ids, 0, static=False)

    def _decode_eager(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self._next(ids[:, None], position, static=True)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._prefill(ids)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, position: int, device: torch.device) -> torch.Tensor:
        if self.static:
            return self._decode(ids, torch.tensor(position, device=device))
        return self._next(ids[:, None], position, static=False)


def generator(net: Optional[GraphNet], autocast: Callable[[], Any], compiled: bool) -> Generator:
    if net is None:
        raise RuntimeError("build() must be called first")
    return Generator(net, autocast, compiled)
