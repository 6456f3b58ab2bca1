"""The quality gate (``quality:`` in the workload, ``spec/quality.py``): a result counts only when
the cell's accuracy holds, as MLPerf makes every result conditional on reaching 99% of the fp32
reference's accuracy.

Each repeat that trained gets a ``gate``, against its baseline's cell of the same repeat: repeats
start from different initial weights (``model.initial_weights(workload, repeat)``), and every
backend of one repeat from the same ones, so the pair differs only in how it computed (where the
baseline has no cell of that repeat, the median of all its ok repeats):

- ``pass``: its metric reaches the target (``0.99 of fp32``: 99% of the baseline's; an absolute
  target: the value);
- ``fail``: it falls short by more than the validation set's sampling noise allows (below);
- ``not_judged``: it cannot be told: the cell failed a check of its own, the baseline did not run
  or has no ok repeat, or it falls short by less than the noise of its validation set;
- ``baseline_varies``: the baseline does not repeat itself, as the PyTorch compiler benchmark
  flags an eager baseline (``eager_variation``): its cells from the same initial weights (the same
  repeat in several runs or files) disagree by more than the gate's margin (1 - target), or its
  repeats (one per initial-weight seed) disagree by more than the margin and more than the
  validation set's noise (a network trained too briefly for its accuracy to settle: resnet20 at
  32 steps read 0.84 and 0.54 at fp32 over two seeds). No ratio to such a baseline says anything.

The noise guard. A validation accuracy is measured on n samples; two correct runs that differ in
float rounding disagree on a few of them. A shortfall is a ``fail`` only when it is larger than
``Z`` (1.645: one-sided 5%) standard errors of the difference of two accuracies on n samples each,
sqrt(2 p (1 - p) / n) at the baseline's accuracy p (of one accuracy against an absolute target).
At 256 samples and p = 0.5 that is 7.3 points: a smoke run's gate rarely fails, and says why; at
cifar10's 5,000, 1.6 points.

Cells that train nothing (``--inference-only``, ``--generate``) get no gate (empty): forward
parity and the greedy tokens judge them. Files written before the gate (no ``quality_target``)
get none either.

compare leaves a group with a failed repeat out of the fastest and prints its verdict as
"faster, fails quality (0.962 of fp32)", never a plain win (``compare._verdict``); its timings use
the repeats that passed where there are any.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pandas as pd

from .experiments import GROUP_KEYS, REPEAT_KEYS

GATES = ("pass", "fail", "not_judged", "baseline_varies")
#: Worst first: a group's gate is its worst repeat's.
_RANK = {"": 0, "pass": 1, "not_judged": 2, "baseline_varies": 3, "fail": 4}
#: One-sided 5%: a shortfall beyond this many standard errors of the noise is a ``fail``.
Z = 1.645
#: The columns :func:`judge` adds per repeat, and the CSV's per cell.
COLUMNS = ("quality", "quality_ratio", "gate", "gate_reason")
REFERENCE = "numpy"
#: The verdict of a group that failed the gate: whatever its speed, never a win.
FAILS = "fails quality"
#: What a gate is judged against (``spec.quality.QualitySpec.of``, which writes ``quality_target``).
BASES = ("fp32", "reference", "absolute")


def parse_target(text: str) -> tuple[float, str]:
    """``quality_target``'s text (``0.99 of fp32``, ``0.5``) as (target, of); ``ValueError`` on anything else."""
    value, _, of = str(text).strip().partition(" of ")
    of = of.strip() or "absolute"
    if of not in BASES:
        raise ValueError(f"unknown quality baseline {of!r}")
    return float(value), of


def _declared(df: pd.DataFrame) -> pd.DataFrame:
    """Per repeat, the first non-empty ``quality_target`` and ``quality_samples`` its rows carry."""
    keys = GROUP_KEYS + REPEAT_KEYS
    if "quality_target" not in df:
        return pd.DataFrame(columns=["quality_target", "quality_samples"])
    rows = df.loc[df["quality_target"].astype(str) != "", keys + ["quality_target", "quality_samples"]]
    return rows.groupby(keys, sort=False, dropna=False)[["quality_target", "quality_samples"]].first()


