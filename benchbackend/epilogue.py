"""After a run: the per-cell summary, then compare's tables, the plots and the verdict for what was measured.

Printed by ``benchbackend run`` (``cli.run``) when its cells have ended, Ctrl-C included.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import click


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def summary(cells: list, out: Optional[Path], plots: bool) -> None:
    """The per-cell summary, then compare's verdict and the plots for what was measured."""
    from .run.progress import summary_line

    generated = _generated(out, cells)
    about = [] if generated and len(generated) == len(cells) else [
        "steady epoch = median of epochs after the first", "inference = median of passes after the first"]
    if generated:
        about.append("generation: TTFT median, TPOT p50/p99 over every step of the passes after the first, "
                     "decode tokens/s = batch / mean TPOT")
    if cells:  # a resumed run with nothing left ran none
        click.echo(f"\nsummary ({'; '.join(about)}):")
    for cell in cells:
        click.echo("  " + summary_line(cell, generated.get(cell.cell.order, ())))
    if out is not None:
        tables_and_plots(out, plots=plots, verdict=len({c.cell.choice for c in cells if c.status != "unavailable"}) > 1)
        click.echo(f"results: {out}")


def _generated(out: Optional[Path], cells: list) -> dict[int, list[Any]]:
    """Each generation cell's figures per prompt length (``progress.Generated``), by its place in the
    run, reduced from its rows in the results file as ``compare`` reduces a repeat (the runner keeps
    no generation timings); the rows of a cell's latest run where a resumed file holds several."""
    if out is None or not cells:
        return {}
    import pandas as pd

    from . import results
    from .analysis import experiments, generation
    from .run.progress import Generated

    try:
        df = experiments.for_comparison(results.read(out))
    except Exception:  # a convenience after the fact: compare's own warning says why
        return {}
    rows = df[df["phase"].isin(generation.PHASES)]
    orders = {c.cell.order for c in cells}
    found: dict[int, list[Any]] = {}
    for order, part in rows.groupby(pd.to_numeric(rows["cell_order"], errors="coerce"), sort=False):
        if order not in orders:
            continue
        part = part[part["run_id"] == part["run_id"].iloc[-1]]
        per = generation.per_repeat(part)
        found[int(order)] = [Generated(int(r.prompt_tokens), r.ttft_s, r.tpot_p50_s, r.tpot_p99_s, r.decode_tps)
                             for r in per.sort_values("prompt_tokens").itertuples()]
    return found


def tables_and_plots(csv_path: Path, plots: bool, verdict: bool) -> None:
    """After a run: the compare tables (when backends can be compared), the plots, then on stderr
    the warnings the report holds (``compare.report_warnings``), and last the verdict."""
    from . import results
    from .analysis import compare, experiments, quality, summary

    try:
        df = experiments.for_comparison(results.read(csv_path))
        outcome = compare.compare_frame(df)
    except Exception as exc:  # a convenience after the fact: never lose the run over it
        _err(f"warning: comparison/plots not written: {exc}")
        return
    try:  # each cell's gate in the file, judged now that every cell has ended
        quality.write(csv_path, df, summary.per_repeat(df))
    except Exception as exc:
        _err(f"warning: the quality gates were not written to {csv_path}: {exc}")
    made: list[Path] = []
    if plots:
        try:
            from .analysis import report

            made = report.write_report(df, csv_path.with_name(csv_path.stem + "-plots"),
                                       summary_text=outcome.text, warnings=outcome.warnings)
        except Exception as exc:
            _err(f"warning: plots not written: {exc}")
    if verdict:
        click.echo("\n" + outcome.body.rstrip("\n"))
    for warning in outcome.warnings:
        _err(f"warning: {warning}")
    if verdict:
        click.echo(outcome.verdict)
    if made:
        click.echo(f"report: {made[-1]}")
