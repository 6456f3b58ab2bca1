"""Text renderings of a ranked comparison (see ``compare.rank``): terminal, markdown, csv, json.

Over 400 lines: one comparison's every table (training, inference, convergence, scaling) and its
verdict lines share their cells' formatting here; generation's and the LoadGen scenarios' tables
live in ``tables_generation`` and ``tables_scenarios``.
"""
from __future__ import annotations

import io
import json
import math
from typing import Any, Callable, Optional

import pandas as pd

from ..results import TRAIN_FLOPS_FACTOR
from . import quality, scaling
from . import tables_generation as generations
from . import tables_scenarios as scenario_tables
from .experiments import CONTEXT_KEYS, context_name
from .stats import CI_LABEL, ESTIMATOR, MIN_REPEATS, RANGE_LABEL, WIDE_SPAN, Ratio
from .summary import INFER_METRICS, METRIC_NAMES, METRICS, TTA


def short_message(message: str, width: int = 160) -> str:
    """The last non-empty line of a message (a traceback's error line), cut to ``width``."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return text if len(text) <= width else text[: width - 3] + "..."


def _num(x: Any, spec: str = "#.4g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)) or pd.isna(x):
        return "n/a"
    return format(x, spec)


def _interval(row: pd.Series, prefix: str, mixed: bool) -> str:
    low, high, kind = row[f"{prefix}_low"], row[f"{prefix}_high"], row[f"{prefix}_interval"]
    if not kind or not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    text = f"[{low:#.4g}, {high:#.4g}]"
    return f"{text} {'CI' if kind == CI_LABEL else kind}" if mixed else text


def _interval_head(frame: pd.DataFrame, prefix: str) -> tuple[str, bool]:
    """The interval column's name: "95% CI" where every group has 6+ repeats (a distribution-free
    interval of the median that covers it 95% of the time), "range" (min-max of the repeats)
    where none has, both (and each cell says which) otherwise."""
    kinds = {k for k in frame[f"{prefix}_interval"] if k}
    if kinds == {CI_LABEL}:
        return f"{CI_LABEL} of median", False
    if kinds <= {RANGE_LABEL}:
        return "range of repeats", False
    return f"{CI_LABEL} or range", len(kinds) > 1


def _pct(x: Any) -> str:
    """MFU as a percentage with 3 significant digits (``0.108%``, ``45.2%``), ``n/a`` when unknown."""
    if x is None or pd.isna(x) or not math.isfinite(x):
        return "n/a"
    return f"{x * 100:#.3g}%"


def _spread(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"±{x * 100:.1f}%"


def vs_cell(row: pd.Series, prefix: str) -> str:
    """``faster: 2.00x [1.98-2.02]``: the verdict and the speed-up (baseline time / this time)
    with its 95% interval, both from one rule (``stats.Ratio.text``)."""
    return str(row[f"{prefix}_text"])


def repeats_cell(row: pd.Series, tta: bool = False) -> str:
    """``3``, or ``2 ok + 1 crashed`` when some repeats failed (they are left out of the timings);
    with ``tta``, ``2 reached + 1 not reached`` (+ the failed ones): a repeat that never reached the
    target accuracy has no time to accuracy."""
    if tta and row.timed_from == "ok" and row.tta_reached + row.tta_missed > 0:
        text = f"{row.tta_reached} reached" + (f" + {row.tta_missed} not reached" if row.tta_missed else "")
        return text + (f" + {row.failed}" if row.failed else "")
    if not row.failed:
        return str(row.repeats)
    return f"{row.ok_repeats} ok + {row.failed}"


def _fixed(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in plain notation (never ``1.14e+03``)."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def _bounds(ratio: float, low: float, high: float) -> tuple[str, str, str]:
    """Ratio and bounds printed with enough digits that the printed bounds stay on their side of 1
    and the printed ratio between them (3 significant digits unless that would blur it; up to 17,
    which tells any two doubles apart, for an exact ratio a hair off 1)."""
    for digits in range(3, 18):
        r, lo, hi = (_fixed(v, digits) for v in (ratio, low, high))
        fr, flo, fhi = float(r), float(lo), float(hi)
        same_side = (low > 1) == (flo > 1) and (high < 1) == (fhi < 1)
        if same_side and flo <= fr <= fhi:
            break
    return r, lo, hi


def ratio_text(r: Ratio) -> str:
    """``faster: 1.85x [1.60-2.10]``, ``slower: 0.361x [0.330-0.395] (2.77x slower)``: the verdict,
    the speed-up and its 95% interval (a slowdown also as its inverse), all from
    one rule, so that a verdict and its interval always point the same way. An interval too wide
    to read (``Ratio.too_wide``) is not printed as if it bounded anything: the withheld verdict
    says why (``unstable: 1.23x (95% CI spans over 1000x)``)."""
    verdict = r.verdict
    if verdict == "n/a":
        return verdict
    if not r.testable:
        return f"{verdict}: {_fixed(r.ratio)}x"
    if r.too_wide:
        return f"{verdict}: {_fixed(r.ratio)}x (95% CI spans over {WIDE_SPAN:g}x)"
    ratio, low, high = _bounds(r.ratio, r.low, r.high)
    # A speed-up below 1 is read more easily as its inverse: 0.361x is 2.77x slower.
    inverse = f" ({_fixed(1 / r.ratio)}x slower)" if verdict == "slower" and 0 < r.ratio < 1 else ""
    return f"{verdict}: {ratio}x [{low}-{high}]{inverse}"


def convention(baseline: str = "baseline", metric: str = "epoch-time") -> str:
    """The one convention of every ``vs`` cell (its estimator, the columns' own, included), and the
    metric that ranks training, stated once above the tables."""
    text = (f"vs {baseline}: speed-up = {baseline}'s time / this time (>1: faster), both the {ESTIMATOR} over "
            f"repeats shown in the time columns, with its 95% CI (Welch's t on log per-repeat times, with a "
            f"{ESTIMATOR}'s standard error); 'faster'/'slower' only where the CI leaves 1 out, and none where "
            f"it spans {WIDE_SPAN:g}x or more (withheld: unstable timings, or fewer than {MIN_REPEATS} repeats a "
            "side). Timings come from ok repeats only.")
    if metric == TTA:
        text += ("\nTraining is ranked on time to accuracy: the training seconds (epoch times summed, first "
                 "epoch included) until the validation accuracy first reached the workload's "
                 "target_accuracy; a repeat that never reached it has no time and is counted apart.")
    elif metric in INFER_METRICS:
        what = ("compile time (compile s: the first epoch or pass less a steady one, the same steps: tracing, "
                "compilation, autotuning, first touches)" if metric == "compile-time" else
                "time to first result (1st result s: the worker process's start to the end of its first step)")
        text += f"\nRanked on {what}, in training and in inference."
    else:
        text += "\nTraining is ranked on the steady epoch time (median of the epochs after the first)."
    return text


def _shows_mfu(frame: pd.DataFrame, prefix: str) -> bool:
    """Whether the rows carry achieved FLOP/s at all (files before MFU do not): then a column."""
    col = "achieved_flops" if prefix == "train" else "infer_achieved_flops"
    return bool(frame[col].notna().any())


def _dispatch_columns(frame: pd.DataFrame, prefix: str) -> list[tuple[str, str]]:
    """(header, column) of the first dispatch's figures that some group of ``frame`` has (files
    before schema 12 have none): ``compile s`` and ``1st result s`` (median over timed repeats)."""
    return [(head, f"{prefix}{col}") for head, col in (("compile s", "compile_s"), ("1st result s", "first_result_s"))
            if frame[f"{prefix}{col}"].notna().any()]


def _shows_sheet(frame: pd.DataFrame) -> bool:
    """Whether any group has a datasheet peak (``--peak-tflops``): then an "MFU sheet" column too."""
    return bool(frame["peak_datasheet"].astype(bool).any())


def _train_rows(frame: pd.DataFrame, metric: str = "epoch-time") -> tuple[list[str], list[list[str]]]:
    base = frame["baseline"].iloc[0] or "baseline"
    mfu = _shows_mfu(frame, "train")
    tta = metric == TTA
    ci_head, mixed = _interval_head(frame, "tta" if tta else "steady")
    head = ["", "backend", "status", "repeats"]
    head += ["time to acc s", ci_head, "steady s"] if tta else ["1st epoch s", "steady s", ci_head]
    sheet = mfu and _shows_sheet(frame)
    dispatch = _dispatch_columns(frame, "")
    head += [h for h, _ in dispatch]
    head += ["samples/s"] + (["MFU"] if mfu else []) + (["MFU sheet"] if sheet else [])
    head += ["val acc", "parity err", f"vs {base}"]
    rows = []
    for _, r in frame.iterrows():
        row = ["*" if r.fastest_train else "", r.label, r.status, repeats_cell(r, tta)]
        row += ([_num(r.tta_s), _interval(r, "tta", mixed), _num(r.steady_s)] if tta else
                [_num(r.first_s), _num(r.steady_s), _interval(r, "steady", mixed)])
        row += [_num(getattr(r, col)) for _, col in dispatch]
        row += [_num(r.samples_per_s, ",.0f")] + ([_pct(r.mfu)] if mfu else []) + ([_pct(r.mfu_datasheet)] if sheet
                                                                                     else [])
        row += [_num(r.val_accuracy, ".4f"), _num(r.parity_max_abs, ".1e"), vs_cell(r, "train")]
        rows.append(row)
    return head, rows


def _convergence_rows(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Epochs to the target accuracy over seeds (``convergence``): how many reached it, the median
    epochs of those that did, MLPerf's trimmed time to accuracy, and the test against the reference."""
    head = ["", "backend", "status", "seeds reached", "epochs to target", "trimmed time to acc s", "convergence"]
    rows = [["", r.label, r.status, f"{r.ett_reached}/{r.ett_n}", _num(r.ett_median, "g"),
             "never" if r.tta_trimmed == math.inf else _num(r.tta_trimmed), r.conv_text]
            for _, r in frame.iterrows() if r.ett_n > 0]
    return head, rows


