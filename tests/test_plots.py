"""Plots: the figures hold the expected series, failed backends are marked, files are written.

Over 400 lines: one test per figure and per thing a figure must show (verdict, baseline, colours,
labels), sharing the context builder below.
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import pytest

from benchbackend import results
from benchbackend.analysis import compare, experiments, plots, report, summary
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
                w.write(dict(base, phase="inference", **{"pass": n}, samples=500,
                             seconds=steady / 4 * (1 + 0.05 * rng.random())))
    w.write(dict(ENV, run_id="r", workload="mnist", backend="plaidml", device="cpu", repeat=1, phase="run",
                 status="crashed", message="RuntimeError: boom"))
    return results.read(path)


@pytest.fixture
def frame(tmp_path: Path) -> pd.DataFrame:
    return _write(tmp_path / "r.csv")


def _context(df: pd.DataFrame, baseline: Optional[str] = None) -> pd.DataFrame:
    """The groups as the figures get them: compare's ranking (verdicts against the baseline)."""
    return compare.rank(summary.summarize(df), baseline)[0].sort_index()


def _figures(df: pd.DataFrame, baseline: Optional[str] = None) -> dict[str, Any]:
    return {d.stem: d.figure for d in report.figures(df, baseline)}


def test_figures_per_experiment_and_device(frame: pd.DataFrame) -> None:
    stems = list(_figures(frame))
    assert stems == ["mnist-cpu-epoch-time", "mnist-cpu-throughput", "mnist-cpu-curves", "mnist-cpu-inference"]


