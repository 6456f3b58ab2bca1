"""Figures of a results frame: one set per experiment and device, written as PNGs with an index.html.

matplotlib is imported inside the functions, and only its Agg canvas is used (no pyplot, no GUI),
so importing this module costs nothing and plotting works on machines without a display.
The figures use the numbers ``compare`` uses (:mod:`benchbackend.stats`): only ok repeats feed a
timing, the first epoch and the first inference pass are apart, one interval rule.
"""
from __future__ import annotations

import html
import math
import re
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np
import pandas as pd

from . import summary as summaries
from .errors import ResultsError
from .experiments import CONTEXT_KEYS, GROUP_KEYS, LABEL_NAMES, REPEAT_KEYS, context_name, text, with_experiment
from .stats import CI_LABEL

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FAILED_COLOR = "#c62828"
#: tab10 without its red and grey.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf"]
#: Markers and line styles per backend, so that identical curves (same weights, same data) stay
#: visible on top of each other: each marker is drawn hollow and smaller than the one before.
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
LINESTYLES = ["-", "--", "-."]
FAILED_LINESTYLE = ":"
DPI = 120
#: Characters per line of a title, per inch of figure width.
_TITLE_CHARS_PER_INCH = 11


def _color(name: str) -> str:
    """The colour of one group label, the same in every figure and every report (not its position
    among the groups drawn): from the label's own digest. No red or grey: they mean failed."""
    import zlib

    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def _colors(labels: list[str]) -> dict[str, Any]:
    return {name: _color(name) for name in set(labels)}


def _styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """Colour, marker, marker size and line style per backend label."""
    names = sorted(set(labels))
    colors = _colors(names)
    return {name: {"color": colors[name], "marker": MARKERS[i % len(MARKERS)],
                   "markersize": max(4.0, 9.0 - 1.5 * i), "linestyle": LINESTYLES[i % len(LINESTYLES)]}
            for i, name in enumerate(names)}


def _figure(width: float, height: float, ncols: int = 1) -> tuple["Figure", list["Axes"]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _wrap(title: str, width_in: float) -> str:
    """A title broken into lines that fit the figure, so that it is never cut off."""
    return "\n".join(textwrap.wrap(title, max(30, int(width_in * _TITLE_CHARS_PER_INCH))))


def _mark_failed_ticks(ax: "Axes", statuses: list[str]) -> None:
    for tick, status in zip(ax.get_xticklabels(), statuses):
        if status != "ok":
            tick.set_color(FAILED_COLOR)


def _tick_labels(names: list[str], statuses: list[str]) -> list[str]:
    return [name + ("" if s == "ok" else f"\n[{s}]") for name, s in zip(names, statuses)]


def _interval_note(kinds: Iterable[str]) -> str:
    kinds = {k for k in kinds if k}
    if kinds == {CI_LABEL}:
        return "bars: 95% CI of the median"
    if kinds == {"range"}:
        return "bars: min-max of the repeats"
    if not kinds:
        return "one repeat: no interval"
    return "bars: 95% CI of the median with 6+ repeats, else min-max of the repeats"


def _bars(ax: "Axes", groups: pd.DataFrame, value: str, low: str, high: str, unit: str, fmt: str,
          notes: Optional[list[str]] = None) -> None:
    """Bars of ``value`` per group with [low, high] error bars; the value (and its line of
    ``notes``, if any) is written above the bar's error bar, never on it; failed groups hatched grey
    with a red label."""
    names, statuses = list(groups["label"]), list(groups["status"])
    x = np.arange(len(names))
    med = groups[value].to_numpy(dtype=float)
    lo = groups[low].to_numpy(dtype=float)
    hi = groups[high].to_numpy(dtype=float)
    below = np.nan_to_num(med - lo, nan=0.0).clip(min=0)
    above = np.nan_to_num(hi - med, nan=0.0).clip(min=0)
    ok = np.array([s == "ok" for s in statuses])
    face = [_color(name) if good else "#d0d0d0" for name, good in zip(names, ok)]
    bars = ax.bar(x, np.nan_to_num(med, nan=0.0), color=face,
                  edgecolor=["black" if good else FAILED_COLOR for good in ok], yerr=np.vstack([below, above]),
                  capsize=5, error_kw={"elinewidth": 1.2, "ecolor": "black"})
    tops = np.where(np.isfinite(med), np.nan_to_num(med, nan=0.0) + above, 0.0)
    for bar, good, v, status, top, note in zip(bars, ok, med, statuses, tops, notes or [""] * len(names)):
        if not good:
            bar.set_hatch("//")
        if math.isfinite(v):
            text = format(v, fmt) + unit + (f"\n{note}" if note else "")
        else:
            text = f"no time\n({status})" if not good else "n/a"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 6), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9, color="black" if good else FAILED_COLOR)
    ax.set_xticks(x, _tick_labels(names, statuses))
    _mark_failed_ticks(ax, statuses)
    top = float(np.nanmax(tops)) if len(tops) and np.nanmax(tops) > 0 else 1.0
    ax.set_ylim(0, top * 1.22)
    ax.grid(axis="y", alpha=0.3)


