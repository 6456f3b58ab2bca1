"""The warnings of a comparison: what makes its numbers weaker than they look.

Too few repeats, a spread over ``SPREAD_LIMIT`` of the median, no steady state, time to accuracy
reached by too few repeats (``stability_warnings``); rows from different hosts, CPUs, thread
counts or versions compared with each other, one group's repeats from several hosts, one workload
name with several definitions (``environment_warnings``); failed groups with their reasons
(``status_warnings``). ``compare.report_warnings`` puts them in the order they are shown.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from . import experiments, tables
from .experiments import CONTEXT_KEYS, GROUP_KEYS, GroupKey
from .summary import TTA

MIN_REPEATS = 3
SPREAD_LIMIT = 0.10
#: Compared across every row of one experiment and device.
CONTEXT_ENV = ("host", "os", "cpu", "gpu", "threads")
#: Compared only within one backend: isolated backend environments legitimately differ in these.
BACKEND_ENV = ("backend_version", "python")


def group_name(groups: pd.DataFrame, index: tuple) -> str:
    """``mnist/cpu/torch`` (``mnist (limit 1024)/cpu/torch``): how warnings name a group."""
    key = GroupKey.of(index)
    return f"{key.experiment}/{key.device}/{groups.loc[index, 'label']}"


def _names(groups: pd.DataFrame, mask: pd.Series, detail: Optional[pd.Series] = None) -> str:
    items = []
    for index in groups.index[mask.to_numpy()]:
        items.append(group_name(groups, index) + (f" ({detail[index]})" if detail is not None else ""))
    return ", ".join(items)


def stability_warnings(groups: pd.DataFrame, metric: str = "epoch-time") -> list[str]:
    """Too few repeats, a spread over 10% of the median, no steady state (single epoch); under
    ``time-to-accuracy``, too few repeats that reached the target."""
    out = []
    if metric == TTA:
        tried = (groups["tta_reached"] + groups["tta_missed"]) > 0
        few_tta = tried & (groups["tta_reached"] < MIN_REPEATS)
        if few_tta.any():
            out.append(f"fewer than {MIN_REPEATS} repeats reached the target accuracy, so time-to-accuracy "
                       "intervals and verdicts are weak or missing: "
                       + _names(groups, few_tta, groups["tta_reached"].astype(str) + " reached"))
    n = groups[["steady_n", "infer_n"]].replace(0, np.nan).min(axis=1)
    few = n.notna() & (n < MIN_REPEATS)
    if few.any():
        out.append(f"fewer than {MIN_REPEATS} timed repeats, so intervals and verdicts are weak: "
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


def _values_by_source(values: dict[str, set[str]]) -> str:
    """``'a' (x.csv); 'b' (y.csv, z.csv)``: each value with the files it came from (3 at most)."""
    parts = []
    for value in sorted(values):
        files = sorted({Path(s).name for s in values[value]})
        parts.append(f"{value!r} ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
    return "; ".join(parts)


def _env_rows(df: pd.DataFrame) -> list[dict[str, str]]:
    """The distinct (group, workload, environment, source) rows, as text ("" where not recorded)."""
    cols = list(dict.fromkeys(GROUP_KEYS + ["workload", "workload_hash", "data_source", "replicas", *CONTEXT_ENV,
                                            *BACKEND_ENV, "source"]))
    env = df[[c for c in cols if c in df.columns]].drop_duplicates()
    for c in cols:
        if c not in env.columns:
            env[c] = ""
    threads = pd.to_numeric(env["threads"], errors="coerce")
    if "replicas" in env.columns:  # per replica in the column: the cell's own count is N times it
        threads = threads * pd.to_numeric(env["replicas"], errors="coerce").fillna(1)
    env["threads"] = threads.map(lambda v: "" if pd.isna(v) else f"{v:g}")
    return env.astype(str).drop_duplicates().to_dict("records")


def _differing(rows: list[dict[str, str]], keys: list[str], col: str) -> list[tuple[tuple, dict[str, set[str]]]]:
    """(key, {value: sources}) of each ``keys`` whose rows hold several non-empty ``col`` values, in key order."""
    seen: dict[tuple, dict[str, set[str]]] = {}
    for row in rows:
        if row[col]:
            seen.setdefault(tuple(row[k] for k in keys), {}).setdefault(row[col], set()).add(row["source"])
    return [(key, values) for key, values in sorted(seen.items()) if len(values) > 1]


def environment_warnings(df: pd.DataFrame) -> list[str]:
    """Rows from different environments compared with each other (host, CPU, threads, versions);
    one group's repeats from different hosts; one workload name with several definitions. Over the
    distinct rows only (a few per repeat), in plain Python: pandas' per-call cost dominated here."""
    rows = _env_rows(df)
    out = []
    checks = [(c, CONTEXT_KEYS) for c in CONTEXT_ENV] + [(c, CONTEXT_KEYS + ["backend"]) for c in BACKEND_ENV]
    for col, keys in checks:
        what = "thread counts" if col == "threads" else "environments"
        for key, values in _differing(rows, keys, col):
            out.append(f"{'/'.join(key)}: rows from different {what} are compared "
                       f"({col} differs): {_values_by_source(values)}")
    named = experiments.labels(GroupKey.of(k) for k in dict.fromkeys(tuple(r[k] for k in GROUP_KEYS) for r in rows))
    for key, values in _differing(rows, GROUP_KEYS, "host"):
        group = GroupKey.of(key)
        out.append(f"{group.experiment}/{group.device}/{named[group]}: its repeats ran on different hosts, "
                   "so its timings mix machines: " + _values_by_source(values))
    for (workload,), values in _differing(rows, ["workload"], "experiment"):
        out.append(f"workload {workload!r} has {len(values)} different definitions in these "
                   "files; each is compared on its own, with no ratio between them: " + _values_by_source(values))
    return out


def status_warnings(groups: pd.DataFrame) -> list[str]:
    """Each group that is not ok, with its run rows' reason."""
    bad = groups[(groups["status"] != "ok") & (groups["message"] != "")]
    return [f"{group_name(groups, k)}: {row.status}: {tables.short_message(row.message)}"
            for k, row in bad.iterrows()]
