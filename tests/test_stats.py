"""The statistics behind compare's verdicts: one decision rule, intervals that cover what they claim.

Timings here are simulated log-normal samples (a fair model of per-repeat times: positive,
right-skewed, multiplicative noise). Coverage tests use 2,000 simulated experiments each.
"""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchbackend.analysis import experiments, stats, summary, tables
from benchbackend.analysis.experiments import GroupKey

SIMULATIONS = 2000
_TEXT = re.compile(r"^(faster|slower|not significant): ([\d.]+)x \[([\d.]+)-([\d.]+)\]( \(([\d.]+)x slower\))?$")


def _parse(text: str) -> tuple[str, float, float, float]:
    m = _TEXT.match(text)
    assert m, text
    if m.group(5):  # a slowdown is also said as its inverse, and only a slowdown
        assert m.group(1) == "slower" and float(m.group(6)) == pytest.approx(1 / float(m.group(2)), rel=2e-2)
    return m.group(1), float(m.group(2)), float(m.group(3)), float(m.group(4))


timings = st.lists(st.floats(min_value=0.05, max_value=50.0, allow_nan=False), min_size=3, max_size=5)


@settings(max_examples=300, deadline=None)
@given(base=timings, cand=timings)
def test_verdict_and_printed_interval_always_agree(base: list[float], cand: list[float]) -> None:
    """Whatever the timings (3 to 5 repeats a side): "not significant" only beside an interval that
    holds 1, "faster"/"slower" only beside one that leaves 1 out on the matching side, and the
    printed speed-up inside its printed interval."""
    r = stats.compare_times(np.array(base), np.array(cand))
    assert r is not None and r.testable  # no spread on either side too: an exact ratio, a verdict
    if r.too_wide:  # an interval spanning 1000x or more is withheld, never a verdict (test_plausible.py)
        assert r.verdict in ("unstable", "too few repeats") and "95% CI spans over" in tables.ratio_text(r)
        return
    verdict, ratio, low, high = _parse(tables.ratio_text(r))
    assert low <= ratio <= high
    assert r.low <= r.ratio <= r.high
    if verdict == "not significant":
        assert low <= 1 <= high and r.low <= 1 <= r.high
    elif verdict == "faster":
        assert low > 1 and r.ratio > 1
    else:
        assert high < 1 and r.ratio < 1
    assert verdict == r.verdict and r.significant == (verdict != "not significant")


def test_the_old_contradiction_cannot_happen() -> None:
    """Issue 8 saw 'not significant [1.04x-1.89x]': an interval excluding 1 called not significant.
    With one rule an interval excluding 1 is always a verdict in its direction."""
    base = np.array([1.50, 1.62, 1.41])
    cand = np.array([1.00, 1.08, 0.95])
    r = stats.compare_times(base, cand)
    verdict, ratio, low, high = _parse(tables.ratio_text(r))
    assert (low > 1) == (verdict == "faster")
    assert verdict == "faster" and 1.4 < ratio < 1.6


def test_ratio_is_the_ratio_of_the_medians_shown_beside_it() -> None:
    """The speed-up is the baseline's median / the candidate's median: the two numbers the table
    prints beside it (a ratio of geometric means would read 2.49x here, beside columns of 2.0 and 1.0)."""
    base, cand = np.array([2.0, 2.0, 2.0, 2.0, 6.0]), np.array([1.0, 0.9, 1.0, 1.1, 1.0])
    r = stats.compare_times(base, cand)
    assert r.ratio == 2.0 and r.low <= r.ratio <= r.high
    assert stats.compare_times(np.array([2.0, 8.0]), np.array([1.0, 1.0])).ratio == 5.0  # not sqrt(2*8)/1


