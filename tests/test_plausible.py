"""Verdicts that survive a busy machine: a table never contradicts its star, and results that cannot
be true (a speed-up whose interval spans 1000x, a scaling efficiency above 1, an MFU above 100%)
are named, not printed as findings.

Every CSV here is written by the real ``results.CsvWriter``, one repeat per given steady epoch time.
"""
from __future__ import annotations

from itertools import takewhile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from benchbackend import results
from benchbackend.analysis import compare, stats, tables

ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}
SAMPLES = 1024


def _cells(writer: results.CsvWriter, backend: str, steady: list[float], *, epochs: int = 3, replicas: int = 1,
           workload: str = "mnist", flops: Optional[float] = None, peak: Optional[float] = None,
           run_id: str = "r1") -> None:
    """One repeat per value: its epochs after the first take exactly ``steady[i]`` seconds (the
    first three times that), its inference passes a tenth of it; ``flops`` (forward FLOPs a sample)
    and ``peak`` (``--peak-tflops``, in FLOP/s) give the timed rows achieved FLOP/s and MFU as the
    runner writes them."""
    for rep, t in enumerate(steady, start=1):
        base: dict[str, Any] = dict(ENV, run_id=run_id, cell_order=rep, workload=workload, workload_hash="h",
                                    backend=backend, backend_version="1.0", mode="eager", precision="fp32",
                                    device="cpu", requested_device="cpu", repeat=rep, replicas=replicas,
                                    scaling="strong", data_source="synthetic", epochs=epochs, batch_size=32,
                                    params=250_000)
        if peak is not None:
            base.update(peak_flops=peak, peak_source="--peak-tflops")

        def rates(phase: str, seconds: float, samples: int) -> dict[str, Any]:
            if flops is None:
                return {}
            achieved = (3 if phase == "train_epoch" else 1) * flops * samples / seconds
            return {"achieved_flops": achieved, "mfu": achieved / peak if peak else None}

        for epoch in range(1, epochs + 1):
            seconds = 3 * t if epoch == 1 else t
            writer.write(dict(base, phase="train_epoch", epoch=epoch, samples=SAMPLES, seconds=seconds,
                              samples_per_s=SAMPLES / seconds, loss=1.0, val_loss=1.0, val_accuracy=0.9,
                              **rates("train_epoch", seconds, SAMPLES)))
        for n in (1, 2, 3):
            writer.write(dict(base, phase="inference", **{"pass": n}, samples=256, seconds=t / 10,
                              samples_per_s=2560 / t, **rates("inference", t / 10, 256)))
        writer.end_cell(base, "ok")
    writer.close()


def _training_rates(text: str) -> dict[str, tuple[bool, float]]:
    """Per row of the Training table: (starred as the fastest, its samples/s)."""
    lines = text.split("\nTraining\n")[1].splitlines()
    end = lines[0].index("samples/s") + len("samples/s")  # right-aligned: a number ends where its header does
    rows = takewhile(lambda ln: ln.startswith(("*", " ")), lines[2:])  # up to the next table's title
    return {ln.lstrip("* ").split()[0]: (ln.startswith("*"), float(ln[:end].split()[-1].replace(",", "")))
            for ln in rows}


# --- 1. one median: the rates of a group are of the time that ranks it ----------------------------

#: The issue's shape: 4 repeats a side (an even count: each median is the mean of the two middle
#: values). tensorflow is steady at 0.8427 s an epoch; torch was fast twice and slow twice, its
#: median time 2.667 s. The median of torch's per-repeat samples/s is the mean of 1024/0.3 and
#: 1024/5.034, about 1,808, far above tensorflow's 1,215: the table starred tensorflow beside the
#: lower samples/s.
CONTRADICTION = {"tensorflow": [0.84, 0.8427, 0.8427, 0.85], "torch": [0.28, 0.3, 5.034, 5.2]}


