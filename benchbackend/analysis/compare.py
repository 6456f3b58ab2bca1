"""``benchbackend compare``: read results CSVs, rank backends against a baseline, say how sure we are.

Rows are pooled and compared only within one *experiment*: one definition of a workload (its
hash: model, training settings, sizes after ``--limit``, epochs, batch size, seed; and its data
source) on one device. Several definitions of one workload name are separate sections, labelled
by what differs (``mnist (limit 1024)``), with no ratio between them.

Within an experiment every backend (and mode, and precision) is compared with the baseline on its
per-repeat steady epoch time and per-repeat steady inference time, with one decision rule
(:mod:`benchbackend.analysis.stats`): the speed-up baseline/candidate as the ratio of the medians shown
beside it, its 95% interval from Welch's t on log times (with a median's standard error), and
"faster"/"slower" iff that interval leaves 1 out; identical timings on both sides give an exact ratio.
Only groups whose every repeat is ``ok`` get a verdict or can be the fastest; only ``ok`` repeats
feed the timings. The text comes from :mod:`benchbackend.analysis.tables`.

``metric="time-to-accuracy"`` ranks the training table on per-repeat time to accuracy instead
(DAWNBench's metric: the training seconds until the validation accuracy first reached the
workload's ``checks.target_accuracy``), with the same decision rule; a repeat that never reached
the target has no time and is counted apart, and a group where none did is not ranked. ``compile-time``
and ``first-result`` rank both tables on the first dispatch's figures (``timing.FirstDispatch``).

Decision rules: :mod:`benchbackend.analysis.stats`; reductions: ``summary``; warnings: ``caveats``
(``report_warnings`` here orders them); formatting: ``tables``; generation's (``--generate``: TTFT,
TPOT, decode tokens/s per prompt length, by the same rule): ``generation``; the LoadGen scenarios'
(``--scenario``: p90, p99, samples/s, peak QPS): ``scenarios``.

Over 400 lines: the ranking, its regressions and the outcome every renderer reads share this room
with the hand-off to the other analyses (quality gate, convergence, scaling, generation, scenarios),
which live apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

import pandas as pd

from .. import results
from ..errors import ResultsError
from . import busy, caveats, convergence, experiments, generation, quality, scaling, scenarios, stats, summary, tables
from .caveats import group_name
from .experiments import CONTEXT_KEYS, GroupKey
from .summary import INFER_METRICS, METRIC_NAMES, METRICS, TTA

FORMATS = ("table", "markdown", "csv", "json")
#: Exit codes of ``compare --fail-on-regression`` (``cli.py`` maps them; 0 otherwise).
EXIT_REGRESSION = 3
EXIT_CANDIDATE_FAILED = 4
#: The correctness oracle: the default baseline only when nothing else passed its checks.
REFERENCE_BACKEND = "numpy"
NOT_REACHED = "not ranked (target not reached)"
#: The verdict of a group whose (or whose baseline's) timed repeats other processes made busy.
BUSY = busy.WITHHELD
#: Verdicts that say nothing either way: a busy machine, or an interval too wide to read (``stats``).
WITHHELD = (BUSY, "too few repeats", "unstable")
FAILS_QUALITY = quality.FAILS


@dataclass
class CompareOutcome:
    """What ``compare`` prints and how it exits; ``cli.py`` does the printing."""

    text: str
    warnings: list[str]
    exit_code: int
    #: The rows compared (for ``report.write_report``).
    frame: Optional[pd.DataFrame] = None
    #: The ranked groups and the metric, from which the other renderings are drawn when asked.
    groups: Optional[pd.DataFrame] = None
    metric: str = "epoch-time"
    fmt: str = "table"
    generation: Optional[pd.DataFrame] = None  # ``generation.rank``'s groups per prompt length
    scenarios: Optional[pd.DataFrame] = None  # ``scenarios.rank``'s

    @cached_property
    def table_text(self) -> str:
        """The terminal table (what ``--format table`` prints)."""
        return self.text if self.fmt == "table" else tables.render(
            self.groups, "table", self.warnings, self.metric, generation=self.generation, scenarios=self.scenarios)

    @cached_property
    def body(self) -> str:
        """The terminal table without its verdict lines (``run`` prints its warnings between: the verdict is last)."""
        return tables.render(self.groups, "table", self.warnings, self.metric, verdicts=False,
                             generation=self.generation, scenarios=self.scenarios)

    @cached_property
    def verdict(self) -> str:
        return tables.verdict_lines(self.groups, self.metric, self.generation, self.scenarios)


def _keys(frame: pd.DataFrame) -> list[GroupKey]:
    return [GroupKey.of(k) for k in frame.index]


def _preference(key: GroupKey) -> tuple:
    """Sort key of default baselines: registry order (the reference oracle last), fp32 before
    other precisions, a backend's default mode first."""
    from ..backends import registry

    names = list(registry.BACKENDS)
    order = names.index(key.backend) if key.backend in names else len(names)
    spec = registry.BACKENDS.get(key.backend)
    modes = list(spec.mode_names) if spec is not None else []
    mode_rank = modes.index(key.mode) if key.mode in modes else len(modes)
    return (key.backend == REFERENCE_BACKEND, order, key.backend, key.precision != "fp32", key.precision,
            mode_rank, key.mode)