def test_identical_timings_on_both_sides_give_an_exact_ratio_and_a_verdict() -> None:
    """No spread on either side (every repeat timed alike): the ratio is exact, its interval has no
    width, and the verdict follows the ratio; it is not 'too few repeats'."""
    faster = stats.compare_times(np.array([2.0] * 3), np.array([1.0] * 3))
    assert (faster.ratio, faster.low, faster.high) == (2.0, 2.0, 2.0)
    assert faster.testable and faster.significant and faster.verdict == "faster"
    assert tables.ratio_text(faster) == "faster: 2.00x [2.00-2.00]"
    assert stats.compare_times(np.array([0.1] * 4), np.array([0.3] * 3)).verdict == "slower"
    same = stats.compare_times(np.array([0.1] * 3), np.array([0.1] * 5))
    assert (same.ratio, same.low, same.high, same.verdict) == (1.0, 1.0, 1.0, "not significant")
    assert tables.ratio_text(same) == "not significant: 1.00x [1.00-1.00]"


def test_printed_bounds_keep_their_side_of_one() -> None:
    """A lower bound of 1.0004 must not print as 1.00 beside 'faster'."""
    r = stats.Ratio(1.02, 1.0004, 1.04, 0.04, True, True)
    verdict, ratio, low, high = _parse(tables.ratio_text(r))
    assert verdict == "faster" and low > 1


def test_one_repeat_gives_no_interval_and_no_verdict() -> None:
    r = stats.compare_times(np.array([2.0]), np.array([1.0]))
    assert r.verdict == "too few repeats" and tables.ratio_text(r) == "too few repeats: 2.00x"
    assert stats.compare_times(np.array([]), np.array([1.0])) is None


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("sigmas", [(0.05, 0.05), (0.03, 0.15)])
def test_ratio_interval_covers_the_true_ratio(n: int, sigmas: tuple[float, float]) -> None:
    """The '95% CI' of the speed-up covers the true ratio of medians >= 93% of the time (on
    log-normal timings: about 95-97%), also with unequal spreads."""
    rng = np.random.default_rng(n * 100 + int(sigmas[1] * 100))
    true = 1.7
    hits = 0
    for _ in range(SIMULATIONS):
        base = np.exp(math.log(true) + sigmas[0] * rng.standard_normal(n))
        cand = np.exp(sigmas[1] * rng.standard_normal(n))
        r = stats.compare_times(base, cand)
        hits += r.low <= true <= r.high
    assert hits / SIMULATIONS >= 0.93


@pytest.mark.parametrize("n", [3, 5])
def test_false_positive_rate_is_about_five_percent(n: int) -> None:
    rng = np.random.default_rng(7 + n)
    flagged = [stats.compare_times(np.exp(0.04 * rng.standard_normal(n)), np.exp(0.04 * rng.standard_normal(n)))
               .significant for _ in range(SIMULATIONS)]
    assert 0.02 < np.mean(flagged) < 0.08


def test_a_true_2x_difference_is_found_with_3_repeats() -> None:
    rng = np.random.default_rng(3)
    found = [stats.compare_times(np.exp(math.log(2) + 0.03 * rng.standard_normal(3)),
                                 np.exp(0.03 * rng.standard_normal(3))).verdict == "faster" for _ in range(200)]
    assert np.mean(found) > 0.95


def test_median_variance_factors_match_simulation() -> None:
    """n x Var(median of n standard normals), which widens the speed-up's interval from a mean's to a
    median's: the table against 200,000 simulated samples (within 2%), pi/2 beyond it."""
    rng = np.random.default_rng(11)
    for n in (2, 3, 4, 5, 8, 13):
        simulated = n * np.median(rng.standard_normal((200_000, n)), axis=1).var()
        assert stats.median_variance(n) == pytest.approx(simulated, rel=0.02)
    assert stats.median_variance(21) == pytest.approx(math.pi / 2)


