"""Plots: the figures hold the expected series, failed backends are marked, files are written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pytest

from benchbackend import plots, results, stats
from benchbackend.errors import ResultsError

ROOT = Path(__file__).resolve().parent.parent
ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}
BACKENDS = {"numpy": (2.0, "ok"), "torch": (1.0, "ok"), "jax": (0.5, "nan_loss")}


def _write(path: Path, epochs: int = 5, repeats: int = 3, backends: Optional[dict] = None,
           workload_hash: str = "h", samples: int = 100, same_curves: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    w = results.CsvWriter(path)
    for backend, (steady, status) in (backends or BACKENDS).items():
        for rep in range(1, repeats + 1):
            base: dict[str, Any] = dict(ENV, run_id="r", workload="mnist", workload_hash=workload_hash,
                                        backend=backend, backend_version="2.1", device="cpu", repeat=rep,
                                        status=status, threads=8, data_source="synthetic")
            for epoch in range(1, epochs + 1):
                noise = 0.0 if same_curves else 0.05 * rng.random()
                loss = float("nan") if status == "nan_loss" and epoch > 2 else 2.0 / epoch + noise
                seconds = steady * (1 + 0.05 * float(rng.standard_normal()))
                w.write(dict(base, phase="train_epoch", epoch=epoch, seconds=seconds, samples=samples,
                             samples_per_s=100 / seconds, loss=loss, val_accuracy=0.5 + 0.08 * epoch))
            for n in range(1, 5):
                w.write(dict(base, phase="inference", epoch=n, samples=500,
                             seconds=steady / 4 * (1 + 0.05 * rng.random())))
    w.write(dict(ENV, run_id="r", workload="mnist", backend="plaidml", device="cpu", repeat=1, phase="run",
                 status="crashed", message="RuntimeError: boom"))
    return results.read(path)


@pytest.fixture
def frame(tmp_path: Path) -> pd.DataFrame:
    return _write(tmp_path / "r.csv")


def _context(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple, str]]:
    groups = stats.summarize(df).groups
    return groups, dict(zip(groups.index, groups["status"]))


def test_figures_per_experiment_and_device(frame: pd.DataFrame) -> None:
    stems = [stem for stem, _ in plots.figures(frame)]
    assert stems == ["mnist-cpu-epoch-time", "mnist-cpu-throughput", "mnist-cpu-curves", "mnist-cpu-inference"]


def test_definitions_get_figures_of_their_own(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.csv", workload_hash="h1", samples=1024)
    b = _write(tmp_path / "b.csv", workload_hash="h2", samples=2000)
    stems = [stem for stem, _ in plots.figures(pd.concat([a, b], ignore_index=True))]
    assert "mnist-limit-1024-cpu-epoch-time" in stems and "mnist-limit-2000-cpu-epoch-time" in stems


def _bars(ax: Any) -> Any:
    from matplotlib.container import BarContainer

    return next(c for c in ax.containers if isinstance(c, BarContainer))


def test_epoch_time_bars_with_intervals_and_failed_marked(frame: pd.DataFrame) -> None:
    groups, _ = _context(frame)
    fig = plots.epoch_time_figure(groups, "t")
    ax = fig.axes[0]
    bars = _bars(ax)
    assert len(bars) == len(groups) == 4  # jax, numpy, plaidml, torch
    heights = dict(zip(["jax", "numpy", "plaidml", "torch"], [b.get_height() for b in bars]))
    assert heights["numpy"] == pytest.approx(2.0, rel=0.1) and heights["torch"] == pytest.approx(1.0, rel=0.1)
    assert heights["plaidml"] == 0  # crashed: no time, but still on the axis with a note
    assert bars.errorbar is not None and bars.errorbar.lines[1]  # caps of the intervals
    assert [b.get_hatch() for b in bars] == ["//", None, "//", None]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["jax\n[nan_loss]", "numpy", "plaidml\n[crashed]", "torch"]
    assert ax.get_xticklabels()[0].get_color() == plots.FAILED_COLOR
    assert "(s)" in ax.get_ylabel()
    assert any("no time" in t.get_text() for t in ax.texts)
    # 3 repeats: the bars are a range, not a "95% CI"
    assert "bars: min-max of the repeats" in ax.get_title() and "CI" not in ax.get_title()


def test_value_labels_sit_above_the_error_bars(frame: pd.DataFrame) -> None:
    groups, _ = _context(frame)
    ax = plots.epoch_time_figure(groups, "t").axes[0]
    tops = dict(zip(groups.index, groups["steady_high"]))
    labels = [t for t in ax.texts if t.get_text().endswith(" s")]
    assert len(labels) == 3
    for text, key in zip(labels, [k for k in groups.index if np.isfinite(tops[k])]):
        assert text.xy[1] >= tops[key] - 1e-12  # anchored at the top of the error bar, not on it


def test_titles_fit_in_the_figure(frame: pd.DataFrame) -> None:
    long = "mnist (limit 1024, epochs 3, def abcdef) on a-very-long-device-name:0"
    groups, _ = _context(frame)
    for fig in (plots.epoch_time_figure(groups, long), plots.throughput_figure(groups, long)):
        fig.canvas.draw()
        title = fig.axes[0].title.get_window_extent()
        width = fig.get_size_inches()[0] * fig.dpi
        assert title.x0 >= 0 and title.x1 <= width, fig.axes[0].get_title()


def test_throughput_figure_is_samples_per_second(frame: pd.DataFrame) -> None:
    groups, _ = _context(frame)
    ax = plots.throughput_figure(groups, "t").axes[0]
    heights = dict(zip(["jax", "numpy", "plaidml", "torch"], [b.get_height() for b in _bars(ax)]))
    assert heights["torch"] == pytest.approx(100.0, rel=0.1) and heights["numpy"] == pytest.approx(50.0, rel=0.1)
    assert "samples/s" in ax.get_ylabel()


def test_curves_have_one_style_per_backend_and_failed_are_dotted(frame: pd.DataFrame) -> None:
    _, statuses = _context(frame)
    train = frame[frame["phase"] == "train_epoch"]
    fig = plots.curves_figure(train, statuses, "t")
    loss_ax, acc_ax = fig.axes
    labelled = {ln.get_label(): ln for ln in loss_ax.lines if not ln.get_label().startswith("_")}
    assert set(labelled) == {"jax [nan_loss]", "numpy", "torch", "loss no longer finite"}
    assert labelled["jax [nan_loss]"].get_linestyle() == ":"
    assert labelled["numpy"].get_linestyle() != labelled["torch"].get_linestyle()
    assert len({labelled[n].get_marker() for n in ("jax [nan_loss]", "numpy", "torch")}) == 3
    assert list(labelled["numpy"].get_xdata()) == [1, 2, 3, 4, 5]
    assert len(acc_ax.lines) == 3 and len(loss_ax.collections) == len(acc_ax.collections) == 3  # bands
    assert acc_ax.get_ylabel() == "validation accuracy" and loss_ax.get_xlabel() == "epoch"
    assert fig.legends and fig.legends[0].get_texts()


def test_identical_curves_stay_visible(tmp_path: Path) -> None:
    """Two backends that agree exactly draw the same curve: marker, size and line style differ,
    so the one underneath still shows."""
    df = _write(tmp_path / "same.csv", backends={"numpy": (1.0, "ok"), "torch": (1.0, "ok")}, same_curves=True)
    _, statuses = _context(df)
    loss_ax = plots.curves_figure(df[df["phase"] == "train_epoch"], statuses, "t").axes[0]
    a, b = [ln for ln in loss_ax.lines if not ln.get_label().startswith("_")]
    assert list(a.get_ydata()) == list(b.get_ydata())
    assert (a.get_marker(), a.get_linestyle(), a.get_markersize()) != (b.get_marker(), b.get_linestyle(),
                                                                        b.get_markersize())
    assert a.get_markerfacecolor() == "none" and b.get_markerfacecolor() == "none"


def test_inference_boxes_per_backend(frame: pd.DataFrame) -> None:
    _, statuses = _context(frame)
    fig = plots.inference_figure(frame[frame["phase"] == "inference"], statuses, "t", samples=500)
    ax = fig.axes[0]
    boxes = [p for p in ax.patches]
    assert len(boxes) == 4
    assert boxes[0].get_hatch() == "//" and boxes[1].get_hatch() is None
    assert len(ax.collections) == 3  # one strip of passes per backend with timings
    assert "(s)" not in ax.get_ylabel() and "500 samples" in ax.get_ylabel() and "500 samples" in ax.get_title()
    firsts = [t.get_text() for t in ax.texts if t.get_text().startswith("1st pass")]
    assert len(firsts) == 3
    # The strip holds the passes after the first: 3 of 4 per repeat, 3 repeats.
    assert all(len(c.get_offsets()) == 9 for c in ax.collections)


def test_write_report_writes_pngs_and_index(frame: pd.DataFrame, tmp_path: Path) -> None:
    written = plots.write_report(frame, tmp_path / "out", summary_text="table <here>",
                                 warnings=["workload 'mnist' has 2 definitions"])
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 4 and written[-1].name == "index.html"
    for png in pngs:
        assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = written[-1].read_text()
    assert all(f'src="{p.name}"' in page for p in pngs) and "table &lt;here&gt;" in page
    assert "<h2>Warnings</h2>" in page and "workload &#x27;mnist&#x27; has 2 definitions" in page
    env = page.split("<h2>Environment</h2>")[1]
    for needed in ("<th>version</th>", "<th>host</th>", "<th>CPU</th>", "<th>threads</th>",
                   "<td>bench-1</td>", "<td>Xeon x16</td>", "<td>8</td>", "<td>2.1</td>"):
        assert needed in env, needed


def test_compare_then_plots_puts_the_compare_table_and_warnings_in_the_report(tmp_path: Path) -> None:
    from benchbackend.compare import run_compare

    a = _write(tmp_path / "a.csv", workload_hash="h1", samples=1024)
    b = _write(tmp_path / "b.csv", workload_hash="h2", samples=2000)
    out = run_compare([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert a is not None and b is not None
    page = plots.write_report(out.frame, tmp_path / "out", out.table_text, out.warnings)[-1].read_text()
    assert "fastest correct" in page and "baseline: torch" in page
    assert "mnist (limit 1024)" in page and "2 different definitions" in page and "RuntimeError: boom" in page


def test_single_epoch_and_unwritable_folder(tmp_path: Path) -> None:
    df = _write(tmp_path / "one.csv", epochs=1, repeats=1)
    assert len(plots.write_report(df, tmp_path / "one", "")) == 5
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ResultsError, match="cannot write plots"):
        plots.write_report(df, blocker / "sub", "")


def test_importing_plots_does_not_import_matplotlib() -> None:
    code = "import sys; import benchbackend.plots; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
