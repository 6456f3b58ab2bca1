"""The numbers behind ``compare`` and the plots: per-repeat reduction, group summaries, ratios.

A *group* is one (workload, device, backend, mode); a *repeat* is one (run_id, repeat), i.e. one
fresh worker process. Statistics are taken over repeats, never over epochs of one process, because
epochs of one process share its caches, allocator and thread pools and are not independent.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from .results import STATUSES, worst_status

GROUP_KEYS = ["workload", "device", "backend", "mode"]
CONTEXT_KEYS = ["workload", "device"]
REPEAT_KEYS = ["run_id", "repeat"]
ALPHA = 0.05
LEVEL = 0.95
RESAMPLES = 2000
SEED = 0

#: Columns of :func:`summarize`'s ``groups`` frame besides the keys.
SUMMARY_COLUMNS = [
    "status", "message", "repeats", "first_s", "steady_s", "steady_low", "steady_high", "steady_spread",
    "steady_n", "samples_per_s", "val_accuracy", "parity_max_abs", "parity_max_rel", "infer_s",
    "infer_low", "infer_high", "infer_spread", "infer_n",
]


def label(backend: str, mode: str) -> str:
    """How a group is named in tables and plots: ``torch``, ``tensorflow:tf.function``, ``torch@bf16``."""
    if not mode:
        return backend
    return f"{backend}{mode}" if mode.startswith("@") else f"{backend}:{mode}"


@dataclass(frozen=True)
class Ratio:
    """Baseline time over candidate time: above 1 the candidate is faster."""

    ratio: float
    low: float
    high: float
    pvalue: float
    significant: bool
    #: False when a side has a single repeat: there is no spread to test against.
    testable: bool

    @property
    def verdict(self) -> str:
        """``"1.85x faster"``, ``"1.20x slower"``, ``"not significant"`` or ``"n/a"``."""
        if not math.isfinite(self.ratio) or self.ratio <= 0:
            return "n/a"
        if not self.significant:
            return "not significant" if self.testable else "not significant (too few repeats)"
        if self.ratio >= 1:
            return f"{self.ratio:.2f}x faster"
        return f"{1 / self.ratio:.2f}x slower"

    @property
    def slowdown(self) -> float:
        """How many times longer the candidate takes than the baseline (point estimate)."""
        return 1 / self.ratio if self.ratio > 0 else math.inf


def boot_medians(values: np.ndarray, seed: int = SEED) -> np.ndarray:
    """Medians of ``RESAMPLES`` bootstrap resamples of ``values`` (vectorized, seeded)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(RESAMPLES, len(values)))
    return np.median(values[idx], axis=1)


def _percentiles(samples: np.ndarray) -> tuple[float, float]:
    low, high = np.percentile(samples, [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2])
    return float(low), float(high)