def epoch_time_figure(groups: pd.DataFrame, title: str) -> "Figure":
    """Bars of the steady epoch time per backend (median over ok repeats) with its interval.

    ``groups``: the rows of ``summary.summarize(df).groups`` for one experiment and device (the
    training ones). Failed backends get hatched grey bars and a red label; those without a time a
    note. When no backend has a steady time (single-epoch runs), the first-epoch time is drawn.
    """
    width = max(5.0, 1.3 * len(groups) + 2)
    fig, (ax,) = _figure(width, 4.4)
    steady = groups["steady_s"].notna().any()
    if steady:
        _bars(ax, groups, "steady_s", "steady_low", "steady_high", " s", "#.3g")
        ax.set_ylabel("steady epoch time (s)")
        note = _interval_note(groups["steady_interval"])
        ax.set_title(_wrap(f"{title}: steady epoch time (median over repeats; {note})", width), fontsize=11)
    else:
        _bars(ax, groups, "first_s", "first_s", "first_s", " s", "#.3g")
        ax.set_ylabel("first epoch time (s)")
        ax.set_title(_wrap(f"{title}: first epoch time (one epoch: no steady state)", width), fontsize=11)
    return fig


def _mfu_text(value: float) -> str:
    return f"MFU {value * 100:#.3g}%" if math.isfinite(value) else ""


def mfu_scale(groups: pd.DataFrame, rate: str, mfu: str) -> Optional[tuple[float, str]]:
    """(MFU per unit of ``rate``, the peak) when every group with a throughput was measured against
    one peak, so that MFU is the throughput times one factor and a second axis shows it exactly;
    None when peaks differ or are unknown (then each value is labelled with its own MFU)."""
    have = groups[groups[rate].notna() & (groups[rate] > 0)]
    peaks = set(have["peak"])
    if not len(have) or len(peaks) != 1 or "" in peaks or have[mfu].isna().any():
        return None
    factors = (have[mfu] / have[rate]).to_numpy(dtype=float)
    if not np.allclose(factors, factors[0], rtol=1e-6):  # one model size and one peak: one factor
        return None
    return float(factors[0]), peaks.pop()


def _mfu_axis(ax: "Axes", scale: tuple[float, str]) -> None:
    factor, peak = scale
    sec = ax.secondary_yaxis("right", functions=(lambda v: v * factor * 100, lambda m: m / (factor * 100)))
    sec.set_ylabel(f"MFU (%) against {peak}", fontsize=9)


def throughput_figure(groups: pd.DataFrame, title: str) -> "Figure":
    """Bars of training throughput (samples/s of the steady epochs; median over ok repeats), each
    labelled with its MFU where a peak is known; a right-hand MFU axis when all share one peak."""
    width = max(5.0, 1.3 * len(groups) + 2)
    fig, (ax,) = _figure(width, 4.4)
    _bars(ax, groups, "samples_per_s", "sps_low", "sps_high", "", ",.0f",
          notes=[_mfu_text(v) for v in groups["mfu"].to_numpy(dtype=float)])
    scale = mfu_scale(groups, "samples_per_s", "mfu")
    if scale is not None:
        _mfu_axis(ax, scale)
    samples = groups["train_samples"].dropna()
    per = f", {samples.max():,.0f} samples an epoch" if len(samples) else ""
    ax.set_ylabel("training samples/s (higher is better)")
    ax.set_title(_wrap(f"{title}: training throughput (median over repeats{per}; "
                       f"{_interval_note(groups['steady_interval'])})", width), fontsize=11)
    return fig