def test_definitions_get_figures_of_their_own(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.csv", workload_hash="h1", samples=1024)
    b = _write(tmp_path / "b.csv", workload_hash="h2", samples=2000)
    stems = list(_figures(pd.concat([a, b], ignore_index=True)))
    assert "mnist-limit-1024-cpu-epoch-time" in stems and "mnist-limit-2000-cpu-epoch-time" in stems


def _bars(ax: Any) -> Any:
    from matplotlib.container import BarContainer

    return next(c for c in ax.containers if isinstance(c, BarContainer))


def test_epoch_time_bars_with_intervals_and_failed_marked(frame: pd.DataFrame) -> None:
    groups = _context(frame)
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
    assert ticks[0] == "jax\n[nan_loss]" and ticks[2] == "plaidml\n[crashed]"  # not ranked: the status says why
    assert ticks[1].startswith("numpy\nslower\n") and ticks[3] == "torch\nbaseline"
    assert ax.get_xticklabels()[0].get_color() == plots.FAILED_COLOR
    assert "(s)" in ax.get_ylabel()
    assert any("no time" in t.get_text() for t in ax.texts)
    # 3 repeats: the bars are a range, not a "95% CI"
    assert "bars: min-max of the repeats" in ax.get_title() and "CI" not in ax.get_title()


def test_value_labels_sit_above_the_error_bars(frame: pd.DataFrame) -> None:
    groups = _context(frame)
    ax = plots.epoch_time_figure(groups, "t").axes[0]
    tops = dict(zip(groups.index, groups["steady_high"]))
    labels = [t for t in ax.texts if t.get_text().endswith(" s")]
    assert len(labels) == 3
    for text, key in zip(labels, [k for k in groups.index if np.isfinite(tops[k])]):
        assert text.xy[1] >= tops[key] - 1e-12  # anchored at the top of the error bar, not on it


def test_titles_fit_in_the_figure(frame: pd.DataFrame) -> None:
    long = "mnist (limit 1024, epochs 3, def abcdef) on a-very-long-device-name:0"
    groups = _context(frame)
    for fig in (plots.epoch_time_figure(groups, long), plots.throughput_figure(groups, long)):
        fig.canvas.draw()
        title = fig.axes[0].title.get_window_extent()
        width = fig.get_size_inches()[0] * fig.dpi
        assert title.x0 >= 0 and title.x1 <= width, fig.axes[0].get_title()


def test_throughput_figure_is_samples_per_second(frame: pd.DataFrame) -> None:
    groups = _context(frame)
    ax = plots.throughput_figure(groups, "t").axes[0]
    heights = dict(zip(["jax", "numpy", "plaidml", "torch"], [b.get_height() for b in _bars(ax)]))
    assert heights["torch"] == pytest.approx(100.0, rel=0.1) and heights["numpy"] == pytest.approx(50.0, rel=0.1)
    assert "samples/s" in ax.get_ylabel()


def test_curves_have_one_style_per_backend_and_failed_are_dotted(frame: pd.DataFrame) -> None:
    groups = _context(frame)
    train = frame[frame["phase"] == "train_epoch"]
    fig = plots.curves_figure(train, groups, "t")
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
    groups = _context(df)
    loss_ax = plots.curves_figure(df[df["phase"] == "train_epoch"], groups, "t").axes[0]
    a, b = [ln for ln in loss_ax.lines if not ln.get_label().startswith("_")]
    assert list(a.get_ydata()) == list(b.get_ydata())
    assert (a.get_marker(), a.get_linestyle(), a.get_markersize()) != (b.get_marker(), b.get_linestyle(),
                                                                        b.get_markersize())
    assert a.get_markerfacecolor() == "none" and b.get_markerfacecolor() == "none"


def test_inference_boxes_per_backend(frame: pd.DataFrame) -> None:
    groups = _context(frame)
    fig = plots.inference_figure(frame[frame["phase"] == "inference"], groups, "t", samples=500)
    ax = fig.axes[0]
    boxes = [p for p in ax.patches]
    assert len(boxes) == 4
    assert boxes[0].get_hatch() == "//" and boxes[1].get_hatch() is None
    assert len(ax.collections) == 3  # one strip of passes per backend with timings
    assert "(s)" not in ax.get_ylabel() and "500 samples" in ax.get_ylabel() and "500 samples" in ax.get_title()
    # The first pass sits under its own box, in its tick label, not somewhere above the boxes.
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert [("1st pass" in t) for t in ticks] == [True, True, False, True]  # plaidml crashed: no pass
    assert not any("1st pass" in t.get_text() for t in ax.texts)
    # The strip holds the passes after the first: 3 of 4 per repeat, 3 repeats.
    assert all(len(c.get_offsets()) == 9 for c in ax.collections)


def test_write_report_writes_pngs_and_index(frame: pd.DataFrame, tmp_path: Path) -> None:
    written = report.write_report(frame, tmp_path / "out", warnings=["workload 'mnist' has 2 definitions"])
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == 4 and written[-1].name == "index.html"
    for png in pngs:
        assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = written[-1].read_text()
    assert all(f'src="{p.name}"' in page for p in pngs)
    assert "<h2>Warnings</h2>" in page and "workload &#x27;mnist&#x27; has 2 definitions" in page
    env = page.split("<h2>Environment</h2>")[1]
    for needed in ("<th>version</th>", "<th>host</th>", "<th>CPU</th>", "<th>threads</th>",
                   "<td>bench-1</td>", "<td>Xeon x16</td>", "<td>8</td>", "<td>2.1</td>"):
        assert needed in env, needed


def test_compare_then_plots_puts_the_compare_table_and_warnings_in_the_report(tmp_path: Path) -> None:
    from benchbackend.analysis.compare import run_compare

    a = _write(tmp_path / "a.csv", workload_hash="h1", samples=1024)
    b = _write(tmp_path / "b.csv", workload_hash="h2", samples=2000)
    out = run_compare([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert a is not None and b is not None
    page = report.write_report(out.frame, tmp_path / "out", out.table_text, out.warnings)[-1].read_text()
    assert "fastest correct" in page and "baseline: torch" in page
    assert "mnist (limit 1024)" in page and "2 different definitions" in page and "RuntimeError: boom" in page


def test_single_epoch_and_unwritable_folder(tmp_path: Path) -> None:
    df = _write(tmp_path / "one.csv", epochs=1, repeats=1)
    assert len(report.write_report(df, tmp_path / "one", "")) == 5
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ResultsError, match="cannot write plots"):
        report.write_report(df, blocker / "sub", "")


def test_importing_plots_does_not_import_matplotlib() -> None:
    code = "import sys; import benchbackend.analysis.plots; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


# --- batch-size sweeps and MFU (issue 13) ----------------------------------------------------------

SWEEP = {"numpy": 1000.0, "torch": 4000.0}
PEAK = 0.4e12
FLOPS = 2e6  # forward FLOPs per sample


def _sweep(path: Path, batches: tuple[int, ...] = (16, 32, 64, 128), rates: Optional[dict] = None,
           peaks: Optional[dict] = None, failed: Optional[dict] = None, limit: int = 512) -> pd.DataFrame:
    """A ``--batch-size`` sweep as the runner writes it: one definition per batch size; samples/s
    grows with the batch as rate * sqrt(batch / 16); achieved_flops and mfu as the runner computes
    them (training 3x the forward FLOPs). ``failed`` = {(backend, batch): status}."""
    rng = np.random.default_rng(1)
    w = results.CsvWriter(path)
    for batch in batches:
        for backend, rate in (rates or SWEEP).items():
            peak = (peaks or {}).get(backend, PEAK)
            status = (failed or {}).get((backend, batch), "ok")
            for rep in range(1, 4):
                base: dict[str, Any] = dict(
                    ENV, run_id="r", workload="mnist", workload_hash=f"h{batch}-{limit}", backend=backend,
                    backend_version="2.1", device="cpu", repeat=rep, status=status, threads=8,
                    data_source="synthetic", flops_per_sample=FLOPS, peak_flops=peak, peak_source="--peak-tflops",
                    precision="fp32", definition=f"train={limit} val=256 test=256 epochs=3 batch={batch} "
                                                 f"infer_batch={batch} seed=0 data=synthetic")
                speed = rate * math.sqrt(batch / 16)
                for epoch in range(1, 4):
                    sps = speed * (1 + 0.03 * float(rng.standard_normal()))
                    w.write(dict(base, phase="train_epoch", epoch=epoch, samples=limit, seconds=limit / sps,
                                 samples_per_s=sps, loss=2.0 / epoch, val_accuracy=0.5 + 0.1 * epoch,
                                 achieved_flops=3 * FLOPS * sps, mfu=3 * FLOPS * sps / peak))
                for n in range(1, 4):
                    sps = 4 * speed * (1 + 0.03 * float(rng.standard_normal()))
                    w.write(dict(base, phase="inference", **{"pass": n}, samples=256, seconds=256 / sps,
                                 samples_per_s=sps, achieved_flops=FLOPS * sps, mfu=FLOPS * sps / peak))
    return experiments.for_comparison(results.read(path))


def _curves(ax: Any) -> dict[str, Any]:
    """The data line of each labelled error-bar series, by label."""
    from matplotlib.container import ErrorbarContainer

    return {c.get_label(): c.lines[0] for c in ax.containers if isinstance(c, ErrorbarContainer)}


def test_batch_sweep_draws_throughput_against_batch_size(tmp_path: Path) -> None:
    df = _sweep(tmp_path / "s.csv")
    figs = _figures(df)
    assert {"mnist-cpu-batch-train", "mnist-cpu-batch-inference"} <= set(figs)
    groups = summary.summarize(df).groups
    ax = figs["mnist-cpu-batch-train"].axes[0]
    assert ax.get_xlabel() == "training batch size" and "samples/s" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "32", "64", "128"]
    assert ax.get_xscale() == "log"
    # one line per backend; its points are the groups' median samples/s, in batch order
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["numpy", "torch"]
    curves = _curves(ax)
    assert set(curves) == {"numpy", "torch"}
    for backend, line in curves.items():
        expected = [groups.xs(backend, level="backend")["samples_per_s"][groups.xs(backend, level="backend")[
            "definition"].str.contains(f" batch={b} ")].iloc[0] for b in (16, 32, 64, 128)]
        assert list(line.get_xdata()) == [16, 32, 64, 128]
        assert np.allclose(line.get_ydata(), expected)
    assert len({(ln.get_marker(), ln.get_linestyle()) for ln in curves.values()}) == 2
    infer = figs["mnist-cpu-batch-inference"].axes[0]
    assert infer.get_xlabel() == "inference batch size"
    top = max(max(ln.get_ydata()) for ln in _curves(infer).values())
    assert top > 4 * 4000  # inference samples/s, not training's


def test_one_peak_gives_an_mfu_axis_that_reads_the_mfu(tmp_path: Path) -> None:
    df = _sweep(tmp_path / "s.csv")
    groups = summary.summarize(df).groups
    figs = _figures(df)
    ax = figs["mnist-cpu-batch-train"].axes[0]
    (mfu_axis,) = ax.child_axes
    assert "MFU (%)" in mfu_axis.get_ylabel() and "0.4 TFLOP/s fp32 (--peak-tflops)" in mfu_axis.get_ylabel()
    factor, peak = plots.mfu_scale(groups, "samples_per_s", "mfu")
    assert factor == pytest.approx(3 * FLOPS / PEAK)  # MFU per sample/s: 3x forward FLOPs over the peak
    row = groups.iloc[0]
    assert row["samples_per_s"] * factor == pytest.approx(row["mfu"])
    assert not any(t.get_text().endswith("%") for t in ax.texts)


def test_different_peaks_label_each_point_with_its_mfu(tmp_path: Path) -> None:
    df = _sweep(tmp_path / "s.csv", peaks={"torch": 0.8e12})
    groups = summary.summarize(df).groups
    assert plots.mfu_scale(groups, "samples_per_s", "mfu") is None
    ax = _figures(df)["mnist-cpu-batch-train"].axes[0]
    assert not ax.child_axes
    labels = sorted(t.get_text() for t in ax.texts if t.get_text().endswith("%"))
    expected = sorted(f"{m * 100:#.3g}%" for m in groups["mfu"])
    assert labels == expected and len(labels) == 8
    assert "labels: MFU" in ax.get_title()


def test_a_failed_batch_size_is_marked_off_the_line(tmp_path: Path) -> None:
    df = _sweep(tmp_path / "s.csv", failed={("torch", 64): "nan_loss"})
    ax = _figures(df)["mnist-cpu-batch-train"].axes[0]
    torch_line = _curves(ax)["torch"]
    ys = np.asarray(torch_line.get_ydata(), dtype=float)
    assert list(torch_line.get_xdata()) == [16, 32, 64, 128]
    assert list(np.isfinite(ys)) == [True, True, False, True]  # the line breaks there
    crosses = [ln for ln in ax.lines if ln.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [64]
    assert crosses[0].get_color() == plots.FAILED_COLOR
    assert any(t.get_text() == "torch\n[nan_loss]" for t in ax.texts)


def test_no_sweep_no_batch_figure_and_sweeps_of_other_definitions_apart(tmp_path: Path) -> None:
    single = _sweep(tmp_path / "one.csv", batches=(32,))
    assert not any("batch" in stem for stem in _figures(single))
    a = _sweep(tmp_path / "a.csv", batches=(32, 64), limit=512)
    b = _sweep(tmp_path / "b.csv", batches=(32, 64), limit=1024)
    both = experiments.for_comparison(pd.concat([a, b], ignore_index=True).drop(columns="experiment"))
    figs = _figures(both)
    sweeps = sorted(stem for stem in figs if stem.startswith("mnist-cpu-batch"))
    assert sweeps == ["mnist-cpu-batch-1-inference", "mnist-cpu-batch-1-train",
                      "mnist-cpu-batch-2-inference", "mnist-cpu-batch-2-train"]
    titles = [figs[s].axes[0].get_title().replace("\n", " ") for s in sweeps if s.endswith("train")]
    assert "limit 1024" in titles[0] and "limit 512" in titles[1]


def test_throughput_bars_carry_their_mfu(tmp_path: Path) -> None:
    df = _sweep(tmp_path / "s.csv", batches=(32,))
    groups = summary.summarize(df).groups
    ax = plots.throughput_figure(groups, "t").axes[0]
    texts = [t.get_text() for t in ax.texts]
    for mfu in groups["mfu"]:
        assert any(t.endswith(f"MFU {mfu * 100:#.3g}%") for t in texts), texts
    assert len(ax.child_axes) == 1 and "MFU (%)" in ax.child_axes[0].get_ylabel()


# --- the verdict on the figures, colours by group, nothing cut off (issue 24) -----------------------

def _ticks(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def _face(ax: Any, label: str) -> Any:
    """The face colour of the bar whose tick label starts with ``label``."""
    from matplotlib.colors import to_hex

    bars = _bars(ax)
    return next(to_hex(b.get_facecolor()) for b, t in zip(bars, _ticks(ax)) if t.split("\n")[0] == label)


def test_a_backend_has_one_colour_in_every_report(tmp_path: Path) -> None:
    """The colour follows the group (backend, mode, precision), not its position among the bars nor
    its printed label: torch eager is "torch" alone and "torch:eager" beside torch:compile."""
    a = _write(tmp_path / "a.csv", backends={"numpy": (2.0, "ok"), "torch": (1.0, "ok")})
    path = tmp_path / "b.csv"
    w = results.CsvWriter(path)
    for backend, mode, steady in (("jax", "jit", 0.4), ("tensorflow", "xla", 0.6), ("torch", "eager", 1.0),
                                  ("torch", "compile", 0.8)):
        for rep in (1, 2, 3):
            base = dict(ENV, run_id="r", workload="mnist", workload_hash="h", backend=backend, mode=mode,
                        device="cpu", repeat=rep, status="ok", threads=8, data_source="synthetic")
            for epoch in (1, 2, 3):
                w.write(dict(base, phase="train_epoch", epoch=epoch, seconds=steady * (1 + 0.01 * rep), samples=100,
                             samples_per_s=100 / steady, loss=1.0 / epoch, val_accuracy=0.9))
    b = results.read(path)
    fig_a = _figures(a)["mnist-cpu-epoch-time"].axes[0]
    fig_b = _figures(b)["mnist-cpu-epoch-time"].axes[0]
    assert "torch" in [t.split("\n")[0] for t in _ticks(fig_a)]
    assert "torch:eager" in [t.split("\n")[0] for t in _ticks(fig_b)]
    assert _face(fig_a, "torch") == _face(fig_b, "torch:eager")
    faces_b = [_face(fig_b, name) for name in ("jax", "tensorflow", "torch:eager", "torch:compile")]
    assert len(set(faces_b)) == 4


def test_every_registered_backend_mode_and_precision_has_its_own_colour() -> None:
    from benchbackend.analysis.style import FAILED_COLOR, FAILED_FACE, color_of
    from benchbackend.backends import registry

    combos = [(name, mode, prec) for name, spec in registry.BACKENDS.items()
              for mode in spec.mode_names for prec in spec.precisions]
    shades = [color_of(*c) for c in combos]
    assert len(set(shades)) == len(combos)
    assert FAILED_COLOR not in shades and FAILED_FACE not in shades
    defaults = [color_of(name, spec.mode_names[0], "fp32") for name, spec in registry.BACKENDS.items()]
    assert len(set(defaults)) == len(defaults)
    assert color_of("torch", "", "") == color_of("torch", "eager", "fp32")  # unrecorded mode: the default


def _verdict_of(groups: pd.DataFrame, label: str, prefix: str) -> str:
    row = groups[groups["label"] == label].iloc[0]
    return str(row[f"{prefix}_text"])


def test_bar_figures_carry_the_baseline_and_compares_verdicts(frame: pd.DataFrame) -> None:
    groups = _context(frame)
    figs = _figures(frame)
    for stem, prefix, value in (("mnist-cpu-epoch-time", "train", "steady_s"), ("mnist-cpu-throughput", "train", None),
                                ("mnist-cpu-inference", "infer", "infer_s")):
        ax = figs[stem].axes[0]
        ticks = {t.split("\n")[0]: t for t in _ticks(ax)}
        verdict = _verdict_of(groups, "numpy", prefix)
        assert verdict.startswith("slower: ")
        assert verdict.replace(": ", "\n", 1) in ticks["numpy"], (stem, ticks)  # verdict and interval
        assert ticks["torch"].endswith("\nbaseline")
        bold = [t.get_fontweight() for t in ax.get_xticklabels() if t.get_text().startswith("torch")]
        assert bold == ["bold"]
        lines = [ln for ln in ax.lines if ln.get_gid() == plots.BASELINE_GID]
        if value is not None:
            assert len(lines) == 1
            assert lines[0].get_ydata()[0] == pytest.approx(groups[groups["label"] == "torch"][value].iloc[0])
        assert "vs torch" in ax.get_title()


def test_a_not_significant_difference_says_so_on_the_figure(tmp_path: Path) -> None:
    """Bars of visibly different height whose verdict is "not significant" say it, with the interval."""
    path = tmp_path / "noisy.csv"
    w = results.CsvWriter(path)
    times = {"torch": [1.0, 2.0, 3.0], "tensorflow": [0.8, 1.5, 2.9]}
    for backend, per_rep in times.items():
        for rep, steady in enumerate(per_rep, 1):
            base = dict(ENV, run_id="r", workload="mnist", workload_hash="h", backend=backend, device="cpu",
                        repeat=rep, status="ok", threads=8, data_source="synthetic")
            for epoch in (1, 2, 3):
                w.write(dict(base, phase="train_epoch", epoch=epoch, seconds=steady, samples=100,
                             samples_per_s=100 / steady, loss=1.0 / epoch, val_accuracy=0.9))
    df = results.read(path)
    groups = _context(df)
    verdict = _verdict_of(groups, "tensorflow", "train")
    assert verdict.startswith("not significant: ") and "[" in verdict
    ax = _figures(df)["mnist-cpu-epoch-time"].axes[0]
    tick = next(t for t in _ticks(ax) if t.startswith("tensorflow"))
    assert tick == "tensorflow\n" + verdict.replace(": ", "\n", 1)


def test_the_baseline_asked_for_is_the_one_marked(frame: pd.DataFrame) -> None:
    ax = _figures(frame, baseline="numpy")["mnist-cpu-epoch-time"].axes[0]
    ticks = {t.split("\n")[0]: t for t in _ticks(ax)}
    assert ticks["numpy"] == "numpy\nbaseline" and ticks["torch"].startswith("torch\nfaster\n")
    assert "vs numpy" in ax.get_title()
    with pytest.raises(ResultsError, match="unknown baseline"):
        report.figures(frame, baseline="tensorflow")


def _outside(fig: Any) -> list[str]:
    """The texts of a figure that do not lie wholly inside it once drawn (tick labels of ticks out
    of view are not drawn, so not counted), and the figure's whole drawn extent."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    hidden = set()
    for ax in fig.axes:
        for axis, (low, high) in ((ax.xaxis, sorted(ax.get_xlim())), (ax.yaxis, sorted(ax.get_ylim()))):
            for tick in axis.get_major_ticks():
                if not low - 1e-9 <= tick.get_loc() <= high + 1e-9:
                    hidden.update({id(tick.label1), id(tick.label2)})
    out = []
    for text in fig.findobj(Text):
        if id(text) in hidden or not text.get_visible() or not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            out.append(repr(text.get_text()))
    whole = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # pixels
    if whole.x0 < -1 or whole.y0 < -1 or whole.x1 > width + 1 or whole.y1 > height + 1:
        out.append(f"drawn extent {whole.bounds}")
    return out


def test_no_label_is_cut_off(frame: pd.DataFrame, tmp_path: Path) -> None:
    """Every text of every figure (titles, axis labels, the MFU axis' label, verdicts under the
    bars, value labels) lies inside the figure."""
    sweep = _sweep(tmp_path / "s.csv").assign(peak_source="torch GEMM probe (cached 2026-11-24T21:19:21.123456)")
    drawn = report.figures(frame) + report.figures(sweep)
    assert any(d.stem.endswith("batch-train") for d in drawn)
    for d in drawn:
        assert _outside(d.figure) == [], d.stem


def test_without_a_baseline_the_figure_says_there_is_no_verdict(tmp_path: Path) -> None:
    df = _write(tmp_path / "bad.csv", backends={"numpy": (2.0, "nan_loss"), "torch": (1.0, "chance_accuracy")})
    ax = _figures(df)["mnist-cpu-epoch-time"].axes[0]
    assert "no baseline" in ax.get_title().replace("\n", " ")
    assert not any(ln.get_gid() == plots.BASELINE_GID for ln in ax.lines)


def test_a_run_stopped_after_its_first_epoch_says_so_not_one_epoch(tmp_path: Path) -> None:
    df = _write(tmp_path / "s.csv", epochs=1, backends={"numpy": (2.0, "interrupted"), "torch": (1.0, "timeout")})
    df["epochs"] = 3  # the workload asked for 3: Ctrl-C or --timeout stopped each cell in its second
    title = plots.epoch_time_figure(_context(df), "t").axes[0].get_title().replace("\n", " ")
    assert "stopped before epoch 2 of 3" in title and "one epoch" not in title, title
    one = _write(tmp_path / "one.csv", epochs=1, backends={"numpy": (2.0, "ok")})
    one["epochs"] = 1
    assert "(one epoch:" in plots.epoch_time_figure(_context(one), "t").axes[0].get_title().replace("\n", " ")


def test_the_baseline_line_sits_on_its_box_and_the_curves_are_medians(tmp_path: Path) -> None:
    """Issue 41 item 10: the dashed baseline line (the median of the repeats' medians, what the
    verdicts use) did not sit on its box's median (the pooled passes'), and the curves drew means
    where every table uses medians."""
    df = _write(tmp_path / "r.csv", backends={"numpy": (1.0, "ok"), "torch": (2.0, "ok")})
    # torch's steady passes per repeat: [1, 2, 9], [3, 4, 5], [6, 7, 8]: the medians' median is 4,
    # the pooled passes' median 5
    steady = (df["phase"] == "inference") & (df["backend"] == "torch") & (df["pass"] > 1)
    df.loc[steady, "seconds"] = [1.0, 2, 9, 3, 4, 5, 6, 7, 8]  # rows in repeat, then pass order
    groups = _context(df, "torch")
    ax = plots.inference_figure(df[df["phase"] == "inference"], groups, "t").axes[0]
    line = next(ln for ln in ax.lines if ln.get_gid() == plots.BASELINE_GID)
    medians = [ln for ln in ax.lines if ln.get_gid() != plots.BASELINE_GID and len(ln.get_ydata()) == 2
               and ln.get_color() == "black" and ln.get_ydata()[0] == ln.get_ydata()[1]]
    torch = groups.reset_index()["backend"].tolist().index("torch")
    assert math.isclose(line.get_ydata()[0], groups["infer_s"].iloc[torch]) and groups["infer_s"].iloc[torch] == 4
    assert any(math.isclose(m.get_ydata()[0], line.get_ydata()[0]) for m in medians)
    # curves: three repeats whose losses at epoch 1 are 1, 2 and 9 draw 2 (their mean would be 4)
    train = df[df["phase"] == "train_epoch"].copy()
    first = (train["epoch"] == 1) & (train["backend"] == "numpy")
    train.loc[first, "loss"] = train.loc[first, "repeat"].map({1: 1.0, 2: 2.0, 3: 9.0})
    loss_ax = plots.curves_figure(train, _context(df), "t").axes[0]
    numpy_line = next(ln for ln in loss_ax.lines if ln.get_label() == "numpy")
    assert numpy_line.get_ydata()[0] == 2.0
