"""``benchbackend compare``: read results CSVs, rank backends against a baseline, say how sure we are.

For each workload and device, every backend (and mode) is compared with the baseline backend on its
per-repeat steady epoch time and per-repeat median inference time: the ratio of medians with a
bootstrap 95% interval, and a Mann-Whitney U test for the verdict ("1.85x faster", "1.20x slower",
"not significant"). Only backends whose status is ``ok`` can be the fastest. The numbers come from
:mod:`benchbackend.stats`; the text from :mod:`benchbackend.tables`.
"""
from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from . import results, stats, tables
from .errors import ResultsError
from .stats import CONTEXT_KEYS, GROUP_KEYS, label

FORMATS = ("table", "markdown", "csv", "json")
MIN_REPEATS = 3
SPREAD_LIMIT = 0.10
#: Compared across every row of one workload and device.
CONTEXT_ENV = ("host", "os", "cpu", "gpu")
#: Compared only within one backend: isolated backend environments legitimately differ in these.
BACKEND_ENV = ("backend_version", "python")
_METRICS = (("train", "steady_s"), ("infer", "infer_s"))


@dataclass
class CompareOutcome:
    """What ``compare`` prints and how it exits; ``cli.py`` does the printing."""

    text: str
    warnings: list[str]
    exit_code: int
    #: The rows compared (for ``plots.write_report``) and the terminal table of them.
    frame: Optional[pd.DataFrame] = None
    table_text: str = ""


def _expand(paths: list[str]) -> list[str]:
    """Expand globs the shell left alone (quoted, or on Windows); directories stay for read_many."""
    out: list[str] = []
    for raw in paths:
        raw = str(raw)
        if any(c in raw for c in "*?[") and not Path(raw).exists():
            found = sorted(glob.glob(raw))
            if not found:
                raise ResultsError(f"{raw}: no files match")
            out += found
        else:
            out.append(raw)
    return out


def group_name(key: tuple) -> str:
    """``mnist/cpu/torch`` for warnings."""
    workload, device, backend, mode = key
    return f"{workload}/{device}/{label(backend, mode)}"


def _matches(key: tuple, name: str) -> bool:
    backend, sep, mode = name.partition(":")
    return key[2] == backend and (not sep or key[3] == mode)


def _pick_baseline(frame: pd.DataFrame, baseline: Optional[str], where: str,
                   warnings: list[str]) -> Optional[tuple]:
    keys = sorted(frame.index)
    if baseline is None:
        ok = sorted(frame.index[frame["status"] == "ok"])
        return (ok or keys)[0]
    found = [k for k in keys if _matches(k, baseline)]
    if not found:
        warnings.append(f"{where}: no {baseline} results, so no ratios there")
        return None
    if len(found) > 1:
        warnings.append(f"{where}: {baseline} ran in several modes; the baseline is {label(*found[0][2:])}")
    return found[0]


def rank(summary: stats.Summary, baseline: Optional[str] = None) -> tuple[pd.DataFrame, list[str]]:
    """Add ratios to the baseline, verdicts and the fastest correct group per workload and device.

    ``baseline`` is a backend name (``BACKEND`` or ``BACKEND:MODE``); by default the first backend
    alphabetically in each workload and device among those whose status is ok (among all when none
    is). Raises ResultsError when the named baseline ran nowhere.
    """
    groups = summary.groups.copy()
    keys = list(groups.index)
    if baseline is not None and not any(_matches(k, baseline) for k in keys):
        raise ResultsError(f"unknown baseline backend {baseline!r}; backends in these results: "
                           + ", ".join(sorted({label(k[2], k[3]) for k in keys})))
    warnings: list[str] = []
    new: dict[str, list] = {c: [] for c in ["baseline", "fastest_train", "fastest_infer"]}
    for prefix, _ in _METRICS:
        for c in ("ratio", "ratio_low", "ratio_high", "p", "verdict"):
            new[f"{prefix}_{c}"] = []
    for ctx, frame in groups.groupby(CONTEXT_KEYS, sort=False):
        ctx_keys = list(frame.index)
        base = _pick_baseline(frame, baseline, "/".join(ctx), warnings)
        fastest = {p: _fastest(frame, col) for p, col in _METRICS}
        for key in ctx_keys:
            new["baseline"].append(label(*base[2:]) if base else "")
            for prefix, col in _METRICS:
                new[f"fastest_{prefix}"].append(key == fastest[prefix])
                r = (stats.compare_times(summary.samples(base, col), summary.samples(key, col),
                                         summary.bootstrap(base, col), summary.bootstrap(key, col))
                     if base is not None and key != base else None)
                new[f"{prefix}_ratio"].append(r.ratio if r else math.nan)
                new[f"{prefix}_ratio_low"].append(r.low if r else math.nan)
                new[f"{prefix}_ratio_high"].append(r.high if r else math.nan)
                new[f"{prefix}_p"].append(r.pvalue if r else math.nan)
                verdict = "baseline" if key == base else (r.verdict if r else "n/a")
                new[f"{prefix}_verdict"].append(verdict)
    order = [k for _, f in groups.groupby(CONTEXT_KEYS, sort=False) for k in f.index]
    groups = groups.loc[order]
    for col, values in new.items():
        groups[col] = values
    return groups, warnings


