"""What ``compare`` and the plots reduce results to: one row per repeat, one row per group.

A *group* is one (experiment, device, backend, mode, precision) (:class:`experiments.GroupKey`);
a *repeat* is one (run_id, repeat), i.e. one fresh worker process.

Only repeats whose status is ``ok`` feed a group's timings. A group with no ``ok`` repeat shows
the timings of its repeats that ran to the end but failed a check (a NaN loss, a parity mismatch),
so that "fast but wrong" stays visible; such a group is never ranked. Crashed, timed-out,
interrupted and pending repeats never feed a timing: their epochs are partial.

Throughput comes with its model FLOPs utilization (MFU: achieved FLOP/s over the peak the run
recorded; a training sample costs ``results.TRAIN_FLOPS_FACTOR`` forward passes), reduced like
samples/s. Time to accuracy
(``time_to_accuracy_s``, written when the workload declares ``checks.target_accuracy``) is one
value per repeat: the training seconds until the validation accuracy first reached the target, or
``inf`` when it never did; such a repeat cannot be timed and is counted apart.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..results import STATUSES, worst_status
from . import quality
from .busy import is_busy, repeat_shares
from .experiments import GROUP_KEYS, REPEAT_KEYS, GroupKey, labels, with_experiment
from .rates import RATE_COLUMNS as _RATE_COLUMNS
from .rates import column as _column
from .rates import one_peak, with_rates
from .stats import clean, median_interval

#: Statuses of repeats that ran to the end but failed a check: their timings are complete.
CHECK_FAILED = ("parity_mismatch", "audit_failed", "generation_mismatch", "chance_accuracy", "not_judged", "diverged",
                "nan_loss")
#: What defines a group's experiment, as columns (one value per group).
_FIXED = ("limit", "epochs", "batch_size", "inference_batch_size", "seed", "data_source")
#: Columns of :func:`summarize`'s ``groups`` frame besides the keys.
SUMMARY_COLUMNS = [
    "label", "workload", "workload_hash", "definition", *_FIXED, "status", "message", "repeats", "ok_repeats",
    "failed",
    "timed_from", "inference_only", "train_samples", "infer_samples",
    "first_s", "steady_s", "steady_low", "steady_high", "steady_interval", "steady_spread", "steady_n",
    "samples_per_s", "sps_low", "sps_high", "val_accuracy", "parity_max_abs", "parity_max_rel",
    "infer_first_s", "infer_s", "infer_low", "infer_high", "infer_interval", "infer_spread", "infer_n",
    "threads",
    "infer_sps", "infer_sps_low", "infer_sps_high",
    # the first dispatch's cost beyond a steady one, and the process's start to its first step (issue 40)
    "compile_s", "first_result_s", "infer_compile_s", "infer_first_result_s",
    # MFU: the peak each group was measured against ("peak": readable, "peak_flops": NaN when several)
    "flops_per_sample", "achieved_flops", "mfu", "infer_achieved_flops", "infer_mfu", "peak_flops", "peak",
    "mfu_datasheet", "infer_mfu_datasheet", "peak_datasheet", "mfu_missing",
    # time to accuracy over the timed repeats that reached the target; the others counted apart
    "tta_s", "tta_low", "tta_high", "tta_interval", "tta_n", "tta_reached", "tta_missed",
    # the machine (``machine.py``): per phase, the timed repeats other processes made busy and the
    # largest share of the cores they held; repeats left out as busy (``skip_busy``)
    "train_busy", "train_busy_share", "infer_busy", "infer_busy_share", "gen_busy", "gen_busy_share", "busy_left_out",
    # the quality gate (``quality.groups``): the worst repeat's gate, how many passed of how many judged
    "quality", "quality_ratio", "quality_target", "gate", "gate_pass", "gate_judged", "gate_reason",
]
#: ``compare --metric``: the per-repeat value (a column of :class:`Summary`) that ranks training.
METRICS = {"epoch-time": "steady_s", "time-to-accuracy": "tta_s", "compile-time": "compile_s",
           "first-result": "first_result_s"}
#: What ranks the inference table under each metric (the steady pass time unless named here).
INFER_METRICS = {"compile-time": "infer_compile_s", "first-result": "infer_first_result_s"}
#: How the verdicts name each metric's training value.
METRIC_NAMES = {"epoch-time": "training", "time-to-accuracy": "time to accuracy", "compile-time": "compile time",
                "first-result": "time to first result"}
TTA = "time-to-accuracy"
#: The first dispatch's columns (``timing.FirstDispatch``), per repeat: (column, per-repeat name) of each phase.
FIRST_DISPATCH = {"train_epoch": (("compile_s", "compile_s"), ("first_result_s", "first_result_s")),
                  "inference": (("compile_s", "infer_compile_s"), ("first_result_s", "infer_first_result_s"))}



def natural_key(text: str) -> tuple:
    """Sort key that orders ``mnist (limit 512)`` before ``mnist (limit 2000)``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", str(text)) if p)


