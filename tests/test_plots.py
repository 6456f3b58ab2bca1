"""Plots: the figures hold the expected series, failed backends are marked, files are written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from benchbackend import plots, results, stats
from benchbackend.errors import ResultsError

ROOT = Path(__file__).resolve().parent.parent
ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}
BACKENDS = {"numpy": (2.0, "ok"), "torch": (1.0, "ok"), "jax": (0.5, "nan_loss")}


def _write(path: Path, epochs: int = 5, repeats: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    w = results.CsvWriter(path)
    for backend, (steady, status) in BACKENDS.items():
        for rep in range(1, repeats + 1):
            base: dict[str, Any] = dict(ENV, run_id="r", workload="mnist", workload_hash="h", backend=backend,
                                        device="cpu", repeat=rep, status=status)
            for epoch in range(1, epochs + 1):
                loss = float("nan") if status == "nan_loss" and epoch > 2 else 2.0 / epoch + 0.05 * rng.random()
                seconds = steady * (1 + 0.05 * float(rng.standard_normal()))
                w.write(dict(base, phase="train_epoch", epoch=epoch, seconds=seconds, samples_per_s=100 / seconds,
                             loss=loss, val_accuracy=0.5 + 0.08 * epoch))
            for n in range(1, 5):
                w.write(dict(base, phase="inference", epoch=n, seconds=steady / 4 * (1 + 0.05 * rng.random())))
    w.write(dict(ENV, run_id="r", workload="mnist", backend="plaidml", device="cpu", repeat=1, phase="run",
                 status="crashed", message="RuntimeError: boom"))
    return results.read(path)


@pytest.fixture
def frame(tmp_path: Path) -> pd.DataFrame:
    return _write(tmp_path / "r.csv")


def _context(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple, str]]:
    groups = stats.summarize(df).groups
    return groups, dict(zip(groups.index, groups["status"]))


def test_figures_per_workload_and_device(frame: pd.DataFrame) -> None:
    stems = [stem for stem, _ in plots.figures(frame)]
    assert stems == ["mnist-cpu-epoch-time", "mnist-cpu-curves", "mnist-cpu-inference"]


def test_epoch_time_bars_with_intervals_and_failed_marked(frame: pd.DataFrame) -> None:
    groups, _ = _context(frame)
    fig = plots.epoch_time_figure(groups, "t")
    ax = fig.axes[0]
    from matplotlib.container import BarContainer

    bars = next(c for c in ax.containers if isinstance(c, BarContainer))
    assert len(bars) == len(groups) == 4  # jax, numpy, plaidml, torch
    heights = dict(zip(["jax", "numpy", "plaidml", "torch"], [b.get_height() for b in bars]))
    assert heights["numpy"] == pytest.approx(2.0, rel=0.1) and heights["torch"] == pytest.approx(1.0, rel=0.1)
    assert heights["plaidml"] == 0  # crashed: no time, but still on the axis with a note
    assert bars.errorbar is not None and bars.errorbar.lines[1]  # caps of the 95% intervals
    assert [b.get_hatch() for b in bars] == ["//", None, "//", None]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["jax\n[nan_loss]", "numpy", "plaidml\n[crashed]", "torch"]
    assert ax.get_xticklabels()[0].get_color() == plots.FAILED_COLOR
    assert "(s)" in ax.get_ylabel()
    assert any("no time" in t.get_text() for t in ax.texts)


def test_curves_have_one_series_per_backend_with_bands(frame: pd.DataFrame) -> None:
    _, statuses = _context(frame)
    train = frame[frame["phase"] == "train_epoch"]
    fig = plots.curves_figure(train, statuses, "t")
    loss_ax, acc_ax = fig.axes
    labelled = {ln.get_label(): ln for ln in loss_ax.lines if not ln.get_label().startswith("_")}
    assert set(labelled) == {"jax [nan_loss]", "numpy", "torch", "loss no longer finite"}
    assert labelled["jax [nan_loss]"].get_linestyle() == "--" and labelled["torch"].get_linestyle() == "-"
    assert list(labelled["numpy"].get_xdata()) == [1, 2, 3, 4, 5]
    assert len(acc_ax.lines) == 3 and len(loss_ax.collections) == len(acc_ax.collections) == 3  # bands
    assert acc_ax.get_ylabel() == "validation accuracy" and loss_ax.get_xlabel() == "epoch"
    assert fig.legends and fig.legends[0].get_texts()


def test_inference_boxes_per_backend(frame: pd.DataFrame) -> None:
    _, statuses = _context(frame)
    fig = plots.inference_figure(frame[frame["phase"] == "inference"], statuses, "t")
    ax = fig.axes[0]
    boxes = [p for p in ax.patches]
    assert len(boxes) == 4
    assert boxes[0].get_hatch() == "//" and boxes[1].get_hatch() is None
    assert len(ax.collections) == 3  # one strip of passes per backend with timings
    assert "(s)" in ax.get_ylabel()


def test_write_report_writes_pngs_and_index(frame: pd.DataFrame, tmp_path: Path) -> None:
    written = plots.write_report(frame, tmp_path / "out", summary_text="table <here>")
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 3 and written[-1].name == "index.html"
    for png in pngs:
        assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = written[-1].read_text()
    assert all(f'src="{p.name}"' in page for p in pngs) and "table &lt;here&gt;" in page


def test_compare_then_plots_puts_the_compare_table_in_the_report(frame: pd.DataFrame, tmp_path: Path) -> None:
    from benchbackend.compare import compare_frame

    page = plots.write_report(frame, tmp_path / "out", compare_frame(frame).table_text)[-1].read_text()
    assert "fastest correct" in page and "baseline: numpy" in page


def test_single_epoch_and_unwritable_folder(tmp_path: Path) -> None:
    df = _write(tmp_path / "one.csv", epochs=1, repeats=1)
    assert len(plots.write_report(df, tmp_path / "one", "")) == 4
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ResultsError, match="cannot write plots"):
        plots.write_report(df, blocker / "sub", "")


def test_importing_plots_does_not_import_matplotlib() -> None:
    code = "import sys; import benchbackend.plots; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
