"""After a run: the per-cell summary, then compare's tables, the plots and the verdict for what was measured.

Printed by ``benchbackend run`` (``cli.run``) when its cells have ended, Ctrl-C included.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def summary(cells: list, out: Optional[Path], plots: bool) -> None:
    """The per-cell summary, then compare's verdict and the plots for what was measured."""
    from .run.progress import summary_line

    if cells:  # a resumed run with nothing left ran none
        click.echo("\nsummary (steady epoch = median of epochs after the first; "
                   "inference = median of passes after the first):")
    for cell in cells:
        click.echo("  " + summary_line(cell))
    if out is not None:
        tables_and_plots(out, plots=plots, verdict=len({c.cell.choice for c in cells if c.status != "unavailable"}) > 1)
        click.echo(f"results: {out}")


def tables_and_plots(csv_path: Path, plots: bool, verdict: bool) -> None:
    """After a run: the compare tables (when backends can be compared), the plots, then on stderr
    the warnings the report holds (``compare.report_warnings``), and last the verdict."""
    from . import results
    from .analysis import compare, experiments

    try:
        df = experiments.for_comparison(results.read(csv_path))
        outcome = compare.compare_frame(df)
    except Exception as exc:  # a convenience after the fact: never lose the run over it
        _err(f"warning: comparison/plots not written: {exc}")
        return
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
