"""How the figures look: one colour per backend, mode and precision, the same in every figure and
every report; markers and line styles; the figure canvas; titles that fit.

A colour comes from the group itself (backend, mode, precision), never from its position among the
groups drawn, nor from its printed label (``torch`` in one report is ``torch:eager`` in another
where torch ran in two modes). Each registered backend has its own hue, in registry order; a mode
other than the backend's default is a lighter shade of it, a precision other than fp32 a darker
one. A backend the registry does not know gets a hue from its name's digest. Red and grey are
never a backend's: they mean failed.
"""
from __future__ import annotations

import textwrap
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FAILED_COLOR = "#c62828"
FAILED_FACE = "#d0d0d0"
#: One hue per registered backend, in registry order (tab10 without red and grey, then darker tab20b).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#393b79", "#8c6d31", "#637939", "#7b4173"]
#: How far a non-default mode is mixed towards white, per rank of the mode in the registry (less for a
#: backend of more than three modes, so that every mode keeps a shade of its own within 0.6).
_MODE_LIGHTEN = 0.3
#: How far a precision other than fp32 is mixed towards black, per rank of the precision.
_PRECISION_DARKEN = 0.22
#: Markers and line styles per backend, so that identical curves (same weights, same data) stay
#: visible on top of each other: each marker is drawn hollow and smaller than the one before.
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
LINESTYLES = ["-", "--", "-."]
FAILED_LINESTYLE = ":"
DPI = 120
#: Characters per line of a title, per inch of figure width.
_TITLE_CHARS_PER_INCH = 11


def _rank(value: str, known: tuple[str, ...], default: str) -> int:
    """0 for the default (or an empty value), the registry's rank otherwise, a digest for unknowns."""
    if value in ("", default):
        return 0
    if value in known:
        return known.index(value) + (default not in known)
    return 1 + zlib.crc32(value.encode()) % 3


def _mix(color: str, target: float, amount: float) -> str:
    """``color`` mixed with white (target 1.0) or black (target 0.0) by ``amount`` (0-1)."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    out = [c + (target - c) * amount for c in rgb]
    return "#" + "".join(f"{round(c * 255):02x}" for c in out)


def color_of(backend: str, mode: str = "", precision: str = "") -> str:
    """The colour of one group, from what it is (see the module docstring)."""
    from ..backends import registry

    names = list(registry.BACKENDS)
    spec = registry.BACKENDS.get(backend)
    hue = names.index(backend) if backend in names else zlib.crc32(backend.encode())
    color = PALETTE[hue % len(PALETTE)]
    modes = tuple(spec.mode_names) if spec is not None else ()
    precisions = tuple(p for p in (spec.precisions if spec is not None else ()) if p != "fp32")
    step = min(_MODE_LIGHTEN, 0.6 / max(1, len(modes) - 1))  # four modes (torch's) still part within 0.6
    lighten = min(0.6, step * _rank(mode, modes, modes[0] if modes else ""))
    darken = min(0.55, _PRECISION_DARKEN * _rank(precision, precisions, "fp32"))
    return _mix(_mix(color, 1.0, lighten), 0.0, darken)


def colors(index: Any) -> dict[tuple, str]:
    """The colour of each group of a summary frame's index (``experiments.GROUP_KEYS`` order)."""
    return {key: color_of(*[str(v) for v in key[2:5]]) for key in index}


def styles(keys: list[tuple], names: dict[tuple, str]) -> dict[str, dict[str, Any]]:
    """Colour, marker, marker size and line style per label ``names[key]`` of the groups ``keys``."""
    by_name = {names[k]: k for k in sorted(set(keys), key=lambda k: names[k])}
    return {name: {"color": color_of(*[str(v) for v in key[2:5]]), "marker": MARKERS[i % len(MARKERS)],
                   "markersize": max(4.0, 9.0 - 1.5 * i), "linestyle": LINESTYLES[i % len(LINESTYLES)]}
            for i, (name, key) in enumerate(by_name.items())}


def figure(width: float, height: float, ncols: int = 1) -> tuple["Figure", list["Axes"]]:
    """A figure on matplotlib's Agg canvas (no pyplot, no display), laid out by constrained layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def wrap(title: str, width_in: float) -> str:
    """A title broken into lines that fit the figure, so that it is never cut off."""
    return "\n".join(textwrap.wrap(title, max(30, int(width_in * _TITLE_CHARS_PER_INCH))))


def mark_failed_ticks(ax: "Axes", statuses: list[str]) -> None:
    for tick, status in zip(ax.get_xticklabels(), statuses):
        if status != "ok":
            tick.set_color(FAILED_COLOR)