def _metrics(metric: str) -> tuple[tuple[str, str], ...]:
    """(table prefix, per-repeat column) of the training and the inference ranking."""
    return (("train", METRICS[metric]), ("infer", INFER_METRICS.get(metric, "infer_s")))


def _pick_baseline(frame: pd.DataFrame, baseline: Optional[str], where: str,
                   warnings: list[str], metric: str = "epoch-time") -> Optional[GroupKey]:
    keys = _keys(frame)
    if baseline is None:
        ok = [k for k in keys if summary.is_ok(frame.loc[k.index, "status"]) and frame.loc[k.index, "ok_repeats"] > 0]
        ok = [k for k in ok if frame.loc[k.index, "gate"] != "fail"] or ok
        if metric == TTA:  # a baseline that never reached the target would leave every ratio n/a
            ok = [k for k in ok if frame.loc[k.index, "tta_reached"] > 0] or ok
        return min(ok, key=_preference) if ok else None
    def failed(k: GroupKey) -> tuple[bool, bool]:  # a group whose every repeat is ok first
        return not summary.is_ok(frame.loc[k.index, "status"]), frame.loc[k.index, "ok_repeats"] == 0

    found = sorted((k for k in keys if k.matches(baseline)), key=lambda k: (failed(k), _preference(k)))
    if not found:
        warnings.append(f"{where}: no {baseline} results, so no ratios there")
        return None
    base = found[0]
    row = frame.loc[base.index]
    if len(found) > 1:
        warnings.append(f"{where}: {baseline} ran in several modes or precisions; the baseline is {row['label']}")
    if row["ok_repeats"] == 0:
        warnings.append(f"{where}: the baseline {row['label']} has no ok repeat ({row['status']}), "
                        "so no ratios there")
        return None
    if not summary.is_ok(row["status"]):
        warnings.append(f"{where}: the baseline {row['label']} is {row['status']} ({row['failed']}); "
                        f"ratios use its {row['ok_repeats']} ok repeat(s)")
    if metric == TTA and row["tta_reached"] == 0 and not row["inference_only"]:
        warnings.append(f"{where}: the baseline {row['label']} never reached the target accuracy, "
                        "so no time-to-accuracy ratios there")
    return base


def _verdict(r: Optional[stats.Ratio], key: GroupKey, base: Optional[GroupKey], row: pd.Series,
             missed: bool) -> tuple[str, str]:
    """(verdict, text) of one group against the baseline."""
    if key == base:  # a named baseline may have failed some repeats: said where its ratios are read
        ok = int(row["ok_repeats"])
        return "baseline", ("baseline" if summary.is_ok(row["status"]) else
                            f"baseline ({row['status']}: ratios use its {ok} ok repeat{'s' if ok != 1 else ''})")
    if not summary.is_ok(row["status"]):
        return (f"not ranked ({row['status']})",) * 2
    if missed:
        return NOT_REACHED, NOT_REACHED
    if r is None:
        return "n/a", "n/a"
    return r.verdict, tables.ratio_text(r)


