"""MFU and precision that a reader of the CSV can trust (issue 40, item 6).

On an AVX2 EPYC, torch's bf16 GEMM probe read 1.33 GFLOP/s where TensorFlow's read 56.5, and the
file kept each cell's own probe: MFU 1.19 to 2.76 on every torch bf16 row, while ``compare``
re-divided by one peak. The file's final rewrite now gives every timed row the one peak per device
and precision that compare uses, an MFU above 1 is never written (the row says why it is missing),
the datasheet's MFU (``--peak-tflops``) is a second column, and bf16 on a CPU without bf16
instructions is named as emulated.
"""
from __future__ import annotations

import math

import pandas as pd
import pytest
from click.testing import CliRunner
from test_peaks import LOW

from benchbackend import results
from benchbackend.analysis import compare, experiments, rates
from benchbackend.backends import registry as backends
from benchbackend.cli import main


def _run(out, *backend_args: str, extra: tuple[str, ...] = ()):
    return CliRunner().invoke(main, ["run", "mnist", *backend_args, "--inference-only", "--data", "synthetic",
                                     "--limit", "256", "-o", str(out), "--no-plots", *extra])


def _timed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["phase"].isin(["train_epoch", "inference"])].reset_index(drop=True)


def test_the_written_csv_has_compares_one_peak_and_no_mfu_above_1(tmp_path, monkeypatch):
    """A planted low probe (``lowpeak``: 1 kFLOP/s) runs first on the CPU's entry, NumPy's probe in
    the next cell: the rewritten file divides every row by NumPy's, as compare does, row for row;
    with the low probe alone, no row has an MFU and each says why."""
    from support import inprocess

    inprocess.use(monkeypatch)
    monkeypatch.setitem(backends.BACKENDS, "lowpeak", LOW)
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "both.csv"
    r = _run(out, "-b", "lowpeak", "-b", "numpy", extra=("--repeats", "2", "-q"))
    assert r.exit_code == 0, r.output[-2000:]
    raw = _timed(pd.read_csv(out, keep_default_na=False, na_values=[""]))  # as a reader with pandas sees it
    assert len(raw) == 2 * 2 * 5 and (raw["mfu"] <= 1).all() and raw["mfu"].notna().all(), raw[["backend", "mfu"]]
    assert raw["peak_flops"].nunique() == 1 and raw["peak_source"].str.startswith("numpy GEMM probe").all()
    assert (raw["mfu_missing"].isna()).all()
    seen = _timed(rates.one_peak(experiments.for_comparison(results.read(out))))
    assert ((seen["mfu"] - raw["mfu"]).abs() <= 1e-12 * raw["mfu"]).all()  # compare's rows are the file's
    assert (seen["peak_flops"] == raw["peak_flops"]).all()
    text = compare.run_compare([str(out)]).text
    assert "MFU = achieved FLOP/s / a peak of " in text and "each backend's own peak" not in text

    alone = tmp_path / "alone.csv"
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache-alone"))
    r = _run(alone, "-b", "lowpeak", extra=("--repeats", "1", "-q"))
    assert r.exit_code == 0, r.output[-2000:]
    raw = _timed(pd.read_csv(alone, keep_default_na=False, na_values=[""]))
    assert raw["mfu"].isna().all() and raw["achieved_flops"].notna().all()
    assert raw["mfu_missing"].str.contains("lowpeak GEMM probe\\) is above 100%, so that peak is too low").all()
    assert _timed(rates.one_peak(experiments.for_comparison(results.read(alone))))["mfu"].isna().all()


