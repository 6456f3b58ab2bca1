"""The GEMM-peak cache behind MFU: keyed by thread count, never lowered by a new probe, and an
entry that a run shows to be too low (a timed row above 100% MFU) is dropped and probed again."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from benchbackend import backends, peaks, results
from benchbackend.cli import main
from conftest import ROOT

LOW = backends.BackendSpec("lowpeak", "support.lazy_backend:LowPeakNumpyBackend", ("numpy",), "numpy", "(test only)",
                           "the NumPy reference whose GEMM probe reads too low",
                           modes=(backends.Mode("reference", "the reference"),),
                           capabilities=backends.Capabilities(peak_probe=True))


def test_the_key_holds_the_thread_count_and_a_probe_never_lowers_a_stored_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path))
    one, two = (peaks.key("h", "cpu", "torch", "cpu", "fp32", t) for t in (1, 2))
    assert one != two
    assert peaks.store(one, 100e9) == 100e9
    assert peaks.store(one, 60e9) == 100e9  # a probe under load reads low: the better one stays
    assert peaks.store(one, 150e9) == 150e9
    assert peaks.lookup(one)[0] == 150e9 and peaks.lookup(two) is None
    assert peaks.forget(one) and peaks.lookup(one) is None and not peaks.forget(one)
    (tmp_path / "peaks.json").write_text("{not json")
    assert peaks.lookup(one) is None  # a corrupt cache costs a probe, not the run


def _run(tmp_path, out):
    return CliRunner().invoke(main, ["run", "mnist", "-b", "lowpeak", "--inference-only", "--data", "synthetic",
                                     "--limit", "256", "--repeats", "1", "-o", str(out), "--no-plots"])


@pytest.mark.slow
def test_a_peak_shown_too_low_by_a_run_is_flagged_and_probed_again_next_run(tmp_path, monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "lowpeak", LOW)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    monkeypatch.setenv("BENCHBACKEND_CACHE", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    monkeypatch.setenv("LOW_PEAK_CALLS", str(calls))

    first = _run(tmp_path, tmp_path / "a.csv")
    assert first.exit_code == 0, first.output
    df = results.read(tmp_path / "a.csv")
    timed = df[df.phase == "inference"]
    assert (timed["mfu"] > 1).all() and set(timed["peak_source"]) == {"lowpeak GEMM probe"}
    assert timed["notes"].str.contains("above 100%: the peak .* is too low; the cached probe is dropped").all()
    assert first.output.count("is above 100%") == 1  # said once per cell on the terminal
    assert json.loads((tmp_path / "cache" / "peaks.json").read_text()) == {}

    second = _run(tmp_path, tmp_path / "b.csv")
    assert second.exit_code == 0, second.output
    assert calls.read_text().split() == ["fp32", "fp32"]  # measured again, not read from the cache
