"""The figures of one experiment and device: epoch time, throughput, training curves, inference time,
throughput against batch size.

matplotlib is imported inside the functions, and only its Agg canvas is used (no pyplot, no GUI),
so importing this module costs nothing and plotting works on machines without a display.
The figures use the numbers ``compare`` uses (:mod:`benchbackend.analysis.stats`): only ok repeats feed a
timing, the first epoch and the first inference pass are apart, one interval rule; the bar figures
carry compare's verdicts (``compare.rank``): the baseline is marked, and each other group says
faster, slower or not significant, with the speed-up's interval. Which figures a report holds, and
the report itself, are :mod:`benchbackend.analysis.report`'s; colours and layout, :mod:`benchbackend.analysis.style`'s.
"""
from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np
import pandas as pd

from . import summary as summaries
from .experiments import GROUP_KEYS, with_experiment
from .stats import CI_LABEL
from .style import FAILED_COLOR, FAILED_FACE, FAILED_LINESTYLE, colors, figure, mark_failed_ticks, styles, wrap

if TYPE_CHECKING:

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: The gid of the dashed line at the baseline's value on the bar figures.
BASELINE_GID = "baseline"
#: Figure width per bar (room for a two-line verdict under it), and the least width.
_INCH_PER_BAR = 1.7
_MIN_WIDTH = 5.5
#: Characters per line of the MFU axis' label (it runs along the axis' height).
_MFU_LABEL_CHARS = 34


def _interval_note(kinds: Iterable[str]) -> str:
    kinds = {k for k in kinds if k}
    if kinds == {CI_LABEL}:
        return "bars: 95% CI of the median"
    if kinds == {"range"}:
        return "bars: min-max of the repeats"
    if not kinds:
        return "one repeat: no interval"
    return "bars: 95% CI of the median with 6+ repeats, else min-max of the repeats"


def verdict_lines(row: pd.Series, prefix: str) -> str:
    """What a bar says against the baseline, from ``compare.rank``'s columns ``PREFIX_verdict`` and
    ``PREFIX_text``: ``baseline``; ``faster`` / ``slower`` / ``not significant`` over the speed-up
    and its 95% interval (``faster\\n1.85x [1.60-2.10]``); nothing when there is no baseline or the
    group is not ranked (its status already says why)."""
    verdict, text = str(row.get(f"{prefix}_verdict", "")), str(row.get(f"{prefix}_text", ""))
    if not row.get("baseline") or not verdict or verdict.startswith("not ranked ("):
        return ""
    if verdict == "baseline":
        return "baseline"
    if verdict == "n/a":
        return "vs baseline: n/a"
    return text.replace(": ", "\n", 1)


def _tick_labels(groups: pd.DataFrame, prefix: Optional[str], extra: Optional[list[str]] = None) -> list[str]:
    """Under each bar: its label, its status when not ok, ``extra`` (e.g. the first pass), the verdict."""
    out = []
    for i, (_, row) in enumerate(groups.iterrows()):
        lines = [str(row["label"])] + ([f"[{row['status']}]"] if row["status"] != "ok" else [])
        lines += [extra[i]] if extra and extra[i] else []
        verdict = verdict_lines(row, prefix) if prefix else ""
        out.append("\n".join(lines + ([verdict] if verdict else [])))
    return out


def _mark_baseline(ax: "Axes", groups: pd.DataFrame, prefix: str, value: str) -> None:
    """A dashed line across the axes at the baseline's value, and its tick label in bold."""
    verdicts = list(groups.get(f"{prefix}_verdict", pd.Series("", index=groups.index)))
    for i, (verdict, v) in enumerate(zip(verdicts, groups[value].to_numpy(dtype=float))):
        if verdict != "baseline":
            continue
        ax.get_xticklabels()[i].set_fontweight("bold")
        if math.isfinite(v):
            ax.axhline(v, color="black", linestyle="--", linewidth=1.0, alpha=0.7, zorder=0.5, gid=BASELINE_GID)