def rank(summary_: summary.Summary, baseline: Optional[str] = None,
         metric: str = "epoch-time") -> tuple[pd.DataFrame, list[str]]:
    """Add ratios to the baseline, verdicts and the fastest correct group per experiment and device.

    ``baseline`` is a backend name (``BACKEND`` or ``BACKEND:MODE``); by default, per experiment,
    the first backend in registry order whose every repeat is ok, the NumPy reference last (it is
    the correctness oracle, not a backend one would pick). Only ok groups get a verdict; the others
    get ``not ranked (STATUS)``. ``metric`` (a key of METRICS) is what ranks the training table;
    under ``time-to-accuracy`` an ok group none of whose repeats reached the target is
    ``not ranked (target not reached)``. Raises ResultsError when the named baseline ran nowhere.
    """
    groups = summary_.groups.copy()
    keys = _keys(groups)
    if baseline is not None and not any(k.matches(baseline) for k in keys):
        raise ResultsError(f"unknown baseline backend {baseline!r}; backends in these results: "
                           + ", ".join(sorted({k.label() for k in keys})))
    warnings: list[str] = []
    new: dict[str, list] = {c: [] for c in ["baseline", "fastest_train", "fastest_infer"]}
    measures = _metrics(metric)
    for prefix, _ in measures:
        for c in ("ratio", "ratio_low", "ratio_high", "p", "verdict", "text"):
            new[f"{prefix}_{c}"] = []
    order = []
    contexts = sorted(groups.groupby(CONTEXT_KEYS, sort=False),
                      key=lambda item: tuple(summary.natural_key(part) for part in item[0]))
    for ctx, frame in contexts:
        base = _pick_baseline(frame, baseline, experiments.context_name(ctx), warnings, metric)
        fastest = {p: _fastest(frame, col, p) for p, col in measures}
        for key in _keys(frame):
            order.append(key.index)
            row = groups.loc[key.index]
            new["baseline"].append(groups.loc[base.index, "label"] if base else "")
            missed = metric == TTA and row["tta_reached"] == 0 and row["tta_missed"] > 0
            for prefix, col in measures:
                new[f"fastest_{prefix}"].append(key == fastest[prefix])
                r = (stats.compare_times(summary_.samples(base, col), summary_.samples(key, col))
                     if base is not None and key != base and summary.is_ok(row["status"]) else None)
                verdict, text = _verdict(r, key, base, row, prefix == "train" and missed)
                busy = _busy(groups, key, base, prefix) if r is not None else ""
                if busy:
                    verdict, text = BUSY, busy
                if row["gate"] == "fail" and key != base and summary.is_ok(row["status"]):
                    verdict, text = FAILS_QUALITY, quality.verdict_text(text, row)
                new[f"{prefix}_ratio"].append(r.ratio if r else math.nan)
                new[f"{prefix}_ratio_low"].append(r.low if r else math.nan)
                new[f"{prefix}_ratio_high"].append(r.high if r else math.nan)
                new[f"{prefix}_p"].append(r.pvalue if r else math.nan)
                new[f"{prefix}_verdict"].append(verdict)
                new[f"{prefix}_text"].append(text)
    groups = groups.loc[order]
    for col, values in new.items():
        groups[col] = values
    return groups, warnings


def _fastest(frame: pd.DataFrame, col: str, prefix: str) -> Optional[GroupKey]:
    """The fastest group among the correct ones (every repeat ``ok``, the quality gate not failed)
    that the machine left alone, or None: a group timed beside other processes is no one's
    fastest (see :func:`_busy`)."""
    ok = frame[(frame["status"] == "ok") & frame[col].notna() & (frame[f"{prefix}_busy"] == 0)
               & (frame["gate"] != "fail")]
    return GroupKey.of(ok[col].idxmin()) if len(ok) else None


def _busy(groups: pd.DataFrame, key: GroupKey, base: Optional[GroupKey], prefix: str) -> str:
    """Why the verdict of ``key`` against ``base`` on ``prefix`` (train, infer) is withheld: other
    processes held more than ``busy.BUSY_SHARE`` of the cores during some of either side's timed
    repeats. Such load slows frameworks unequally (torch's spinning threads far more than
    TensorFlow's), so no ratio between the two says which is faster. "" when neither was busy."""
    for who, k in (("", key), ("the baseline: ", base)):
        if k is None:
            continue
        row = groups.loc[k.index]
        n = int(row[f"{prefix}_busy"])
        if n:
            total = int(row["steady_n" if prefix == "train" else "infer_n"])
            return (f"{who}machine busy during {n} of {total} repeat{'s' if total != 1 else ''} "
                    f"({row[f'{prefix}_busy_share']:.0%} of the cores held by other processes): no verdict")
    return ""


def _is_candidate(key: tuple, row: pd.Series, candidate: tuple[str, ...]) -> bool:
    if candidate:
        return any(GroupKey.of(key).matches(c) for c in candidate)
    return row["baseline"] != "" and row["train_verdict"] != "baseline"


