"""A backend with a planted learning-rate error, registered only by the tests (issue 43's
convergence verdict): the NumPy reference whose mode ``lr4`` steps at 4x the workload's learning
rate. On mnist at --limit 512 (SGD at 0.01) it reaches validation accuracy 0.6 in 1-2 epochs
where the reference needs 2-4 (5 initial-weight seeds each), faster, and wrong: not the workload's
schedule. Mode ``honest`` is the reference unchanged."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from benchbackend.backends.numpy.reference import NumpyBackend

FACTOR = 4.0


class LrBugBackend(NumpyBackend):
    def build(self, weights: Sequence[np.ndarray]) -> int:
        n = super().build(weights)
        if self.mode == "lr4":
            self.optimizer.lr *= FACTOR
        return n