def _infer_rows(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    base = frame["baseline"].iloc[0] or "baseline"
    ci_head, mixed = _interval_head(frame, "infer")
    mfu = _shows_mfu(frame, "infer")
    head = ["", "backend", "status", "repeats", "1st pass s", "median s", "spread", ci_head]
    sheet = mfu and _shows_sheet(frame)
    dispatch = _dispatch_columns(frame, "infer_")
    head += [h for h, _ in dispatch] + (["MFU"] if mfu else []) + (["MFU sheet"] if sheet else []) + [f"vs {base}"]
    rows = [["*" if r.fastest_infer else "", r.label, r.status, repeats_cell(r), _num(r.infer_first_s),
             _num(r.infer_s), _spread(r.infer_spread), _interval(r, "infer", mixed)]
            + [_num(getattr(r, col)) for _, col in dispatch]
            + ([_pct(r.infer_mfu)] if mfu else []) + ([_pct(r.infer_mfu_datasheet)] if sheet else [])
            + [vs_cell(r, "infer")]
            for _, r in frame.iterrows()]
    return head, rows


def mfu_line(frame: pd.DataFrame) -> str:
    """What MFU is measured against in one section, said once: one peak per device and precision
    (the best GEMM probe taken there, whichever framework took it: ``rates.one_peak``), each named
    with the groups it divides, the datasheet's where ``--peak-tflops`` gave one, and the groups with
    no known peak (their MFU is n/a)."""
    measured = frame[frame["achieved_flops"].notna() | frame["infer_achieved_flops"].notna()]
    if measured.empty:
        return ""
    peaks: dict[str, list[str]] = {}
    for name, p in zip(measured["label"], measured["peak"]):
        if p:
            peaks.setdefault(p, []).append(name)
    missing = [name for name, p in zip(measured["label"], measured["peak"]) if not p]
    parts = []
    if len(peaks) == 1:
        parts.append(f"MFU = achieved FLOP/s / a peak of {next(iter(peaks))}")
    elif peaks:
        parts.append("MFU = achieved FLOP/s / the peak of its device and precision (the best GEMM probe taken there, "
                     "whichever framework took it): " + "; ".join(f"{p} for {', '.join(names)}"
                                                                   for p, names in peaks.items()))
    sheets = sorted({p for p in measured["peak_datasheet"] if p})
    if sheets:
        parts.append(f"MFU sheet = achieved FLOP/s / {', '.join(sheets)}")
    if missing:
        parts.append(f"MFU n/a for {', '.join(missing)}: no peak known (give --peak-tflops)")
    if peaks or sheets:
        parts.append(f"a training sample counts {TRAIN_FLOPS_FACTOR}x its forward FLOPs")
    return "; ".join(parts)


def _fastest_line(frame: pd.DataFrame, metric: str = "epoch-time", generation: Optional[pd.DataFrame] = None,
                  scenarios: Optional[pd.DataFrame] = None) -> str:
    parts, notes = generations.fastest(generations.in_context(generation, frame))
    parts += scenario_tables.fastest(scenario_tables.in_context(scenarios, frame))
    infer_what = "inference" if metric not in INFER_METRICS else f"inference {METRIC_NAMES[metric]}"
    for prefix, col, what in (("train", METRICS[metric], METRIC_NAMES[metric]),
                              ("infer", INFER_METRICS.get(metric, "infer_s"), infer_what)):
        timed = frame[frame[col].notna()]
        if timed.empty:
            continue
        best = frame[frame[f"fastest_{prefix}"]]
        if best.empty:
            ok = frame["status"] == "ok"
            busy = ok.any() and (frame.loc[ok, f"{prefix}_busy"] > 0).all()
            why = "the machine was busy: no verdict" if busy else "no backend passed its checks"
            parts.append(f"{what} none ({why})")
        else:
            row = best.iloc[0]
            verdict = row[f"{prefix}_verdict"]
            how = "" if verdict in ("baseline", "n/a") else f"; vs {row['baseline']}: {row[f'{prefix}_text']}"
            parts.append(f"{what} {row['label']} ({_num(row[col])} s{how})")
        quickest = timed[col].idxmin()
        row = timed.loc[quickest]
        if row["status"] != "ok":
            notes.append(f"{row['label']} was quicker in {what} but is {row['status']}, so it is not ranked")
        elif row["gate"] == "fail":
            notes.append(f"{row['label']} was quicker in {what} but fails quality ({quality.shortfall_text(row)}), "
                         "so it is not ranked")
    line = "fastest correct (*): " + "; ".join(parts) if parts else "no timings"
    return line + "".join(f"\nnote: {n}" for n in notes)


def _what(frame: pd.DataFrame) -> str:
    """What the experiment is: its definition, or the sizes the rows show."""
    definition = next((d for d in frame["definition"] if d), "")
    if definition:
        return f"definition: {definition}"
    parts = []
    train = frame["train_samples"].dropna()
    if len(train):
        parts.append(f"{train.max():,.0f} training samples per epoch")
    infer = frame["infer_samples"].dropna()
    if len(infer):
        parts.append(f"{infer.max():,.0f} samples per inference pass")
    hashes = sorted({h for h in frame["workload_hash"] if h})
    if hashes:
        parts.append(f"workload hash {', '.join(hashes)}")
    return "; ".join(parts)


def _contexts(groups: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    out = []
    for ctx, frame in groups.groupby(CONTEXT_KEYS, sort=False):
        base = frame["baseline"].iloc[0]
        title = context_name(ctx) + (f" (baseline: {base})" if base else " (no baseline)")
        out.append((title, _what(frame), frame))
    return out


def _aligned(head: list[str], rows: list[list[str]], left: Optional[set[int]] = None) -> str:
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    # names, status, repeats and the verdict read left to right
    left = {1, 2, 3, len(head) - 1} if left is None else left

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left or i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _markdown(head: list[str], rows: list[list[str]], left: Optional[set[int]] = None) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    left = {1, 2, 3, len(head) - 1} if left is None else left
    align = ["---" if i in left else "--:" for i in range(len(head))]
    return "\n".join([line(head), "|" + "|".join(align) + "|"] + [line(r) for r in rows])


def _text(groups: pd.DataFrame, table: Callable[..., str], markdown: bool,
          metric: str = "epoch-time", verdicts: bool = True, generation: Optional[pd.DataFrame] = None,
          scenarios: Optional[pd.DataFrame] = None) -> str:
    blocks = [convention(metric=metric)] + ([generations.CONVENTION] if generation is not None and len(generation)
                                            else []) + ([scenario_tables.CONVENTION] if scenarios is not None
                                                        and len(scenarios) else [])
    for title, what, frame in _contexts(groups):
        parts = [f"### {title}" if markdown else f"== {title} =="]
        about = [line for line in (what, mfu_line(frame)) if line]
        if about:
            parts.append(("\n\n" if markdown else "\n").join(about))
        trains = frame[~frame["inference_only"].astype(bool)]
        timed_infer = frame["infer_s"].notna().any()
        gen = generations.in_context(generation, frame)
        sc = scenario_tables.in_context(scenarios, frame)
        if (gen is None and sc is None) or frame[["first_s", "steady_s", "infer_s"]].notna().any(axis=None):
            if len(trains) and (trains[["first_s", "steady_s"]].notna().any(axis=None) or not timed_infer):
                parts += ["**Training**" if markdown else "Training", table(*_train_rows(trains, metric))]
            if timed_infer or not len(trains):
                parts += ["**Inference**" if markdown else "Inference", table(*_infer_rows(frame))]
        if "ett_n" in frame and (frame["ett_n"] > 0).any():
            parts += ["**Convergence**" if markdown else "Convergence (epochs to checks.target_accuracy; repeats "
                      "are seeds; trimmed: MLPerf's mean without the fastest and slowest run)",
                      table(*_convergence_rows(frame))]
        if gen is not None:
            parts += generations.blocks(gen, table, markdown)
        if sc is not None:
            parts += scenario_tables.blocks(sc, table, markdown)
        scaled = scaling.rows(frame) if "replicas" in frame else None
        if scaled is not None:
            parts += ["**Scaling**" if markdown else "Scaling", scaling.SCALING_LINE, table(*scaled)]
        gate = quality.pass_rates(frame)
        if gate:
            parts.append(gate)
        if verdicts:
            parts.append(_fastest_line(frame, metric, generation, scenarios))
        blocks.append(("\n\n" if markdown else "\n").join(parts))
    return "\n\n".join(blocks) + "\n"


def verdict_lines(groups: pd.DataFrame, metric: str = "epoch-time", generation: Optional[pd.DataFrame] = None,
                  scenarios: Optional[pd.DataFrame] = None) -> str:
    """Each comparison's verdict (its fastest correct backend, and any quicker one that failed
    its checks), named by the comparison: what ``run`` ends with, after the warnings."""
    return "\n".join(f"{context_name(ctx)}: {_fastest_line(frame, metric, generation, scenarios)}"
                     for ctx, frame in groups.groupby(CONTEXT_KEYS, sort=False))


def records(groups: pd.DataFrame) -> list[dict[str, Any]]:
    """One plain dict per group (NaN as None), for csv and json."""
    flat = groups.reset_index()
    out = []
    for rec in flat.to_dict(orient="records"):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else
                        v.item() if hasattr(v, "item") else v) for k, v in rec.items()})
    return out


