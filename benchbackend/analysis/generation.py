"""Generation (``--generate``) in ``compare``, the report and the run's summary: time to first token,
time per output token and decode tokens/s per group and prompt length, with verdicts.

The rows (``run/generation.py``): ``prefill``, one per pass (``seconds``: the time to first token,
TTFT); ``decode``, one per step and pass (``seconds``: that step's time per output token, TPOT), or
one of ``steps`` G - 1 where every step ran in one dispatch (``jax:scan``: each step's TPOT is then
seconds / steps). Per repeat (one worker process) and prompt length P, over the passes after the
first (the first carries compilation and first-touch allocation and is shown apart, as inference's
first pass is; a repeat of one pass has only it):

- ``ttft_s``: the median time to first token of those passes;
- ``tpot_mean_s``, ``tpot_p50_s``, ``tpot_p90_s``, ``tpot_p99_s``: over every decode step of those
  passes, pooled (a one-dispatch row counts as its ``steps`` steps of seconds / steps each);
- ``decode_tps``: B / mean TPOT, with B the batch (``samples``); ``prefill_tps``: B x P / TTFT.

A group's figure is the median of its timed repeats' (``summary.timed_repeats``: ok repeats only,
or, where a group has none, those that ran to the end but failed a check, so that "fast but wrong"
stays visible), as every time of ``compare`` is. Verdicts follow ``stats.compare_times`` on the
per-repeat values against compare's baseline (``compare.rank``) at the same prompt length: TTFT,
TPOT p50, TPOT p99, and decode tokens/s through each repeat's mean TPOT (B is one within an
experiment: the batch is part of its definition, so the speed-up of decode tokens/s is the mean
TPOT's). Only a group whose every repeat is ok is ranked or can be the fastest (by decode tokens/s);
a repeat whose generation passes other processes made busy (``busy``) withholds the verdicts it feeds.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pandas as pd

from . import stats
from .busy import BUSY_SHARE, WITHHELD
from .caveats import group_name
from .experiments import CONTEXT_KEYS, GROUP_KEYS, REPEAT_KEYS, GroupKey
from .tables import ratio_text
from .tables_generation import VERDICTS

#: The rows a generation run times.
PHASES = ("prefill", "decode")
#: A generation group: a compare group at one prompt length.
KEYS = GROUP_KEYS + ["prompt_tokens"]
#: Per-repeat values, each reduced to the median over the timed repeats.
VALUES = ("first_ttft_s", "ttft_s", "tpot_mean_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "decode_tps",
          "prefill_tps", "batch", "new_tokens", "cache_bytes", "cache_bytes_expected")
def _numbers(rows: pd.DataFrame, cols: tuple[str, ...]) -> pd.DataFrame:
    return rows.assign(**{c: pd.to_numeric(rows[c], errors="coerce") if c in rows else math.nan for c in cols})


def _steady(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The rows of the passes after each repeat's first, unless the first is its only one."""
    last = rows.groupby(keys, sort=False, dropna=False)["pass"].transform("max")
    return rows[(rows["pass"] >= 2) | (last == 1)]