def is_ok(status: str) -> bool:
    """Whether a group's results count as correct (only ``ok`` can be ranked)."""
    return status == STATUSES[0]


def repeat_status(df: pd.DataFrame, by: str) -> pd.Series:
    """The worst status of each repeat's rows, ``by`` naming the column that tells repeats apart."""
    known = {s: i for i, s in enumerate(STATUSES)}
    codes, uniques = pd.factorize(df["status"])
    # Rank each distinct status once ("" as ok; an unknown one worst of all), take the worst per repeat.
    ranks = np.array([known.get(u, len(STATUSES)) if u else 0 for u in uniques], dtype=int)
    worst = pd.Series(ranks[codes], index=df.index).groupby(df[by]).max()
    by_rank = dict(enumerate(STATUSES))
    by_rank[len(STATUSES)] = next((u for u in uniques if u and u not in known), "unknown")
    return worst.map(by_rank).rename("status")


def timed_repeats(status: pd.Series) -> pd.Series:
    """Which repeats feed the timings: a group's ``ok`` repeats, or, where it has none, its repeats
    that ran to the end but failed a check. Boolean, same index as ``status``."""
    ok = status == STATUSES[0]
    group_level = list(range(len(GROUP_KEYS)))
    any_ok = ok.groupby(level=group_level, sort=False).transform("any")
    return ok | (~any_ok & status.isin(CHECK_FAILED))


def per_repeat(df: pd.DataFrame, skip_busy: bool = False) -> pd.DataFrame:
    """One row per repeat: status, timed (feeds the timings), first_s (epoch 1), steady_s (median
    of epochs >= 2; NaN with a single epoch), samples_per_s, achieved_flops and mfu (of the same
    epochs; epoch 1's with a single epoch), val_accuracy (last epoch), infer_first_s (the first
    inference pass, which carries tracing, compilation and first copies, as epoch 1 does), infer_s,
    infer_sps (samples/s), infer_achieved_flops and infer_mfu (median of the passes after the
    first; the only pass when there is one), and tta_s (time to accuracy: ``inf`` when the target
    was not reached, NaN when the workload declared none), train_busy and infer_busy (the share
    of the cell's cores other processes held over its epochs and its passes, ``busy.phase_shares``;
    NaN where not measured), and the quality gate (``quality.judge``: a repeat that failed it feeds no
    timing while its group has one that did not). With ``skip_busy``, a repeat busy in either phase
    feeds no timing."""
    keys = GROUP_KEYS + REPEAT_KEYS
    # One integer per repeat, in key order: every reduction below groups by it, not by seven columns.
    repeats = df.groupby(keys, sort=True, dropna=False)
    df = df.assign(_repeat=repeats.ngroup(),
                   **{c: _column(df, c) for c in _RATE_COLUMNS + ("time_to_accuracy_s", "epochs_to_target")})
    phase = df["phase"]
    train = df.loc[phase == "train_epoch", ["_repeat", "epoch", "seconds", "samples_per_s", "val_accuracy",
                                            *_RATE_COLUMNS]]
    later = train["epoch"] >= 2
    rates = {c: (c, "median") for c in ("samples_per_s",) + _RATE_COLUMNS}
    steady = train[later].groupby("_repeat").agg(steady_s=("seconds", "median"), **rates)
    first = train[train["epoch"] == 1].groupby("_repeat").agg(
        first_s=("seconds", "median"), **{f"first_{c}": spec for c, spec in rates.items()})
    last = train.sort_values("epoch", kind="stable").groupby("_repeat")["val_accuracy"].last()
    inf = df.loc[phase == "inference", ["_repeat", "pass", "seconds"]]
    passes = steady_inference(df)
    passes = passes.assign(sps=passes["samples"] / passes["seconds"])
    infer = passes.groupby("_repeat")[["seconds", "sps", *_RATE_COLUMNS]].median()
    infer.columns = ["infer_s", "infer_sps"] + [f"infer_{c}" for c in _RATE_COLUMNS]
    infer_first = inf[inf["pass"] == 1].groupby("_repeat")["seconds"].median()
    # A cell-level value on every row of the repeat: the largest is the one (inf: not reached).
    tta = df.groupby("_repeat")["time_to_accuracy_s"].max().rename("tta_s")
    ett = df.groupby("_repeat")["epochs_to_target"].max().rename("epochs_to_target")
    status = repeat_status(df, "_repeat")
    dispatch = [df.loc[phase == p].assign(**{c: _column(df, c)}).groupby("_repeat")[c].max().rename(name)
                for p, cols in FIRST_DISPATCH.items() for c, name in cols]
    out = pd.concat([status, first, steady, last, infer_first.rename("infer_first_s"), infer, tta, ett,
                     repeat_shares(df), *dispatch],
                    axis=1)
    out = out.reindex(range(repeats.ngroups))
    out.index = repeats.size().index
    out["status"] = out["status"].fillna("ok")
    # With a single epoch there is no steady state; its throughput is all there is.
    for c in rates:
        out[c] = out[c].fillna(out.pop(f"first_{c}"))
    out["timed"] = timed_repeats(out["status"])
    out = out.join(quality.judge(out, df))
    # A repeat that failed the quality gate feeds no timing while its group has one that did not.
    fails = out["gate"] == "fail"
    others = (out["timed"] & ~fails).groupby(level=list(range(len(GROUP_KEYS))), sort=False).transform("any")
    out["timed"] &= ~fails | ~others
    out["left_out"] = out["timed"] & is_busy(out) if skip_busy else False
    out["timed"] &= ~out["left_out"]
    return out