#: The two phases of a batch-size sweep: (stem part, definition field, throughput, interval, MFU, what).
_SWEEP_PHASES = (("train", "batch_size", "samples_per_s", "sps", "mfu", "training"),
                 ("inference", "inference_batch_size", "infer_sps", "infer_sps", "infer_mfu", "inference"))


def _sweeps(groups: pd.DataFrame) -> list[tuple[tuple, str, pd.DataFrame]]:
    """Groups of one workload name, device and definition but for the batch sizes, where the
    definitions hold several batch sizes: (key, what the fixed definition is, groups)."""
    fixed = ["limit", "epochs", "seed", "data_source"]
    frame = groups[groups["batch_size"].notna()]
    rest = frame[fixed].map(text).agg(" ".join, axis=1) if len(frame) else pd.Series(dtype=str)
    device = frame.index.get_level_values("device")
    out = []
    for key, sub in frame.groupby([frame["workload"], device, rest], sort=True):
        if sub["batch_size"].nunique() > 1 or sub["inference_batch_size"].nunique() > 1:
            what = ", ".join(f"{LABEL_NAMES[c]} {v}" for c, v in zip(fixed, key[2].split(" ")) if v not in ("", "nan"))
            out.append((key, what, sub))
    return out


def batch_size_figure(groups: pd.DataFrame, title: str, phase: str = "train") -> "Figure":
    """Throughput against batch size, one line per backend (mode, precision) in the styles of the
    other figures: the median samples/s over ok repeats with its interval; a right-hand MFU axis
    when every point shares one peak, else each point labelled with its MFU. A batch size whose
    group is not ok is a red x with its status, off the line.

    ``groups``: ``summary.summarize(df).groups`` rows of one workload, device and definition but for
    the batch size, with ``batch`` and ``infer_batch`` columns (see :func:`_sweeps`)."""
    _, field, rate, interval, mfu, what = next(p for p in _SWEEP_PHASES if p[0] == phase)
    fig, (ax,) = _figure(7.5, 4.6)
    labels = list(groups["label"])
    styles = _styles(labels)
    scale = mfu_scale(groups, rate, mfu)
    sizes = sorted({int(b) for b in groups[field].dropna()})
    for name in sorted(set(labels)):
        sub = groups[[lab == name for lab in labels]].sort_values(field)
        look = styles[name]
        # A batch size whose group is not ok breaks the line (NaN) rather than being bridged.
        good = sub.assign(**{rate: sub[rate].where(sub["status"] == "ok")})
        x, y = good[field].to_numpy(dtype=float), good[rate].to_numpy(dtype=float)
        below = np.nan_to_num(y - good[f"{interval}_low"].to_numpy(dtype=float), nan=0.0).clip(min=0)
        above = np.nan_to_num(good[f"{interval}_high"].to_numpy(dtype=float) - y, nan=0.0).clip(min=0)
        ax.errorbar(x, y, yerr=np.vstack([below, above]), label=name, color=look["color"], marker=look["marker"],
                    markersize=look["markersize"], markerfacecolor="none", markeredgewidth=1.4,
                    linestyle=look["linestyle"], linewidth=1.6, capsize=4)
        if scale is None:
            for xi, yi, m in zip(x, y, good[mfu].to_numpy(dtype=float)):
                if math.isfinite(m) and math.isfinite(yi):
                    ax.annotate(f"{m * 100:#.3g}%", (xi, yi), xytext=(0, 7), textcoords="offset points",
                                ha="center", fontsize=8, color=look["color"])
        bad = sub[sub["status"] != "ok"]
        for b, v, status in zip(bad[field], bad[rate], bad["status"]):
            v = float(v) if pd.notna(v) else 0.0
            ax.plot([b], [v], marker="x", color=FAILED_COLOR, markersize=10, markeredgewidth=2, linestyle="none")
            ax.annotate(f"{name}\n[{status}]", (b, v), xytext=(0, 7), textcoords="offset points", ha="center",
                        fontsize=8, color=FAILED_COLOR)
    if sizes and sizes[-1] >= 4 * sizes[0]:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_xlabel(f"{what} batch size")
    ax.set_ylabel(f"{what} samples/s (higher is better)")
    top = np.nanmax(groups[[rate, f"{interval}_high"]].to_numpy(dtype=float)) if len(groups) else np.nan
    ax.set_ylim(0, (top if np.isfinite(top) and top > 0 else 1.0) * 1.2)
    if scale is not None:
        _mfu_axis(ax, scale)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=False)
    mfu_note = "" if scale is not None else "; labels: MFU"
    ax.set_title(_wrap(f"{title}: {what} throughput against batch size (median over ok repeats; "
                       f"{_interval_note(groups['steady_interval' if phase == 'train' else 'infer_interval'])}"
                       f"{mfu_note})", 7.5), fontsize=11)
    return fig