def _bars(ax: "Axes", groups: pd.DataFrame, value: str, low: str, high: str, unit: str, fmt: str,
          notes: Optional[list[str]] = None, prefix: Optional[str] = "train") -> None:
    """Bars of ``value`` per group with [low, high] error bars; the value (and its line of
    ``notes``, if any) is written above the bar's error bar, never on it; the verdict against the
    baseline (``compare.rank``'s ``PREFIX_*`` columns) under the bar, in its tick label, so that it
    stays with its bar; failed groups hatched grey with a red label."""
    statuses = list(groups["status"])
    x = np.arange(len(groups))
    med = groups[value].to_numpy(dtype=float)
    lo = groups[low].to_numpy(dtype=float)
    hi = groups[high].to_numpy(dtype=float)
    below = np.nan_to_num(med - lo, nan=0.0).clip(min=0)
    above = np.nan_to_num(hi - med, nan=0.0).clip(min=0)
    ok = np.array([s == "ok" for s in statuses])
    palette = colors(groups.index)
    face = [palette[key] if good else FAILED_FACE for key, good in zip(groups.index, ok)]
    bars = ax.bar(x, np.nan_to_num(med, nan=0.0), color=face,
                  edgecolor=["black" if good else FAILED_COLOR for good in ok], yerr=np.vstack([below, above]),
                  capsize=5, error_kw={"elinewidth": 1.2, "ecolor": "black"})
    tops = np.where(np.isfinite(med), np.nan_to_num(med, nan=0.0) + above, 0.0)
    for bar, good, v, status, top, note in zip(bars, ok, med, statuses, tops, notes or [""] * len(groups)):
        if not good:
            bar.set_hatch("//")
        if math.isfinite(v):
            text = format(v, fmt) + unit + (f"\n{note}" if note else "")
        else:
            text = f"no time\n({status})" if not good else "n/a"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9, color="black" if good else FAILED_COLOR)
    ax.set_xticks(x, _tick_labels(groups, prefix), fontsize=8.5)
    mark_failed_ticks(ax, statuses)
    if prefix:
        _mark_baseline(ax, groups, prefix, value)
    top = float(np.nanmax(tops)) if len(tops) and np.nanmax(tops) > 0 else 1.0
    ax.set_ylim(0, top * 1.25)
    ax.grid(axis="y", alpha=0.3)


def _versus(groups: pd.DataFrame, what: str = "bar") -> str:
    """``; under each bar: verdict vs torch`` when the groups have a baseline."""
    base = next((b for b in groups.get("baseline", []) if b), "")
    if base:
        return f"; under each {what}: verdict vs {base}"
    return "; no baseline (none passed its checks): no verdict" if "baseline" in groups else ""


def _width(n: int) -> float:
    return max(_MIN_WIDTH, _INCH_PER_BAR * n + 2)


def epoch_time_figure(groups: pd.DataFrame, title: str) -> "Figure":
    """Bars of the steady epoch time per backend (median over ok repeats) with its interval, the
    baseline marked and each other bar's verdict under it.

    ``groups``: the rows of ``compare.rank`` for one experiment and device (the training ones).
    Failed backends get hatched grey bars and a red label; those without a time a note. When no
    backend has a steady time (single-epoch runs), the first-epoch time is drawn, with no verdict
    (compare has none: there is no steady epoch).
    """
    width = _width(len(groups))
    fig, (ax,) = figure(width, 4.8)
    if groups["steady_s"].notna().any():
        _bars(ax, groups, "steady_s", "steady_low", "steady_high", " s", "#.3g")
        ax.set_ylabel("steady epoch time (s), lower is better")
        note = _interval_note(groups["steady_interval"])
        ax.set_title(wrap(f"{title}: steady epoch time (median over repeats; {note}{_versus(groups)})", width),
                     fontsize=11)
    else:
        _bars(ax, groups, "first_s", "first_s", "first_s", " s", "#.3g", prefix=None)
        ax.set_ylabel("first epoch time (s)")
        asked = pd.to_numeric(groups["epochs"], errors="coerce").max() if "epochs" in groups else math.nan
        why = f"stopped before epoch 2 of {asked:g}" if asked > 1 else "one epoch"  # Ctrl-C, --timeout, a crash
        ax.set_title(wrap(f"{title}: first epoch time ({why}: no steady state, no verdict)", width), fontsize=11)
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
    """A right-hand MFU axis whose label (the peak, which can be long: "torch GEMM probe (cached
    ...)") is wrapped to lines that fit the axis' height; constrained layout makes room for them."""
    factor, peak = scale
    sec = ax.secondary_yaxis("right", functions=(lambda v: v * factor * 100, lambda m: m / (factor * 100)))
    sec.set_ylabel("\n".join(["MFU (%) against"] + textwrap.wrap(peak, _MFU_LABEL_CHARS)), fontsize=9)


