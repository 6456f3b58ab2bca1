"""The Chainer adapter with one decoder convention of issue 37 planted wrong (tests only; the worker
imports this module in the Chainer environment, ``tests/`` on its path, by the job's ``target``):
``test_decoder_chainer.py`` shows that each one fails the check that the real adapter passes.

A plant replaces a module-level function of ``backends/chainer/decoder.py`` when the adapter is made
(the worker process runs this one cell, so it stays replaced), or changes the built chain's links.
"""
from __future__ import annotations

from typing import Any, Sequence

import chainer
import chainer.functions as F
import numpy as np

from benchbackend.backends.chainer import decoder
from benchbackend.backends.chainer.adapter import ChainerBackend

#: The functions as the adapter has them, kept when first replaced (a second adapter made in the same
#: process plants the same wrong one, never the wrong one of the wrong one).
_ORIGINALS: dict[str, Any] = {}


class _Patched(ChainerBackend):
    """Replaces ``decoder.NAME`` by ``wrong(original)`` before anything is built."""

    NAME = ""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        original = _ORIGINALS.setdefault(self.NAME, getattr(decoder, self.NAME))
        setattr(decoder, self.NAME, self.wrong(original))

    @staticmethod
    def wrong(original: Any) -> Any:
        raise NotImplementedError


class PairingSwapped(_Patched):
    """RoPE's ``half`` pairs taken as ``interleaved`` ones (and the other way)."""

    NAME = "rope_rotate"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda a, cos, sin, pairing: original(a, cos, sin, "interleaved" if pairing == "half" else "half")


class RopeBase10000(_Patched):
    """RoPE at the usual default base, whatever the spec says (50 on the trap)."""

    NAME = "rope_tables"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda tokens, head_dim, base: original(tokens, head_dim, 10000.0)


class DiagonalMasked(_Patched):
    """Token t sees 0..t-1 (token 0 sees nothing: NaN)."""

    NAME = "causal_mask"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda tokens: np.tril(np.ones((tokens, tokens), dtype=bool), k=-1)


class SeesNext(_Patched):
    """Token t sees 0..t+1."""

    NAME = "causal_mask"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda tokens: np.tril(np.ones((tokens, tokens), dtype=bool), k=1)


class Unmasked(_Patched):
    """No causal mask: every token sees every other."""

    NAME = "causal_mask"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda tokens: np.ones((tokens, tokens), dtype=bool)


class GroupsInterleaved(_Patched):
    """Query head h reads key/value head ``h % kv_heads`` (tiled) instead of ``h // share`` (blocks)."""

    NAME = "repeat_kv"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda a, share: a if share == 1 else F.tile(a, (1, share, 1, 1))


class ScaleFormsSwapped(_Patched):
    """RMSNorm's ``w`` read as ``1 + w`` and ``1 + w`` as ``w``."""

    NAME = "rms_scale"

    @staticmethod
    def wrong(original: Any) -> Any:
        return lambda w, one_plus: original(w, not one_plus)


class GateUpSwapped(ChainerBackend):
    """Each block's gate weights loaded into its up projection and up's into the gate: ``silu(up) * gate``."""

    def build(self, weights: Sequence[np.ndarray]) -> int:
        n = super().build(weights)
        links = {node.layer.name: link for node, link in zip(self.net.graph.nodes, self.net.holders)
                 if node.layer.name}
        for name, gate in links.items():
            if name.endswith(".gate"):
                up = links[name[:-len("gate")] + "up"]
                gate.W.array[...], up.W.array[...] = up.W.array.copy(), gate.W.array.copy()
        return n


class _UntiedDense(decoder.TiedDense):
    """The output layer on a trainable copy of the table (its own parameter, filled when the weights are
    loaded): the same numbers at the start, but the embedding never gets the output layer's gradient."""

    def __init__(self, embedding: Any, units: int, use_bias: bool):
        super().__init__(embedding, units, use_bias)
        self.embedding = lambda: embedding
        with self.init_scope():
            self.copy = chainer.Parameter(np.zeros(embedding.W.shape, np.float32))
        self.table = lambda: self.copy


class Untied(ChainerBackend):
    """An untied output layer: a copy of the table, trained on its own."""

    def build(self, weights: Sequence[np.ndarray]) -> int:
        decoder.TiedDense = _UntiedDense
        n = super().build(weights)
        for link in self.net.holders:
            if isinstance(link, _UntiedDense):
                link.copy.array[...] = link.embedding().W.array
        return n
