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
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from . import stats
from .busy import BUSY_SHARE
from .experiments import CONTEXT_KEYS, GROUP_KEYS, REPEAT_KEYS, GroupKey

#: The rows a generation run times.
PHASES = ("prefill", "decode")
#: A generation group: a compare group at one prompt length.
KEYS = GROUP_KEYS + ["prompt_tokens"]
#: Per-repeat values, each reduced to the median over the timed repeats.
VALUES = ("first_ttft_s", "ttft_s", "tpot_mean_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "decode_tps",
          "prefill_tps", "batch", "new_tokens", "cache_bytes", "cache_bytes_expected")
#: (prefix, the per-repeat value the verdict compares, what it is called): every one a time, lower is
#: better; decode tokens/s is B over the mean TPOT.
VERDICTS = (("ttft", "ttft_s", "TTFT"), ("tpot_p50", "tpot_p50_s", "TPOT p50"),
            ("tpot_p99", "tpot_p99_s", "TPOT p99"), ("decode", "tpot_mean_s", "decode tokens/s"))
#: How the terminal, the report and the end of a run state the metrics, once.
CONVENTION = ("Generation: TTFT = time to first token (prefill, the prompt's copy and the first token on the host), "
              "the median of the passes after the first; TPOT = time per output token over every decode step of "
              "those passes (mean, p50, p90, p99); decode tokens/s = batch / mean TPOT; each the median over "
              "repeats. Verdicts as above, per prompt length; decode tokens/s ranks (*).")


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
    p50, p90, p99 = np.percentile(each, [50, 90, 99])
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
    from .tables import ratio_text

    if base is not None and key == base:
        return "baseline", "baseline"
    if status != "ok":
        return (f"not ranked ({status})",) * 2
    if r is None:
        return "n/a", "n/a"
    return r.verdict, ratio_text(r)


def _busy(counts: dict[tuple, tuple[int, int, float]], key: GroupKey, base: Optional[GroupKey],
          prompt: float) -> str:
    """Why a verdict is withheld: other processes held more than ``BUSY_SHARE`` of the cores during
    some of either side's timed generation passes ("" when neither was busy)."""
    for who, k in (("", key), ("the baseline: ", base)):
        if k is None:
            continue
        n, total, share = counts.get((*k.index, prompt), (0, 0, math.nan))
        if n:
            return (f"{who}machine busy during {n} of {total} repeat{'s' if total != 1 else ''} "
                    f"({share:.0%} of the cores held by other processes): no verdict")
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
    from .compare import BUSY

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
            verdict, text = BUSY, why
        values += [r.ratio if r else math.nan, r.low if r else math.nan, r.high if r else math.nan, verdict, text]
    return values


def regressions(gen: pd.DataFrame, groups: pd.DataFrame, candidate: tuple[str, ...],
                factor: float) -> tuple[list[str], int]:
    """``compare --fail-on-regression`` on generation (``compare.regressions``' rule: a failed
    candidate is its business): messages, and ``EXIT_REGRESSION`` where a candidate's TTFT or decode
    tokens/s at some prompt length is slower than the baseline's by more than ``factor`` and
    significantly so."""
    from .caveats import group_name
    from .compare import EXIT_REGRESSION, WITHHELD, _is_candidate

    out, code = [], 0
    if gen.empty:
        return out, code
    for index, row in gen.iterrows():
        key = tuple(index[:5])
        if row["status"] != "ok" or not _is_candidate(key, groups.loc[key], candidate):
            continue
        for prefix, what in (("ttft", "time to first token"), ("decode", "decode tokens/s")):
            ratio, verdict = row[f"{prefix}_ratio"], row[f"{prefix}_verdict"]
            if verdict == "baseline" or not ratio > 0 or 1 / ratio <= factor:
                continue
            said = (f"{group_name(groups, key)} {what} at prompt {index[5]:g} is {1 / ratio:.2f}x slower than "
                    f"{row['baseline']} (limit {factor:g}x; {row[f'{prefix}_text']})")
            if verdict == "slower":
                out.append(f"regression: {said}")
                code = EXIT_REGRESSION
            else:
                out.append(f"possible regression, {'verdict withheld' if verdict in WITHHELD else 'not significant'}: "
                           f"{said}")
    return out, code


def in_context(generation: Optional[pd.DataFrame], frame: pd.DataFrame) -> Optional[pd.DataFrame]:
    """The generation rows of ``frame``'s experiment and device (``frame``: one context of compare's
    groups), or None where it generated nothing."""
    if generation is None or generation.empty or frame.empty:
        return None
    experiment, device = frame.index[0][:2]
    index = generation.index
    sub = generation[(index.get_level_values("experiment") == experiment)
                     & (index.get_level_values("device") == device)]
    return sub if len(sub) else None


def only_generation(groups: pd.DataFrame, generation: Optional[pd.DataFrame]) -> pd.Series:
    """Which of compare's groups generated and have no training or inference time (boolean, ``groups``' index)."""
    if generation is None or generation.empty:
        return pd.Series(False, index=groups.index)
    generated = {tuple(k[:5]) for k in generation.index}
    timed = groups[["first_s", "steady_s", "infer_s"]].notna().any(axis=1)
    return pd.Series([tuple(k) in generated for k in groups.index], index=groups.index) & ~timed


