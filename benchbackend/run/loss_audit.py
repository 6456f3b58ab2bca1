"""Timed training epochs audited through their losses (issue 43, item 2): the training half of
the audit whose inference half is ``checks.audit``.

An epoch's reported loss is one mean, computed inside the clock; a recomputation after the epoch
sees other weights. So the adapter hands back the loss of every step it took (``Backend.step_losses``:
the device scalars it already had, stacked outside the clock, with no extra host sync inside it),
and outside the clock the worker holds them against what they must be:

- **the epoch's first step, every epoch**: before the clock, the backend's own training-mode
  forward pass (``train_scores``: batch statistics, dropout off, nothing updated) on the epoch's
  first batch, from the weights the epoch starts from, gives the loss that step must report (plus
  the L2 penalty of the kernels, from ``get_weights``). Keras clips probabilities at 1e-7 in its
  loss and the others do not, so the step's loss must lie between the clipped and the unclipped
  cross-entropy, widened by the trajectory check's step-1 tolerance at the cell's precision;
- **epoch 1's first K steps** with ``--parity-steps K``: the trajectory check ran the same backend on
  the same first batches from the same initial weights (the worker builds afresh after it), so its
  losses are what epoch 1's first steps must report, at the trajectory tolerance of each step;
- **the epoch's mean**: the reported loss must be the mean of the step losses, each step weighted by
  its batch's samples (the last batch may be short), to the same step-1 tolerance.

A step that differs is ``audit_failed`` (``audit_step``: the step; 0 for a mean that is not its steps'
mean), named with its epoch. Not judged, and said so in the row's notes: the steps of a network with
dropout (a step's masks cannot be drawn again outside it: only the mean is checked), the replicas of a
data-parallel cell, and an adapter that keeps no step losses (``step_losses`` returns None).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..backends.base import Backend, cross_entropy

NOT_SUPPORTED = "loss audit: not supported by this adapter (it hands back no step losses)"

def band(probs: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(low, high) of the mean cross-entropy of ``probs`` against ``labels`` as Keras computes it
    (probabilities clipped to [1e-7, 1 - 1e-7]) and as a loss from the logits does (no clip; a
    probability that underflowed to 0 gives ``inf``). Any correct step's loss lies between."""
    clipped, unclipped = cross_entropy(probs, labels), cross_entropy(probs, labels, clip=0.0)
    return min(clipped, unclipped), max(clipped, unclipped)


def judge(epoch: int, mean: float, steps: Optional[np.ndarray], sizes: np.ndarray,
          expected: dict[int, tuple[float, float, float, str]], mean_rtol: float) -> tuple[Optional[int], str]:
    """(the first step whose reported loss is not its recomputation, 0 for a mean that is not its
    steps' mean, or None; what differs). ``steps``: the epoch's reported step losses; ``sizes``: the
    samples of each step's batch; ``expected``: step (1-based) -> (low, high, rtol, what it was
    recomputed from)."""
    if steps is None or not math.isfinite(mean):
        return None, ""
    steps = np.asarray(steps, np.float64).ravel()
    if len(steps) != len(sizes):
        return min(len(steps), len(sizes)) + 1, (f"training epoch {epoch}: {len(steps)} step losses handed back for "
                                                 f"its {len(sizes)} steps")
    for step in sorted(expected):
        low, high, rtol, what = expected[step]
        got = float(steps[step - 1])
        if not (low - rtol * abs(low) <= got <= high + rtol * abs(high)):
            want = f"{low:.6g}" if high - low <= rtol * abs(low) else f"{low:.6g} to {high:.6g}"
            return step, (f"training epoch {epoch}, step {step}: reported loss {got:.6g}, recomputed outside the "
                          f"clock {want} ({what}; rtol {rtol:.3g})")
    own = float(np.sum(steps * sizes) / np.sum(sizes))
    if not abs(mean - own) <= mean_rtol * max(abs(own), 1e-12):
        return 0, (f"training epoch {epoch}: reported loss {mean:.6g} is not the mean of its {len(steps)} step "
                   f"losses, {own:.6g} (rtol {mean_rtol:.3g})")
    return None, ""