def test_the_starred_group_shows_the_largest_samples_per_s(tmp_path: Path) -> None:
    path = tmp_path / "even.csv"
    w = results.CsvWriter(path)
    for backend, times in CONTRADICTION.items():
        _cells(w, backend, times)
    out = compare.run_compare([str(path)], baseline="tensorflow")
    tf, torch = (out.groups.reset_index().set_index("backend").loc[b] for b in ("tensorflow", "torch"))
    assert tf["steady_s"] == pytest.approx(0.8427) and torch["steady_s"] == pytest.approx(2.667)
    # The data has the issue's shape: medians of per-repeat rates would contradict the times.
    old = {b: np.median([SAMPLES / t for t in times]) for b, times in CONTRADICTION.items()}
    assert old["torch"] > old["tensorflow"], "the CSV must reproduce the contradiction of medians of rates"
    # The table never contradicts its star: the quickest steady epoch has the most samples/s.
    assert tf["fastest_train"]
    assert tf["samples_per_s"] > torch["samples_per_s"], \
        f"starred tensorflow shows {tf['samples_per_s']:,.0f} samples/s, torch {torch['samples_per_s']:,.0f}"
    shown = _training_rates(out.text)
    assert set(shown) == {"tensorflow", "torch"} and shown["tensorflow"][0]
    assert max(shown, key=lambda b: shown[b][1]) == "tensorflow", f"the star and samples/s disagree: {shown}"
    # Each rate is the epoch's work over the median time that ranks the group, its interval turned over.
    for row in (tf, torch):
        assert row["samples_per_s"] == pytest.approx(SAMPLES / row["steady_s"])
        assert (row["sps_low"], row["sps_high"]) == pytest.approx((SAMPLES / row["steady_high"],
                                                                   SAMPLES / row["steady_low"]))
        assert row["infer_sps"] == pytest.approx(256 / row["infer_s"])
        assert (row["infer_sps_low"], row["infer_sps_high"]) == pytest.approx((256 / row["infer_high"],
                                                                               256 / row["infer_low"]))


def test_one_epoch_rates_fall_back_to_the_first_epoch(tmp_path: Path) -> None:
    """No steady state: a rate is of the first epoch's median time, as before."""
    path = tmp_path / "one.csv"
    _cells(results.CsvWriter(path), "torch", [1.0, 1.2, 1.4, 1.6], epochs=1)
    row = compare.run_compare([str(path)]).groups.iloc[0]
    assert np.isnan(row["steady_s"]) and row["first_s"] == pytest.approx(3 * 1.3)
    assert row["samples_per_s"] == pytest.approx(SAMPLES / (3 * 1.3))
    assert (row["sps_low"], row["sps_high"]) == pytest.approx((SAMPLES / 4.8, SAMPLES / 3.0))


# --- 2. a speed-up whose interval spans 1000x or more is no verdict --------------------------------

def test_an_interval_spanning_1000x_withholds_the_verdict() -> None:
    few = stats.compare_times(np.array([1.0, 10.0]), np.array([1.2, 12.0]))
    assert few.high / few.low >= 1000 and (few.n_base, few.n_cand) == (2, 2)
    assert few.verdict == "too few repeats", "two repeats a side with a 1000x interval: too few repeats"
    assert tables.ratio_text(few) == "too few repeats: 0.833x (95% CI spans over 1000x)"
    # Three repeats a side, one of them far off: the interval leaves 1 out but spans over 1000x.
    wide = stats.compare_times(np.array([1000.0, 1100.0, 40000.0]), np.array([0.5, 0.55, 20.0]))
    assert wide.significant and wide.low > 1 and wide.high / wide.low >= 1000
    assert wide.verdict == "unstable", f"a 1000x interval must never be 'faster': {tables.ratio_text(wide)}"
    assert tables.ratio_text(wide) == "unstable: 2000x (95% CI spans over 1000x)"
    # A readable interval keeps its verdict.
    assert stats.compare_times(np.array([2.0, 2.1, 2.05]), np.array([1.0, 1.05, 1.02])).verdict == "faster"


def test_a_withheld_verdict_is_shown_and_is_no_regression(tmp_path: Path) -> None:
    path = tmp_path / "busy.csv"
    w = results.CsvWriter(path)
    _cells(w, "tensorflow", [3.0, 30.0])
    _cells(w, "torch", [1.0, 10.0])
    out = compare.run_compare([str(path)], baseline="tensorflow")
    torch = out.groups.reset_index().set_index("backend").loc["torch"]
    assert torch["train_verdict"] == "too few repeats"
    assert torch["train_text"] == "too few repeats: 3.00x (95% CI spans over 1000x)"
    assert "95% CI spans over 1000x" in out.text and "faster" not in torch["train_text"]
    assert "vs tensorflow: too few repeats: 3.00x (95% CI spans over 1000x)" in out.verdict
    # tensorflow is 3x slower than torch on the point estimate, but the interval says nothing: no exit 3.
    slow = compare.run_compare([str(path)], baseline="torch", candidate=("tensorflow",), fail_on_regression=1.5)
    assert slow.exit_code == 0, "a withheld verdict is not a regression"
    assert not any(m.startswith("regression:") for m in slow.warnings)
    assert any(m.startswith("possible regression, verdict withheld: mnist/cpu/tensorflow steady epoch is 3.00x "
                            "slower than torch") for m in slow.warnings), slow.warnings


