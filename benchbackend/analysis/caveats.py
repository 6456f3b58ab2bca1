"""The warnings of a comparison: what makes its numbers weaker than they look.

Too few repeats, a spread over ``SPREAD_LIMIT`` of the median, no steady state, time to accuracy
reached by too few repeats (``stability_warnings``); a busy machine (``busy_warnings``); rows from
different hosts, CPUs or versions compared with each other, one group's repeats from several hosts, one workload
name with several definitions (``environment_warnings``); failed groups with their reasons
(``status_warnings``). ``compare.report_warnings`` puts them in the order they are shown.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from . import experiments, tables
from .busy import BUSY_SHARE
from .experiments import CONTEXT_KEYS, GROUP_KEYS, GroupKey
from .stats import MIN_REPEATS
from .summary import TTA

SPREAD_LIMIT = 0.10
#: Compared across every row of one experiment and device (threads define the experiment: never pooled).
CONTEXT_ENV = ("host", "os", "cpu", "gpu")
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
    cols = list(dict.fromkeys(GROUP_KEYS + ["workload", "workload_hash", "data_source", *CONTEXT_ENV,
                                            *BACKEND_ENV, "source"]))
    env = df[[c for c in cols if c in df.columns]].drop_duplicates()
    for c in cols:
        if c not in env.columns:
            env[c] = ""
    return env.astype(str).drop_duplicates().to_dict("records")


def _differing(rows: list[dict[str, str]], keys: list[str], col: str) -> list[tuple[tuple, dict[str, set[str]]]]:
    """(key, {value: sources}) of each ``keys`` whose rows hold several non-empty ``col`` values, in key order."""
    seen: dict[tuple, dict[str, set[str]]] = {}
    for row in rows:
        if row[col]:
            seen.setdefault(tuple(row[k] for k in keys), {}).setdefault(row[col], set()).add(row["source"])
    return [(key, values) for key, values in sorted(seen.items()) if len(values) > 1]


def environment_warnings(df: pd.DataFrame) -> list[str]:
    """Rows from different environments compared with each other (host, CPU, versions);
    one group's repeats from different hosts; one workload name with several definitions from
    different files (one file that holds them all is one command's, which swept them: ``--batch-size``,
    ``--threads``). Over the
    distinct rows only (a few per repeat), in plain Python: pandas' per-call cost dominated here."""
    rows = _env_rows(df)
    out = []
    checks = [(c, CONTEXT_KEYS) for c in CONTEXT_ENV] + [(c, CONTEXT_KEYS + ["backend"]) for c in BACKEND_ENV]
    for col, keys in checks:
        for key, values in _differing(rows, keys, col):
            out.append(f"{'/'.join(key)}: rows from different environments are compared "
                       f"({col} differs): {_values_by_source(values)}")
    named = experiments.labels(GroupKey.of(k) for k in dict.fromkeys(tuple(r[k] for k in GROUP_KEYS) for r in rows))
    for key, values in _differing(rows, GROUP_KEYS, "host"):
        group = GroupKey.of(key)
        out.append(f"{group.experiment}/{group.device}/{named[group]}: its repeats ran on different hosts, "
                   "so its timings mix machines: " + _values_by_source(values))
    by_file: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        by_file.setdefault((row["workload"], row["source"]), set()).add(row["experiment"])
    for (workload,), values in _differing(rows, ["workload"], "experiment"):
        if any(name == workload and set(values) <= seen for (name, _), seen in by_file.items()):
            continue  # one file holds them all: one command (a resumed one keeps its definitions) swept them
        out.append(f"workload {workload!r} has {len(values)} different definitions in these "
                   "files; each is compared on its own, with no ratio between them: " + _values_by_source(values))
    return out


def busy_warnings(groups: pd.DataFrame) -> list[str]:
    """Each group whose timed repeats other processes made busy (``busy.BUSY_SHARE``): its
    verdicts are withheld (``compare._busy``); and the repeats ``--skip-bad`` left out for it."""
    out = []
    for phase, what, n in (("train", "training", "steady_n"), ("infer", "inference", "infer_n"),
                           ("gen", "generation", "ok_repeats")):
        busy = groups[f"{phase}_busy"] > 0
        if busy.any():
            detail = (groups[f"{phase}_busy"].astype(str) + " of " + groups[n].astype(str) + " repeats, up to "
                + (groups[f"{phase}_busy_share"] * 100).round().astype("Int64").astype(str) + "%")
            out.append(f"machine busy: other processes held over {BUSY_SHARE:.0%} of the cores during the timed "
                       f"{what} of " + _names(groups, busy, detail) + ". Such load slows frameworks unequally, so "
                       "no verdict rests on those repeats: run again on a quiet machine, or compare --skip-bad to "
                       "leave them out")
    left = groups["busy_left_out"] > 0
    if left.any():
        out.append("left out as busy (--skip-bad): " + _names(groups, left, groups["busy_left_out"].astype(str)
                                                                + " repeat(s)"))
    return out


