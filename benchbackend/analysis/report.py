"""The report of a results frame: which figures (:mod:`benchbackend.analysis.plots`) per experiment and
device, each with its caption, written as PNGs beside an index.html of real tables: the summary
(compare's training and inference tables), the verdicts against the baseline, the warnings and the
environment.

The verdicts are compare's own (``compare.rank``), for the baseline the user named or compare's
default one, so that a figure and the terminal never disagree. The figures rank on the steady epoch
time, which is what they draw; the summary tables rank on the metric asked for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

import pandas as pd

from ..errors import ResultsError
from . import compare, generation, page, plots, plots_generation, plots_scaling, plots_scenarios, scaling, summary
from .busy import BUSY_SHARE
from .experiments import CONTEXT_KEYS, GROUP_KEYS, LABEL_NAMES, REPEAT_KEYS, context_name, text, with_experiment

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Drawn:
    """One figure of a report: its file stem, the figure and what it shows (its caption)."""

    stem: str
    figure: "Figure"
    caption: str


_VERDICT_RULE = ("speed-up = {base}'s time / this time (above 1: faster), with its 95% CI (Welch's t on the log "
                 "per-repeat times); 'faster' or 'slower' only where the CI leaves 1 out, else 'not significant'; "
                 "withheld where the CI spans 1000x or more, or where the machine was busy")
_WHISKERS = ("a distribution-free 95% CI of that median from 6 timed repeats, else the min-max of the "
             "per-repeat values.")
_FAILED = "Hatched grey bars and red labels: groups that failed a check or did not finish; they are not ranked."


def _verdict_caption(frame: pd.DataFrame, what: str) -> str:
    base = next((b for b in frame["baseline"] if b), "")
    if not base:
        return "No baseline (no group passed its checks), so no verdicts." + _busy_caption(frame)
    return (f"The baseline is {base} (bold label, dashed line at its {what}). Under each other group, compare's "
            f"verdict: {_VERDICT_RULE.format(base=base)}.{_busy_caption(frame)}")


def _busy_caption(frame: pd.DataFrame) -> str:
    """The groups timed while other processes held the machine (README "Trust"), said beside their figure."""
    busy = frame[(frame["train_busy"] > 0) | (frame["infer_busy"] > 0)]
    if busy.empty:
        return ""
    return (f" Machine busy: other processes held over {BUSY_SHARE:.0%} of the cores while "
            f"{', '.join(busy['label'])} {'was' if len(busy) == 1 else 'were'} timed, so no verdict rests on "
            "those repeats (see the warnings).")


def _slug(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", value).strip("-") or "x"


def _timed_rows(df: pd.DataFrame, reduced: summary.Summary) -> pd.DataFrame:
    """The rows of the repeats that feed the timings (see ``summary.timed_repeats``)."""
    timed = reduced.repeats.index[reduced.repeats["timed"].to_numpy()]
    return df[df.set_index(GROUP_KEYS + REPEAT_KEYS).index.isin(timed)]


def _context_figures(df: pd.DataFrame, timed: pd.DataFrame, ctx: tuple, frame: pd.DataFrame) -> list[Drawn]:
    where = context_name(ctx)
    stem = f"{_slug(ctx[0])}-{_slug(ctx[1])}"
    rows = df[(df["experiment"] == ctx[0]) & (df["device"] == ctx[1])]
    train = rows[rows["phase"] == "train_epoch"]
    infer = timed[(timed["experiment"] == ctx[0]) & (timed["device"] == ctx[1]) & (timed["phase"] == "inference")]
    trains = frame[~frame["inference_only"].astype(bool)]
    out = []
    if len(train):
        steady = trains["steady_s"].notna().any()
        verdicts = _verdict_caption(trains, "median") if steady else "One epoch: no steady state, so no verdict."
        out.append(Drawn(f"{stem}-epoch-time", plots.epoch_time_figure(trains, where),
                         f"Steady epoch time on {where}: per group, the median over its ok repeats of each repeat's "
                         f"median epoch after the first (the first epoch holds tracing and compilation); whiskers: "
                         f"{_WHISKERS} {verdicts} {_FAILED}"))
        if trains["samples_per_s"].notna().any():
            out.append(Drawn(f"{stem}-throughput", plots.throughput_figure(trains, where),
                             f"Training throughput on {where}: samples per second of the steady epochs (median over "
                             "ok repeats), with the model FLOPs utilization (MFU: achieved FLOP/s over the peak) "
                             f"where a peak is known. {verdicts} {_FAILED}"))
        if "replicas" in trains and (trains["replicas"] > 1).any():
            out.append(Drawn(f"{stem}-scaling", plots_scaling.scaling_figure(trains, where),
                             f"Training throughput against data-parallel replicas on {where}: per backend, the "
                             "median samples/s over ok repeats with its interval, strong scaling solid, weak dashed; "
                             "the legend gives each N's scaling efficiency throughput_N / (N x throughput_1) with "
                             f"its 95% interval; dotted: perfect scaling. {_FAILED}"))
        out.append(Drawn(f"{stem}-curves", plots.curves_figure(train, frame, where),
                         f"Training loss and validation accuracy per epoch on {where}: the median over repeats, the "
                         "band spans their min to max. Backends that agree draw the same curve: hollow markers of "
                         "different sizes keep each visible. Dotted: failed; a red x: the loss stopped being finite."))
    decode = timed[(timed["experiment"] == ctx[0]) & (timed["device"] == ctx[1]) & (timed["phase"] == "decode")]
    if len(decode):
        out.append(Drawn(f"{stem}-tpot-depth", plots_generation.tpot_depth_figure(decode, frame, where),
                         f"Time per output token against cache depth on {where} (--generate): per group, the median "
                         "TPOT of each decode step over the passes after each repeat's first and over its timed "
                         "repeats, at the tokens already in the key/value cache; one segment per prompt length; "
                         "dashed and flat: a backend that ran every step in one dispatch (its mean TPOT). Dotted: "
                         "a group that failed a check (not ranked)."))
    scenario = rows[rows["phase"] == "scenario"]
    if len(scenario):
        out.append(Drawn(f"{stem}-latency-cdf", plots_scenarios.latency_cdf_figure(scenario, frame, where),
                         f"Latency distribution on {where} (--scenario, MLPerf LoadGen): the share of queries "
                         "completed within each latency, at LoadGen's p50, p90, p99 and p99.9, one line per repeat "
                         "(its last LoadGen run). Dotted: a group that failed a check (not ranked)."))
        if pd.to_numeric(scenario["probe"], errors="coerce").notna().any():
            out.append(Drawn(f"{stem}-peak-search", plots_scenarios.peak_search_figure(scenario, frame, where),
                             f"Server peak search on {where} (--slo-ms): every probe's p99 latency against its "
                             "offered rate, filled where LoadGen called the run valid; dashed: the bound; a thin "
                             "vertical line at each backend's peak (its highest valid rate)."))
    if len(rows[rows["phase"] == "inference"]):
        samples = frame["infer_samples"].max()
        out.append(Drawn(f"{stem}-inference", plots.inference_figure(infer, frame, where, samples),
                         f"Inference time per pass on {where}: a box of the passes after each repeat's first (dots: "
                         "every pass); each group's first pass, which holds tracing and compilation, is written "
                         f"under its box. {_verdict_caption(frame, 'median')} {_FAILED}"))
    return out


def figures(df: pd.DataFrame, baseline: Optional[str] = None) -> list[Drawn]:
    """Every figure for a results frame, per experiment and device, then the batch-size sweeps.

    ``baseline`` (``BACKEND`` or ``BACKEND:MODE``, as ``compare --baseline``) is the group the bar
    figures mark and compare with; by default compare's. Raises ResultsError when it ran nowhere."""
    df = with_experiment(df)
    reduced = summary.summarize(df)
    ranked, _ = compare.rank(reduced, baseline)
    ranked = scaling.annotate(ranked, reduced, df)
    timed = _timed_rows(df, reduced)
    out: list[Drawn] = []
    contexts = sorted(ranked.groupby(CONTEXT_KEYS, sort=False),
                      key=lambda item: tuple(summary.natural_key(part) for part in item[0]))
    for ctx, frame in contexts:
        out += _context_figures(df, timed, ctx, frame.sort_index())
    return out + sweep_figures(ranked)