def _per_epoch(train: pd.DataFrame, col: str) -> pd.DataFrame:
    values = train[col].where(np.isfinite(train[col]))
    return values.groupby(train["epoch"]).agg(["mean", "min", "max"])


def curves_figure(df: pd.DataFrame, groups: pd.DataFrame, title: str) -> "Figure":
    """Training loss and validation accuracy per epoch per backend: mean over repeats with a
    min-max band. ``df``: train_epoch rows of one experiment and device. Each backend has its own
    colour, marker and line style (backends that agree draw identical curves: the hollow markers
    of decreasing size keep each visible); failed backends are dotted and labelled with their
    status, and a red x marks where their loss stopped being finite. ``groups``: the summary rows
    of those groups (``summary.summarize(df).groups``): their status and label."""
    df = with_experiment(df)
    keys = sorted({tuple(k) for k in df[GROUP_KEYS].itertuples(index=False)})
    names, statuses = groups["label"].to_dict(), groups["status"].to_dict()
    styles = _styles([names[k] for k in keys])
    fig, (loss_ax, acc_ax) = _figure(10.0, 4.4, ncols=2)
    by_group = dict(list(df.groupby(GROUP_KEYS, sort=True)))
    marked = False
    for key in keys:
        train, status = by_group[key], statuses.get(key, "ok")
        look = styles[names[key]]
        style = {"color": look["color"], "marker": look["marker"], "markersize": look["markersize"],
                 "markerfacecolor": "none", "markeredgewidth": 1.4, "linewidth": 1.6,
                 "linestyle": look["linestyle"] if status == "ok" else FAILED_LINESTYLE}
        name = names[key] + ("" if status == "ok" else f" [{status}]")
        for ax, col in ((loss_ax, "loss"), (acc_ax, "val_accuracy")):
            agg = _per_epoch(train, col)
            ax.plot(agg.index, agg["mean"], label=name if ax is loss_ax else None, **style)
            ax.fill_between(agg.index, agg["min"], agg["max"], color=style["color"], alpha=0.15, linewidth=0)
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
    fig.suptitle(_wrap(title + ": training curves (mean over repeats, band: min-max)", 10.0), fontsize=11)
    fig.legend(loc="outside lower center", ncols=min(len(keys) + 1, 5), fontsize=9, frameon=False)
    return fig


