"""Compile time apart (issue 40, item 3): ``compile_s`` and ``first_result_s`` from the worker to
the CSV and into compare, which shows them beside the steady times and ranks on either.

The cells run in this process on simulated devices (``support.lazy_backend``) with the worker's
clock virtual: ``compiling`` compiles each shape once for ``COMPILE_SECONDS``, ``syncdev`` does
not, and both take ``DEVICE_SECONDS`` a step; so the compile times compare exactly.
"""
from __future__ import annotations

import pytest
from click.testing import CliRunner
from support import inprocess, lazy_backend
from support.lazy_backend import COMPILE_SECONDS

from benchbackend import results
from benchbackend.analysis import compare
from benchbackend.backends import registry as backends
from benchbackend.cli import main
from benchbackend.errors import ResultsError
from benchbackend.run import machine, timing


def _spec(name: str, cls: str) -> backends.BackendSpec:
    return backends.BackendSpec(name, f"support.lazy_backend:{cls}", ("numpy",), "numpy", "(test only)",
                                "the NumPy reference on a simulated device", modes=(backends.Mode("reference", ""),))


@pytest.fixture
def measured(tmp_path, monkeypatch):
    clock = lazy_backend.VirtualClock()
    monkeypatch.setattr(lazy_backend, "CLOCK", clock)
    monkeypatch.setattr(timing, "clock", clock)
    inprocess.use(monkeypatch)
    # The regions' seconds are virtual, the machine's readings real: no share of them is meaningful here.
    monkeypatch.setattr(machine, "foreign_share", lambda *args, **kwargs: 0.0)
    monkeypatch.setitem(backends.BACKENDS, "compiling", _spec("compiling", "CompilingDevice"))
    monkeypatch.setitem(backends.BACKENDS, "syncdev", _spec("syncdev", "SyncDevice"))
    out = tmp_path / "compile.csv"
    r = CliRunner().invoke(main, ["run", "mnist", "-b", "syncdev", "-b", "compiling", "--data", "synthetic",
                                  "--limit", "256", "--epochs", "2", "--repeats", "2", "-o", str(out), "--no-plots",
                                  "-q"])
    assert r.exit_code in (0, 1), r.output[-3000:]  # 64 samples may leave accuracy unjudged: timings stand
    return out


@pytest.mark.slow
def test_the_csv_and_compare_hold_compile_time_and_rank_on_it(measured):
    df = results.read(measured)
    second = df[(df["phase"] == "train_epoch") & (df["epoch"] == 2)].set_index("backend")
    assert second.loc["compiling", "compile_s"].tolist() == pytest.approx([COMPILE_SECONDS] * 2)
    assert second.loc["syncdev", "compile_s"].tolist() == pytest.approx([0.0] * 2)
    assert (second["first_result_s"] > 0).all()
    assert df.loc[(df["phase"] == "train_epoch") & (df["epoch"] == 1), "compile_s"].isna().all()

    out = compare.run_compare([str(measured)], metric="compile-time")
    groups = out.groups.reset_index().set_index("backend")
    assert groups.loc["compiling", "compile_s"] == pytest.approx(COMPILE_SECONDS)
    assert groups.loc["compiling", "infer_compile_s"] == pytest.approx(COMPILE_SECONDS)
    training = out.text.split("\nTraining\n")[1].split("\nInference\n")[0]
    assert "compile s" in training.splitlines()[0] and "1st result s" in training.splitlines()[0]
    assert "Ranked on compile time" in out.text
    fastest = [ln for ln in out.text.splitlines() if ln.startswith("fastest correct")]
    assert fastest and "compile time syncdev" in fastest[0] and "inference compile time syncdev" in fastest[0]
    assert "fastest correct (*): training syncdev" not in out.text  # not the steady epoch's ranking
    first = compare.run_compare([str(measured)], metric="first-result")
    assert "Ranked on time to first result" in first.text and "time to first result" in first.text
    with pytest.raises(ResultsError, match="compile-time, first-result"):
        compare.run_compare([str(measured)], metric="compile")