def _clean(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return values[np.isfinite(values)]


def bootstrap_median_ci(values: np.ndarray, seed: int = SEED) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median; (nan, nan) for fewer than 2 values."""
    values = _clean(values)
    if len(values) < 2:
        return math.nan, math.nan
    return _percentiles(boot_medians(values, seed))


def _min_pvalue(n: int, m: int) -> float:
    """Smallest two-sided p-value an exact Mann-Whitney U test can give for sizes n and m."""
    return min(1.0, 2 / math.comb(n + m, n))


def compare_times(baseline: np.ndarray, candidate: np.ndarray, base_boot: Optional[np.ndarray] = None,
                  cand_boot: Optional[np.ndarray] = None) -> Optional[Ratio]:
    """Compare per-repeat times: Mann-Whitney U (two-sided, ``ALPHA``) plus a bootstrap interval
    of median(baseline) / median(candidate). None when either side has no value.

    ``base_boot``/``cand_boot``: bootstrap medians already drawn (independently) for each side."""
    base, cand = _clean(baseline), _clean(candidate)
    if len(base) == 0 or len(cand) == 0:
        return None
    ratio = float(np.median(base) / np.median(cand))
    if len(base) < 2 or len(cand) < 2:
        return Ratio(ratio, math.nan, math.nan, 1.0, False, False)
    # imported here: scipy.stats costs ~0.7 s to import
    from scipy.stats import mannwhitneyu, ttest_ind

    if _min_pvalue(len(base), len(cand)) < ALPHA:
        pvalue = float(mannwhitneyu(base, cand, alternative="two-sided").pvalue)
    else:
        # A rank test cannot reach ALPHA with so few repeats (3 against 3: p >= 0.1 whatever the
        # times), so use Welch's t-test on log times, which can; timings are roughly log-normal.
        with np.errstate(all="ignore"):
            pvalue = float(ttest_ind(np.log(base), np.log(cand), equal_var=False).pvalue)
        pvalue = 1.0 if math.isnan(pvalue) else pvalue
    base_boot = boot_medians(base, SEED) if base_boot is None else base_boot
    cand_boot = boot_medians(cand, SEED + 1) if cand_boot is None else cand_boot
    low, high = _percentiles(base_boot / cand_boot)
    # Significant: the test rejects *and* the ratio's interval leaves 1 out.
    significant = pvalue < ALPHA and (low > 1 or high < 1)
    return Ratio(ratio, float(low), float(high), pvalue, bool(significant), True)


@dataclass
class Summary:
    """``groups``: one row per group (index GROUP_KEYS, columns SUMMARY_COLUMNS);
    ``repeats``: one row per repeat (index GROUP_KEYS + REPEAT_KEYS) with first_s, steady_s, infer_s,
    samples_per_s and val_accuracy."""

    groups: pd.DataFrame
    repeats: pd.DataFrame
    _boot: dict = field(default_factory=dict, repr=False)

    def bootstrap(self, key: tuple, column: str) -> Optional[np.ndarray]:
        """Bootstrap medians of one group's per-repeat ``column``, drawn once, from a seed of its own
        (so that two groups' resamples are independent and results do not depend on order)."""
        if (key, column) not in self._boot:
            values = self.samples(key, column)
            seed = zlib.crc32(repr((key, column)).encode())
            self._boot[key, column] = boot_medians(values, seed) if len(values) >= 2 else None
        return self._boot[key, column]

    def samples(self, key: tuple, column: str) -> np.ndarray:
        """Per-repeat values of ``column`` ("steady_s" or "infer_s") for one group."""
        try:
            values = self.repeats.loc[key, column]
        except KeyError:
            return np.array([])
        return _clean(np.atleast_1d(np.asarray(values, dtype=float)))


def per_repeat(df: pd.DataFrame) -> pd.DataFrame:
    """Reduce measurement rows to one row per repeat.

    steady_s is the median of the repeat's epochs >= 2 (NaN with a single epoch), first_s its
    epoch 1, infer_s the median of its inference passes after the first (the first carries
    tracing, compilation and first copies, as epoch 1 does; with a single pass, that pass),
    val_accuracy the last epoch's value.
    """
    keys = GROUP_KEYS + REPEAT_KEYS
    phase = df["phase"]
    train = df.loc[phase == "train_epoch", keys + ["epoch", "seconds", "samples_per_s", "val_accuracy"]]
    later = train["epoch"] >= 2
    steady = train[later].groupby(keys, sort=False, dropna=False).agg(
        steady_s=("seconds", "median"), samples_per_s=("samples_per_s", "median"))
    first = train[train["epoch"] == 1].groupby(keys, sort=False, dropna=False).agg(
        first_s=("seconds", "median"), first_sps=("samples_per_s", "median"))
    last = train.sort_values("epoch", kind="stable").groupby(keys, sort=False, dropna=False)["val_accuracy"].last()
    infer = steady_inference(df).groupby(keys, sort=False, dropna=False)["seconds"].median().rename("infer_s")
    out = pd.concat([first, steady, last, infer], axis=1)
    # With a single epoch there is no steady state; its throughput is all there is.
    out["samples_per_s"] = out["samples_per_s"].fillna(out.pop("first_sps"))
    return out.sort_index()


def steady_inference(df: pd.DataFrame) -> pd.DataFrame:
    """Inference rows without each repeat's first pass, unless that pass is the repeat's only one."""
    inf = df[df["phase"] == "inference"]
    passes = inf.groupby(GROUP_KEYS + REPEAT_KEYS, sort=False, dropna=False)["epoch"].transform("count")
    return inf[(inf["epoch"] >= 2) | (passes == 1)]


def _spread(values: pd.Series, keys: list[str], centre: pd.Series) -> pd.Series:
    """Robust spread of ``values`` per group (1.4826 x median absolute deviation, which equals the
    standard deviation for normal data), as a fraction of the group's median. One slow pass (a
    first inference pass, a busy moment) should not read as a 900% spread."""
    grouped = values.groupby(keys, sort=False, dropna=False)
    deviation = (values - grouped.transform("median")).abs()
    mad = 1.4826 * deviation.groupby(keys, sort=False, dropna=False).median()
    return (mad / centre).reindex(centre.index)


def _status_and_message(df: pd.DataFrame) -> pd.DataFrame:
    uniq = df.groupby(GROUP_KEYS, sort=True, dropna=False)["status"].unique()
    status = uniq.map(lambda s: worst_status(v for v in s if v) if any(s) else "ok").rename("status")
    noted = df.loc[df["message"] != "", GROUP_KEYS + ["status", "message"]]
    noted = noted.join(status.rename("worst"), on=GROUP_KEYS)
    noted = noted[noted["status"] == noted["worst"]]
    message = noted.groupby(GROUP_KEYS, sort=False, dropna=False)["message"].first()
    return pd.concat([status, message.reindex(status.index).fillna("")], axis=1)


def summarize(df: pd.DataFrame) -> Summary:
    """Aggregate a results frame (``results.read``/``read_many``) per group."""
    reps = per_repeat(df)
    groups = _status_and_message(df)
    by_group = reps.groupby(GROUP_KEYS, sort=False, dropna=False)
    med = by_group.median()
    groups["repeats"] = df[GROUP_KEYS + REPEAT_KEYS].drop_duplicates().groupby(
        GROUP_KEYS, sort=False, dropna=False).size()
    for col in ["first_s", "steady_s", "samples_per_s", "val_accuracy", "infer_s"]:
        groups[col] = med[col]
    groups["steady_n"] = by_group["steady_s"].count()
    groups["infer_n"] = by_group["infer_s"].count()
    phase = df["phase"]
    steady_rows = df.loc[(phase == "train_epoch") & (df["epoch"] >= 2)].set_index(GROUP_KEYS)["seconds"]
    infer_rows = steady_inference(df).set_index(GROUP_KEYS)["seconds"]
    groups["steady_spread"] = _spread(steady_rows, GROUP_KEYS, steady_rows.groupby(GROUP_KEYS).median()
                                      .reindex(groups.index))
    groups["infer_spread"] = _spread(infer_rows, GROUP_KEYS, infer_rows.groupby(GROUP_KEYS).median()
                                     .reindex(groups.index))
    parity = df.loc[(phase == "parity") & df["steps"].isna()].groupby(GROUP_KEYS, sort=False, dropna=False)[
        ["parity_max_abs", "parity_max_rel"]].max()
    groups = groups.join(parity)
    groups["repeats"] = groups["repeats"].fillna(0).astype(int)
    for col in ("steady_n", "infer_n"):
        groups[col] = groups[col].fillna(0).astype(int)
    summary = Summary(groups=groups, repeats=reps)
    for name, col in (("steady", "steady_s"), ("infer", "infer_s")):
        boots = [summary.bootstrap(key, col) for key in groups.index]
        cis = [_percentiles(b) if b is not None else (math.nan, math.nan) for b in boots]
        groups[f"{name}_low"] = [c[0] for c in cis]
        groups[f"{name}_high"] = [c[1] for c in cis]
    summary.groups = groups[SUMMARY_COLUMNS]
    return summary


def is_ok(status: str) -> bool:
    """Whether a group's results count as correct (only ``ok`` can be ranked)."""
    return status == STATUSES[0]