def steady_inference(df: pd.DataFrame) -> pd.DataFrame:
    """Inference rows without each repeat's first pass, unless that pass is the repeat's only one."""
    inf = df[df["phase"] == "inference"]
    passes = inf.groupby(GROUP_KEYS + REPEAT_KEYS, sort=False, dropna=False)["pass"].transform("count")
    return inf[(inf["pass"] >= 2) | (passes == 1)]


def _spread(values: pd.Series, keys: list[str], centre: pd.Series) -> pd.Series:
    """Robust spread of ``values`` per group (1.4826 x median absolute deviation, which equals the
    standard deviation for normal data), as a fraction of the group's median. One slow pass (a
    first inference pass, a busy moment) should not read as a 900% spread."""
    grouped = values.groupby(keys, sort=False, dropna=False)
    deviation = (values - grouped.transform("median")).abs()
    mad = 1.4826 * deviation.groupby(keys, sort=False, dropna=False).median()
    return (mad / centre).reindex(centre.index)


def _failed_text(status: pd.Series) -> str:
    """``1 crashed, 2 nan_loss``: a group's repeats that are not ok, by status."""
    counts = status[status != STATUSES[0]].value_counts()
    rank = {s: i for i, s in enumerate(STATUSES)}
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: rank.get(kv[0], 99)))