# --- 3. a scaling efficiency above 1 ----------------------------------------------------------------

def test_a_scaling_efficiency_above_1_is_implausible_or_unstable(tmp_path: Path) -> None:
    path = tmp_path / "scaling.csv"
    w = results.CsvWriter(path)
    _cells(w, "torch", [10.0, 10.3, 10.1], workload="cifar10", run_id="one")
    _cells(w, "torch", [3.0, 3.2, 3.1], workload="cifar10", replicas=2, run_id="two")  # 1.63x N: beyond noise
    _cells(w, "torch", [1.5, 2.4, 4.0], workload="cifar10", replicas=4, run_id="four")  # 1.05x N: within it
    out = compare.run_compare([str(path)])
    g = out.groups.reset_index().set_index("mode")
    two, four = g.loc["eager x2"], g.loc["eager x4"]
    assert two["scaling_low"] > 1 and two["scaling_check"] == "implausible"
    assert four["scaling_eff"] > 1 >= four["scaling_low"] and four["scaling_check"] == "unstable"
    assert g.loc["eager", "scaling_check"] == ""
    scaled = out.text.split("\nScaling\n")[1].split("\n", 1)[1]  # the table, after the line on the marks
    assert f"{two['scaling_eff']:.2f} [{two['scaling_low']:.2f}-{two['scaling_high']:.2f}] (implausible)" in scaled
    assert "(unstable)" in scaled
    named = [m for m in out.warnings if "scaling efficiency" in m]
    assert len(named) == 2, named
    assert named[0].startswith(f"cifar10/cpu/torch:eager x2: scaling efficiency {two['scaling_eff']:.2f} "
                               f"[{two['scaling_low']:.2f}-{two['scaling_high']:.2f}] is above 1, its 95% CI too, "
                               "which is implausible"), named[0]
    assert named[1].startswith("cifar10/cpu/torch:eager x4: scaling efficiency") and \
        "is above 1 within noise (its 95% CI holds 1): too unstable to read" in named[1], named[1]


def test_an_efficiency_of_at_most_1_is_not_named(tmp_path: Path) -> None:
    path = tmp_path / "fine.csv"
    w = results.CsvWriter(path)
    _cells(w, "torch", [10.0, 10.3, 10.1], workload="cifar10", run_id="one")
    _cells(w, "torch", [6.0, 6.4, 6.1], workload="cifar10", replicas=2, run_id="two")
    out = compare.run_compare([str(path)])
    assert out.groups["scaling_eff"].max() < 1
    assert not any("scaling efficiency" in m for m in out.warnings)
    table = out.text.split("\nScaling\n")[1].split("\n", 1)[1]  # after the line that explains the marks
    assert "(implausible)" not in table and "(unstable)" not in table


# --- 4. an MFU above 100% ---------------------------------------------------------------------------

def test_an_mfu_above_100_percent_is_named_as_impossible(tmp_path: Path) -> None:
    path = tmp_path / "mfu.csv"
    w = results.CsvWriter(path)
    # 3 x 1e6 FLOPs x 1024 samples / 0.5 s = 6.1 GFLOP/s against a peak of 2 GFLOP/s: 307%.
    _cells(w, "numpy", [0.5, 0.5, 0.5], flops=1e6, peak=2e9)
    _cells(w, "torch", [0.5, 0.5, 0.5], flops=1e6, peak=1e12)
    out = compare.run_compare([str(path)])
    named = [m for m in out.warnings if "MFU" in m]
    assert named[0].startswith("mnist/cpu/numpy: training MFU 307% is above 100%, which is impossible: the peak "
                               "it is against (0.002 TFLOP/s fp32 (--peak-tflops)) under-read"), named
    assert len(named) == 2 and named[1].startswith("mnist/cpu/numpy: inference MFU 256% is above 100%"), named
    assert not any(m.startswith("mnist/cpu/torch") for m in named), "an MFU under 100% is not named"
