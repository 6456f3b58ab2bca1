"""Text renderings of a ranked comparison (see ``compare.rank``): terminal, markdown, csv, json."""
from __future__ import annotations

import io
import json
import math
from typing import Any, Callable

import pandas as pd

from .stats import CONTEXT_KEYS, label


def short_message(message: str, width: int = 160) -> str:
    """The last non-empty line of a message (a traceback's error line), cut to ``width``."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return text if len(text) <= width else text[: width - 3] + "..."


def _num(x: Any, spec: str = "#.4g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)) or pd.isna(x):
        return "n/a"
    return format(x, spec)


def _ci(low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    return f"[{low:#.4g}, {high:#.4g}]"


def _spread(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"±{x * 100:.1f}%"


def vs_cell(row: pd.Series, prefix: str) -> str:
    """``2.00x faster [1.98-2.02]``: the verdict with the 95% interval in the same direction."""
    verdict = row[f"{prefix}_verdict"]
    ratio, low, high = row[f"{prefix}_ratio"], row[f"{prefix}_ratio_low"], row[f"{prefix}_ratio_high"]
    if verdict in ("baseline", "n/a") or not math.isfinite(ratio):
        return verdict
    has_ci = math.isfinite(low) and math.isfinite(high) and low > 0
    if verdict.endswith("slower"):
        return verdict + (f" [{1 / high:.2f}-{1 / low:.2f}]" if has_ci else "")
    if verdict.endswith("faster"):
        return verdict + (f" [{low:.2f}-{high:.2f}]" if has_ci else "")
    return verdict + (f" [{low:.2f}x-{high:.2f}x]" if has_ci else f" ({ratio:.2f}x)")


def _label(key: tuple) -> str:
    return label(key[2], key[3])


def _train_rows(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    base = frame["baseline"].iloc[0] or "baseline"
    head = ["", "backend", "status", "reps", "1st epoch s", "steady s", "95% CI", "samples/s", "val acc",
            "parity err", f"vs {base}"]
    rows = [["*" if r.fastest_train else "", _label(k), r.status, str(r.repeats), _num(r.first_s),
             _num(r.steady_s), _ci(r.steady_low, r.steady_high), _num(r.samples_per_s, ",.0f"),
             _num(r.val_accuracy, ".4f"), _num(r.parity_max_abs, ".1e"), vs_cell(r, "train")]
            for k, r in frame.iterrows()]
    return head, rows


def _infer_rows(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    base = frame["baseline"].iloc[0] or "baseline"
    head = ["", "backend", "status", "reps", "median s", "spread", "95% CI", f"vs {base}"]
    rows = [["*" if r.fastest_infer else "", _label(k), r.status, str(r.infer_n), _num(r.infer_s),
             _spread(r.infer_spread), _ci(r.infer_low, r.infer_high), vs_cell(r, "infer")]
            for k, r in frame.iterrows()]
    return head, rows


def _fastest_line(frame: pd.DataFrame) -> str:
    parts, notes = [], []
    for prefix, col, what in (("train", "steady_s", "training"), ("infer", "infer_s", "inference")):
        timed = frame[frame[col].notna()]
        if timed.empty:
            continue
        best = frame[frame[f"fastest_{prefix}"]]
        if best.empty:
            parts.append(f"{what} none (no backend passed its checks)")
        else:
            key, row = best.index[0], best.iloc[0]
            verdict = row[f"{prefix}_verdict"]
            how = ("" if verdict in ("baseline", "n/a") else f", {verdict} than {row['baseline']}"
                   if verdict.endswith(("faster", "slower")) else f"; vs {row['baseline']}: {verdict}")
            parts.append(f"{what} {_label(key)} ({_num(row[col])} s{how})")
        quickest = timed[col].idxmin()
        if timed.loc[quickest, "status"] != "ok":
            notes.append(f"{_label(quickest)} was quicker in {what} but is {timed.loc[quickest, 'status']}, "
                         "so it is not ranked")
    line = "fastest correct (*): " + "; ".join(parts) if parts else "no timings"
    return line + "".join(f"\nnote: {n}" for n in notes)


def _contexts(groups: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    out = []
    for ctx, frame in groups.groupby(CONTEXT_KEYS, sort=False):
        base = frame["baseline"].iloc[0]
        out.append((f"{ctx[0]} on {ctx[1]}" + (f" (baseline: {base})" if base else " (no baseline)"), frame))
    return out


def _aligned(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    left = {1, 2, len(head) - 1}  # names, status and the verdict read left to right

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left or i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    align = ["---" if i in (1, 2, len(head) - 1) else "--:" for i in range(len(head))]
    return "\n".join([line(head), "|" + "|".join(align) + "|"] + [line(r) for r in rows])


def _text(groups: pd.DataFrame, table: Callable[[list[str], list[list[str]]], str], markdown: bool) -> str:
    blocks = []
    for title, frame in _contexts(groups):
        parts = [f"### {title}" if markdown else f"== {title} =="]
        timed_infer = frame["infer_s"].notna().any()
        if frame[["first_s", "steady_s"]].notna().any(axis=None) or not timed_infer:
            parts += ["**Training**" if markdown else "Training", table(*_train_rows(frame))]
        if timed_infer:
            parts += ["**Inference**" if markdown else "Inference", table(*_infer_rows(frame))]
        parts.append(_fastest_line(frame))
        blocks.append(("\n\n" if markdown else "\n").join(parts))
    return "\n\n".join(blocks) + "\n"


def records(groups: pd.DataFrame) -> list[dict[str, Any]]:
    """One plain dict per group (NaN as None), for csv and json."""
    flat = groups.reset_index()
    flat.insert(4, "label", [_label(k) for k in groups.index])
    out = []
    for rec in flat.to_dict(orient="records"):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else
                        v.item() if hasattr(v, "item") else v) for k, v in rec.items()})
    return out


def render(groups: pd.DataFrame, fmt: str, warnings: list[str]) -> str:
    """Render ``groups`` (from ``compare.rank``) as table, markdown, csv or json; json holds the
    warnings too, the other formats leave them to the caller."""
    if fmt == "table":
        return _text(groups, _aligned, markdown=False)
    if fmt == "markdown":
        return _text(groups, _markdown, markdown=True)
    if fmt == "csv":
        buf = io.StringIO()
        pd.DataFrame(records(groups)).to_csv(buf, index=False)
        return buf.getvalue()
    if fmt == "json":
        return json.dumps({"groups": records(groups), "warnings": warnings}, indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r}")