def _pooled(seconds: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """TPOT mean and percentiles of one repeat's decode rows, each row ``steps`` steps of seconds/steps."""
    ok = np.isfinite(seconds) & (seconds > 0)
    seconds, steps = seconds[ok], steps[ok]
    if not len(seconds):
        return {}
    each = np.repeat(seconds / steps, steps)
    p50, p90, p99 = (stats.latency_percentile(each, q) for q in (0.50, 0.90, 0.99))  # LoadGen's rule
    return {"tpot_mean_s": float(seconds.sum() / steps.sum()), "tpot_p50_s": float(p50), "tpot_p90_s": float(p90),
            "tpot_p99_s": float(p99)}


def per_repeat(df: pd.DataFrame, repeats: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """One row per generation group and repeat (columns ``KEYS`` + ``REPEAT_KEYS`` + ``VALUES`` +
    status, timed, gen_busy). ``df``: rows shaped by ``experiments.for_comparison``; ``repeats``:
    ``summary.per_repeat``'s frame (each repeat's status, whether it is timed, its busy shares;
    without it every repeat reads ok, untimed, not busy: the values alone)."""
    rows = df[df["phase"].isin(PHASES)]
    columns = [*KEYS, *REPEAT_KEYS, *VALUES, "status", "timed", "gen_busy"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    rows = _numbers(rows, ("seconds", "steps", "pass", "prompt_tokens", "new_tokens", "samples", "cache_bytes",
                           "cache_bytes_expected"))
    keys = KEYS + REPEAT_KEYS
    pre = rows[rows["phase"] == "prefill"]
    by_pre = pre.groupby(keys, sort=True, dropna=False)
    out = pd.DataFrame({"batch": by_pre["samples"].max(), "new_tokens": by_pre["new_tokens"].max(),
                        "cache_bytes": by_pre["cache_bytes"].max(),
                        "cache_bytes_expected": by_pre["cache_bytes_expected"].max()})
    out["first_ttft_s"] = pre[pre["pass"] == 1].groupby(keys, dropna=False)["seconds"].median()
    out["ttft_s"] = _steady(pre, keys).groupby(keys, dropna=False)["seconds"].median()
    dec = _steady(rows[rows["phase"] == "decode"], keys)
    steps = dec["steps"].fillna(1).clip(lower=1).astype(int).to_numpy()
    seconds = dec["seconds"].to_numpy(dtype=float)
    found = {key: _pooled(seconds[at], steps[at]) for key, at in dec.groupby(keys, dropna=False).indices.items()}
    tpot = pd.DataFrame.from_dict(found, orient="index", columns=list(VALUES[2:6]), dtype=float)
    if len(tpot):
        tpot.index = pd.MultiIndex.from_tuples(tpot.index, names=keys)
        out = out.join(tpot, how="outer")
    else:
        out = out.assign(**{c: math.nan for c in VALUES[2:6]})
    prompt = out.index.get_level_values("prompt_tokens").to_numpy(dtype=float)
    out["decode_tps"] = out["batch"] / out["tpot_mean_s"]
    out["prefill_tps"] = out["batch"] * prompt / out["ttft_s"]
    out = out.reset_index()
    if repeats is not None:
        rep = repeats.reindex(columns=["status", "timed", "gen_busy"]).reset_index()
        out = out.merge(rep, on=GROUP_KEYS + REPEAT_KEYS, how="left")
    else:
        out = out.assign(status="ok", timed=False, gen_busy=math.nan)
    out["status"] = out["status"].fillna("ok")
    out["timed"] = out["timed"].fillna(False).astype(bool)
    return out[columns]


def _verdict(r: Optional[stats.Ratio], key: GroupKey, base: Optional[GroupKey], status: str) -> tuple[str, str]:
    """(verdict, text) of one group at one prompt length against the baseline (``compare._verdict``'s rules)."""
    if base is not None and key == base:
        return "baseline", "baseline"
    if status != "ok":
        return (f"not ranked ({status})",) * 2
    if r is None:
        return "n/a", "n/a"
    return r.verdict, ratio_text(r)


def _busy(counts: dict[tuple, tuple[int, int, float]], key: GroupKey, base: Optional[GroupKey],
          prompt: float) -> str:
    """Why a verdict is withheld, in a few words: other processes held more than ``BUSY_SHARE`` of
    the cores during some of either side's timed generation passes ("" when neither was busy). The
    four verdict columns of a row share it, so it stays short; the run's and compare's busy-machine
    warning says which repeats and how much."""
    for who, k in (("", key), ("the baseline's ", base)):
        if k is not None and counts.get((*k.index, prompt), (0, 0, math.nan))[0]:
            return f"no verdict ({who}machine busy)"
    return ""


def rank(groups: pd.DataFrame, repeats: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """One row per generation group (index ``KEYS``): label, status, repeats, the medians of ``VALUES``
    over the timed repeats, and per ``VERDICTS`` prefix its ratio (baseline / this), interval, verdict
    and text against ``groups``' baseline (``compare.rank``'s frame); ``fastest`` marks each
    experiment, device and prompt length's fastest correct group by decode tokens/s. Groups of a
    context that generated but have no generation rows (unavailable, crashed) have one row with no
    prompt length. Empty when ``df`` has no generation rows."""
    per = per_repeat(df, repeats)
    if per.empty:
        return pd.DataFrame()
    timed = per[per["timed"]]
    by = timed.groupby(KEYS, sort=True, dropna=False)
    out = by[list(VALUES)].median()
    out["n"] = by.size()
    contexts = {tuple(c) for c in per[CONTEXT_KEYS].drop_duplicates().itertuples(index=False)}
    shown = {tuple(k[:5]) for k in out.index}
    missing = [k for k in groups.index if tuple(k[:2]) in contexts and tuple(k) not in shown]
    if missing:
        empty = pd.DataFrame(index=pd.MultiIndex.from_tuples([(*k, math.nan) for k in missing], names=KEYS))
        out = pd.concat([out, empty]).sort_index()
    out["n"] = out["n"].fillna(0).astype(int)
    info = groups.reindex([k[:5] for k in out.index])
    for col in ("label", "status", "repeats", "ok_repeats", "failed", "baseline"):
        out[col] = info[col].to_numpy()
    busy = timed.assign(busy=timed["gen_busy"] > BUSY_SHARE).groupby(KEYS, dropna=False)
    counts = {k: (int(b), int(n), float(s)) for k, b, n, s in
              zip(busy.size().index, busy["busy"].sum(), busy.size(), busy["gen_busy"].max())}
    samples = {k: timed.iloc[at] for k, at in by.indices.items()}
    columns = [f"{p}_{c}" for p, _, _ in VERDICTS for c in ("ratio", "ratio_low", "ratio_high", "verdict", "text")]
    ranked = [_versus(out, index, counts, samples) for index in out.index]
    return out.join(pd.DataFrame(ranked, index=out.index, columns=["fastest", *columns]))


def _versus(out: pd.DataFrame, index: tuple, counts: dict[tuple, tuple[int, int, float]],
            samples: dict[tuple, pd.DataFrame]) -> list[Any]:
    """Whether the generation group ``index`` is its prompt length's fastest correct one, then per
    ``VERDICTS`` prefix its ratio, bounds, verdict and text against its context's baseline."""
    row, key, prompt = out.loc[index], GroupKey.of(index[:5]), index[5]
    ctx = out[(out.index.get_level_values("experiment") == key.experiment)
              & (out.index.get_level_values("device") == key.device)]
    base = next((GroupKey.of(k[:5]) for k, r in ctx.iterrows() if r["baseline"] and r["label"] == r["baseline"]),
                None)
    same = ctx[(ctx.index.get_level_values("prompt_tokens") == prompt) & (ctx["status"] == "ok")]
    quiet = [k for k in same.index if not counts.get(k, (0,))[0] and math.isfinite(same.loc[k, "decode_tps"])]
    values: list[Any] = [bool(quiet) and max(quiet, key=lambda k: same.loc[k, "decode_tps"]) == index]
    mine, theirs = samples.get(index), samples.get((*base.index, prompt)) if base is not None else None
    for _, col, _ in VERDICTS:
        r = (stats.compare_times(theirs[col].to_numpy(dtype=float), mine[col].to_numpy(dtype=float))
             if theirs is not None and mine is not None and key != base and row["status"] == "ok" else None)
        verdict, text = _verdict(r, key, base, str(row["status"]))
        why = _busy(counts, key, base, prompt) if r is not None else ""
        if why:
            verdict, text = WITHHELD, why
        values += [r.ratio if r else math.nan, r.low if r else math.nan, r.high if r else math.nan, verdict, text]
    return values


def regressions(gen: Optional[pd.DataFrame], groups: pd.DataFrame, candidate: tuple[str, ...],
                factor: Optional[float]) -> tuple[list[str], bool]:
    """``compare --fail-on-regression`` on generation, by ``compare.regressions``' rule (which
    already fails a candidate that is not ok): messages, and whether a candidate's TTFT or decode
    tokens/s at some prompt length is slower than the baseline's by more than ``factor`` and
    significantly so. Nothing without a factor. A candidate is a named one, else every group but
    the baseline."""
    out: list[str] = []
    slower = False
    if factor is None or gen is None or gen.empty:
        return out, slower
    for index, row in gen.iterrows():
        key = GroupKey.of(index[:5])
        named = any(key.matches(c) for c in candidate) if candidate else bool(row["baseline"])
        if row["status"] != "ok" or not named:
            continue
        for prefix, what in (("ttft", "time to first token"), ("decode", "decode tokens/s")):
            ratio, verdict = row[f"{prefix}_ratio"], row[f"{prefix}_verdict"]
            if verdict == "baseline" or not ratio > 0 or 1 / ratio <= factor:
                continue
            said = (f"{group_name(groups, key.index)} {what} at prompt {index[5]:g} is {1 / ratio:.2f}x slower than "
                    f"{row['baseline']} (limit {factor:g}x; {row[f'{prefix}_text']})")
            slower |= verdict == "slower"
            how = "not significant" if verdict == "not significant" else "verdict withheld"
            out.append(f"regression: {said}" if verdict == "slower" else f"possible regression, {how}: {said}")
    return out, slower