def sweeps(groups: pd.DataFrame) -> list[tuple[tuple, str, pd.DataFrame]]:
    """Groups of one workload name, device and definition but for the batch sizes, where the
    definitions hold several batch sizes: (key, what the fixed definition is, groups)."""
    fixed = ["limit", "epochs", "seed", "data_source"]
    frame = groups[groups["batch_size"].notna()]
    rest = frame[fixed].map(text).agg(" ".join, axis=1) if len(frame) else pd.Series(dtype=str)
    device = frame.index.get_level_values("device")
    out = []
    for key, sub in frame.groupby([frame["workload"], device, rest], sort=True):
        if sub["batch_size"].nunique() > 1 or sub["inference_batch_size"].nunique() > 1:
            what = ", ".join(f"{LABEL_NAMES[c]} {v}" for c, v in zip(fixed, key[2].split(" ")) if v not in ("", "nan"))
            out.append((key, what, sub))
    return out


_SWEEP_CAPTION = ("{what} throughput against batch size for {title}: per backend, the median samples/s over ok "
                  "repeats at each batch size, with its interval; MFU on the right-hand axis when every point has "
                  "one peak, else beside each point. A red x: a batch size whose group failed. Each batch size is "
                  "its own experiment, so no verdict is drawn here.")


def sweep_figures(groups: pd.DataFrame) -> list[Drawn]:
    """Throughput against batch size (training and inference) for each workload and device whose
    results hold several batch sizes of one definition otherwise."""
    out = []
    found = sweeps(groups)
    per_workload: dict[tuple, int] = {}
    for key, _, _ in found:
        per_workload[key[:2]] = per_workload.get(key[:2], 0) + 1
    seen: dict[tuple, int] = {}
    for key, rest, sub in found:
        workload, device = key[0], key[1]
        seen[key[:2]] = seen.get(key[:2], 0) + 1
        several = per_workload[key[:2]] > 1
        title = f"{workload} on {device}" + (f" ({rest})" if several else "")
        stem = f"{_slug(workload)}-{_slug(device)}-batch" + (f"-{seen[key[:2]]}" if several else "")
        trains = sub[~sub["inference_only"].astype(bool)]
        if trains["samples_per_s"].notna().any() and trains["batch_size"].nunique() > 1:
            out.append(Drawn(f"{stem}-train", plots.batch_size_figure(trains, title, "train"),
                             _SWEEP_CAPTION.format(what="Training", title=title)))
        if sub["infer_sps"].notna().any() and sub["inference_batch_size"].nunique() > 1:
            out.append(Drawn(f"{stem}-inference", plots.batch_size_figure(sub, title, "inference"),
                             _SWEEP_CAPTION.format(what="Inference", title=title)))
    return out


