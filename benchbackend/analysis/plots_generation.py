"""The generation figure: time per output token (TPOT) against the depth of the key/value cache.

One line per backend, mode and precision: at each cache depth (the tokens in the cache as a decode
step begins: P + step - 1), the median TPOT of that step over the passes after each repeat's first
and over the timed repeats (``summary.timed_repeats``), as llama-bench's ``-d`` reads decode speed
after D tokens. Each prompt length P is a segment of its own along the same line (depths P to
P + G - 2). A backend that ran every step in one dispatch (``jax:scan``) has no per-step time: its
mean TPOT (seconds / steps) is a flat dashed segment over the depths it covered. A group that
failed a check is dotted and labelled with its status. matplotlib is imported inside the function
(see ``plots.py``).
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


def depth_medians(decode: pd.DataFrame) -> pd.DataFrame:
    """Per group, prompt length and cache depth: the median TPOT (s) over the steady passes of every
    repeat given, and whether it is a one-dispatch mean (``scan``). ``decode``: ``decode`` rows."""
    cols = ("seconds", "steps", "pass", "prompt_tokens", "cache_depth")
    rows = decode.assign(**{c: pd.to_numeric(decode[c], errors="coerce") for c in cols})
    last = rows.groupby(GROUP_KEYS + ["prompt_tokens"] + REPEAT_KEYS, dropna=False)["pass"].transform("max")
    rows = rows[(rows["pass"] >= 2) | (last == 1)]
    steps = rows["steps"].fillna(1).clip(lower=1)
    rows = rows.assign(tpot=rows["seconds"] / steps, scan=steps > 1, span=steps)
    per_step = rows[~rows["scan"]].groupby(GROUP_KEYS + ["prompt_tokens", "cache_depth"])["tpot"].median()
    scan = rows[rows["scan"]].groupby(GROUP_KEYS + ["prompt_tokens"]).agg(
        tpot=("tpot", "median"), cache_depth=("cache_depth", "min"), span=("span", "max"))
    out = per_step.reset_index().assign(scan=False, span=1.0)
    if len(scan):
        out = pd.concat([out, scan.reset_index().assign(scan=True)], ignore_index=True)
    return out


def tpot_depth_figure(decode: pd.DataFrame, groups: pd.DataFrame, title: str) -> "Figure":
    """TPOT (ms) against cache depth, one line per group. ``decode``: the ``decode`` rows of one
    experiment and device, of the repeats that feed timings; ``groups``: compare's groups of that
    context (their labels and statuses)."""
    fig, (ax,) = figure(_WIDTH, 4.8)
    found = depth_medians(decode)
    keys = sorted({tuple(k) for k in found[GROUP_KEYS].itertuples(index=False)})
    names = {k: str(groups.loc[k, "label"]) if k in groups.index else k[2] for k in keys}
    looks = styles(keys, names)
    for key in keys:
        status = str(groups.loc[key, "status"]) if key in groups.index else "ok"
        look = looks[names[key]]
        style = {"color": look["color"], "linewidth": 1.6, "markerfacecolor": "none", "markeredgewidth": 1.2}
        label = names[key] + ("" if status == "ok" else f" [{status}]")
        mine = found[(found[GROUP_KEYS] == pd.Series(key, index=GROUP_KEYS)).all(axis=1)]
        for _, seg in mine.groupby("prompt_tokens", sort=True):
            for scan, part in seg.groupby("scan"):
                part = part.sort_values("cache_depth")
                if scan:
                    row = part.iloc[0]
                    x = np.array([row["cache_depth"], row["cache_depth"] + row["span"] - 1])
                    y = np.full(2, row["tpot"] * 1e3)
                    ax.plot(x, y, linestyle="--" if status == "ok" else FAILED_LINESTYLE, label=label + " (one "
                            "dispatch: mean)", **style)
                else:
                    ax.plot(part["cache_depth"], part["tpot"] * 1e3, marker=look["marker"],
                            markersize=max(3.0, look["markersize"] - 3),
                            linestyle=look["linestyle"] if status == "ok" else FAILED_LINESTYLE, label=label, **style)
                label = "_" + label  # one legend entry per group
    tpot = found["tpot"].to_numpy(dtype=float) * 1e3
    tpot = tpot[np.isfinite(tpot) & (tpot > 0)]
    wide = len(tpot) and tpot.max() / tpot.min() > 10  # gpt-nano's span 35x: close lines merge on a linear axis
    if wide:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, None)
    ax.set_xlabel("cache depth (tokens in the key/value cache as the step begins)")
    ax.set_ylabel(f"time per output token (ms{', log scale' if wide else ''}), lower is better")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=min(len(keys), 4), fontsize=9, frameon=False)
    batch = sorted({int(b) for b in pd.to_numeric(decode["samples"], errors="coerce").dropna()})
    per = f"batch {', '.join(map(str, batch))}; " if batch else ""
    ax.set_title(wrap(f"{title}: time per output token against cache depth ({per}median over the passes after "
                      "the first and over repeats; one segment per prompt length)", _WIDTH), fontsize=11)
    return fig
