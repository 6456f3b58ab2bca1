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


def _cells(n: int) -> list[plan.Cell]:
    w = workload.load("mnist")
    return [plan.Cell(w, plan.Choice("numpy", "reference", "fp32"), r, n, r - 1) for r in range(1, n + 1)]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_count_cells_and_estimate_the_time_left_from_finished_cells(clock: Clock) -> None:
    out = io.StringIO()
    shown = progress.PlainDisplay(out)
    cells = _cells(4)
    shown.begin(len(cells))
    for cell, seconds in zip(cells[:2], (10, 30)):
        shown.cell_started(cell)
        clock.now += seconds
        shown.cell_ended(cell, "ok")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[mnist/numpy:reference/fp32 r1/4] ok [1/4 cells, 0:10 elapsed, ~0:30 left]"
    assert lines[1] == "[mnist/numpy:reference/fp32 r2/4] ok [2/4 cells, 0:40 elapsed, ~0:40 left]"
    shown.skipped(1)  # a group turned out unavailable: its other cells will not run
    assert shown.status() == "2/3 cells, 0:40 elapsed, ~0:20 left"


def test_the_live_line_names_the_current_cell_and_epoch(clock: Clock) -> None:
    shown = progress.LiveDisplay(Tty())
    cells = _cells(2)
    shown.begin(2)
    try:
        shown.cell_started(cells[0])
        shown.epoch(cells[0], 2, 5)
        clock.now += 65
        assert shown._render().plain == "0/2 cells, 1:05 elapsed | [mnist/numpy:reference/fp32 r1/2] epoch 2/5"
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
