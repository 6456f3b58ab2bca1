"""Convergence judged over seeds (issue 43, item 3): how many epochs each backend needs to reach the
workload's ``checks.target_accuracy``, tested against the fp32 reference's, and time to accuracy
reduced MLPerf's way.

Per-trajectory agreement holds for a horizon only: small float differences grow in a batchnorm
network, so two correct backends end apart after long training, and whether one converges slower
is a statistical question over initial weights. Every repeat starts from its own initial weights
(the workload's seed and the repeat, the same on every backend: ``run --seeds N`` is ``--repeats
N``), so a group's repeats are its seeds.

- ``epochs_to_target`` (a cell-level column): the first epoch whose validation accuracy reached
  the target, ``inf`` when none did.
- Trimmed time to accuracy (``tta_trimmed``), MLPerf's rule: a run that never reached the target
  counts as the slowest; with 3 or more runs the fastest and the slowest are dropped and the
  rest averaged; ``inf`` when one of those never reached it.
- The convergence verdict: each group's epochs to target against the baseline's, the NumPy
  reference at fp32 where it ran in the comparison (else compare's baseline, named), by an exact
  one-sided permutation test of the rank sum (ties share ranks; ``inf`` ranks last) at
  p < ``ALPHA`` either way. "converges slower" is a cost a faster epoch may not repay;
  "converges faster than the reference" is what MLPerf's reference convergence points catch: a
  schedule, a learning rate or a data leak that is not the workload's. ``MIN_SEEDS`` a side
  at least (3 against 3 can reach p = 0.05; 5 against 5, 0.004).
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

import numpy as np
import pandas as pd

from .experiments import CONTEXT_KEYS

ALPHA = 0.05
MIN_SEEDS = 3
REFERENCE = "numpy"
#: Splits enumerated exactly up to this many; beyond, this many random ones (seeded).
_EXACT = 200_000
COLUMNS = ("ett_median", "ett_reached", "ett_n", "tta_trimmed", "conv_vs", "conv_p", "conv_verdict", "conv_text")


def trimmed(values: np.ndarray) -> float:
    """MLPerf's reduction of per-run times to accuracy (``inf``: never reached): with 3 or more
    runs, drop the fastest and the slowest and average the rest; ``inf`` when one of those is
    ``inf``, NaN with no run."""
    v = np.sort(np.asarray(values, dtype=float))
    if not len(v):
        return math.nan
    kept = v[1:-1] if len(v) >= 3 else v
    return math.inf if np.isinf(kept).any() else float(kept.mean())


def _midranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank (``inf`` ties last)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    sorted_values = values[order]
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_test(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """One-sided p-values (x tends larger, x tends smaller) of the rank sum of ``x`` among ``x`` and
    ``y``, from its exact permutation distribution (every split of the pooled ranks; a seeded
    sample of ``_EXACT`` splits beyond that many)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ranks = _midranks(np.concatenate([x, y]))
    n, k = len(ranks), len(x)
    observed = ranks[:k].sum()
    if math.comb(n, k) <= _EXACT:
        sums = np.array([ranks[list(c)].sum() for c in itertools.combinations(range(n), k)])
    else:
        rng = np.random.default_rng(0)
        sums = np.array([ranks[rng.permutation(n)[:k]].sum() for _ in range(_EXACT)])
    eps = 1e-9
    return float((sums >= observed - eps).mean()), float((sums <= observed + eps).mean())


def _values(reps: pd.DataFrame, key: tuple, column: str = "epochs_to_target") -> np.ndarray:
    """A group's ``column`` over its timed ok repeats (``inf``: never reached), without the unknown."""
    try:
        sub = reps.loc[key]
    except KeyError:
        return np.array([])
    v = sub.loc[sub["timed"] & (sub["status"] == "ok"), column].to_numpy(dtype=float)
    return v[~np.isnan(v)]


def _reference(frame: pd.DataFrame, reps: pd.DataFrame) -> Optional[tuple]:
    """The group every other is tested against in one comparison: the NumPy reference at fp32 with
    epochs to target, else compare's baseline group."""
    for key in frame.index:
        if key[2] == REFERENCE and key[4] == "fp32" and len(_values(reps, key)):
            return key
    named = frame[frame["label"] == frame["baseline"]]
    return named.index[0] if len(named) else None


def annotate(groups: pd.DataFrame, reps: pd.DataFrame) -> pd.DataFrame:
    """``groups`` (compare's, ranked) with ``COLUMNS``: per group its median epochs to target over
    the repeats that reached it, how many did of how many, the trimmed time to accuracy, and the
    convergence verdict against the reference (``conv_vs`` its label, ``conv_p`` the smaller
    one-sided p); empty where the workload declared no target."""
    out = groups.copy()
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    references = {ctx: _reference(frame, reps) for ctx, frame in groups.groupby(CONTEXT_KEYS, sort=False)}
    for key in groups.index:
        v = _values(reps, key)
        reached = v[np.isfinite(v)]
        tta = _values(reps, key, "tta_s")
        cols["ett_median"].append(float(np.median(reached)) if len(reached) else math.nan)
        cols["ett_reached"].append(int(len(reached)))
        cols["ett_n"].append(int(len(v)))
        cols["tta_trimmed"].append(trimmed(tta) if len(tta) else math.nan)
        ref = references.get(tuple(key[i] for i in range(len(CONTEXT_KEYS))))
        verdict, text, p, vs = _verdict(v, key, ref, groups, reps)
        cols["conv_vs"].append(vs)
        cols["conv_p"].append(p)
        cols["conv_verdict"].append(verdict)
        cols["conv_text"].append(text)
    for c, values in cols.items():
        out[c] = values
    return out


def _verdict(v: np.ndarray, key: tuple, ref: Optional[tuple], groups: pd.DataFrame,
             reps: pd.DataFrame) -> tuple[str, str, float, str]:
    if not len(v):
        return "", "", math.nan, ""
    if ref is None:
        return "n/a", "no reference to test against", math.nan, ""
    name = groups.loc[ref, "label"]
    if tuple(key) == tuple(ref):
        return "reference", "reference", math.nan, name
    r = _values(reps, ref)
    if len(v) < MIN_SEEDS or len(r) < MIN_SEEDS:
        return "too few seeds", (f"too few seeds ({len(v)} against {len(r)}; {MIN_SEEDS} a side: run --seeds "
                                 f"{MIN_SEEDS} or more)"), math.nan, name
    slower, faster = rank_test(v, r)
    p = min(slower, faster)

    def med(a: np.ndarray) -> str:
        m = float(np.median(a))
        return "never" if math.isinf(m) else f"{m:g}"

    epochs = f"median epochs to target {med(v)} against {med(r)}"
    if slower < ALPHA:
        return "converges slower", f"converges slower than {name} (p={slower:.3f}; {epochs})", slower, name
    if faster < ALPHA:
        return "converges faster", (f"converges faster than {name} (p={faster:.3f}; {epochs}): check its learning "
                                    "rate, schedule or data for a leak"), faster, name
    return "no difference", f"no difference from {name} (p={p:.3f}; {epochs})", p, name
