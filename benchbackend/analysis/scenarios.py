"""LoadGen scenarios (``--scenario``) in ``compare``: per group, the medians over repeats of each
repeat's LoadGen figures, and verdicts with intervals against compare's baseline.

The rows (``run/scenario.py``): ``scenario``, one per LoadGen run; a repeat (one worker process)
has one, or with ``--slo-ms`` one per probe of the Server's peak search. Per repeat:

- ``p50_s``, ``p90_s``, ``p99_s``, ``p999_s``: LoadGen's latency percentiles (of its last probe's
  run with a search: the latencies at a search's probes are of different loads, not one figure);
- ``sps``: samples/s (Offline's metric; the others' achieved rate);
- ``peak_qps``: with ``--slo-ms``, the highest target QPS LoadGen called valid (and the audit passed);
- ``top1``: the accuracy-mode run's top-1 agreement with the NumPy reference;
- ``valid``: every run of the repeat VALID to LoadGen; ``short``: below MLPerf's minimum.

Verdicts follow ``stats.compare_times`` (the decision rule of every compare time) on the per-repeat
values: p90 and p99 latency as times, samples/s and peak QPS through their reciprocals (seconds per
sample, per query), so a ratio above 1 is always "faster than the baseline". Only ok groups are ranked.
The tables are :mod:`benchbackend.analysis.tables_scenarios`'.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pandas as pd

from . import stats
from .experiments import GROUP_KEYS, REPEAT_KEYS, GroupKey
from .tables import ratio_text
from .tables_scenarios import VERDICTS

PHASE = "scenario"
VALUES = ("p50_s", "p90_s", "p99_s", "p999_s", "early_s", "sps", "peak_qps", "top1", "valid", "short")


def _num(rows: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(rows[col], errors="coerce") if col in rows else pd.Series(math.nan, index=rows.index)


def per_repeat(df: pd.DataFrame) -> pd.DataFrame:
    """One row per group and repeat (``GROUP_KEYS`` + ``REPEAT_KEYS`` + scenario + ``VALUES`` + status)."""
    rows = df[df["phase"] == PHASE] if "phase" in df else df.iloc[:0]
    if rows.empty:
        return pd.DataFrame(columns=[*GROUP_KEYS, *REPEAT_KEYS, "scenario", *VALUES, "status"])
    out = []
    for key, sub in rows.groupby(GROUP_KEYS + REPEAT_KEYS, sort=True, dropna=False):
        valid = sub["loadgen_valid"].astype(str).eq("valid") & ~_num(sub, "audit_sample").notna()
        last = sub.iloc[-1]
        target = _num(sub, "target_qps")
        searched = _num(sub, "probe").notna().any()
        out.append({**dict(zip(GROUP_KEYS + REPEAT_KEYS, key)), "scenario": last.get("scenario"),
                    "p50_s": _num(sub, "latency_p50_ms").iloc[-1] / 1e3,
                    "p90_s": _num(sub, "latency_p90_ms").iloc[-1] / 1e3,
                    "p99_s": _num(sub, "latency_p99_ms").iloc[-1] / 1e3,
                    "p999_s": _num(sub, "latency_p999_ms").iloc[-1] / 1e3,
                    "early_s": _num(sub, "early_stopping_ms").iloc[-1] / 1e3,
                    "sps": _num(sub, "samples_per_s").iloc[-1], "top1": _num(sub, "top1_agreement").iloc[-1],
                    "peak_qps": (target[valid].max() if valid.any() else math.nan) if searched else math.nan,
                    "valid": bool(valid.all()) if not searched else bool(valid.any()),
                    "short": str(last.get("below_mlperf_minimum")) == "True", "status": last.get("status", "ok")})
    return pd.DataFrame(out)


def rank(groups: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """One row per scenario group (index ``GROUP_KEYS``): label, status, repeats, the medians of
    ``VALUES`` over the ok repeats (all repeats where none is ok), and per ``VERDICTS`` prefix the
    ratio (baseline / this, on times), its interval, verdict and text against ``groups``' baseline."""
    per = per_repeat(df)
    if per.empty:
        return pd.DataFrame()
    out_rows, index = [], []
    for key, sub in per.groupby(GROUP_KEYS, sort=True, dropna=False):
        ok = sub[sub["status"] == "ok"]
        use = ok if len(ok) else sub
        row: dict[str, Any] = {c: float(np.nanmedian(use[c].to_numpy(float))) if use[c].notna().any() else math.nan
                               for c in VALUES if c not in ("valid", "short")}
        row.update(scenario=sub["scenario"].iloc[0], repeats=len(sub), valid=int(sub["valid"].sum()),
                   short=bool(sub["short"].any()), status="ok" if len(ok) == len(sub) else
                   sub.loc[sub["status"] != "ok", "status"].iloc[0])
        info = groups.loc[key] if key in groups.index else None
        row["label"] = info["label"] if info is not None else GroupKey.of(key).label()
        row["baseline"] = info["baseline"] if info is not None else ""
        out_rows.append(row)
        index.append(key)
    out = pd.DataFrame(out_rows, index=pd.MultiIndex.from_tuples(index, names=GROUP_KEYS))
    samples = {k: per.iloc[at] for k, at in per.groupby(GROUP_KEYS, dropna=False).indices.items()}
    for prefix, col, _, rate in VERDICTS:
        found = [_versus(out, k, samples, col, rate) for k in out.index]
        out[f"{prefix}_ratio"] = [r.ratio if r else math.nan for r, _, _ in found]
        out[f"{prefix}_low"] = [r.low if r else math.nan for r, _, _ in found]
        out[f"{prefix}_high"] = [r.high if r else math.nan for r, _, _ in found]
        out[f"{prefix}_verdict"] = [v for _, v, _ in found]
        out[f"{prefix}_text"] = [t for _, _, t in found]
    return out


def _versus(out: pd.DataFrame, index: tuple, samples: dict[tuple, pd.DataFrame], col: str,
            rate: bool) -> tuple[Optional[stats.Ratio], str, str]:
    row = out.loc[index]
    ctx = out[(out.index.get_level_values("experiment") == index[0])
              & (out.index.get_level_values("device") == index[1])]
    base = next((k for k, r in ctx.iterrows() if r["baseline"] and r["label"] == r["baseline"]), None)
    if base is not None and base == index:
        return None, "baseline", "baseline"
    if row["status"] != "ok":
        return None, f"not ranked ({row['status']})", f"not ranked ({row['status']})"
    if base is None or out.loc[base, "status"] != "ok":
        return None, "n/a", "n/a"

    def times(k: tuple) -> np.ndarray:
        values = samples[k][col].to_numpy(dtype=float)
        return 1.0 / values if rate else values

    r = stats.compare_times(times(base), times(index))
    return (r, r.verdict, ratio_text(r)) if r is not None else (None, "n/a", "n/a")