def _group_info(df: pd.DataFrame, reps: pd.DataFrame) -> pd.DataFrame:
    """Status, message, repeat counts and what the experiment is, per group."""
    by_rep = reps.groupby(level=list(range(len(GROUP_KEYS))), sort=True)
    info = pd.DataFrame({
        "status": by_rep["status"].agg(lambda s: worst_status(s)),
        "repeats": by_rep.size(),
        "ok_repeats": by_rep["status"].agg(lambda s: int((s == STATUSES[0]).sum())),
        "failed": by_rep["status"].agg(_failed_text),
    })
    info.index.names = GROUP_KEYS
    timed = reps[reps["timed"]]
    level = list(range(len(GROUP_KEYS)))
    for phase in ("train", "infer", "gen"):
        busy = is_busy(timed, phase).groupby(level=level).sum()
        info[f"{phase}_busy"] = busy.reindex(info.index).fillna(0).astype(int)
        info[f"{phase}_busy_share"] = timed[f"{phase}_busy"].groupby(level=level).max().reindex(info.index)
    left = by_rep["left_out"].sum().astype(int)
    info["busy_left_out"] = left
    info["ok_repeats"] -= left
    info["failed"] = [", ".join(filter(None, (text, f"{n} busy (left out)" if n else "")))
                      for text, n in zip(info["failed"], left)]
    # A failed cell's reason is its `run` row's message, never another row's (a build row's
    # notes are facts, not reasons; ``results.read`` moves older files' notes out of `message`).
    noted = df.loc[(df["message"] != "") & (df["phase"] == "run"), GROUP_KEYS + ["status", "message"]]
    noted = noted.join(info["status"].rename("worst"), on=GROUP_KEYS)
    noted = noted[noted["status"] == noted["worst"]]
    info["message"] = noted.groupby(GROUP_KEYS, sort=False, dropna=False)["message"].first().reindex(
        info.index).fillna("")
    # What the experiment is, from the distinct values only (a few rows, not one per epoch).
    extra = [c for c in ("workload", "workload_hash", "definition", "inference_only", "threads", *_FIXED)
             if c in df.columns]
    meta = df[GROUP_KEYS + extra].drop_duplicates()
    by_meta = meta.groupby(GROUP_KEYS, sort=False, dropna=False)
    info = info.join(by_meta[["workload", "workload_hash", *_FIXED]].first())
    info["definition"] = (by_meta["definition"].agg(lambda d: next((v for v in d if v), ""))
                          if "definition" in meta else "")
    info["definition"] = info["definition"].fillna("")
    phase = df["phase"]
    sizes = df.loc[phase.isin(["train_epoch", "inference"]), GROUP_KEYS + ["phase", "samples"]].drop_duplicates()
    for name, which in (("train_samples", "train_epoch"), ("infer_samples", "inference")):
        part = sizes[sizes["phase"] == which]
        info[name] = part.groupby(GROUP_KEYS, sort=False)["samples"].max().reindex(info.index)
    if "inference_only" in meta:
        flagged = meta["inference_only"].astype(str).str.lower().isin(["true", "1"])
        only = flagged.groupby([meta[k] for k in GROUP_KEYS], sort=False).any()
        info["inference_only"] = only.reindex(info.index).fillna(False).astype(bool) & info["train_samples"].isna()
    else:
        info["inference_only"] = False
    if "threads" in meta:
        threads = meta.groupby(GROUP_KEYS, sort=False, dropna=False)["threads"].agg(
            lambda t: ", ".join(sorted({f"{v:g}" for v in t.dropna()})))
        info["threads"] = threads.reindex(info.index).fillna("")
    else:
        info["threads"] = ""
    return info


def _intervals(timed: pd.DataFrame, col: str, index: pd.Index) -> pd.DataFrame:
    values = timed[col].to_numpy()
    where = timed[col].groupby(level=list(range(len(GROUP_KEYS))), sort=False).indices
    rows = {key: median_interval(values[at]) for key, at in where.items()}
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=["low", "high", "kind"])
    if len(frame):
        frame.index = pd.MultiIndex.from_tuples(frame.index, names=GROUP_KEYS)
    return frame.reindex(index)


@dataclass
class Summary:
    """``groups``: one row per group (index GROUP_KEYS, columns SUMMARY_COLUMNS);
    ``repeats``: one row per repeat (index GROUP_KEYS + REPEAT_KEYS), see :func:`per_repeat`."""

    groups: pd.DataFrame
    repeats: pd.DataFrame

    def samples(self, key: GroupKey, column: str) -> np.ndarray:
        """Per-repeat values of ``column`` ("steady_s" or "infer_s") of one group's timed repeats."""
        try:
            sub = self.repeats.loc[key.index]
        except KeyError:
            return np.array([])
        return clean(sub.loc[sub["timed"], column].to_numpy(dtype=float))


