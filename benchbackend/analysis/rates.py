"""What a group's rates are, and what its MFU is against: samples/s, achieved FLOP/s and MFU from
the very median time that ranks the group (``summary``), and one peak per device and precision.

A rate is the work of one epoch (pass) over the group's median time, not a median of per-repeat
rates: with an even number of repeats a median is the mean of its two middle values, and the
median of rates is then not the reciprocal of the median of times (a table once starred the
quicker group beside the lower samples/s).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..results import DATASHEET, PEAK_KEYS, best_peaks, mfu_values
from .experiments import GROUP_KEYS

#: Per-repeat values of the training and the inference phase, reduced alike (``summary.per_repeat``).
RATE_COLUMNS = ("achieved_flops", "mfu", "mfu_datasheet")


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column, all NaN where the file predates it."""
    if name in df.columns:
        return pd.to_numeric(df[name], errors="coerce")
    return pd.Series(np.nan, index=df.index, dtype=float)


def peak_text(peak_flops: float, source: str, precision: str) -> str:
    """``0.4 TFLOP/s fp32 (--peak-tflops)``: one peak MFU was measured against."""
    where = f" ({source})" if source else ""
    return f"{peak_flops / 1e12:.3g} TFLOP/s {precision or 'fp32'}{where}"


def one_peak(df: pd.DataFrame) -> pd.DataFrame:
    """Every timed row measured against the best GEMM probe the frame holds for its device,
    precision and threads (``results.PEAK_KEYS``: one denominator per device, so that MFU compares
    across backends; a run whose backends probed for the first time saw the best rise between its
    cells), its MFU again, never above 1 (``results.mfu_values``: the rule of the file's own final
    rewrite, so that a file's rows and compare agree). Rows of files before schema 12 against
    ``--peak-tflops`` keep their datasheet figure."""
    if "peak_flops" not in df.columns or "achieved_flops" not in df.columns:
        return df
    text = {c: df[c].astype(str) if c in df.columns else pd.Series("", index=df.index) for c in PEAK_KEYS}
    keys = list(zip(*(text[c] for c in PEAK_KEYS)))
    source = df.get("peak_source", pd.Series("", index=df.index)).fillna("").astype(str)
    best = best_peaks(zip(keys, df["peak_flops"], source))
    timed = column(df, "achieved_flops").notna() & ~source.str.startswith(DATASHEET)
    if not timed.any():
        return df
    df = df.copy()
    for col in ("mfu_missing", "peak_source"):
        df[col] = df[col].fillna("").astype(str) if col in df.columns else ""
    datasheet = column(df, "peak_datasheet_flops")
    precision = df.get("precision", pd.Series("", index=df.index)).fillna("").astype(str)
    updates: dict[str, list] = {c: [] for c in ("peak_flops", "peak_source", "mfu", "mfu_datasheet", "mfu_missing")}
    rows = np.flatnonzero(timed.to_numpy())
    for i in rows:
        peak, src = best.get(keys[i], (df["peak_flops"].iat[i], source.iat[i]))
        values = mfu_values(df["achieved_flops"].iat[i], peak, src, precision.iat[i], datasheet.iat[i])
        for col, value in (("peak_flops", peak), ("peak_source", src), *values.items()):
            updates[col].append(math.nan if value is None else value)
    for col, values in updates.items():
        if col not in df.columns:
            df[col] = math.nan if col != "mfu_missing" else ""
        df.iloc[rows, df.columns.get_loc(col)] = np.array(values, dtype=object if col in ("peak_source",
                                                                                           "mfu_missing") else float)
    return df


#: The rate columns of a group, per phase: (samples/s, the prefix of its interval, of the others).
_RATE_NAMES = (("samples_per_s", "sps", ""), ("infer_sps", "infer_sps", "infer_"))


