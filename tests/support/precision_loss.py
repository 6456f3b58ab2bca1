"""A backend with a planted precision loss, registered only by the tests (issue 43's quality gate).

``RoundingBackend`` is the NumPy reference whose ``bf16`` path in mode ``rounding`` keeps its
weights at 4 mantissa bits, rounded to nearest after every update: the way a pure low-precision
weight copy (no fp32 master weights) loses the small late updates. Early steps move the weights by
more than a rounding step, so the first 10 steps' losses stay within the bf16 trajectory bound
(at most 19% of it, measured on mnist at --limit 1024); later updates are rounded away and
training stalls: validation accuracy 0.25 against fp32's 0.77 (--limit 1024 --epochs 2, repeat 1).
Its ``fp32`` path, and mode ``honest`` at any precision, is the reference unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from benchbackend.backends.numpy.reference import NumpyBackend

BITS = 4


def round_mantissa(a: np.ndarray, bits: int = BITS) -> None:
    """Round float32 ``a`` in place to ``bits`` mantissa bits (to nearest, ties up)."""
    u = a.view(np.uint32)
    drop = 23 - bits
    u += np.uint32(1 << (drop - 1))
    u &= np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)


class _Rounding:
    """The optimizer's update, then every parameter rounded."""

    def __init__(self, inner: Any):
        self.inner = inner

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> None:
        self.inner.step(params, grads)
        for p in params:
            round_mantissa(p)


class RoundingBackend(NumpyBackend):
    def build(self, weights: Sequence[np.ndarray]) -> int:
        n = super().build(weights)
        if self.precision == "bf16" and self.mode == "rounding":
            self.optimizer = _Rounding(self.optimizer)
        return n