def _baseline(reps: pd.DataFrame, key: tuple, of: str) -> tuple[Optional[tuple], str]:
    """The group ``key``'s baseline group (GROUP_KEYS values) and its name, or (None, why not)."""
    experiment, device, backend, mode, _ = key
    groups = set(reps.index.droplevel(list(range(len(GROUP_KEYS), reps.index.nlevels))))
    if of == "fp32":
        same = (experiment, device, backend, mode, "fp32")
        if same in groups:
            return same, f"{backend}:{mode}" if mode else backend
        others = sorted(g for g in groups if g[:3] == (experiment, device, backend) and g[4] == "fp32")
        if others:
            return others[0], f"{backend}:{others[0][3]}" if others[0][3] else backend
        return None, f"no fp32 cell of {backend} in these results to judge it against (add --precision fp32)"
    found = sorted(g for g in groups if g[:3] == (experiment, device, REFERENCE) and g[4] == "fp32")
    if found:
        return found[0], "the reference"
    return None, "the reference (numpy at fp32) did not run in these results (add -b numpy)"


def _noise(p: float, n: float, absolute: bool) -> float:
    """Standard error of a shortfall in accuracy on ``n`` samples at accuracy ``p``: of one
    accuracy (against an absolute target) or of the difference of two (against a baseline's)."""
    if not (n > 0) or not 0 <= p <= 1:
        return 0.0
    return math.sqrt((1 if absolute else 2) * p * (1 - p) / n)


def _one(q: float, n: float, target: float, of: str, base: Optional[np.ndarray], base_name: str,
         paired: bool = True, seeds: Optional[np.ndarray] = None) -> tuple[float, str, str]:
    """(ratio, gate, reason) of one repeat's metric ``q`` against ``base``: the baseline's values
    from the same initial weights (``paired``: its cells of the same repeat), else all its repeats'
    (``seeds``: every ok repeat of the baseline, one per initial-weight seed and run)."""
    if of == "absolute":
        ratio = q / target
        if q >= target:
            return ratio, "pass", f"{q:.4f} >= {target:g}"
        shortfall, se, what = target - q, _noise(target, n, True), f"{q:.4f} < {target:g}"
    else:
        assert base is not None
        median = float(np.median(base))
        if not median > 0:
            return math.nan, "not_judged", f"{base_name} fp32's accuracy is {median:g}: no ratio to it"
        ratio = q / median
        varies = _varies(base, median, target, 0.0, "cells from the same initial weights" if paired else "repeats")
        if seeds is not None and not varies:  # beyond sampling noise: the seed decides, not the arithmetic
            varies = _varies(seeds, float(np.median(seeds)), target, Z * _noise(median, n, False), "seeds")
        if varies:
            return ratio, "baseline_varies", f"{base_name} fp32's {varies}"
        unpaired = "" if paired else f", the median of its {len(base)} repeats: none from the same initial weights"
        if ratio >= target:
            return ratio, "pass", f"{ratio:.3f} of {of} ({base_name} fp32: {median:.4f}{unpaired})"
        shortfall, se = target * median - q, _noise(median, n, False)
        what = f"{ratio:.3f} of {of} ({q:.4f} against {base_name} fp32's {median:.4f}{unpaired})"
    if shortfall > Z * se:
        return ratio, "fail", what
    return ratio, "not_judged", (f"{what}: short of {target:g} by less than the noise of {n:,.0f} validation "
                                 f"samples (±{Z * se:.3f})")


def _varies(values: np.ndarray, median: float, target: float, noise: float, which: str) -> str:
    """Why ``values`` (a baseline's) disagree too much to judge against: by more than the gate's
    margin (1 - target) of their median and by more than ``noise``; "" when they do not."""
    if len(values) < 2 or not median > 0:
        return ""
    width = float(values.max() - values.min())
    if width / median <= 1 - target or width <= noise:
        return ""
    beyond = f" and the validation set's noise (±{noise:.3f})" if noise else ""
    return (f"{len(values)} {which} range {values.min():.4f}-{values.max():.4f} ({width / median:.1%}), more than "
            f"the gate's {1 - target:.1%} margin{beyond}: train longer (more steps) to judge it")