def throughput_figure(groups: pd.DataFrame, title: str) -> "Figure":
    """Bars of training throughput (samples/s of the steady epochs; median over ok repeats), each
    labelled with its MFU where a peak is known; a right-hand MFU axis when all share one peak. The
    verdicts are the epoch time's (a throughput ratio is the inverse time ratio: one verdict)."""
    width = _width(len(groups))
    fig, (ax,) = figure(width, 4.8)
    _bars(ax, groups, "samples_per_s", "sps_low", "sps_high", "", ",.0f",
          notes=[_mfu_text(v) for v in groups["mfu"].to_numpy(dtype=float)],
          prefix="train" if groups["steady_s"].notna().any() else None)
    scale = mfu_scale(groups, "samples_per_s", "mfu")
    if scale is not None:
        _mfu_axis(ax, scale)
    samples = groups["train_samples"].dropna()
    per = f", {samples.max():,.0f} samples an epoch" if len(samples) else ""
    ax.set_ylabel("training samples/s (higher is better)")
    ax.set_title(wrap(f"{title}: training throughput (median over repeats{per}; "
                      f"{_interval_note(groups['steady_interval'])}{_versus(groups)})", width), fontsize=11)
    return fig


def inference_figure(df: pd.DataFrame, groups: pd.DataFrame, title: str,
                     samples: Optional[float] = None) -> "Figure":
    """Box plot (with every pass as a point) of the steady inference time per backend: passes
    after each repeat's first; the box's middle line is the median of the repeats' medians (what
    the tables and verdicts use). Under each box: its first pass (tracing, compilation, first
    copies; apart, so that it does not squash the scale) and its verdict against the baseline; the
    baseline's median is a dashed line.

    ``df``: inference rows of one experiment and device (of the repeats that count); ``samples``:
    the samples in one pass, said in the title. Failed backends are hatched and red. ``groups``:
    ``compare.rank``'s rows of those groups (status, label, verdicts)."""
    df = with_experiment(df)
    groups = groups.sort_index()
    keys = list(groups.index)
    width = _width(len(keys))
    fig, (ax,) = figure(width, 4.8)
    steady = summaries.steady_inference(df)
    by_group = {k: g["seconds"].dropna().to_numpy() for k, g in steady.groupby(GROUP_KEYS, sort=True)}
    firsts = groups["infer_first_s"]  # summary's: which row is the first pass is its to know
    data = [by_group.get(k, np.array([])) for k in keys]
    st = list(groups["status"])
    # The line across a box is the statistic every table and verdict uses, the median of the
    # repeats' medians (the baseline's dashed line sits on its box's), not the median of the pooled
    # passes the quartiles show.
    medians = [float(v) if math.isfinite(v) else None for v in groups["infer_s"].to_numpy(dtype=float)]
    box = ax.boxplot(data, positions=np.arange(len(keys)), widths=0.55, patch_artist=True,
                     showfliers=False, medianprops={"color": "black"},
                     usermedians=[m if len(d) else None for m, d in zip(medians, data)])
    rng = np.random.default_rng(0)
    tops = [float(np.max(v)) if len(v) else 0.0 for v in data]
    palette = colors(keys)
    first_lines = []
    for i, (key, values, status) in enumerate(zip(keys, data, st)):
        patch = box["boxes"][i]
        good = status == "ok"
        patch.set_facecolor(palette[key] if good else FAILED_FACE)
        patch.set_alpha(0.6)
        if not good:
            patch.set_hatch("//")
            patch.set_edgecolor(FAILED_COLOR)
        first = firsts.get(key, math.nan)
        first_lines.append(f"1st pass {first:#.3g} s" if math.isfinite(first) else "")
        if len(values):
            ax.scatter(i + rng.uniform(-0.15, 0.15, len(values)), values, s=12, color="black", alpha=0.6, zorder=3)
        else:
            ax.annotate(f"no time\n({status})", (i, 0), xytext=(0, 6), textcoords="offset points", ha="center",
                        va="bottom", fontsize=8, color=FAILED_COLOR)
    ax.set_xticks(np.arange(len(keys)), _tick_labels(groups, "infer", first_lines), fontsize=8.5)
    mark_failed_ticks(ax, st)
    _mark_baseline(ax, groups, "infer", "infer_s")
    ax.set_ylim(0, (max(tops) if tops and max(tops) > 0 else 1.0) * 1.2)
    per = f"{samples:,.0f} samples" if samples and math.isfinite(samples) else "one"
    ax.set_ylabel(f"seconds per pass ({per}), lower is better")
    ax.set_title(wrap(f"{title}: inference time per pass of {per} (passes after the first; "
                      f"box: quartiles, dots: passes{_versus(groups, 'box')})", width), fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _per_epoch(train: pd.DataFrame, col: str) -> pd.DataFrame:
    """Per epoch over the repeats: the median (as the tables use), and the min-max band."""
    values = train[col].where(np.isfinite(train[col]))
    return values.groupby(train["epoch"]).agg(["median", "min", "max"])


def curves_figure(df: pd.DataFrame, groups: pd.DataFrame, title: str) -> "Figure":
    """Training loss and validation accuracy per epoch per backend: the median over repeats (as
    the tables use) with a min-max band. ``df``: train_epoch rows of one experiment and device. Each backend has its own
    colour, marker and line style (backends that agree draw identical curves: the hollow markers
    of decreasing size keep each visible); failed backends are dotted and labelled with their
    status, and a red x marks where their loss stopped being finite. ``groups``: the summary rows
    of those groups (``summary.summarize(df).groups`` or ``compare.rank``): their status and label."""
    df = with_experiment(df)
    keys = sorted({tuple(k) for k in df[GROUP_KEYS].itertuples(index=False)})
    names, statuses = groups["label"].to_dict(), groups["status"].to_dict()
    looks = styles(keys, names)
    fig, (loss_ax, acc_ax) = figure(10.0, 4.4, ncols=2)
    by_group = dict(list(df.groupby(GROUP_KEYS, sort=True)))
    marked = False
    for key in keys:
        train, status = by_group[key], statuses.get(key, "ok")
        look = looks[names[key]]
        style = {"color": look["color"], "marker": look["marker"], "markersize": look["markersize"],
                 "markerfacecolor": "none", "markeredgewidth": 1.4, "linewidth": 1.6,
                 "linestyle": look["linestyle"] if status == "ok" else FAILED_LINESTYLE}
        name = names[key] + ("" if status == "ok" else f" [{status}]")
        for ax, col in ((loss_ax, "loss"), (acc_ax, "val_accuracy")):
            agg = _per_epoch(train, col)
            ax.plot(agg.index, agg["median"], label=name if ax is loss_ax else None, **style)
            ax.fill_between(agg.index, agg["min"], agg["max"], color=style["color"], alpha=0.15, linewidth=0)
        bad = train.loc[~np.isfinite(train["loss"]), "epoch"]
        if len(bad):
            finite = _per_epoch(train, "loss")["median"].dropna()
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
    fig.suptitle(wrap(title + ": training curves (median over repeats, band: min-max)", 10.0), fontsize=11)
    fig.legend(loc="outside lower center", ncols=min(len(keys) + 1, 5), fontsize=9, frameon=False)
    return fig


#: The two phases of a batch-size sweep: (stem part, definition field, throughput, interval, MFU, what).
_SWEEP_PHASES = (("train", "batch_size", "samples_per_s", "sps", "mfu", "training"),
                 ("inference", "inference_batch_size", "infer_sps", "infer_sps", "infer_mfu", "inference"))


def batch_size_figure(groups: pd.DataFrame, title: str, phase: str = "train") -> "Figure":
    """Throughput against batch size, one line per backend (mode, precision) in the styles of the
    other figures: the median samples/s over ok repeats with its interval; a right-hand MFU axis
    when every point shares one peak, else each point labelled with its MFU. A batch size whose
    group is not ok is a red x with its status, off the line.

    ``groups``: ``summary.summarize(df).groups`` rows of one workload, device and definition but for
    the batch size, with ``batch_size`` and ``inference_batch_size`` columns (see ``report.sweeps``)."""
    _, field, rate, interval, mfu, what = next(p for p in _SWEEP_PHASES if p[0] == phase)
    fig, (ax,) = figure(7.5, 4.6)
    labels = list(groups["label"])
    looks = styles(list(groups.index), groups["label"].to_dict())
    scale = mfu_scale(groups, rate, mfu)
    sizes = sorted({int(b) for b in groups[field].dropna()})
    for name in sorted(set(labels)):
        sub = groups[[lab == name for lab in labels]].sort_values(field)
        look = looks[name]
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
    ax.set_title(wrap(f"{title}: {what} throughput against batch size (median over ok repeats; "
                       f"{_interval_note(groups['steady_interval' if phase == 'train' else 'infer_interval'])}"
                       f"{mfu_note})", 7.5), fontsize=11)
    return fig