def test_order_statistic_ranks() -> None:
    """[min, max] of n covers the median with probability 1 - 2/2^n: 93.75% at n=5, 96.9% at n=6."""
    assert [stats.order_statistic_rank(n) for n in (2, 3, 4, 5)] == [None] * 4
    assert stats.order_statistic_rank(6) == 1 and stats.order_statistic_rank(8) == 1
    assert stats.order_statistic_rank(9) == 2  # [x2, x8] of 9: 1 - 2*10/512 = 96.1%
    assert stats.order_statistic_rank(20) == 6


@pytest.mark.parametrize("n", [2, 3, 5])
def test_few_repeats_show_the_range_not_a_ci(n: int) -> None:
    values = np.arange(1.0, n + 1)
    assert stats.median_interval(values) == (1.0, float(n), stats.RANGE_LABEL)


@pytest.mark.parametrize("n", [6, 7, 9, 12, 20])
def test_median_ci_covers_the_true_median(n: int) -> None:
    """Shown as '95% CI' only from 6 repeats, and there it covers the true median >= 93% (>= 95%
    in theory, for any continuous distribution)."""
    rng = np.random.default_rng(n)
    mu, hits = math.log(3.0), 0
    for _ in range(SIMULATIONS):
        low, high, kind = stats.median_interval(np.exp(mu + 0.1 * rng.standard_normal(n)))
        assert kind == stats.CI_LABEL
        hits += low <= 3.0 <= high
    assert hits / SIMULATIONS >= 0.93


def test_five_repeats_range_would_not_be_an_honest_95_ci() -> None:
    """Why n=5 is labelled 'range': its min-max covers the median only ~93.75% of the time."""
    rng = np.random.default_rng(5)
    samples = np.exp(0.1 * rng.standard_normal((SIMULATIONS, 5)))
    covered = np.mean((samples.min(axis=1) <= 1.0) & (1.0 <= samples.max(axis=1)))
    assert covered < 0.95


# --- MFU and time to accuracy per repeat (issue 13) ------------------------------------------------

def _rows(tmp_path: Any, epochs: int, tta: list[float], peak: float = 0.5e12) -> Any:
    """Rows of three repeats as the runner writes them: epoch e of repeat r runs at 100*r*e
    samples/s; time_to_accuracy_s is the repeat's cell-level value on every row."""
    from benchbackend import results

    w = results.CsvWriter(tmp_path / "r.csv")
    for rep, reached in enumerate(tta, start=1):
        base = dict(run_id="r", workload="mnist", workload_hash="h", backend="numpy", device="cpu", repeat=rep,
                    status="ok", peak_flops=peak, peak_source="--peak-tflops", time_to_accuracy_s=reached)
        for epoch in range(1, epochs + 1):
            sps = 100.0 * rep * epoch
            w.write(dict(base, phase="train_epoch", epoch=epoch, samples=100, seconds=100 / sps, samples_per_s=sps,
                         achieved_flops=3e6 * sps, mfu=3e6 * sps / peak, val_accuracy=0.5))
        for n in range(1, 4):
            sps = 1000.0 * rep * n
            w.write(dict(base, phase="inference", **{"pass": n}, samples=50, seconds=50 / sps, samples_per_s=sps,
                         achieved_flops=1e6 * sps, mfu=1e6 * sps / peak))
    return results.read(w.path)


def _by_repeat(df: Any) -> Any:
    """``summary.per_repeat`` of one group, indexed by repeat number."""
    return summary.per_repeat(experiments.with_experiment(df)).droplevel([0, 1, 2, 3, 4, 5])


def test_mfu_per_repeat_is_of_the_steady_epochs_and_passes(tmp_path: Any) -> None:
    reps = _by_repeat(_rows(tmp_path, epochs=4, tta=[1.0, 2.0, 3.0]))
    for rep in (1, 2, 3):
        steady = np.median([100.0 * rep * e for e in (2, 3, 4)])
        assert reps.loc[rep, "samples_per_s"] == pytest.approx(steady)
        assert reps.loc[rep, "mfu"] == pytest.approx(3e6 * steady / 0.5e12)
        assert reps.loc[rep, "infer_mfu"] == pytest.approx(1e6 * np.median([2000.0 * rep, 3000.0 * rep]) / 0.5e12)
        assert reps.loc[rep, "infer_sps"] == pytest.approx(np.median([2000.0 * rep, 3000.0 * rep]))