def test_mfu_against_the_datasheet_is_a_second_column(tmp_path, monkeypatch):
    """``--peak-tflops`` adds MLPerf's MFU beside the probe's, never instead of it, and is held
    to the same rule: a figure below what a row achieved gives no MFU, and says why."""
    from support import inprocess

    inprocess.use(monkeypatch)
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sheet.csv"
    r = _run(out, "-b", "numpy", extra=("--repeats", "1", "--peak-tflops", "1000", "-q"))
    assert r.exit_code == 0, r.output[-2000:]
    timed = _timed(results.read(out))
    assert (timed["peak_datasheet_flops"] == 1e15).all() and timed["peak_source"].str.contains("GEMM probe").all()
    assert ((timed["mfu_datasheet"] - timed["achieved_flops"] / 1e15).abs() <= 1e-12).all()
    assert ((timed["mfu"] - timed["achieved_flops"] / timed["peak_flops"]).abs() <= 1e-9).all()
    assert "MFU sheet" in compare.run_compare([str(out)]).text

    low = tmp_path / "low.csv"
    r = _run(low, "-b", "numpy", extra=("--repeats", "1", "--peak-tflops", "1e-9", "-q"))
    assert r.exit_code == 0, r.output[-2000:]
    timed = _timed(results.read(low))
    assert timed["mfu_datasheet"].isna().all() and timed["mfu"].notna().all()
    assert timed["mfu_missing"].str.contains(r"datasheet MFU \d+% against .*\(--peak-tflops\) is above 100%").all()


@pytest.mark.slow
@pytest.mark.parametrize("flags, emulated", [({"fma", "avx2", "avx512f"}, True),
                                             ({"fma", "avx2", "avx512f", "avx512_bf16"}, False),
                                             ({"fma", "avx2", "amx_tile", "amx_bf16"}, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_is_named_as_emulated(tmp_path, monkeypatch, flags, emulated):
    """The CPU's flags faked: without avx512_bf16 or AMX, ``run``'s warnings and compare's say
    that the bf16 rows are emulated (the CPU's cost, not the framework's); with either, nothing."""
    pytest.importorskip("torch")
    from support import inprocess

    from benchbackend.run import machine

    inprocess.use(monkeypatch)
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset(flags))
    out = tmp_path / "bf16.csv"
    r = _run(out, "-b", "torch", extra=("--precision", "fp32", "--precision", "bf16", "--repeats", "1", "-q",
                                        "--peak-tflops", "1000"))
    assert r.exit_code == 0, r.output[-2000:]
    df = results.read(out)
    assert set(df.loc[df["phase"] == "inference", "cpu_bf16"]) == {str(not emulated)}
    said = [line for line in r.output.splitlines() if "bf16 is emulated on this CPU" in line]
    warnings = compare.run_compare([str(out)]).warnings
    named = [w for w in warnings if "bf16 is emulated on this CPU" in w]
    if emulated:
        assert len(said) == 1 and said[0].startswith("warning: ") and "torch" in said[0], r.output[-3000:]
        assert len(named) == 1
        groups = named[0].split("slower than fp32: ")[1].split(". Their")[0]
        assert "bf16" in groups and "fp32" not in groups, named  # the bf16 group only
    else:
        assert said == [] and named == []


def test_a_probe_and_a_row_agree_on_what_mfu_above_1_means():
    """``results.mfu_values``, the one rule of the file and of compare: at 100% the MFU is given, above it not."""
    at = results.mfu_values(1e9, 1e9, "numpy GEMM probe", "fp32", None)
    assert at == {"mfu": 1.0, "mfu_datasheet": None, "mfu_missing": ""}
    above = results.mfu_values(1.5e9, 1e9, "numpy GEMM probe", "fp32", 3e9)
    assert above["mfu"] is None and math.isclose(above["mfu_datasheet"], 0.5)
    assert above["mfu_missing"].startswith("MFU 150% against 0.001 TFLOP/s fp32 (numpy GEMM probe) is above 100%")
    none = results.mfu_values(1e9, None, "", "bf16", None)
    assert none["mfu"] is None and none["mfu_missing"] == "no GEMM probe on this device and precision"
    assert results.mfu_values(None, 1e9, "x", "fp32", None) == {}