def _fastest(frame: pd.DataFrame, col: str) -> Optional[tuple]:
    """The fastest group among the correct ones (status ``ok``), or None."""
    ok = frame[(frame["status"] == "ok") & frame[col].notna()]
    return ok[col].idxmin() if len(ok) else None


def _names(groups: pd.DataFrame, mask: pd.Series, detail: Optional[pd.Series] = None) -> str:
    items = []
    for key in groups.index[mask.to_numpy()]:
        items.append(group_name(key) + (f" ({detail[key]})" if detail is not None else ""))
    return ", ".join(items)


def stability_warnings(groups: pd.DataFrame) -> list[str]:
    """Too few repeats, a spread over 10% of the median, no steady state (single epoch)."""
    out = []
    n = groups[["steady_n", "infer_n"]].replace(0, np.nan).min(axis=1)
    few = n.notna() & (n < MIN_REPEATS)
    if few.any():
        out.append(f"fewer than {MIN_REPEATS} repeats, so intervals and verdicts are weak: "
                   + _names(groups, few, n.astype("Int64").astype(str)))
    for col, what in (("steady_spread", "steady epoch time"), ("infer_spread", "inference time")):
        wide = groups[col] > SPREAD_LIMIT
        if wide.any():
            pct = (groups[col] * 100).round().astype("Int64").astype(str) + "%"
            out.append(f"unstable {what} (spread over {SPREAD_LIMIT:.0%} of the median): "
                       + _names(groups, wide, pct))
    single = (groups["steady_n"] == 0) & groups["first_s"].notna()
    if single.any():
        out.append("only one epoch, so no steady epoch time (n/a): " + _names(groups, single))
    return out


