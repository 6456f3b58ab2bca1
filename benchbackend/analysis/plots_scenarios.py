"""The LoadGen scenario figures (``--scenario``): each backend's latency distribution, and for a
Server peak search, p99 against the offered rate with the bound drawn.

LoadGen's detail log gives percentiles, not every latency, so the distribution is drawn from the
row's percentiles (p50, p90, p99, p99.9): the empirical CDF at those points, one line per repeat
(the last run of a repeat: a peak search's probes are different loads). matplotlib is imported
inside ``style.figure`` (see ``plots.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .experiments import GROUP_KEYS, REPEAT_KEYS
from .style import FAILED_LINESTYLE, figure, styles, wrap

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_WIDTH = 8.0
POINTS = (("latency_p50_ms", 0.5), ("latency_p90_ms", 0.9), ("latency_p99_ms", 0.99), ("latency_p999_ms", 0.999))


def _numbers(rows: pd.DataFrame, cols: tuple[str, ...]) -> pd.DataFrame:
    return rows.assign(**{c: pd.to_numeric(rows[c], errors="coerce") for c in cols if c in rows})


def _looks(rows: pd.DataFrame, groups: pd.DataFrame) -> tuple[list[tuple], dict[tuple, str], dict[str, dict]]:
    keys = sorted({tuple(k) for k in rows[GROUP_KEYS].itertuples(index=False)})
    names = {k: str(groups.loc[k, "label"]) if k in groups.index else str(k[2]) for k in keys}
    return keys, names, styles(keys, names)


def _tail(q: np.ndarray) -> np.ndarray:
    """The CDF's height on a tail scale, -log10(1 - q): p50, p90, p99 and p99.9 evenly apart."""
    return -np.log10(1 - q)


def latency_cdf_figure(rows: pd.DataFrame, groups: pd.DataFrame, title: str) -> "Figure":
    """Share of queries completed within a latency (log scale) at LoadGen's percentiles, per group:
    one line per repeat. ``rows``: the ``scenario`` rows of one experiment and device."""
    fig, (ax,) = figure(_WIDTH, 4.8)
    rows = _numbers(rows, tuple(c for c, _ in POINTS))
    keys, names, looks = _looks(rows, groups)
    for key in keys:
        status = str(groups.loc[key, "status"]) if key in groups.index else "ok"
        look = looks[names[key]]
        label = names[key] + ("" if status == "ok" else f" [{status}]")
        mine = rows[(rows[GROUP_KEYS] == pd.Series(key, index=GROUP_KEYS)).all(axis=1)]
        for _, rep in mine.groupby(REPEAT_KEYS, sort=True):
            last = rep.iloc[-1]
            x = np.array([last[c] for c, _ in POINTS], dtype=float)
            y = _tail(np.array([q for _, q in POINTS]))
            ax.plot(x, y, color=look["color"], marker=look["marker"], markerfacecolor="none",
                    linestyle=look["linestyle"] if status == "ok" else FAILED_LINESTYLE, label=label)
            label = "_" + label
    ax.set_xscale("log")
    ax.set_yticks(_tail(np.array([q for _, q in POINTS])), ["p50", "p90", "p99", "p99.9"])
    ax.set_xlabel("latency (ms, log scale): LoadGen's, from a query's issue to its completion")
    ax.set_ylabel("share of queries completed within it (tail scale)")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=min(len(keys), 4), fontsize=9, frameon=False)
    scenario = next((s for s in rows["scenario"] if isinstance(s, str) and s), "")
    ax.set_title(wrap(f"{title}: {scenario} latency distribution at LoadGen's percentiles (one line per repeat)",
                      _WIDTH), fontsize=11)
    return fig


def peak_search_figure(rows: pd.DataFrame, groups: pd.DataFrame, title: str) -> "Figure":
    """p99 latency against the offered rate of every probe of a Server peak search, per group;
    filled markers: probes LoadGen called valid; the bound drawn as a dashed line."""
    fig, (ax,) = figure(_WIDTH, 4.8)
    rows = _numbers(rows, ("latency_p99_ms", "target_qps", "latency_bound_ms", "probe"))
    rows = rows[rows["target_qps"].notna()]
    keys, names, looks = _looks(rows, groups)
    for key in keys:
        look = looks[names[key]]
        mine = rows[(rows[GROUP_KEYS] == pd.Series(key, index=GROUP_KEYS)).all(axis=1)].sort_values("target_qps")
        valid = mine["loadgen_valid"].astype(str).eq("valid").to_numpy()
        ax.plot(mine["target_qps"], mine["latency_p99_ms"], color=look["color"], linestyle=":", linewidth=1,
                label="_" + names[key])
        ax.scatter(mine["target_qps"][valid], mine["latency_p99_ms"][valid], color=look["color"],
                   marker=look["marker"], label=names[key] + " (valid)")
        ax.scatter(mine["target_qps"][~valid], mine["latency_p99_ms"][~valid], facecolors="none",
                   edgecolors=look["color"], marker=look["marker"], label=names[key] + " (invalid)")
        if valid.any():
            ax.axvline(mine["target_qps"][valid].max(), color=look["color"], alpha=0.4, linewidth=1)
    for bound in sorted(set(rows["latency_bound_ms"].dropna())):
        ax.axhline(bound, color="black", linestyle="--", linewidth=1.2, label=f"bound {bound:g} ms")
    ax.set_yscale("log")
    rates = rows["target_qps"].to_numpy(dtype=float)
    wide = len(rates) and rates.max() / rates.min() > 10  # backends 100x apart: each search stays readable
    if wide:
        ax.set_xscale("log")
    ax.set_xlabel(f"offered rate (target QPS of the Poisson arrivals{', log scale' if wide else ''})")
    ax.set_ylabel("p99 latency (ms, log scale)")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    ax.set_title(wrap(f"{title}: Server peak search, p99 against offered QPS per probe (filled: LoadGen valid; "
                      "thin vertical line: each backend's peak)", _WIDTH), fontsize=11)
    return fig
