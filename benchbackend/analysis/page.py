"""The report's index.html: real tables (summary, verdicts, warnings, environment) and the figures
with their captions. The numbers are compare's (``compare.rank``), laid out by
:mod:`benchbackend.analysis.tables`'s row builders, so that the page and the terminal show the same cells.
"""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Optional

import pandas as pd

from . import scaling, tables
from . import tables_generation as generations
from .experiments import context_name, with_experiment

_STYLE = ("body{font-family:system-ui,sans-serif;max-width:1250px;margin:2em auto;padding:0 1em}"
          "table{border-collapse:collapse;font-size:13px;margin:0.5em 0 1em}"
          "td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}th{background:#f6f8fa}"
          "td.num{text-align:right;font-variant-numeric:tabular-nums}.warnings td{color:#8a4b00}"
          "figure{margin:1.5em 0}figcaption{font-size:14px;color:#333;max-width:60em}"
          "img{max-width:100%;border:1px solid #ddd}")
#: Phases only a running worker writes.
_WORKER_PHASES = ("build", "tune", "parity", "train_epoch", "inference")
_ENV_COLUMNS = (("backend_version", "version"), ("host", "host"), ("cpu", "CPU"), ("threads", "threads"),
                ("gpu", "GPU"), ("python", "python"), ("os", "OS"))


def _esc(value: object) -> str:
    return html.escape(str(value))