def render(groups: pd.DataFrame, fmt: str, warnings: list[str], metric: str = "epoch-time",
           verdicts: bool = True, generation: Optional[pd.DataFrame] = None,
           scenarios: Optional[pd.DataFrame] = None) -> str:
    """Render ``groups`` (from ``compare.rank``) as table, markdown, csv or json; json holds the
    metric, the estimator (``stats.ESTIMATOR``: of every time and, as their ratio, every speed-up)
    and the warnings too, the other formats leave the warnings to the caller. A table
    without ``verdicts`` leaves out each section's "fastest correct" line (``verdict_lines``).
    ``generation`` (``generation.rank``) adds each context's generation tables (json: its records;
    csv holds the groups only); ``scenarios`` (``scenarios.rank``) each context's LoadGen scenario tables."""
    if fmt == "table":
        return _text(groups, _aligned, markdown=False, metric=metric, verdicts=verdicts, generation=generation,
                     scenarios=scenarios)
    if fmt == "markdown":
        return _text(groups, _markdown, markdown=True, metric=metric, generation=generation, scenarios=scenarios)
    if fmt == "csv":
        buf = io.StringIO()
        pd.DataFrame(records(groups)).to_csv(buf, index=False)
        return buf.getvalue()
    if fmt == "json":
        return json.dumps({"metric": metric, "estimator": ESTIMATOR, "groups": records(groups), "warnings": warnings,
                           **({"generation": records(generation)} if generation is not None else {}),
                           **({"scenarios": records(scenarios)} if scenarios is not None and len(scenarios) else {})},
                          indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r}")


