"""Backends that cheat on inference, registered only by the tests (issue 43's audit): each returns
quickly what it should have computed.

- ``ShapeCachingBackend``: keeps each batch shape's first output and returns it for every later
  batch of that shape (a cache keyed on the wrong thing): in a timed pass every full batch after
  the first gets the first batch's outputs.
- ``SkippingBackend``: from its second call on, computes only the first batch of a call and
  repeats it for the rest (work skipped once the first, warm-up, call is done).
- ``StaleBackend`` (issue 39): once it has served ``STALE_AFTER`` samples (env var, default 768:
  three times ``tiny()``'s test split, more than the parity check, the warm-up and LoadGen's accuracy-mode
  run ask of it), returns the previous call's outputs without computing: right in every untimed
  check and in the accuracy mode, stale while a LoadGen performance run times it.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from benchbackend.backends.numpy.reference import NumpyBackend


class ShapeCachingBackend(NumpyBackend):
    def scores(self, x: Any, batch_size: int) -> Any:
        memo = self.__dict__.setdefault("_memo", {})
        parts = []
        for i in range(0, len(x), batch_size):
            xb = x[i:i + batch_size]
            if xb.shape not in memo:
                memo[xb.shape] = super().scores(xb, batch_size)
            parts.append(memo[xb.shape])
        return np.concatenate(parts) if parts else super().scores(x, batch_size)


class SkippingBackend(NumpyBackend):
    def scores(self, x: Any, batch_size: int) -> Any:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 1 or len(x) <= batch_size:
            return super().scores(x, batch_size)
        first = super().scores(x[:batch_size], batch_size)
        reps = -(-len(x) // batch_size)
        return np.concatenate([first] * reps)[:len(x)]


class StaleBackend(NumpyBackend):
    def scores(self, x: Any, batch_size: int) -> Any:
        self.served = getattr(self, "served", 0) + len(x)
        last = getattr(self, "last", None)
        if self.served > int(os.environ.get("STALE_AFTER", "768")) and last is not None and len(last) == len(x):
            return last
        self.last = super().scores(x, batch_size)
        return self.last
