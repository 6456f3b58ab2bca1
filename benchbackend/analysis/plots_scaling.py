"""The scaling figure: training throughput against data-parallel replicas (``--replicas``).

One line per backend, mode and precision, and per scaling (strong solid, weak dashed: never one
line), through the single replica's point; beside each line a faint line of perfect scaling
(N times the single replica's throughput), and in the legend each N's efficiency with its
interval (:mod:`benchbackend.analysis.scaling`). A replica count whose group failed is a red x with its status.
matplotlib is imported inside the function (see ``plots.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .experiments import split_mode
from .scaling import efficiency_text
from .style import FAILED_COLOR, figure, styles, wrap

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def scaling_figure(groups: pd.DataFrame, title: str) -> "Figure":
    """``groups``: one comparison's ranked groups with ``scaling.annotate``'s columns."""
    fig, (ax,) = figure(7.5, 4.6)
    keys = list(groups.index)
    base = {k: split_mode(k[3])[0] for k in keys}
    lines: dict[tuple, list] = {}
    for k in keys:
        for kind in ("strong", "weak"):  # the single replica starts both lines
            if groups.loc[k, "replicas"] == 1 or groups.loc[k, "scaling"] == kind:
                lines.setdefault((k[2], base[k], k[4], kind), []).append(k)
    lines = {line: ks for line, ks in lines.items() if any(groups.loc[k, "replicas"] > 1 for k in ks)}
    # Each line is drawn in the look of its first group (the single replica's where it ran).
    firsts = {line: min(ks, key=lambda k: groups.loc[k, "replicas"]) for line, ks in lines.items()}
    looks = styles(list(firsts.values()), {k: groups.loc[k, "label"] for k in firsts.values()})
    counts: set[int] = set()
    for line, ks in lines.items():
        sub = groups.loc[ks].sort_values("replicas")
        label = groups.loc[firsts[line], "label"]
        name, look = label + (" (weak)" if line[3] == "weak" else ""), looks[label]
        ok = sub[sub["status"] == "ok"]
        # Each N's efficiency in the legend: labels at the points would overlap where lines meet.
        effs = [f"x{int(r['replicas'])} {efficiency_text(r)}" for _, r in ok[ok["replicas"] > 1].iterrows()]
        name += f" ({'; '.join(effs)})" if effs else ""
        x, y = ok["replicas"].to_numpy(dtype=float), ok["samples_per_s"].to_numpy(dtype=float)
        below = np.nan_to_num(y - ok["sps_low"].to_numpy(dtype=float), nan=0.0).clip(min=0)
        above = np.nan_to_num(ok["sps_high"].to_numpy(dtype=float) - y, nan=0.0).clip(min=0)
        ax.errorbar(x, y, yerr=np.vstack([below, above]), label=name, color=look["color"], marker=look["marker"],
                    markerfacecolor="none", markeredgewidth=1.4, linestyle="--" if line[3] == "weak" else "-",
                    linewidth=1.6, capsize=4)
        counts |= {int(n) for n in sub["replicas"]}
        one = sub[sub["replicas"] == 1]
        if len(one) and one["status"].iloc[0] == "ok":
            n = sub["replicas"].to_numpy(dtype=float)
            ax.plot(n, n * float(one["samples_per_s"].iloc[0]), color=look["color"], alpha=0.25, linestyle=":")
        for _, r in sub[sub["status"] != "ok"].iterrows():
            v = float(r["samples_per_s"]) if pd.notna(r["samples_per_s"]) else 0.0
            ax.plot([r["replicas"]], [v], marker="x", color=FAILED_COLOR, markersize=10, markeredgewidth=2)
            ax.annotate(f"{name}\n[{r['status']}]", (r["replicas"], v), xytext=(0, 7), textcoords="offset points",
                        ha="center", fontsize=8, color=FAILED_COLOR)
    ax.set_xticks(sorted(counts), [str(n) for n in sorted(counts)])
    ax.set_xlabel("data-parallel replicas")
    ax.set_ylabel("training samples/s (higher is better)")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=False)
    ax.set_title(wrap(f"{title}: training throughput against replicas (median over ok repeats; legend: scaling "
                      "efficiency [95% CI] at each N; dotted: perfect scaling)", 7.5), fontsize=11)
    return fig
