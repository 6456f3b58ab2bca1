"""The decision rules behind every verdict and interval of ``compare`` and the plots: plain NumPy.

One estimator everywhere: the median of per-repeat values. A group's time is the median of its
repeats; the speed-up is the ratio of those medians, baseline/candidate (above 1: the candidate is
faster), so it is the ratio of the two numbers printed beside it. Its 95% interval is Welch's t on
the log of per-repeat times, taken about the log of that ratio with the standard error of a median
(``sqrt(c_n) s / sqrt(n)``, where ``c_n`` is n times the variance of the median of n normal values;
the mean's would be 1). In simulation it covers the true ratio 95-97% of the time for log-normal
times (2 to 9 repeats a side, equal or unequal spreads), and more where log times have heavier
tails or an outlying repeat. The difference is significant iff that interval leaves 1 out; the
point estimate always lies inside its interval. Where neither side has any spread (every repeat
timed alike) the ratio is exact: its interval has no width, and it is significant iff it is not 1.
A group's own interval is a distribution-free interval of its median (order statistics) where the
repeats allow one, else the range of the repeats.

An interval that spans ``WIDE_SPAN`` or more (high/low: three orders of magnitude, e.g. two
repeats a side on a busy machine giving ``[0.0000043-11629443]``) says nothing about which side is
faster, wherever it lies: its verdict is withheld, ``too few repeats`` where a side has fewer than
``MIN_REPEATS``, else ``unstable``, and never ``faster``/``slower``.

Statistics are taken over repeats (fresh worker processes), never over epochs of one process,
which share its caches, allocator and thread pools and are not independent. How results are
reduced to per-repeat values is :mod:`benchbackend.analysis.summary`; how a ratio is printed,
:mod:`benchbackend.analysis.tables`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

LEVEL = 0.95
#: Labels of a group's interval column: a real 95% interval, or the min-max range of the repeats.
CI_LABEL = "95% CI"
RANGE_LABEL = "range"
#: The estimator of every time and every ratio ``compare`` shows (``--format json`` names it).
ESTIMATOR = "median"
#: A speed-up whose 95% interval spans this factor or more (high/low) is too wide to read.
WIDE_SPAN = 1000.0
#: Fewer repeats than this on a side: a too-wide interval is blamed on the repeats ("too few
#: repeats"); from this many up, on the timings themselves ("unstable").
MIN_REPEATS = 3
#: n x Var(median of n standard normal values), n = 1..20, by numerical integration of the order
#: statistics' densities (tests/test_stats.py checks them by simulation). It rises to pi/2 (odd n)
#: and, more slowly, towards it (even n); beyond the table pi/2 is used, a little wide.
_MEDIAN_VARIANCE = (1.0, 1.0, 1.34601, 1.1928, 1.43417, 1.28846, 1.47313, 1.34545, 1.49491, 1.38326,
                    1.50879, 1.41019, 1.51839, 1.43035, 1.52542, 1.446, 1.53079, 1.45851, 1.53503, 1.46874)


@dataclass(frozen=True)
class Ratio:
    """Speed-up of a candidate over a baseline: baseline time / candidate time (above 1: faster).

    ``ratio`` is the ratio of medians; ``low``/``high`` its 95% interval (the rule in this module's
    docstring); ``significant`` iff the interval leaves 1 out. ``testable`` is False when a side
    has a single repeat: there is then no interval. With no spread on either side the ratio is
    exact and ``low == ratio == high``. ``n_base``/``n_cand`` are the repeats on each side (0:
    not known), which say whether a too-wide interval is for want of repeats.
    """

    ratio: float
    low: float
    high: float
    pvalue: float
    significant: bool
    testable: bool
    n_base: int = 0
    n_cand: int = 0

    @property
    def too_wide(self) -> bool:
        """Whether the interval spans ``WIDE_SPAN`` or more: a significance drawn from it would be
        an accident of the spread, not a finding."""
        if not self.testable:
            return False
        # A bound that under- or overflowed (0, inf) spans everything.
        return not (self.low > 0 and math.isfinite(self.high)) or self.high / self.low >= WIDE_SPAN

    @property
    def verdict(self) -> str:
        """``faster``, ``slower``, ``not significant``, ``too few repeats``, ``unstable`` or ``n/a``."""
        if not math.isfinite(self.ratio) or self.ratio <= 0:
            return "n/a"
        if not self.testable:
            return "too few repeats"
        if self.too_wide:
            return "too few repeats" if 0 < min(self.n_base, self.n_cand) < MIN_REPEATS else "unstable"
        if not self.significant:
            return "not significant"
        return "faster" if self.ratio > 1 else "slower"

    @property
    def slowdown(self) -> float:
        """How many times longer the candidate takes than the baseline (point estimate)."""
        return 1 / self.ratio if self.ratio > 0 else math.inf


def clean(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return values[np.isfinite(values) & (values > 0)]


def median_variance(n: int) -> float:
    """n x the variance of the median of n independent standard normal values (the mean's: 1)."""
    return _MEDIAN_VARIANCE[n - 1] if n <= len(_MEDIAN_VARIANCE) else math.pi / 2


def _median_log_variance(values: np.ndarray) -> float:
    """The squared standard error of the median of log ``values``; exactly 0 when they are all equal
    (the mean of equal floats need not equal them, and would leave a variance of rounding errors)."""
    if values.min() == values.max():
        return 0.0
    return median_variance(len(values)) * float(np.log(values).var(ddof=1)) / len(values)


def compare_times(baseline: np.ndarray, candidate: np.ndarray) -> Optional[Ratio]:
    """Compare per-repeat times with the decision rule in this module's docstring.

    None when either side has no value. Welch's t needs no equal variances and works with 3
    repeats a side, where a rank test can never reach 5% (3 against 3: p >= 0.1 whatever the times).
    """
    base, cand = clean(baseline), clean(candidate)
    if len(base) == 0 or len(cand) == 0:
        return None
    ratio = float(np.median(base) / np.median(cand))
    sizes = (len(base), len(cand))
    if len(base) < 2 or len(cand) < 2:
        return Ratio(ratio, math.nan, math.nan, math.nan, False, False, *sizes)
    vb, vc = _median_log_variance(base), _median_log_variance(cand)
    if vb + vc == 0:  # every repeat of each side timed alike: the ratio is exact
        return Ratio(ratio, ratio, ratio, float(ratio == 1), ratio != 1, True, *sizes)
    se, diff = math.sqrt(vb + vc), math.log(ratio)
    df = (vb + vc) ** 2 / (vb ** 2 / (len(base) - 1) + vc ** 2 / (len(cand) - 1))
    half = t_quantile((1 + LEVEL) / 2, df) * se
    pvalue = 2 * t_cdf(-abs(diff) / se, df)
    # ratio x exp(-+half), not exp(diff -+ half): the bounds then hold the ratio itself, to the last bit
    low, high = ratio * math.exp(-half), ratio * math.exp(half)
    return Ratio(ratio, low, high, pvalue, bool(low > 1 or high < 1), True, *sizes)


# --- Student's t, without SciPy (importing scipy.special costs a quarter of a second) -------------

def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    out = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            out *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return out


def _incomplete_beta(a: float, b: float, x: float, y: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and y = 1 - x (given
    apart: where x is near 1, 1 - x computed from it would lose its digits)."""
    if x <= 0.0 or y <= 0.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, y) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (real, > 0) degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t), t * t / (df + t * t))
    return tail if t < 0 else 1.0 - tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = ``p`` (0.5 <= p < 1), by bisection on :func:`t_cdf` to 1e-12."""
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2
    while high - low > 1e-12 * max(1.0, high):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


# --- the interval of one group's median ----------------------------------------------------------

@lru_cache(maxsize=None)
def order_statistic_rank(n: int, level: float = LEVEL) -> Optional[int]:
    """The largest k such that [x_(k), x_(n-k+1)] (1-based order statistics) covers the median of
    any continuous distribution with probability >= ``level``; None when even [min, max] falls short
    (n <= 5 for 95%: [min, max] of 5 covers 93.75%)."""
    best = None
    for k in range(1, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if 1 - 2 * tail >= level:
            best = k
        else:
            break
    return best


def median_interval(values: np.ndarray) -> tuple[float, float, str]:
    """(low, high, kind): a distribution-free 95% interval of the median (kind ``CI_LABEL``) where
    the repeats allow one (6 or more), else the min-max range (kind ``RANGE_LABEL``); NaN and ""
    for fewer than 2 values."""
    values = np.sort(clean(values))
    n = len(values)
    if n < 2:
        return math.nan, math.nan, ""
    k = order_statistic_rank(n)
    if k is None:
        return float(values[0]), float(values[-1]), RANGE_LABEL
    return float(values[k - 1]), float(values[n - k]), CI_LABEL


def latency_percentile(values: Sequence[float], q: float) -> float:
    """MLPerf LoadGen's latency percentile: the value at index floor(n q) of the sorted latencies
    (``PerformanceSummary::ProcessLatencies`` in LoadGen's results.cc), ``q`` in [0, 1). A scenario
    row's percentiles are LoadGen's, by this rule; generation's TPOT percentiles use this function,
    so a p99 means the same in both (NumPy's default interpolates between two latencies instead)."""
    ordered = np.sort(np.asarray(values, dtype=float))
    if not len(ordered):
        return math.nan
    return float(ordered[min(int(len(ordered) * q), len(ordered) - 1)])