def judge(reps: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """The gate of each repeat of ``reps`` (``summary.per_repeat``'s frame: ``status``,
    ``val_accuracy``, ``first_s``), from the targets ``df``'s rows declare: a frame on ``reps``'
    index with ``COLUMNS`` and ``quality_target``."""
    declared = _declared(df).reindex(reps.index)
    out = pd.DataFrame(index=reps.index, columns=[*COLUMNS, "quality_target"], dtype=object)
    out["quality"] = reps["val_accuracy"].astype(float)
    out["quality_ratio"] = math.nan
    out["gate"], out["gate_reason"] = "", ""
    out["quality_target"] = declared["quality_target"].fillna("").astype(str)
    accuracy = reps["val_accuracy"].astype(float)
    ok = reps[(reps["status"] == "ok") & np.isfinite(accuracy)]["val_accuracy"].astype(float)
    level = list(range(len(GROUP_KEYS)))
    values = {key: part.to_numpy() for key, part in ok.groupby(level=level, sort=False)}
    repeat_at = reps.index.names.index("repeat")
    paired = {key: part.to_numpy() for key, part in
              ok.groupby(level=[*level, repeat_at], sort=False)}

    def base_values(group: tuple, repeat: Any) -> tuple[np.ndarray, bool]:
        """The baseline's ok values from the same initial weights (its cells of this repeat, in any
        run), else from all its repeats; and whether they were paired."""
        same = paired.get((*group, repeat))
        if same is not None and len(same):
            return same, True
        return values.get(group, np.array([])), False

    for index, rep in reps.iterrows():
        text = out.at[index, "quality_target"]
        trained = pd.notna(rep.get("first_s")) or pd.notna(rep.get("steady_s"))
        if not text or (not trained and rep["status"] == "ok"):
            continue  # no gate declared (an older file), or nothing trained: parity judges it
        gate, reason, ratio = "not_judged", "", math.nan
        try:
            target, of = parse_target(text)
        except ValueError:
            reason = f"unreadable quality_target {text!r}"
        else:
            q, n = float(rep["val_accuracy"]), float(pd.to_numeric(declared.at[index, "quality_samples"],
                                                                   errors="coerce"))
            if rep["status"] != "ok":
                reason = f"the cell is {rep['status']}"
            elif not math.isfinite(q):
                reason = "no validation accuracy in its rows"
            else:
                group = index[:len(GROUP_KEYS)]
                base, name = (None, "") if of == "absolute" else _baseline(reps, group, of)
                if of != "absolute" and base is None:
                    reason = name
                else:
                    found, pair = base_values(base, index[repeat_at]) if base is not None else (None, False)
                    if found is not None and not len(found):
                        reason = f"{name} fp32 has no ok repeat with a validation accuracy"
                    else:
                        ratio, gate, reason = _one(q, n, target, of, found, name, pair,
                                                   None if base is None else values.get(base))
        out.at[index, "quality_ratio"], out.at[index, "gate"], out.at[index, "gate_reason"] = ratio, gate, reason
    return out


def worst(gates: pd.Series) -> str:
    """A group's gate: its worst repeat's (fail, baseline_varies, not_judged, pass; "" when none has one)."""
    return max(gates, key=lambda g: _RANK.get(g, 0), default="")


def groups(reps: pd.DataFrame) -> pd.DataFrame:
    """Per group (index GROUP_KEYS): quality and quality_ratio (medians), gate (the worst),
    gate_pass and gate_judged (repeats passed, repeats with a gate), gate_reason (the worst
    repeat's), quality_target."""
    level = list(range(len(GROUP_KEYS)))
    by = reps.groupby(level=level, sort=False)
    out = pd.DataFrame({
        "quality": by["quality"].median(),
        "quality_ratio": by["quality_ratio"].apply(lambda r: pd.to_numeric(r, errors="coerce").median()),
        "gate": by["gate"].agg(worst),
        "gate_pass": by["gate"].agg(lambda g: int((g == "pass").sum())),
        "gate_judged": by["gate"].agg(lambda g: int((g != "").sum())),
        "quality_target": by["quality_target"].agg(lambda t: next((v for v in t if v), "")),
    })
    reason = {}
    for key, sub in by:
        chosen = sub[sub["gate"] == worst(sub["gate"])]
        reason[key] = chosen["gate_reason"].iloc[0] if len(chosen) else ""
    out["gate_reason"] = pd.Series(reason).reindex(out.index).fillna("") if reason else ""
    out.index.names = GROUP_KEYS
    return out


def shortfall_text(row: Any) -> str:
    """``0.962 of fp32`` (or ``0.412 < 0.5``): what a failed gate's verdict says."""
    target = str(row["quality_target"])
    try:
        value, of = parse_target(target)
    except ValueError:
        return "quality"
    if of == "absolute":
        return f"{row['quality']:.4f} < {value:g}"
    return f"{row['quality_ratio']:.3f} of {of}"


def verdict_text(text: str, row: Any) -> str:
    """``faster, fails quality (0.962 of fp32): 1.85x [1.60-2.10]``: a failed group's speed verdict
    (``text``) kept in view, the failed gate first, so that a fast wrong mode never reads as a win."""
    verdict, colon, rest = text.partition(":")
    fails = f"{FAILS} ({shortfall_text(row)})"
    return f"{verdict}, {fails}:{rest}" if colon and verdict not in ("n/a", "") else fails


def pass_rates(frame: pd.DataFrame) -> str:
    """One line per comparison: each group's repeats that passed the gate, and why the others did
    not ("" when no group has a gate)."""
    judged = frame[frame["gate_judged"] > 0]
    if judged.empty:
        return ""
    targets = sorted({t for t in judged["quality_target"] if t})
    parts = []
    for _, row in judged.iterrows():
        text = f"{row['label']} {row['gate_pass']}/{row['gate_judged']} pass"
        if row["gate"] == "fail":
            text += f" (fails: {shortfall_text(row)})"
        elif row["gate"] in ("not_judged", "baseline_varies"):
            text += f" ({row['gate'].replace('_', ' ')}: {row['gate_reason']})"
        parts.append(text)
    return f"quality gate (val_accuracy, {' / '.join(targets)}): " + "; ".join(parts)


def write(path: Any, df: pd.DataFrame, reps: pd.DataFrame) -> int:
    """Give every row of each judged cell of the results file ``path`` its gate (``COLUMNS``), as
    ``reps`` (``summary.per_repeat`` of ``df``, the file's rows for comparison) judged it; one
    atomic rewrite (``results.rewrite``). Returns the cells written."""
    from .. import results

    judged = reps[reps["gate"] != ""]
    if judged.empty or "cell_order" not in df:
        return 0
    keys = GROUP_KEYS + REPEAT_KEYS
    cells = df[["cell_order", "attempt", *keys]].drop_duplicates().join(judged[list(COLUMNS)], on=keys, how="inner")
    found: dict[tuple[str, int, int], list[str]] = {}
    for row in cells.itertuples(index=False):
        order, attempt = pd.to_numeric(row.cell_order, errors="coerce"), pd.to_numeric(row.attempt, errors="coerce")
        if pd.isna(order):
            continue
        values = [getattr(row, c) for c in COLUMNS]
        found[(str(row.run_id), int(order), 1 if pd.isna(attempt) else int(attempt))] = [
            "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else
            repr(float(v)) if isinstance(v, (float, np.floating)) else str(v) for v in values]

    def rows(header: list[str], reader: Any) -> Any:
        at = {c: i for i, c in enumerate(header)}
        if any(c not in at for c in COLUMNS):  # a file of an older schema: left as it is
            yield from reader
            return
        for row in reader:
            order, attempt = row[at["cell_order"]], row[at["attempt"]] or "1"
            try:
                key = (row[at["run_id"]], int(float(order)), int(float(attempt)))
            except ValueError:
                key = None
            values = found.get(key) if key is not None else None
            if values is not None:
                for col, value in zip(COLUMNS, values):
                    row[at[col]] = value
            yield row

    results.rewrite(path, rows)
    return len(found)