def inference_figure(df: pd.DataFrame, groups: pd.DataFrame, title: str,
                     samples: Optional[float] = None) -> "Figure":
    """Box plot (with every pass as a point) of the steady inference time per backend: passes
    after each repeat's first; the first pass (tracing, compilation, first copies) is written
    above each box instead, so that it does not squash the scale.

    ``df``: inference rows of one experiment and device (of the repeats that count); ``samples``:
    the samples in one pass, said in the title. Failed backends are hatched and red. ``groups``:
    the summary rows of those groups (their status and label)."""
    df = with_experiment(df)
    keys = sorted(groups.index)
    names, statuses = groups["label"].to_dict(), groups["status"].to_dict()
    width = max(5.0, 1.3 * len(keys) + 2)
    fig, (ax,) = _figure(width, 4.4)
    steady = summaries.steady_inference(df)
    by_group = {k: g["seconds"].dropna().to_numpy() for k, g in steady.groupby(GROUP_KEYS, sort=True)}
    firsts = df[(df["phase"] == "inference") & (df["pass"] == 1)].groupby(GROUP_KEYS)["seconds"].median()
    data = [by_group.get(k, np.array([])) for k in keys]
    st = [statuses[k] for k in keys]
    box = ax.boxplot(data, positions=np.arange(len(keys)), widths=0.55, patch_artist=True,
                     showfliers=False, medianprops={"color": "black"})
    rng = np.random.default_rng(0)
    tops = [float(np.max(v)) if len(v) else 0.0 for v in data]
    for i, (key, values, status) in enumerate(zip(keys, data, st)):
        patch = box["boxes"][i]
        good = status == "ok"
        patch.set_facecolor(_color(names[key]) if good else "#d0d0d0")
        patch.set_alpha(0.6)
        if not good:
            patch.set_hatch("//")
            patch.set_edgecolor(FAILED_COLOR)
        if len(values):
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(values)), values, s=12, color="black", alpha=0.6, zorder=3)
            first = firsts.get(key, math.nan)
            note = f"1st pass\n{first:#.3g} s" if math.isfinite(first) else ""
        else:
            note = f"no time\n({status})"
        if note:
            ax.annotate(note, (i, tops[i]), xytext=(0, 6), textcoords="offset points", ha="center",
                        va="bottom", fontsize=8, color="dimgray" if good else FAILED_COLOR)
    ax.set_xticks(np.arange(len(keys)), _tick_labels([names[k] for k in keys], st))
    _mark_failed_ticks(ax, st)
    ax.set_ylim(0, (max(tops) if tops and max(tops) > 0 else 1.0) * 1.3)
    per = f"{samples:,.0f} samples" if samples and math.isfinite(samples) else "one"
    ax.set_ylabel(f"seconds per pass ({per})")
    ax.set_title(_wrap(f"{title}: inference time per pass of {per} (passes after the first; "
                       "box: quartiles, dots: passes)", width), fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def _timed_rows(df: pd.DataFrame, summary: summaries.Summary) -> pd.DataFrame:
    """The rows of the repeats that feed the timings (see ``summary.timed_repeats``)."""
    timed = summary.repeats.index[summary.repeats["timed"].to_numpy()]
    return df[df.set_index(GROUP_KEYS + REPEAT_KEYS).index.isin(timed)]


def figures(df: pd.DataFrame) -> list[tuple[str, "Figure"]]:
    """Every figure for a results frame, as (file stem, figure), per experiment and device."""
    df = with_experiment(df)
    summary = summaries.summarize(df)
    groups = summary.groups
    timed = _timed_rows(df, summary)
    out = []
    contexts = sorted(groups.groupby(CONTEXT_KEYS, sort=False),
                      key=lambda item: tuple(summaries.natural_key(part) for part in item[0]))
    for ctx, frame in contexts:
        where = context_name(ctx)
        stem = f"{_slug(ctx[0])}-{_slug(ctx[1])}"
        in_ctx = (df["experiment"] == ctx[0]) & (df["device"] == ctx[1])
        rows = df[in_ctx]
        train = rows[rows["phase"] == "train_epoch"]
        infer = timed[(timed["experiment"] == ctx[0]) & (timed["device"] == ctx[1]) & (timed["phase"] == "inference")]
        trains = frame[~frame["inference_only"].astype(bool)]
        if len(train):
            out.append((f"{stem}-epoch-time", epoch_time_figure(trains, where)))
            if trains["samples_per_s"].notna().any():
                out.append((f"{stem}-throughput", throughput_figure(trains, where)))
            out.append((f"{stem}-curves", curves_figure(train, frame, where)))
        if len(rows[rows["phase"] == "inference"]):
            samples = frame["infer_samples"].max()
            out.append((f"{stem}-inference", inference_figure(infer, frame, where, samples)))
    return out + sweep_figures(groups)


def sweep_figures(groups: pd.DataFrame) -> list[tuple[str, "Figure"]]:
    """Throughput against batch size (training and inference) for each workload and device whose
    results hold several batch sizes of one definition otherwise."""
    out = []
    sweeps = _sweeps(groups)
    per_workload: dict[tuple, int] = {}
    for key, _, _ in sweeps:
        per_workload[key[:2]] = per_workload.get(key[:2], 0) + 1
    seen: dict[tuple, int] = {}
    for key, rest, sub in sweeps:
        workload, device = key[0], key[1]
        seen[key[:2]] = seen.get(key[:2], 0) + 1
        several = per_workload[key[:2]] > 1
        title = f"{workload} on {device}" + (f" ({rest})" if several else "")
        stem = f"{_slug(workload)}-{_slug(device)}-batch" + (f"-{seen[key[:2]]}" if several else "")
        trains = sub[~sub["inference_only"].astype(bool)]
        if trains["samples_per_s"].notna().any() and trains["batch_size"].nunique() > 1:
            out.append((f"{stem}-train", batch_size_figure(trains, title, "train")))
        if sub["infer_sps"].notna().any() and sub["inference_batch_size"].nunique() > 1:
            out.append((f"{stem}-inference", batch_size_figure(sub, title, "inference")))
    return out


_ENV_COLUMNS = (("backend_version", "version"), ("host", "host"), ("cpu", "CPU"), ("threads", "threads"),
                ("gpu", "GPU"), ("python", "python"), ("os", "OS"))


def environment_table(df: pd.DataFrame) -> list[list[str]]:
    """One row per backend label: its versions, hosts, CPUs, threads (each distinct value)."""
    df = with_experiment(df)
    rows = []
    for (backend, mode, precision), sub in df.groupby(["backend", "mode", "precision"], sort=True):
        name = f"{backend}:{mode}" + (f"@{precision}" if precision != "fp32" else "")
        cells = [name, ", ".join(sorted({str(d) for d in sub["device"] if d != ""}))]
        for col, _ in _ENV_COLUMNS:
            if col not in sub.columns:
                cells.append("")
                continue
            values = sub[col].dropna()
            text = sorted({f"{v:g}" if isinstance(v, float) else str(v) for v in values} - {""})
            cells.append(", ".join(text))
        rows.append(cells)
    return rows


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    cell = lambda tag, v: f"<{tag}>{html.escape(v)}</{tag}>"  # noqa: E731
    return ("<table><tr>" + "".join(cell("th", h) for h in head) + "</tr>"
            + "".join("<tr>" + "".join(cell("td", v) for v in r) + "</tr>" for r in rows) + "</table>")


def _index_html(images: list[Path], summary_text: str, sources: list[str], warnings: list[str],
                env_rows: list[list[str]]) -> str:
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>benchbackend report</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1250px;margin:2em auto;padding:0 1em}"
             "pre{background:#f6f8fa;padding:1em;overflow-x:auto;font-size:13px}"
             "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:2px 8px;"
             "text-align:left}.warnings li{color:#8a4b00}"
             "img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}</style></head><body>",
             "<h1>benchbackend report</h1>",
             "<p>From " + ", ".join(f"<code>{html.escape(s)}</code>" for s in sources) + "</p>"]
    if warnings:
        parts += ["<h2>Warnings</h2>", '<ul class="warnings">']
        parts += [f"<li>{html.escape(w)}</li>" for w in warnings]
        parts.append("</ul>")
    if summary_text:
        parts += ["<h2>Summary</h2>", f"<pre>{html.escape(summary_text)}</pre>"]
    if env_rows:
        head = ["backend", "device"] + [name for _, name in _ENV_COLUMNS]
        parts += ["<h2>Environment</h2>", _html_table(head, env_rows)]
    if images:
        parts.append("<h2>Figures</h2>")
    for img in images:
        parts.append(f'<figure><img src="{html.escape(img.name)}" alt="{html.escape(img.stem)}"></figure>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(df: pd.DataFrame, out_dir: Path, summary_text: str,
                 warnings: Iterable[str] = ()) -> list[Path]:
    """Write the figures as PNGs and an index.html: the warnings, the summary table, the
    environment (backend versions, hosts, CPUs, threads) and the figures.

    ``summary_text`` and ``warnings`` are what ``compare`` printed (this module draws, it does not
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
        index.write_text(_index_html(written, summary_text, sources, list(warnings), environment_table(df)),
                         encoding="utf-8")
    except OSError as exc:
        raise ResultsError(f"{out_dir}: cannot write plots ({exc})") from None
    return written + [index]