def write_report(df: pd.DataFrame, out_dir: Path, summary_text: str = "", warnings: Iterable[str] = (),
                 baseline: Optional[str] = None, metric: str = "epoch-time") -> list[Path]:
    """Write the figures as PNGs and an index.html (:func:`benchbackend.analysis.page.render`).

    ``warnings`` are what ``compare`` printed; ``baseline`` and ``metric`` what it was asked
    (``compare --baseline``, ``--metric``): the figures and tables are ranked against that
    baseline. ``summary_text`` (compare's terminal table) is no longer drawn: the page builds real
    tables from the rows; it is accepted so that earlier callers keep working. Returns the paths
    written, PNGs first, index.html last. Raises ResultsError when ``out_dir`` is not writable or
    the baseline ran nowhere.
    """
    del summary_text
    out_dir = Path(out_dir)
    df = with_experiment(df)
    drawn = figures(df, baseline)
    reduced = summary.summarize(df)
    groups, _ = compare.rank(reduced, baseline, metric)
    gen = generation.rank(groups, reduced.repeats, df)
    written: list[Path] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for item in drawn:
            path = out_dir / f"{item.stem}.png"
            item.figure.savefig(path)
            written.append(path)
        index = out_dir / "index.html"
        sources = sorted(set(df["source"])) if "source" in df else []
        captions = [(path.name, item.caption) for path, item in zip(written, drawn)]
        index.write_text(page.render(df, groups, captions, sources, list(warnings), metric, gen), encoding="utf-8")
    except OSError as exc:
        raise ResultsError(f"{out_dir}: cannot write plots ({exc})") from None
    return written + [index]