def regressions(groups: pd.DataFrame, candidate: tuple[str, ...], factor: float,
                metric: str = "epoch-time") -> tuple[list[str], int]:
    """Messages and exit code for ``--fail-on-regression``.

    Exit ``EXIT_CANDIDATE_FAILED`` when a candidate is not ok (crashed, NaN loss, ...): its
    timings cannot speak for it; under ``time-to-accuracy`` also when it never reached the
    target. Else ``EXIT_REGRESSION`` when a candidate is slower than the baseline by more than
    ``factor`` (point estimate) *and* significantly so (the 95% interval of the speed-up lies
    below 1). With no candidate named, every non-baseline group is one.
    """
    out, code = [], 0
    for key, row in groups.iterrows():
        if not _is_candidate(key, row, candidate) or row["train_verdict"] == "baseline":
            continue
        if not summary.is_ok(row["status"]):
            detail = row["failed"] or row["status"]
            out.append(f"candidate failed: {group_name(groups, key)} is {row['status']} ({detail}), so it cannot pass "
                       "--fail-on-regression")
            code = EXIT_CANDIDATE_FAILED
            continue
        if row["gate"] == "fail":
            out.append(f"candidate failed: {group_name(groups, key)} fails the quality gate "
                       f"({quality.shortfall_text(row)}), so it cannot pass --fail-on-regression")
            code = EXIT_CANDIDATE_FAILED
            continue
        if row["train_verdict"] == NOT_REACHED:
            out.append(f"candidate failed: {group_name(groups, key)} never reached the target accuracy "
                       f"({row['tta_missed']} repeat(s)), so it cannot pass --fail-on-regression")
            code = EXIT_CANDIDATE_FAILED
            continue
        infer_what = "inference" if metric not in INFER_METRICS else f"inference {METRIC_NAMES[metric]}"
        train_what = "steady epoch" if metric == "epoch-time" else METRIC_NAMES[metric]
        for prefix, what in (("train", train_what), ("infer", infer_what)):
            ratio = row[f"{prefix}_ratio"]
            if not ratio > 0 or 1 / ratio <= factor:
                continue
            if row[f"{prefix}_verdict"] in WITHHELD:
                out.append(f"possible regression, verdict withheld: {group_name(groups, key)} {what} is "
                           f"{1 / ratio:.2f}x slower than {row['baseline']} (limit {factor:g}x; "
                           f"{row[f'{prefix}_text']})")
            elif row[f"{prefix}_verdict"] == "slower":
                out.append(f"regression: {group_name(groups, key)} {what} is {1 / ratio:.2f}x slower than "
                           f"{row['baseline']} (limit {factor:g}x; {row[f'{prefix}_text']})")
                code = code or EXIT_REGRESSION
            else:
                out.append(f"possible regression, not significant: {group_name(groups, key)} {what} is "
                           f"{1 / ratio:.2f}x slower than {row['baseline']} (limit {factor:g}x; "
                           f"{row[f'{prefix}_text']})")
    return out, code


def _check_measured(df: pd.DataFrame) -> None:
    """Files with no training, inference or generation row (header only, or only status rows) are an error."""
    if len(df) and df["phase"].isin(["train_epoch", "inference", "scenario", *generation.PHASES]).any():
        return
    files = df.attrs.get("files") or (sorted(set(df["source"])) if "source" in df else [])
    names = ", ".join(Path(f).name for f in files) or "the results given"
    what = "no rows at all" if not len(df) else "only build, parity or status rows"
    raise ResultsError(f"{names}: no measurements to compare ({what})")


def _check_metric(metric: str, df: Optional[pd.DataFrame] = None) -> None:
    if metric not in METRICS:
        raise ResultsError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    if metric == TTA and df is not None:
        tta = pd.to_numeric(df["time_to_accuracy_s"], errors="coerce") if "time_to_accuracy_s" in df else None
        if tta is None or not tta.notna().any():
            raise ResultsError("no time_to_accuracy_s in these results: declare checks.target_accuracy in the workload")


