"""The workload's ``quality:`` section: the gate a cell's result must pass to count (issue 43).

MLPerf makes every result conditional on quality: a run counts only when its accuracy reaches 99%
of the fp32 reference's. Here a workload declares the metric and the target, and the target is
one of three kinds:

- ``of: fp32`` (the default): the cell's metric over the median of the same backend's fp32 cells
  (the same mode where it ran at fp32, else the backend's first fp32 mode) in the same results.
  It answers "what did this precision or compiled mode cost in accuracy?", on any backend, with
  no reference run needed;
- ``of: reference``: over the median of the NumPy reference's fp32 cells in the same results
  (``-b numpy``; slow on big networks);
- ``of: absolute``: the metric itself against ``target``.

The gate is judged from the rows (``analysis.quality``), so a CSV says what it was judged
against: the runner writes ``quality_metric``, ``quality_target`` and ``quality_samples`` on every
row, and the end of a run adds ``quality``, ``quality_ratio`` and ``gate``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .layers import Strict


class QualitySpec(Strict):
    """``quality:``: the result a cell must reach to count (docs/results.md, "The quality gate")."""

    metric: Literal["val_accuracy"] = Field(
        default="val_accuracy",
        description="the last epoch's validation accuracy (an inference-only cell: its passes' accuracy on the "
                    "test set)")
    target: float = Field(default=0.99, gt=0.0, le=1.0,
                          description="`of: fp32` or `reference`: the least ratio to that baseline's median; "
                                      "`of: absolute`: the least value")
    of: Literal["fp32", "reference", "absolute"] = Field(
        default="fp32", description="`fp32`: the same backend's fp32 cells; `reference`: the NumPy reference's "
                                    "fp32 cells (`-b numpy`); `absolute`: `target` itself")

    def text(self) -> str:
        """The target as the CSV's ``quality_target`` holds it: ``0.99 of fp32``, or ``0.5``
        (``analysis.quality.parse_target`` reads it back)."""
        return f"{self.target:g}" if self.of == "absolute" else f"{self.target:g} of {self.of}"

