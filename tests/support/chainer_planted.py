"""The Chainer adapter with one ViT convention planted back to a default (tests only; the worker imports
this module in the Chainer environment, ``tests/`` on its path): ``test_vit_chainer.py`` shows that each
one fails the check that the real adapter passes.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from benchbackend.backends.chainer import graph as chainer_graph
from benchbackend.backends.chainer.adapter import ChainerBackend
from benchbackend.backends.chainer.decoder import Attention
from benchbackend.backends.chainer.transformer import LayerNorm, gelu


class ChainerEpsilon(ChainerBackend):
    """Every layernorm at ``L.LayerNormalization``'s default epsilon (1e-6) instead of the spec's."""

    def build(self, weights: Sequence[np.ndarray]) -> int:
        n = super().build(weights)
        for link in self.net.links():
            if isinstance(link, LayerNorm):
                link.eps = 1e-6
        return n


class TanhGelu(ChainerBackend):
    """GELU's tanh form where the spec asks for the exact one."""

    def build(self, weights: Sequence[np.ndarray]) -> int:
        exact = chainer_graph.gelu
        chainer_graph.gelu = lambda x, approximate=False: gelu(x, True)
        try:
            return super().build(weights)
        finally:
            chainer_graph.gelu = exact


class Unscaled(ChainerBackend):
    """Attention scores not divided by sqrt(head_dim)."""

    def build(self, weights: Sequence[np.ndarray]) -> int:
        n = super().build(weights)
        for link in self.net.links():
            if isinstance(link, Attention):
                link.scale = 1.0
        return n


class AttentionUndecayed(ChainerBackend):
    """Weight decay on the conv and dense kernels only, not the attention's (as a CNN-only adapter would)."""

    def build(self, weights: Sequence[np.ndarray]) -> int:
        n = super().build(weights)
        attention = {id(p) for link in self.net.links() if isinstance(link, Attention) for p in link.kernels()}
        kernels = self.net.kernels

        def without_attention() -> list[Any]:
            return [k for k in kernels() if id(k) not in attention]

        self.net.kernels = without_attention
        return n