def _values_by_source(frame: pd.DataFrame, col: str) -> str:
    parts = []
    for value, sub in frame.groupby(col, sort=True):
        files = sorted({Path(s).name for s in sub["source"]})
        parts.append(f"{value!r} ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
    return "; ".join(parts)


def environment_warnings(df: pd.DataFrame) -> list[str]:
    """Rows from different environments compared with each other; one workload name, several hashes."""
    cols = list(dict.fromkeys(GROUP_KEYS + ["workload_hash", *CONTEXT_ENV, *BACKEND_ENV, "source"]))
    env = df[cols].drop_duplicates()
    out = []
    checks = [(c, CONTEXT_KEYS) for c in CONTEXT_ENV] + [(c, CONTEXT_KEYS + ["backend"]) for c in BACKEND_ENV]
    for col, keys in checks:
        known = env[env[col] != ""]
        counts = known.groupby(keys, sort=True)[col].nunique()
        for key in counts.index[counts > 1]:
            key = key if isinstance(key, tuple) else (key,)
            sub = known[(known[keys] == pd.Series(key, index=keys)).all(axis=1)]
            out.append(f"{'/'.join(key)}: rows from different environments are compared "
                       f"({col} differs): {_values_by_source(sub, col)}")
    hashes = env[env["workload_hash"] != ""].groupby("workload", sort=True)["workload_hash"].nunique()
    for workload in hashes.index[hashes > 1]:
        sub = env[(env["workload"] == workload) & (env["workload_hash"] != "")]
        out.append(f"workload {workload!r} has {hashes[workload]} different definitions (workload_hash): "
                   + _values_by_source(sub, "workload_hash"))
    return out


def _status_warnings(groups: pd.DataFrame) -> list[str]:
    bad = groups[(groups["status"] != "ok") & (groups["message"] != "")]
    return [f"{group_name(k)}: {row.status}: {tables.short_message(row.message)}" for k, row in bad.iterrows()]


def regressions(groups: pd.DataFrame, candidate: tuple[str, ...], factor: float) -> list[str]:
    """Messages for each candidate slower than the baseline by more than ``factor`` (median ratio).

    With no candidate named, every non-baseline group is a candidate.
    """
    out = []
    for key, row in groups.iterrows():
        if row["baseline"] == "" or row["train_verdict"] == "baseline":
            continue
        if candidate and not any(_matches(key, c) for c in candidate):
            continue
        for prefix, what in (("train", "steady epoch"), ("infer", "inference")):
            ratio = row[f"{prefix}_ratio"]
            if ratio > 0 and 1 / ratio > factor:
                out.append(f"regression: {group_name(key)} {what} is {1 / ratio:.2f}x slower than "
                           f"{row['baseline']} (limit {factor:g}x)")
    return out


def _analyse(df: pd.DataFrame, baseline: Optional[str], candidate: tuple[str, ...],
             fail_on_regression: Optional[float], notes: list[str]) -> tuple[pd.DataFrame, list[str], int]:
    if fail_on_regression is not None and not fail_on_regression >= 1:
        raise ResultsError(f"the regression factor must be at least 1; got {fail_on_regression!r}")
    summary = stats.summarize(df)
    keys = list(summary.groups.index)
    for name in candidate:
        if not any(_matches(k, name) for k in keys):
            raise ResultsError(f"unknown candidate backend {name!r}; backends in these results: "
                               + ", ".join(sorted({label(k[2], k[3]) for k in keys})))
    groups, warnings = rank(summary, baseline)
    warnings = notes + warnings + stability_warnings(groups) + environment_warnings(df) + _status_warnings(groups)
    found = regressions(groups, candidate, fail_on_regression) if fail_on_regression is not None else []
    return groups, warnings + found, 3 if found else 0


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ResultsError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")


def compare_frame(df: pd.DataFrame, *, baseline: Optional[str] = None, candidate: tuple[str, ...] = (),
                  fmt: str = "table", fail_on_regression: Optional[float] = None) -> CompareOutcome:
    """Compare results already read (``results.read_many``), e.g. right after a run; see
    :func:`run_compare` for the arguments."""
    _check_format(fmt)
    groups, warnings, code = _analyse(df, baseline, tuple(candidate), fail_on_regression, [])
    text = tables.render(groups, fmt, warnings)
    return CompareOutcome(text=text, warnings=warnings, exit_code=code, frame=df,
                          table_text=text if fmt == "table" else tables.render(groups, "table", warnings))


def run_compare(paths: list[str], *, baseline: str | None = None, candidate: tuple[str, ...] = (),
                fmt: str = "table", skip_bad: bool = False,
                fail_on_regression: float | None = None) -> CompareOutcome:
    """Read results CSVs (files, directories, globs) and compare backends.

    ``fmt`` is table, markdown, csv or json. The outcome carries the rows and the terminal table,
    which ``plots.write_report`` draws.
    ``skip_bad`` goes on without unreadable files (each becomes a warning). ``fail_on_regression``
    sets exit_code 3 when a ``candidate`` backend (every non-baseline one when none is named) takes
    more than that factor times the baseline's median time, in training or inference.
    Raises ResultsError for bad input (a bad file, an unknown baseline or candidate, a bad format).
    """
    _check_format(fmt)
    df, skipped = results.read_many(_expand(list(paths)), skip_bad=skip_bad)
    df = results.for_comparison(df)
    notes = [f"skipped {msg}" for msg in skipped]
    groups, warnings, code = _analyse(df, baseline, tuple(candidate), fail_on_regression, notes)
    text = tables.render(groups, fmt, warnings)
    return CompareOutcome(text=text, warnings=warnings, exit_code=code, frame=df,
                          table_text=text if fmt == "table" else tables.render(groups, "table", warnings))