def table(head: list[str], rows: list[list[str]], numeric: Optional[set[int]] = None,
          cls: str = "") -> str:
    """An HTML table; the columns in ``numeric`` are right-aligned."""
    numeric = numeric or set()
    attr = f' class="{cls}"' if cls else ""
    body = "".join("<tr>" + "".join(f'<td class="num">{_esc(v)}</td>' if i in numeric else f"<td>{_esc(v)}</td>"
                                    for i, v in enumerate(r)) + "</tr>" for r in rows)
    return (f"<table{attr}><thead><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _numeric(head: list[str]) -> set[int]:
    """Compare's tables: names, status, repeats and the verdict read left to right, the rest are numbers."""
    return {i for i in range(len(head)) if i not in (0, 1, 2, 3, len(head) - 1)}


def summary_html(groups: pd.DataFrame, metric: str = "epoch-time", generation: Optional[pd.DataFrame] = None) -> str:
    """Compare's training, inference and generation tables per experiment and device, as HTML tables."""
    parts = [f"<p>{_esc(line)}</p>" for line in tables.convention(metric=metric).splitlines()]
    if generation is not None and len(generation):
        parts.append(f"<p>{_esc(generations.CONVENTION)}</p>")
    for title, what, frame in tables._contexts(groups):
        parts.append(f"<h3>{_esc(title)}</h3>")
        parts += [f"<p>{_esc(line)}</p>" for line in (what, tables.mfu_line(frame)) if line]
        trains = frame[~frame["inference_only"].astype(bool)]
        timed_infer = frame["infer_s"].notna().any()
        gen = generations.in_context(generation, frame)
        if gen is None or frame[["first_s", "steady_s", "infer_s"]].notna().any(axis=None):
            if len(trains) and (trains[["first_s", "steady_s"]].notna().any(axis=None) or not timed_infer):
                head, rows = tables._train_rows(trains, metric)
                parts += ["<h4>Training</h4>", table(head, rows, _numeric(head))]
            if timed_infer or not len(trains):
                head, rows = tables._infer_rows(frame)
                parts += ["<h4>Inference</h4>", table(head, rows, _numeric(head))]
        if gen is not None:
            head, rows = generations.value_rows(gen)
            parts += [f"<h4>{_esc(generations.what(gen))}</h4>", table(head, rows, set(range(4, len(head))))]
            if gen["baseline"].ne("").any():
                head, rows = generations.verdict_rows(gen)
                parts.append(table(head, rows, {2}))
        scaled = scaling.rows(frame) if "replicas" in frame else None
        if scaled is not None:  # what compare prints: efficiency, comm share, gradient and ring MB
            head, rows = scaled
            parts += ["<h4>Scaling</h4>", f"<p>{_esc(scaling.SCALING_LINE)}</p>",
                      table(head, rows, set(range(4, len(head))))]
        parts += [f"<p>{_esc(line)}</p>" for line in tables._fastest_line(frame, metric, generation).splitlines()]
    return "\n".join(parts)


def _ratio_cells(row: pd.Series, prefix: str) -> list[str]:
    """Verdict, speed-up and its 95% CI of one group (printed so that the bounds keep their side of 1)."""
    verdict = str(row[f"{prefix}_verdict"])
    ratio, low, high = (float(row[f"{prefix}_{c}"]) for c in ("ratio", "ratio_low", "ratio_high"))
    if not math.isfinite(ratio):
        return [verdict, "", ""]
    if not (math.isfinite(low) and math.isfinite(high)):
        return [verdict, f"{tables._fixed(ratio)}x", "n/a"]
    r, lo, hi = tables._bounds(ratio, low, high)
    return [verdict, f"{r}x", f"[{lo}, {hi}]"]


def verdicts_rows(groups: pd.DataFrame) -> list[list[str]]:
    """One row per group: where, backend, its baseline, then training's and inference's verdict,
    speed-up and interval."""
    rows = []
    for index, row in groups.iterrows():
        where = context_name(index[:2])
        rows.append([where, str(row["label"]), str(row["status"]), str(row["baseline"] or "none")]
                    + _ratio_cells(row, "train") + _ratio_cells(row, "infer"))
    return rows


VERDICT_HEAD = ["experiment", "backend", "status", "baseline", "training verdict", "speed-up", "95% CI",
                "inference verdict", "speed-up", "95% CI"]


def environment_rows(df: pd.DataFrame) -> tuple[list[list[str]], list[str]]:
    """One row per backend label whose worker ran (its versions, hosts, CPUs, threads: each distinct
    value), and the labels whose worker never reported (unavailable, or died at once) with their
    status: one line for them instead of rows of empty cells (their rows hold only the parent's host)."""
    df = with_experiment(df)
    rows, missing = [], []
    for (backend, mode, precision), sub in df.groupby(["backend", "mode", "precision"], sort=True):
        name = f"{backend}:{mode}" + (f"@{precision}" if precision != "fp32" else "")
        cells = []
        for col, _ in _ENV_COLUMNS:
            values = sub[col].dropna() if col in sub.columns else pd.Series(dtype=object)
            found = sorted({f"{v:g}" if isinstance(v, float) else str(v) for v in values} - {""})
            cells.append(", ".join(found))
        ran = sub["phase"].isin(_WORKER_PHASES).any() or bool(cells[0])  # cells[0]: the backend's version
        if not ran:
            statuses = sorted({str(s) for s in sub["status"] if str(s) not in ("", "ok")})
            missing.append(name + (f" ({', '.join(statuses)})" if statuses else ""))
            continue
        rows.append([name, ", ".join(sorted({str(d) for d in sub["device"] if d != ""}))] + cells)
    return rows, missing


def render(df: pd.DataFrame, groups: pd.DataFrame, figures: list[tuple[str, str]], sources: list[str],
           warnings: list[str], metric: str = "epoch-time", generation: Optional[pd.DataFrame] = None) -> str:
    """The page. ``groups``: ``compare.rank``'s frame; ``figures``: (PNG file name, caption);
    ``generation``: ``generation.rank``'s frame, where the rows generated."""
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', "<title>benchbackend report</title>",
             f"<style>{_STYLE}</style></head><body>", "<h1>benchbackend report</h1>",
             "<p>From " + ", ".join(f"<code>{_esc(Path(s))}</code>" for s in sources) + "</p>"]
    if warnings:
        parts += ["<h2>Warnings</h2>",
                  table(["#", "warning"], [[str(i), w] for i, w in enumerate(warnings, 1)], {0}, "warnings")]
    parts += ["<h2>Summary</h2>", summary_html(groups, metric, generation)]
    speed = groups[~generations.only_generation(groups, generation)]  # generation's verdicts are in its tables
    if speed["baseline"].ne("").any():
        parts += ["<h2>Verdicts</h2>", f"<p>{_esc(tables.convention(metric=metric).splitlines()[0])}</p>",
                  table(VERDICT_HEAD, verdicts_rows(speed), {5, 6, 8, 9})]
    env, missing = environment_rows(df)
    if env or missing:
        parts.append("<h2>Environment</h2>")
    if env:
        parts.append(table(["backend", "device"] + [name for _, name in _ENV_COLUMNS], env))
    if missing:
        parts.append(f"<p>No worker environment (not run): {_esc(', '.join(missing))}</p>")
    if figures:
        parts.append("<h2>Figures</h2>")
    for name, caption in figures:
        parts.append(f'<figure><img src="{_esc(name)}" alt="{_esc(Path(name).stem)}">'
                     f"<figcaption>{_esc(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
