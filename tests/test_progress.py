"""What a person sees while a run goes: counts, the current cell and epoch, elapsed and left time;
live on a terminal, plain lines in CI or a pipe, nothing with --quiet."""
from __future__ import annotations

import io

import pytest
from click.testing import CliRunner

from benchbackend.cli import main
from benchbackend.run import plan, progress
from benchbackend.spec import workload


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


def _cells(n: int, backend: str = "numpy", name: str = "mnist", first: int = 0) -> list[plan.Cell]:
    w = workload.load(name)
    return [plan.Cell(w, plan.Choice(backend, "reference", "fp32"), r, n, first + r - 1) for r in range(1, n + 1)]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_count_cells_and_estimate_the_time_left_from_finished_cells(clock: Clock) -> None:
    out = io.StringIO()
    shown = progress.PlainDisplay(out)
    cells = _cells(3)
    other = _cells(2, backend="torch", first=3)[0]  # a group of its own, which turns out unavailable
    shown.begin([*cells, other])
    for cell, seconds in zip(cells[:2], (10, 30)):
        shown.cell_started(cell)
        clock.now += seconds
        shown.cell_ended(cell, "ok")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[mnist/numpy:reference/fp32 r1/3] ok [1/4 cells, 0:10 elapsed, estimating time left]"
    shown.skipped(other.group)  # its cells will not run
    assert shown.status() == "2/3 cells, 0:40 elapsed, ~0:20 left"


def test_the_time_left_is_estimated_per_workload_and_backend(clock: Clock) -> None:
    """Quick mnist cells say nothing of cifar10's: until one of its kind has finished (or the
    running one has an epoch to project), the estimate says so instead of guessing."""
    shown = progress.Display()
    mnist, cifar = _cells(2), _cells(2, name="cifar10", first=2)
    epochs = cifar[0].workload.training.epochs
    shown.begin([*mnist, *cifar])
    for cell in mnist:
        shown.cell_started(cell)
        clock.now += 5
        shown.cell_ended(cell, "ok")
    assert shown.status() == "2/4 cells, 0:10 elapsed, estimating time left"
    shown.cell_started(cifar[0])
    clock.now += 30
    shown.epoch(cifar[0], 1, epochs)  # its first epoch: 30 s, so about 30 s an epoch for each cifar10 cell
    assert shown.left() == pytest.approx(30 * epochs - 30 + 30 * epochs)
    clock.now += 30 * epochs - 30
    shown.cell_ended(cifar[0], "ok")
    assert shown.left() == pytest.approx(30 * epochs)


def test_an_interrupted_run_shows_no_time_left(clock: Clock) -> None:
    out = Tty()
    shown = progress.LiveDisplay(out)
    cells = _cells(3)
    shown.begin(cells)
    shown.cell_started(cells[0])
    clock.now += 10
    shown.cell_ended(cells[0], "ok")
    shown.cell_started(cells[1])
    shown.interrupted()
    shown.cell_ended(cells[1], "interrupted")
    shown.close()
    assert out.getvalue().splitlines()[-1].endswith("stopped: 2/3 cells, 0:10 elapsed")


def test_the_live_line_names_the_current_cell_and_epoch(clock: Clock) -> None:
    shown = progress.LiveDisplay(Tty())
    cells = _cells(2)
    shown.begin(cells)
    try:
        shown.cell_started(cells[0])
        clock.now += 65
        shown.epoch(cells[0], 2, 5)
        assert shown._render().plain == ("0/2 cells, 1:05 elapsed, ~4:20 left | "
                                         "[mnist/numpy:reference/fp32 r1/2] epoch 2/5")
    finally:
        shown.close()


def test_a_terminal_gets_the_live_display_ci_and_pipes_plain_lines_and_quiet_nothing(monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert type(progress.display(stream=Tty())) is progress.LiveDisplay
    assert type(progress.display(stream=io.StringIO())) is progress.PlainDisplay
    monkeypatch.setenv("CI", "true")
    assert type(progress.display(stream=Tty())) is progress.PlainDisplay
    quiet = progress.display(quiet=True, stream=Tty())
    assert type(quiet) is progress.Display
    quiet.note("never shown")  # the quiet display writes nothing anywhere


def test_quiet_run_prints_the_summary_and_no_progress(tmp_path) -> None:
    result = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--inference-only", "--data", "synthetic",
                                       "--limit", "64", "--repeats", "1", "-o", str(tmp_path / "q.csv"),
                                       "--no-plots", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "starting worker" not in result.output and "cells," not in result.output
    assert "summary" in result.output and "numpy:reference/fp32" in result.output


def test_the_summary_says_a_cell_stopped_after_an_epoch_rather_than_having_one() -> None:
    from benchbackend.run.runner import CellResult

    cell = _cells(1)[0]
    epochs = cell.workload.training.epochs
    stopped = progress.summary_line(CellResult(cell, "cpu", "interrupted", "stopped by Ctrl-C", [1.5]))
    assert f"epoch n/a (stopped after epoch 1 of {epochs}, so no steady epoch time)" in stopped
    assert "only one epoch" not in stopped
    later = progress.summary_line(CellResult(cell, "cpu", "timeout", "past --timeout", [1.5, 1.0, 1.0]))
    assert f"epoch 1.000s (stopped after epoch 3 of {epochs})" in later
    whole = progress.summary_line(CellResult(cell, "cpu", "ok", "", [1.5] * epochs))
    assert "epoch 1.500s " in whole and "stopped" not in whole


def test_a_peak_search_summary_gives_its_peak_not_its_last_probe() -> None:
    # A cifar10 search read "probe 7 at 2964 QPS ... LoadGen INVALID" in the summary, its peak being 2,915.
    from benchbackend.run.runner import CellResult

    result = CellResult(_cells(1)[0], "cpu", "ok")
    probes = [(1, 1500.0, "valid"), (2, 3000.0, "invalid"), (3, 2250.0, "valid"), (4, 2900.0, "valid"),
              (5, 2964.0, "invalid")]
    for k, qps, valid in probes:
        row = {"phase": "scenario", "scenario": "server", "probe": k, "target_qps": qps, "loadgen_valid": valid,
               "latency_p50_ms": 0.5, "samples_per_s": qps}
        progress.keep_scenario_line(result, row, progress.scenario_line(row))
    assert "probe 4 at 2900 QPS" in result.scenario and "VALID" in result.scenario, result.scenario
    audited = CellResult(_cells(1)[0], "cpu", "ok")
    row = {"phase": "scenario", "scenario": "server", "probe": 1, "target_qps": 10.0, "loadgen_valid": "valid",
           "audit_sample": 3}
    progress.keep_scenario_line(audited, row, "first")
    progress.keep_scenario_line(audited, {**row, "probe": 2, "target_qps": 5.0, "loadgen_valid": "invalid",
                                          "audit_sample": None}, "second")
    assert audited.scenario == "second" and audited.peak_qps is None  # none valid yet: the last probe


def test_a_batchnorm_networks_second_parity_line_says_it_is_the_training_mode() -> None:
    """Issue 41 item 10: two unlabelled 'parity vs NumPy reference' lines."""
    w = workload.load("resnet8")
    row = {"phase": "parity", "parity_max_abs": 1e-7, "parity_max_rel": 2e-7}
    assert progress.row_line(row, w, []).startswith("parity vs NumPy reference: max abs")
    trained = progress.row_line(dict(row, notes="training mode (batch statistics)"), w, [])
    assert trained.startswith("parity vs NumPy reference (training mode (batch statistics)): max abs 1e-07")