def status_warnings(groups: pd.DataFrame) -> list[str]:
    """Each group that is not ok, with its run rows' reason."""
    bad = groups[(groups["status"] != "ok") & (groups["message"] != "")]
    return [f"{group_name(groups, k)}: {row.status}: {tables.short_message(row.message)}"
            for k, row in bad.iterrows()]


def implausible_warnings(groups: pd.DataFrame) -> list[str]:
    """Results that cannot be true, each named with its figures so that no one reads it as a
    finding: a scaling efficiency above 1 (``scaling.check``: implausible where its interval lies
    above 1 too, unstable where the interval holds 1) and an MFU above 100% (the peak it is against
    under-read, or the timing is spoiled): a row's is left out (``results.mfu_values``) and its reason
    named here. ``groups`` is ``compare.rank``'s, through ``scaling.annotate``."""
    from . import scaling

    out = []
    checks = groups["scaling_check"] if "scaling_check" in groups else pd.Series("", index=groups.index)
    for index, flag in checks.items():
        if not flag:
            continue
        row, n = groups.loc[index], int(groups.loc[index, "replicas"])
        efficiency = scaling.efficiency_text(row, mark=False)
        figures = f"{group_name(groups, index)}: scaling efficiency {efficiency} is above 1"
        if flag == scaling.IMPLAUSIBLE:
            out.append(f"{figures}, its 95% CI too, which is implausible: {n} replicas did more than {n} times the "
                       "work of one, which points to a spoiled measurement (the single replica timed while something "
                       "else ran, say), not a finding")
        else:
            why = "its 95% CI holds 1" if row["scaling_low"] <= 1 else "no interval, one repeat a side"
            out.append(f"{figures} within noise ({why}): too unstable to read; rerun with more repeats on an idle "
                       "machine")
    left_out = (groups["mfu_missing"] != "") & ((groups["peak"] != "") | (groups["peak_datasheet"] != ""))
    for index, row in groups[left_out].iterrows():
        out.append(f"{group_name(groups, index)}: MFU left out of its rows where it would be above 100%, which is "
                   f"impossible: {row['mfu_missing']}")
    for col, what in (("mfu", "training"), ("infer_mfu", "inference")):
        for index, row in groups[groups[col] > 1].iterrows():
            peak = f" ({row['peak']})" if row["peak"] else ""
            out.append(f"{group_name(groups, index)}: {what} MFU {row[col]:.0%} is above 100%, which is "
                       f"impossible: the peak it is against{peak} under-read (a probe taken on a busy machine, a low "
                       "--peak-tflops), or the timing is spoiled")
    return out


#: The ``/proc/cpuinfo`` flags that give a CPU bf16 arithmetic (``machine.native_bf16``), as the caveat names them.
BF16_FLAGS = "avx512_bf16, amx_bf16 or Arm's bf16"


def emulated_bf16_warnings(groups: pd.DataFrame, df: pd.DataFrame) -> list[str]:
    """The bf16 groups that ran on a CPU without bf16 instructions (their rows' ``cpu_bf16`` is
    False): there every bf16 operation goes through fp32 and back, several times slower than fp32
    (4-7x on an AVX2 EPYC in issue 40), which is the CPU's doing, not the framework's."""
    if "cpu_bf16" not in df.columns:
        return []
    rows = df[(df["precision"] == "bf16") & (df["cpu_bf16"].astype(str) == "False")]
    found = set(map(tuple, rows[GROUP_KEYS].astype(str).to_numpy()))
    emulated = pd.Series([tuple(map(str, k)) in found for k in groups.index], index=groups.index)
    if not emulated.any():
        return []
    cpus = sorted(set(rows["cpu"].astype(str))) if "cpu" in rows else []
    return [f"bf16 is emulated on this CPU ({', '.join(cpus) or 'its flags'}: no {BF16_FLAGS} in /proc/cpuinfo), so "
            f"every bf16 operation goes through fp32 and back, often several times slower than fp32: "
            f"{_names(groups, emulated)}. Their bf16 times are the CPU's, not the framework's; time bf16 on a CPU "
            "with bf16 instructions or on a GPU"]
