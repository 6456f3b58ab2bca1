"""Figures of a results frame: one set per workload and device, written as PNGs with an index.html.

matplotlib is imported inside the functions, and only its Agg canvas is used (no pyplot, no GUI),
so importing this module costs nothing and plotting works on machines without a display.
"""
from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from . import stats
from .errors import ResultsError
from .stats import CONTEXT_KEYS, GROUP_KEYS, label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FAILED_COLOR = "#c62828"
#: tab10 without its red and grey.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf"]
DPI = 120


def _label(key: tuple) -> str:
    return label(key[2], key[3])


def _colors(labels: list[str]) -> dict[str, Any]:
    """One colour per backend label, the same in every figure (no red or grey: they mean failed)."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(set(labels)))}


def _figure(width: float, height: float, ncols: int = 1) -> tuple["Figure", list["Axes"]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _mark_failed_ticks(ax: "Axes", statuses: list[str]) -> None:
    for tick, status in zip(ax.get_xticklabels(), statuses):
        if status != "ok":
            tick.set_color(FAILED_COLOR)


def _tick_labels(keys: list[tuple], statuses: list[str]) -> list[str]:
    return [_label(k) + ("" if s == "ok" else f"\n[{s}]") for k, s in zip(keys, statuses)]


def epoch_time_figure(groups: pd.DataFrame, title: str) -> "Figure":
    """Bars of the steady epoch time per backend (median over repeats) with the 95% interval.

    ``groups``: the rows of ``stats.summarize(df).groups`` for one workload and device. Backends
    whose status is not ok get hatched grey bars and a red label; those without a time get a note.
    When no backend has a steady time (single-epoch runs), the first-epoch time is drawn instead.
    """
    keys, statuses = list(groups.index), list(groups["status"])
    colors = _colors([_label(k) for k in keys])
    fig, (ax,) = _figure(max(5.0, 1.3 * len(keys) + 2), 4.2)
    x = np.arange(len(keys))
    steady = groups["steady_s"].notna().any()
    med = groups["steady_s" if steady else "first_s"].to_numpy(dtype=float)
    lo_col, hi_col = ("steady_low", "steady_high") if steady else ("first_s", "first_s")
    low = np.nan_to_num(med - groups[lo_col].to_numpy(dtype=float), nan=0.0)
    high = np.nan_to_num(groups[hi_col].to_numpy(dtype=float) - med, nan=0.0)
    ok = np.array([s == "ok" for s in statuses])
    face = [colors[_label(k)] if good else "#d0d0d0" for k, good in zip(keys, ok)]
    bars = ax.bar(x, np.nan_to_num(med, nan=0.0), color=face, edgecolor=[
        "black" if good else FAILED_COLOR for good in ok], yerr=np.vstack([low, high]), capsize=5,
        error_kw={"elinewidth": 1.2, "ecolor": "black"})
    top = np.nanmax(np.where(np.isfinite(med), med + high, np.nan)) if np.isfinite(med).any() else 1.0
    for bar, good, value, status in zip(bars, ok, med, statuses):
        if not good:
            bar.set_hatch("//")
        if math.isfinite(value):
            text = f"{value:#.3g} s"
        else:
            text = f"no time\n({status})" if not good else "n/a\n(1 epoch)"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, (value if math.isfinite(value) else 0)),
                    xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=9,
                    color="black" if good else FAILED_COLOR)
    ax.set_xticks(x, _tick_labels(keys, statuses))
    _mark_failed_ticks(ax, statuses)
    ax.set_ylim(0, top * 1.18)
    ax.set_ylabel("steady epoch time (s)" if steady else "first epoch time (s)")
    ax.set_title(title if steady else title.split(":")[0] + ": first epoch time (one epoch: no steady state)",
                 fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _per_epoch(train: pd.DataFrame, col: str) -> pd.DataFrame:
    values = train[col].where(np.isfinite(train[col]))
    return values.groupby(train["epoch"]).agg(["mean", "min", "max"])


def curves_figure(df: pd.DataFrame, statuses: dict[tuple, str], title: str) -> "Figure":
    """Training loss and validation accuracy per epoch per backend: mean over repeats with a
    min-max band. ``df``: train_epoch rows of one workload and device. Failed backends are dashed,
    labelled with their status, and a red x marks where their loss stopped being finite."""
    keys = sorted({tuple(k) for k in df[GROUP_KEYS].itertuples(index=False)})
    colors = _colors([_label(k) for k in keys])
    fig, (loss_ax, acc_ax) = _figure(10.0, 4.2, ncols=2)
    by_group = dict(list(df.groupby(GROUP_KEYS, sort=True)))
    marked = False
    for key in keys:
        train, status = by_group[key], statuses.get(key, "ok")
        style = {"color": colors[_label(key)], "linestyle": "-" if status == "ok" else "--", "marker": "o",
                 "markersize": 3}
        name = _label(key) + ("" if status == "ok" else f" [{status}]")
        for ax, col in ((loss_ax, "loss"), (acc_ax, "val_accuracy")):
            agg = _per_epoch(train, col)
            ax.plot(agg.index, agg["mean"], label=name if ax is loss_ax else None, **style)
            ax.fill_between(agg.index, agg["min"], agg["max"], color=style["color"], alpha=0.18, linewidth=0)
        bad = train.loc[~np.isfinite(train["loss"]), "epoch"]
        if len(bad):
            finite = _per_epoch(train, "loss")["mean"].dropna()
            y = finite.iloc[-1] if len(finite) else 0.0
            loss_ax.plot([bad.min()], [y], marker="x", color=FAILED_COLOR, markersize=11, markeredgewidth=2.5,
                         linestyle="none", label=None if marked else "loss no longer finite")
            marked = True
    loss = df["loss"].where(np.isfinite(df["loss"]))
    if (loss > 0).all() and loss.max() / max(loss.min(), 1e-300) > 100:
        loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss")
    acc_ax.set_ylabel("validation accuracy")
    acc_ax.set_ylim(0, 1.02)
    from matplotlib.ticker import MaxNLocator

    last = int(df["epoch"].max()) if len(df) else 1
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("epoch")
        ax.set_xlim(0.7, last + 0.3)
        if last <= 12:
            ax.set_xticks(range(1, last + 1))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(title + " (mean over repeats, band: min-max)", fontsize=11)
    fig.legend(loc="outside lower center", ncols=min(len(keys) + 1, 5), fontsize=9, frameon=False)
    return fig


def inference_figure(df: pd.DataFrame, statuses: dict[tuple, str], title: str) -> "Figure":
    """Box plot (with every pass as a point) of the inference time per backend.

    ``df``: inference rows of one workload and device; failed backends are hatched and red."""
    keys = sorted(statuses)
    colors = _colors([_label(k) for k in keys])
    fig, (ax,) = _figure(max(5.0, 1.3 * len(keys) + 2), 4.2)
    by_group = {k: g["seconds"].dropna().to_numpy() for k, g in df.groupby(GROUP_KEYS, sort=True)}
    data = [by_group.get(k, np.array([])) for k in keys]
    st = [statuses[k] for k in keys]
    box = ax.boxplot(data, positions=np.arange(len(keys)), widths=0.55, patch_artist=True,
                     showfliers=False, medianprops={"color": "black"})
    rng = np.random.default_rng(0)
    for i, (key, values, status) in enumerate(zip(keys, data, st)):
        patch = box["boxes"][i]
        good = status == "ok"
        patch.set_facecolor(colors[_label(key)] if good else "#d0d0d0")
        patch.set_alpha(0.6)
        if not good:
            patch.set_hatch("//")
            patch.set_edgecolor(FAILED_COLOR)
        if len(values):
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(values)), values, s=12, color="black", alpha=0.6, zorder=3)
        else:
            ax.annotate(f"no time\n({status})", (i, 0), xytext=(0, 4), textcoords="offset points",
                        ha="center", va="bottom", fontsize=9, color=FAILED_COLOR)
    ax.set_xticks(np.arange(len(keys)), _tick_labels(keys, st))
    _mark_failed_ticks(ax, st)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("inference time per pass (s)")
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def figures(df: pd.DataFrame) -> list[tuple[str, "Figure"]]:
    """Every figure for a results frame, as (file stem, figure), per workload and device."""
    groups = stats.summarize(df).groups
    out = []
    for ctx, frame in groups.groupby(CONTEXT_KEYS, sort=True):
        where = f"{ctx[0]} on {ctx[1]}"
        stem = f"{_slug(ctx[0])}-{_slug(ctx[1])}"
        rows = df[(df["workload"] == ctx[0]) & (df["device"] == ctx[1])]
        statuses = dict(zip(frame.index, frame["status"]))
        train = rows[rows["phase"] == "train_epoch"]
        infer = rows[rows["phase"] == "inference"]
        if len(train):
            out.append((f"{stem}-epoch-time", epoch_time_figure(
                frame, f"{where}: steady epoch time (median over repeats, 95% CI)")))
            out.append((f"{stem}-curves", curves_figure(train, statuses, f"{where}: training curves")))
        if len(infer):
            out.append((f"{stem}-inference", inference_figure(
                infer, statuses, f"{where}: inference time (box: quartiles, dots: passes)")))
    return out


def _index_html(images: list[Path], summary_text: str, sources: list[str]) -> str:
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>benchbackend report</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1250px;margin:2em auto;padding:0 1em}"
             "pre{background:#f6f8fa;padding:1em;overflow-x:auto;font-size:13px}"
             "img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}</style></head><body>",
             "<h1>benchbackend report</h1>",
             "<p>From " + ", ".join(f"<code>{html.escape(s)}</code>" for s in sources) + "</p>"]
    if summary_text:
        parts += ["<h2>Summary</h2>", f"<pre>{html.escape(summary_text)}</pre>"]
    for img in images:
        parts.append(f'<figure><img src="{html.escape(img.name)}" alt="{html.escape(img.stem)}"></figure>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(df: pd.DataFrame, out_dir: Path, summary_text: str) -> list[Path]:
    """Write the figures as PNGs and an index.html showing them under the summary table.

    ``summary_text`` is the table to show (``compare``'s text: this module draws, it does not
    compare). Returns the paths written, PNGs first, index.html last. Raises ResultsError when
    ``out_dir`` is not writable.
    """
    out_dir = Path(out_dir)
    written: list[Path] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stem, fig in figures(df):
            path = out_dir / f"{stem}.png"
            fig.savefig(path)
            written.append(path)
        index = out_dir / "index.html"
        sources = sorted(set(df["source"])) if "source" in df else []
        index.write_text(_index_html(written, summary_text, sources), encoding="utf-8")
    except OSError as exc:
        raise ResultsError(f"{out_dir}: cannot write plots ({exc})") from None
    return written + [index]