def _analyse(df: pd.DataFrame, baseline: Optional[str], candidate: tuple[str, ...],
             fail_on_regression: Optional[float], notes: list[str],
             metric: str = "epoch-time", skip_busy: bool = False
             ) -> tuple[pd.DataFrame, list[str], int, Optional[pd.DataFrame]]:
    if fail_on_regression is not None and not fail_on_regression >= 1:
        raise ResultsError(f"the regression factor must be at least 1; got {fail_on_regression!r}")
    _check_measured(df)
    _check_metric(metric, df)
    df = experiments.with_experiment(df)
    reduced = summary.summarize(df, skip_busy)
    keys = _keys(reduced.groups)
    for name in candidate:
        if not any(k.matches(name) for k in keys):
            raise ResultsError(f"unknown candidate backend {name!r}; backends in these results: "
                               + ", ".join(sorted({k.label() for k in keys})))
    groups, warnings = rank(reduced, baseline, metric)
    groups = convergence.annotate(scaling.annotate(groups, reduced, df), reduced.repeats)
    warnings = report_warnings(groups, df, warnings, notes, metric)
    found, code = (regressions(groups, candidate, fail_on_regression, metric) if fail_on_regression is not None
                   else ([], 0))
    gen = generation.rank(groups, reduced.repeats, df)
    more, slower = generation.regressions(gen, groups, candidate, fail_on_regression)
    return groups, warnings + found + more, code or (EXIT_REGRESSION if slower else 0), gen


def report_warnings(groups: pd.DataFrame, df: pd.DataFrame, ranking: list[str], notes: list[str],
                    metric: str = "epoch-time") -> list[str]:
    """Every warning of one comparison, in the order they are shown: ``notes`` (skipped files),
    the baseline's (``ranking``, from :func:`rank`), a busy machine, stability, implausible figures,
    emulated bf16, environments, failed groups with their run rows' reasons. The one list that
    ``compare`` prints, that ``run`` ends with and that the report (index.html) holds."""
    return (list(notes) + list(ranking) + caveats.busy_warnings(groups) + caveats.stability_warnings(groups, metric)
            + caveats.implausible_warnings(groups) + caveats.emulated_bf16_warnings(groups, df)
            + caveats.environment_warnings(df) + caveats.status_warnings(groups))


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ResultsError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")


def compare_frame(df: pd.DataFrame, *, baseline: Optional[str] = None, candidate: tuple[str, ...] = (),
                  fmt: str = "table", fail_on_regression: Optional[float] = None,
                  notes: Optional[list[str]] = None, metric: str = "epoch-time",
                  skip_busy: bool = False) -> CompareOutcome:
    """Compare results already read (``results.read_many``, best through ``experiments.for_comparison``),
    e.g. right after a run; see :func:`run_compare` for the arguments."""
    _check_format(fmt)
    groups, warnings, code, gen = _analyse(df, baseline, tuple(candidate), fail_on_regression, list(notes or []),
                                           metric, skip_busy)
    sc = scenarios.rank(groups, experiments.with_experiment(df))
    text = tables.render(groups, fmt, warnings, metric, generation=gen, scenarios=sc)
    return CompareOutcome(text=text, warnings=warnings, exit_code=code, frame=df, groups=groups, metric=metric,
                          fmt=fmt, generation=gen, scenarios=sc)


def run_compare(paths: list[str], *, baseline: str | None = None, candidate: tuple[str, ...] = (),
                fmt: str = "table", skip_bad: bool = False,
                fail_on_regression: float | None = None, metric: str = "epoch-time") -> CompareOutcome:
    """Read results CSVs (files, directories, globs) and compare backends.

    ``fmt`` is table, markdown, csv or json. The outcome carries the rows and the terminal table,
    which ``report.write_report`` draws. ``skip_bad`` goes on without unreadable files (each becomes
    a warning) and leaves out the repeats other processes made busy, as failed ones are (without
    it, a group with such repeats gets no verdict: :func:`_busy`). ``fail_on_regression`` (a factor
    >= 1) sets exit_code 4 when a ``candidate`` (every non-baseline group when none is named) is not
    ok, else 3 when one is slower than the baseline by more than that factor and significantly so,
    in training or inference.
    ``metric`` (``epoch-time`` or ``time-to-accuracy``) ranks the training table.
    Raises ResultsError for bad input: a bad file, files with no measurements, an unknown
    baseline or candidate, a bad format or metric, time to accuracy asked of files without it.
    """
    _check_format(fmt)
    _check_metric(metric)
    df, skipped = results.read_many(results.expand(list(paths)), skip_bad=skip_bad)
    df = experiments.for_comparison(df)
    notes = [f"skipped {msg}" for msg in skipped]
    return compare_frame(df, baseline=baseline, candidate=candidate, fmt=fmt,
                         fail_on_regression=fail_on_regression, notes=notes, metric=metric, skip_busy=skip_bad)
