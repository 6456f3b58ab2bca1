"""The text of generation (``--generate``) in ``compare``'s tables and verdict lines and on the
report's page: the values and the verdicts that :mod:`benchbackend.analysis.generation` reduces and
ranks, per experiment and device, one row per group and prompt length. Times are in milliseconds;
the fastest correct group of each prompt length (by decode tokens/s) is starred, as elsewhere.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import pandas as pd

#: (prefix, the per-repeat value the verdict compares, what it is called): every one a time, lower is
#: better; decode tokens/s is B over the mean TPOT.
VERDICTS = (("ttft", "ttft_s", "TTFT"), ("tpot_p50", "tpot_p50_s", "TPOT p50"),
            ("tpot_p99", "tpot_p99_s", "TPOT p99"), ("decode", "tpot_mean_s", "decode tokens/s"))
#: How the terminal, the report and the end of a run state the metrics, once.
CONVENTION = ("Generation: TTFT = time to first token (prefill, the prompt's copy and the first token on the host), "
              "the median of the passes after the first; TPOT = time per output token over every decode step of "
              "those passes (mean, p50, p90, p99); decode tokens/s = batch / mean TPOT; each the median over "
              "repeats. Verdicts as above, per prompt length; decode tokens/s ranks (*).")


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