class Audit:
    """One cell's loss audit, epoch by epoch: ``before`` (outside the clock, just before the epoch's)
    recomputes what can be recomputed; ``after`` (outside the clock, after it) judges the epoch."""

    def __init__(self, cell: Any, trajectory: Optional[list[float]], replicas: int = 1):
        w = cell.workload
        self.cell, self.trajectory = cell, trajectory or []
        self.tols = w.checks.trajectory(cell.backend.precision, max(1, len(self.trajectory)))
        self.skip = ""  # why no step is recomputed ("": they are)
        self.supported = True  # the adapter hands back its step losses
        if getattr(type(cell.backend), "step_losses", Backend.step_losses) is Backend.step_losses:
            self.supported = False  # nothing to recompute for (a Keras fit twin costs a build)
            self.skip = NOT_SUPPORTED
        elif replicas > 1:
            self.supported = False
            self.skip = "loss audit: not supported for data-parallel replicas (each replica's steps are its shard's)"
        elif any(layer.type == "dropout" for layer in getattr(w, "model", [])):
            self.skip = ("loss audit: steps not recomputed (dropout: a step's masks cannot be drawn again outside "
                         "it); the epoch's mean checked against its step losses")
        self.expected: dict[int, tuple[float, float, float, str]] = {}

    def _penalty(self) -> float:
        """The L2 penalty the step's loss includes (``training.weight_decay`` of kind ``l2``)."""
        w = self.cell.workload
        decay = w.training.weight_decay
        if decay is None or decay.kind != "l2":
            return 0.0
        from ..spec.graph import resolve
        from ..spec.model import kernel_mask

        weights = self.cell.backend.get_weights()
        return float(decay.rate * sum(float(np.sum(np.asarray(k, np.float64) ** 2))
                                      for k, is_kernel in zip(weights, kernel_mask(resolve(w))) if is_kernel))

    def before(self, epoch: int, order: np.ndarray) -> None:
        self.expected = {}
        if not self.supported or self.skip:
            return
        cell, b = self.cell, self.cell.backend
        first = order[:cell.workload.training.batch_size]
        x, y = cell.arrays["x_train"][first], cell.arrays["y_train"][first]
        try:
            probs = np.asarray(b.to_host(b.train_scores(b.to_device(np.ascontiguousarray(x, np.float32)))))
            penalty = self._penalty()
        except NotImplementedError as exc:
            self.skip = f"loss audit: steps not recomputed ({exc})"
            return
        low, high = band(probs, y)
        self.expected[1] = (low + penalty, high + penalty, self.tols[0],
                            "a training-mode forward pass of the epoch's first batch from its starting weights")
        if epoch == 1:
            for step, loss in enumerate(self.trajectory, start=1):
                lo, hi, _, what = self.expected.get(step, (loss, loss, 0.0, ""))
                self.expected[step] = (min(lo, loss), max(hi, loss), self.tols[step - 1],
                                       "the trajectory check's steps" + (f" and {what}" if what else ""))

    def after(self, epoch: int, mean: float, n: int) -> dict[str, Any]:
        """The row's columns: ``loss_audited`` (steps recomputed), ``audit_step`` and the notes."""
        if not self.supported:
            return {"notes": self.skip}
        b = self.cell.backend
        kept = b.step_losses()
        if kept is None:
            self.supported = False
            self.skip = NOT_SUPPORTED
            return {"notes": self.skip}
        bs = self.cell.workload.training.batch_size
        sizes = np.minimum(bs, n - np.arange(0, n, bs)).astype(np.float64)
        step, message = judge(epoch, mean, np.asarray(b.to_host(kept)), sizes, self.expected, self.tols[0])
        out: dict[str, Any] = {"loss_audited": len(self.expected)}
        if step is not None:
            out.update(audit_step=step, notes=message)
        elif self.skip:
            out["notes"] = self.skip
        return out