def _work(rows: pd.DataFrame, index: pd.Index) -> pd.DataFrame:
    """Per group, the work of one epoch (or pass) of ``rows`` that each rate is of: ``samples``,
    and each of ``RATE_COLUMNS`` (achieved FLOP/s, MFU) x the row's seconds. It is the same in
    every epoch of a definition; the median keeps one odd row from moving it."""
    seconds = column(rows, "seconds")
    work = pd.DataFrame({"samples": column(rows, "samples").fillna(column(rows, "samples_per_s") * seconds),
                         **{c: column(rows, c) * seconds for c in RATE_COLUMNS}})
    return work.groupby([rows[k] for k in GROUP_KEYS], sort=False, dropna=False).median().reindex(index)


def with_rates(groups: pd.DataFrame, df: pd.DataFrame, phase_rows: tuple[pd.DataFrame, pd.DataFrame],
               first: pd.DataFrame) -> pd.DataFrame:
    """Each group's rates (samples/s with its interval, achieved FLOP/s and MFU, of training and of
    inference), FLOPs per sample, and the peak(s) its MFU is against (``peak`` names them all,
    ``peak_flops`` is NaN unless there is one).

    A rate is the work of one epoch (pass) over the very median time that ranks the group,
    ``steady_s`` (``infer_s``), and its interval that time's, turned over (the module docstring).
    ``phase_rows`` are the timed repeats' steady epochs and passes (``summary._rate_rows``); with one
    epoch (no ``steady_s``) the first epoch's time and its interval (``first``) stand in, as in
    ``summary.per_repeat``."""
    one_epoch = groups["steady_s"].isna()
    times = ((groups["steady_s"].where(~one_epoch, groups["first_s"]),
              groups["steady_low"].where(~one_epoch, first["low"]),
              groups["steady_high"].where(~one_epoch, first["high"])),
             (groups["infer_s"], groups["infer_low"], groups["infer_high"]))
    for (sps, bounds, prefix), rows, (time, low, high) in zip(_RATE_NAMES, phase_rows, times):
        work = _work(rows, groups.index)
        groups[sps] = work["samples"] / time
        groups[f"{bounds}_low"], groups[f"{bounds}_high"] = work["samples"] / high, work["samples"] / low
        for c in RATE_COLUMNS:
            groups[f"{prefix}{c}"] = work[c] / time
    timed_phase = df[df["phase"].isin(["train_epoch", "inference"])]
    groups["flops_per_sample"] = column(timed_phase, "flops_per_sample").groupby(
        [timed_phase[k] for k in GROUP_KEYS], sort=False).max().reindex(groups.index)
    by_group = [timed_phase[k] for k in GROUP_KEYS]
    sheet = column(timed_phase, "peak_datasheet_flops")
    groups["peak_datasheet"] = sheet.groupby(by_group, sort=False).max().reindex(groups.index).map(
        lambda f: f"{f / 1e12:.3g} TFLOP/s (--peak-tflops)" if f > 0 else "")
    missing = timed_phase.get("mfu_missing", pd.Series("", index=timed_phase.index)).fillna("").astype(str)
    groups["mfu_missing"] = missing.groupby(by_group, sort=False).agg(
        lambda m: next((w for w in m if w), "")).reindex(groups.index).fillna("")
    peaks = pd.DataFrame({"peak_flops": column(timed_phase, "peak_flops"),
                          "source": timed_phase.get("peak_source", pd.Series("", index=timed_phase.index)),
                          "precision": timed_phase.get("precision", pd.Series("", index=timed_phase.index))})
    peaks[GROUP_KEYS] = timed_phase[GROUP_KEYS]
    peaks = peaks[peaks["peak_flops"] > 0].fillna({"source": "", "precision": ""}).drop_duplicates()
    if not len(peaks):
        groups["peak"], groups["peak_flops"] = "", math.nan
        return groups
    peaks["text"] = [peak_text(f, str(src), str(prec)) for f, src, prec in
                     zip(peaks["peak_flops"], peaks["source"], peaks["precision"])]
    by_peak = peaks.groupby(GROUP_KEYS, sort=False)
    groups["peak"] = by_peak["text"].agg(lambda t: "; ".join(sorted(set(t)))).reindex(groups.index).fillna("")
    single = by_peak["peak_flops"].agg(lambda v: v.iloc[0] if v.nunique() == 1 else math.nan)
    groups["peak_flops"] = single.reindex(groups.index)
    return groups