def summarize(df: pd.DataFrame, skip_busy: bool = False) -> Summary:
    """Aggregate a results frame (``results.read``/``read_many``, best through
    ``experiments.for_comparison``) per group; with ``skip_busy``, repeats that other processes
    made busy feed no timing (``per_repeat``)."""
    df = one_peak(with_experiment(df))
    reps = per_repeat(df, skip_busy)
    groups = _group_info(df, reps)
    timed = reps[reps["timed"]]
    level = list(range(len(GROUP_KEYS)))
    by_group = timed.groupby(level=level, sort=False)
    med = by_group[["first_s", "steady_s", "val_accuracy", "infer_first_s", "infer_s",
                    *(name for cols in FIRST_DISPATCH.values() for _, name in cols)]].median()
    med.index.names = GROUP_KEYS
    groups = groups.join(med)
    groups["timed_from"] = by_group["status"].agg(
        lambda s: "ok" if (s == STATUSES[0]).all() else "failed").reindex(groups.index).fillna("")
    groups["steady_n"] = by_group["steady_s"].count().reindex(groups.index).fillna(0).astype(int)
    groups["infer_n"] = by_group["infer_s"].count().reindex(groups.index).fillna(0).astype(int)
    for name, col in (("steady", "steady_s"), ("infer", "infer_s")):
        iv = _intervals(timed, col, groups.index)
        groups[f"{name}_low"], groups[f"{name}_high"] = iv["low"], iv["high"]
        groups[f"{name}_interval"] = iv["kind"].fillna("")
    # The spread is over the individual epochs / passes of the timed repeats.
    keep = df.set_index(GROUP_KEYS + REPEAT_KEYS).index.isin(timed.index)
    rows = df[keep]
    steady_rows = rows.loc[(rows["phase"] == "train_epoch") & (rows["epoch"] >= 2)].set_index(GROUP_KEYS)["seconds"]
    infer_rows = steady_inference(rows).set_index(GROUP_KEYS)["seconds"]
    for name, values in (("steady", steady_rows), ("infer", infer_rows)):
        centre = values.groupby(GROUP_KEYS).median().reindex(groups.index)
        groups[f"{name}_spread"] = _spread(values, GROUP_KEYS, centre) if len(values) else math.nan
    parity = df.loc[(df["phase"] == "parity") & df["steps"].isna()].groupby(GROUP_KEYS, sort=False, dropna=False)[
        ["parity_max_abs", "parity_max_rel"]].max()
    groups = groups.join(parity)
    groups = with_rates(groups, df, _rate_rows(rows), _intervals(timed, "first_s", groups.index))
    groups = _with_tta(groups, timed)
    groups = groups.join(quality.groups(reps))
    named = labels(GroupKey.of(k) for k in groups.index)
    groups["label"] = [named[GroupKey.of(k)] for k in groups.index]
    return Summary(groups=groups[SUMMARY_COLUMNS], repeats=reps)


def _rate_rows(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The timed epochs and passes the median times are of: the steady epochs (the first where a
    group has no other, as :func:`per_repeat`) and the passes after the first (``steady_inference``)."""
    train = rows[rows["phase"] == "train_epoch"]
    steady = train["epoch"] >= 2
    any_steady = steady.groupby([train[k] for k in GROUP_KEYS], sort=False, dropna=False).transform("any")
    return train[steady | (~any_steady.astype(bool) & (train["epoch"] == 1))], steady_inference(rows)


def _with_tta(groups: pd.DataFrame, timed: pd.DataFrame) -> pd.DataFrame:
    """Time to accuracy of the timed repeats that reached the target (median, interval, count) and
    how many of them did not (``inf``): those cannot be timed. Only groups that train are counted."""
    level = list(range(len(GROUP_KEYS)))
    tta = timed["tta_s"]
    reached = tta[np.isfinite(tta)]
    groups["tta_s"] = reached.groupby(level=level, sort=False).median().reindex(groups.index)
    iv = _intervals(reached.to_frame(), "tta_s", groups.index)
    groups["tta_low"], groups["tta_high"], groups["tta_interval"] = iv["low"], iv["high"], iv["kind"].fillna("")
    counts = {"tta_reached": np.isfinite(tta), "tta_missed": np.isinf(tta)}
    trains = ~groups["inference_only"].astype(bool)  # a cell that trains nothing reaches no target, nor misses one
    for name, mask in counts.items():
        counted = mask.groupby(level=level, sort=False).sum().reindex(groups.index).fillna(0).astype(int)
        groups[name] = counted.where(trains, 0)
    groups["tta_n"] = groups["tta_reached"]
    return groups

