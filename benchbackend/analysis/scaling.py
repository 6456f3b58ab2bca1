"""Scaling: what N data-parallel replicas buy over one, with its interval (``compare``, the plots).

A cell of N > 1 replicas is a group of its own, its mode named ``eager x2`` (strong scaling: the
global batch fixed) or ``eager x2 weak`` (weak scaling: the per-replica batch fixed), beside the
single replica's ``eager`` of the same experiment, device, backend and precision (the single
replica is the same cell under both). Strong and weak cells are so never one group.

Scaling efficiency is ``throughput_N / (N * throughput_1)``. Both cells train the same samples per
epoch, so the throughput ratio is the ratio of steady epoch times, and the efficiency is the
speed-up of N replicas over one (``stats.compare_times``: the ratio of medians and its 95% interval)
divided by N, interval included. 1 is perfect scaling; 1/N means N replicas ran no faster than one.
Above 1 is not a finding: N replicas sharing a machine do not do more than N times one replica's
work, so a spoiled or unstable measurement is the likely reading (a single replica timed while
something else ran, say). Where even the interval's low end is above 1 the efficiency is
``implausible``; where only the point is (the interval holds 1, or there is none), ``unstable``,
too noisy to read (``scaling_check``; ``caveats.implausible_warnings`` names each).

Where the time goes: ``comm_share`` is the median fraction of a steady epoch spent in gradient
communication where the engine measures it (``comm_s``: torch DDP's comm hook); elsewhere only the
estimate from bytes is shown: ``grad_mb`` (the fp32 gradients, ``params * 4`` bytes, in MB of 10^6
bytes as link speeds count them) and the ring all-reduce's traffic per replica per step,
``2 (N - 1) / N * grad_mb`` (README "Data parallel").

Nothing here imports a framework.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import pandas as pd

from . import stats
from .experiments import GROUP_KEYS, GroupKey, split_mode

COLUMNS = ["replicas", "scaling", "scaling_of", "scaling_eff", "scaling_low", "scaling_high", "scaling_check",
           "comm_share", "grad_mb", "ring_mb"]
#: ``scaling_check`` of an efficiency above 1: beyond its interval, or within it.
IMPLAUSIBLE = "implausible"
UNSTABLE = "unstable"


def check(eff: float, low: float) -> str:
    """``implausible`` for an efficiency above 1 whose interval's low end is above 1 too,
    ``unstable`` for one above 1 whose interval holds 1 (or that has none: one repeat a side),
    "" otherwise (at most 1, or unknown)."""
    if not (math.isfinite(eff) and eff > 1):
        return ""
    return IMPLAUSIBLE if math.isfinite(low) and low > 1 else UNSTABLE


def ring_mb(grad_mb: float, replicas: int) -> float:
    """Megabytes each replica sends (and receives) per step in a ring all-reduce of ``grad_mb``."""
    return 2 * (replicas - 1) / replicas * grad_mb


def annotate(groups: pd.DataFrame, summary_: Any, df: pd.DataFrame) -> pd.DataFrame:
    """``groups`` (``compare.rank``'s) with :data:`COLUMNS`: each N-replica group's efficiency
    against its single replica (NaN where that did not run ok), its communication share and bytes."""
    out = groups.copy()
    keys = [GroupKey.of(k) for k in out.index]
    parts = [split_mode(k.mode) for k in keys]
    out["replicas"] = [n for _, n, _ in parts]
    out["scaling"] = [s for _, _, s in parts]
    params = _per_group(df, "params", "max")
    comm = _per_group(df[df["epoch"] >= 2] if "epoch" in df else df, "comm_s", "median")
    values: dict[str, list] = {c: [] for c in COLUMNS[2:]}
    for key, (mode, n, _) in zip(keys, parts):
        row = out.loc[key.index]
        one = GroupKey(key.experiment, key.device, key.backend, mode, key.precision)
        r = None
        if n > 1 and one.index in out.index and row["status"] == "ok" and out.loc[one.index, "status"] == "ok":
            r = stats.compare_times(summary_.samples(one, "steady_s"), summary_.samples(key, "steady_s"))
        values["scaling_of"].append(out.loc[one.index, "label"] if n > 1 and one.index in out.index else "")
        values["scaling_eff"].append(r.ratio / n if r else math.nan)
        values["scaling_low"].append(r.low / n if r else math.nan)
        values["scaling_high"].append(r.high / n if r else math.nan)
        values["scaling_check"].append(check(values["scaling_eff"][-1], values["scaling_low"][-1]))
        seconds = comm.get(key.index, math.nan)
        values["comm_share"].append(seconds / row["steady_s"] if n > 1 and row["steady_s"] > 0 else math.nan)
        grad = params.get(key.index, math.nan) * 4 / 1e6  # MB, as link speeds count (README's table)
        values["grad_mb"].append(grad if n > 1 else math.nan)
        values["ring_mb"].append(ring_mb(grad, n) if n > 1 else math.nan)
    for col, vals in values.items():
        out[col] = vals
    return out


def _per_group(df: pd.DataFrame, column: str, how: str) -> dict[tuple, float]:
    if column not in df or not len(df):
        return {}
    values = pd.to_numeric(df[column], errors="coerce")
    reduced = values.groupby([df[k] for k in GROUP_KEYS], sort=False).agg(how).dropna()
    return {k: float(v) for k, v in reduced.items()}


def _num(x: float, spec: str) -> str:
    return "n/a" if not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, spec)


def efficiency_text(row: pd.Series, mark: bool = True) -> str:
    """``0.74 [0.70-0.78]``: the efficiency and its interval (one repeat a side: no interval); with
    ``mark``, an efficiency above 1 says what it is (``1.30 [1.10-1.52] (implausible)``)."""
    eff, low, high = row["scaling_eff"], row["scaling_low"], row["scaling_high"]
    if not math.isfinite(eff):
        return "n/a"
    text = f"{eff:.2f}" if not (math.isfinite(low) and math.isfinite(high)) else f"{eff:.2f} [{low:.2f}-{high:.2f}]"
    flag = row.get("scaling_check", "") if mark else ""
    return f"{text} ({flag})" if flag else text


def rows(frame: pd.DataFrame) -> Optional[tuple[list[str], list[list[str]]]]:
    """The scaling table of one comparison (None when no group has several replicas)."""
    many = frame[frame["replicas"] > 1]
    if many.empty:
        return None
    head = ["", "backend", "scaling", "of", "samples/s", "efficiency [95% CI]", "comm share", "grad MB",
            "ring MB/step"]
    out = []
    for _, r in many.iterrows():
        why = "" if r["status"] == "ok" else f" ({r['status']})"
        out.append(["", r["label"], f"{r['scaling']}{why}", r["scaling_of"] or "n/a", _num(r["samples_per_s"], ",.0f"),
                    efficiency_text(r), _num(r["comm_share"], ".0%"), _num(r["grad_mb"], ".2f"),
                    _num(r["ring_mb"], ".2f")])
    return head, out


SCALING_LINE = ("Scaling efficiency = throughput_N / (N x throughput_1) = (1-replica steady epoch / N-replica "
                "steady epoch) / N, with its 95% CI; comm share: the epoch's measured gradient communication "
                "(torch DDP), n/a where the engine does not expose it; ring MB/step = 2(N-1)/N x grad MB, each "
                "replica's all-reduce traffic per step. Above 1 is no finding: (implausible) where the CI's low "
                "end is above 1 too, (unstable) where the CI holds 1 (see the warnings).")