def test_one_epoch_mfu_is_the_first_epochs(tmp_path: Any) -> None:
    reps = _by_repeat(_rows(tmp_path, epochs=1, tta=[1.0, 2.0, 3.0]))
    assert list(reps["mfu"]) == pytest.approx([3e6 * 100.0 * r / 0.5e12 for r in (1, 2, 3)])


def test_time_to_accuracy_counts_unreached_repeats_apart(tmp_path: Any) -> None:
    reduced = summary.summarize(_rows(tmp_path, epochs=2, tta=[4.0, math.inf, 6.0]))
    group = reduced.groups.iloc[0]
    assert (group["tta_reached"], group["tta_missed"]) == (2, 1)
    assert group["tta_s"] == pytest.approx(5.0)  # the median of the repeats that reached it
    assert (group["tta_low"], group["tta_high"], group["tta_interval"]) == (4.0, 6.0, stats.RANGE_LABEL)
    assert list(reduced.samples(GroupKey.of(reduced.groups.index[0]), "tta_s")) == [4.0, 6.0]
    assert group["peak"] == "0.5 TFLOP/s fp32 (--peak-tflops)" and group["peak_flops"] == 0.5e12


def test_no_target_means_no_time_to_accuracy(tmp_path: Any) -> None:
    group = summary.summarize(_rows(tmp_path, epochs=2, tta=[math.nan] * 3)).groups.iloc[0]
    assert math.isnan(group["tta_s"]) and group["tta_reached"] == group["tta_missed"] == 0


@settings(max_examples=300, deadline=None)
@given(df=st.floats(min_value=0.3, max_value=1e5), t=st.floats(min_value=-1e3, max_value=1e3),
       p=st.floats(min_value=0.5, max_value=0.9999))
def test_student_t_without_scipy_agrees_with_scipy(df: float, t: float, p: float) -> None:
    """The decision rule needs Student's t; it is computed here (SciPy would add a quarter of a
    second to every `compare`), and must agree with SciPy's to 1e-9."""
    from scipy.special import stdtr, stdtrit

    assert stats.t_cdf(t, df) == pytest.approx(float(stdtr(df, t)), abs=1e-9)
    assert stats.t_quantile(p, df) == pytest.approx(float(stdtrit(df, p)), rel=1e-9, abs=1e-9)


def test_a_slowdown_is_also_said_as_its_inverse() -> None:
    """Issue 41 item 10: 0.361x reads as '2.77x slower' beside the ratio; a speed-up is not inverted."""
    from benchbackend.analysis import tables

    slow = stats.Ratio(ratio=0.361, low=0.33, high=0.395, pvalue=0.001, significant=True, testable=True)
    assert tables.ratio_text(slow) == "slower: 0.361x [0.330-0.395] (2.77x slower)"
    fast = stats.Ratio(ratio=1.85, low=1.6, high=2.1, pvalue=0.001, significant=True, testable=True)
    assert tables.ratio_text(fast) == "faster: 1.85x [1.60-2.10]"


def test_latency_percentiles_follow_loadgens_rule() -> None:
    # LoadGen (results.cc, ProcessLatencies): sorted latencies at index floor(n q); never interpolated.
    values = np.arange(100, 0, -1, dtype=float)  # 100..1, unsorted
    assert [stats.latency_percentile(values, q) for q in (0.5, 0.9, 0.99)] == [51.0, 91.0, 100.0]
    assert stats.latency_percentile([3.0, 1.0, 2.0, 4.0], 0.9) == 4.0  # index 3; NumPy's linear: 3.7
    assert stats.latency_percentile([5.0], 0.99) == 5.0 and math.isnan(stats.latency_percentile([], 0.5))
