"""Backends that train correctly but report losses not computed on the timed batches, registered
only by the tests (issue 43's loss audit, ``run/loss_audit.py``):

- ``StaleLossBackend``: reports, for every step and as the epoch's mean, the first step's loss it
  ever computed (a logging hook that reads a buffer written once).
- ``FixedBatchLossBackend``: reports, for every step, the loss of one fixed batch (the first batch
  of the first epoch) at the step's weights, as a loss "sampled" on a held batch would be, and
  their plain mean as the epoch's (the short last batch weighted as a full one).
- ``SilentBackend``: the reference as an adapter that keeps no step losses (the contract's
  default ``step_losses``, as Keras' ``fit`` adapters): its epochs are noted as not audited.
- ``FirstBatchMeanBackend``: keeps honest step losses but reports the epoch's first step's loss as
  the epoch's mean (the loss of one batch, not of the timed epoch).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from benchbackend.backends.base import Backend, batches
from benchbackend.backends.numpy import ops
from benchbackend.backends.numpy.reference import NumpyBackend, train_step


class StaleLossBackend(NumpyBackend):
    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        _, acc = super().train_epoch(order)
        first = self.__dict__.setdefault("_first", float(self._losses[0]))
        self._losses = [first] * len(self._losses)
        return first, acc


class FixedBatchLossBackend(NumpyBackend):
    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        net, w = self._net(), self.workload
        x_all, y_all = self.train_data
        held = self.__dict__.setdefault("_held", order[:w.training.batch_size])
        x_held, y_held = x_all[held], ops.one_hot(y_all[held], w.num_classes, self.dtype)
        self._losses, correct = [], 0
        for idx in batches(order, w.training.batch_size):
            self._losses.append(float(net.loss(x_held, y_held)))  # the held batch at this step's weights
            y = ops.one_hot(y_all[idx], w.num_classes, self.dtype)
            _, scores = train_step(net, self.optimizer, x_all[idx], y, w.training, self.rng)
            correct += int((scores.argmax(axis=-1) == y_all[idx]).sum())
        return float(np.mean(self._losses)), correct / len(order)


class FirstBatchMeanBackend(NumpyBackend):
    def train_epoch(self, order: np.ndarray) -> tuple[Any, Any]:
        _, acc = super().train_epoch(order)
        return float(self._losses[0]), acc


class SilentBackend(NumpyBackend):
    step_losses = Backend.step_losses