def _ms(x: Any) -> str:
    return "n/a" if x is None or pd.isna(x) or not math.isfinite(x) else f"{x * 1e3:#.4g}"


def _count(x: Any, spec: str = ",.0f") -> str:
    return "n/a" if x is None or pd.isna(x) or not math.isfinite(x) else format(x, spec)


def _prompt(x: Any) -> str:
    return "" if pd.isna(x) else f"{x:g}"


def _repeats(row: pd.Series) -> str:
    return str(row["repeats"]) if not row["failed"] else f"{row['ok_repeats']} ok + {row['failed']}"


def value_rows(gen: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """The generation table: per group and prompt length, the medians over repeats."""
    head = ["", "backend", "status", "repeats", "prompt", "1st TTFT ms", "TTFT ms", "TPOT mean ms", "TPOT p50 ms",
            "TPOT p90 ms", "TPOT p99 ms", "decode tok/s", "prefill tok/s", "cache MiB"]
    rows = [["*" if r["fastest"] else "", str(r["label"]), str(r["status"]), _repeats(r), _prompt(index[5]),
             _ms(r["first_ttft_s"]), _ms(r["ttft_s"]), _ms(r["tpot_mean_s"]), _ms(r["tpot_p50_s"]),
             _ms(r["tpot_p90_s"]), _ms(r["tpot_p99_s"]), _count(r["decode_tps"]), _count(r["prefill_tps"]),
             _count(r["cache_bytes"] / 2 ** 20, "#.3g")] for index, r in gen.iterrows()]
    return head, rows


def verdict_rows(gen: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """The generation verdicts: per group and prompt length, each metric's against the baseline."""
    base = next((b for b in gen["baseline"] if b), "") or "baseline"
    head = ["", "backend", "prompt"] + [f"{what} vs {base}" for _, _, what in VERDICTS]
    rows = [["*" if r["fastest"] else "", str(r["label"]), _prompt(index[5])]
            + [str(r[f"{p}_text"]) for p, _, _ in VERDICTS] for index, r in gen.iterrows()]
    return head, rows


def what(gen: pd.DataFrame) -> str:
    """``batch 1, 32 new tokens, prompts of 16 and 64 tokens``: what one context generated."""
    prompts = sorted({int(p) for p in gen.index.get_level_values("prompt_tokens") if pd.notna(p)})
    batch = sorted({int(b) for b in gen["batch"].dropna()})
    new = sorted({int(g) for g in gen["new_tokens"].dropna()})
    parts = [f"batch {', '.join(map(str, batch))}" if batch else "",
             f"{', '.join(map(str, new))} new tokens" if new else "",
             f"prompt{'s' if len(prompts) > 1 else ''} of {' and '.join(map(str, prompts))} tokens" if prompts else ""]
    return "Generation (" + ", ".join(p for p in parts if p) + ")"


def blocks(gen: pd.DataFrame, table: Callable[..., str], markdown: bool) -> list[str]:
    """compare's generation section of one context: its title, the table of values, the verdicts."""
    title = what(gen)
    out = [f"**{title}**" if markdown else title, table(*value_rows(gen), left={1, 2, 3})]
    if gen["baseline"].ne("").any():
        head, rows = verdict_rows(gen)
        out.append(table(head, rows, left=set(range(len(head))) - {2}))
    return out


def fastest(gen: Optional[pd.DataFrame]) -> tuple[list[str], list[str]]:
    """(parts, notes) of a context's verdict line: per prompt length, the fastest correct group by
    decode tokens/s with its verdict against the baseline; a quicker group that is not ok is noted."""
    if gen is None:
        return [], []
    parts, notes = [], []
    for prompt, sub in gen[gen["decode_tps"].notna()].groupby(level="prompt_tokens", sort=True):
        at = f"decode at prompt {prompt:g}"
        best = sub[sub["fastest"].astype(bool)]
        if best.empty:
            ok = (sub["status"] == "ok").any()
            why = "the machine was busy: no verdict" if ok else "no backend passed its checks"
            parts.append(f"{at} none ({why})")
        else:
            row = best.iloc[0]
            how = ("" if row["decode_verdict"] in ("baseline", "n/a") else
                   f"; vs {row['baseline']}: {row['decode_text']}")
            parts.append(f"{at} {row['label']} ({row['decode_tps']:,.0f} tokens/s{how})")
        quickest = sub.loc[sub["decode_tps"].idxmax()]
        if quickest["status"] != "ok":
            notes.append(f"{quickest['label']} decoded quicker at prompt {prompt:g} but is {quickest['status']}, "
                         "so it is not ranked")
    return parts, notes


def records(gen: Optional[pd.DataFrame]) -> list[dict[str, Any]]:
    """One plain dict per generation group (NaN as None), for ``compare --format json``."""
    if gen is None or gen.empty:
        return []
    from .tables import records as plain

    return plain(gen)
