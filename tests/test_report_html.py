"""The report's index.html: real tables (summary, verdicts, warnings, environment), no <pre> block,
no empty environment rows, a caption under every figure, the baseline asked for."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchbackend import results
from benchbackend.analysis import compare, page, report

ENV = {"host": "bench-1", "os": "Linux-6.1", "python": "3.11.7", "cpu": "Xeon x16", "gpu": ""}
TIMES = {"torch": 1.0, "numpy": 2.0}


def _write(path: Path) -> pd.DataFrame:
    """Two backends over 3 repeats, and a torch@fp16 cell that was unavailable (a status row only,
    with the parent's host but no backend version or threads: the worker never started)."""
    w = results.CsvWriter(path)
    for backend, steady in TIMES.items():
        mode = "eager" if backend == "torch" else "reference"
        for rep in (1, 2, 3):
            base: dict[str, Any] = dict(ENV, run_id="r", workload="mnist", workload_hash="h", backend=backend,
                                        mode=mode, backend_version="2.1", device="cpu", repeat=rep, status="ok",
                                        threads=2, data_source="synthetic", precision="fp32")
            for epoch in (1, 2, 3):
                seconds = steady * (1 + 0.02 * rep)
                w.write(dict(base, phase="train_epoch", epoch=epoch, seconds=seconds, samples=100,
                             samples_per_s=100 / seconds, loss=1.0 / epoch, val_accuracy=0.9))
            for n in (1, 2, 3):
                w.write(dict(base, phase="inference", **{"pass": n}, samples=50,
                             seconds=steady / 10 * (1 + 0.02 * rep)))
    w.write(dict(ENV, run_id="r", workload="mnist", workload_hash="h", backend="torch", mode="eager", precision="fp16",
                 repeat=1, device="cpu", requested_device="cpu", data_source="synthetic", phase="run",
                 status="unavailable", message="fp16 needs a GPU"))
    return results.read(path)


@pytest.fixture
def written(tmp_path: Path) -> tuple[list[Path], str]:
    _write(tmp_path / "r.csv")
    out = compare.run_compare([str(tmp_path / "r.csv")])
    paths = report.write_report(out.frame, tmp_path / "out", out.table_text, out.warnings)
    return paths, paths[-1].read_text()


def _section(html: str, name: str) -> str:
    return html.split(f"<h2>{name}</h2>")[1].split("<h2>")[0]


def _rows(table_html: str) -> list[list[str]]:
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", table_html)]


def test_the_page_holds_tables_not_a_pre_block(written: tuple[list[Path], str]) -> None:
    _, html = written
    assert "<pre>" not in html
    summary = _section(html, "Summary")
    assert summary.count("<table>") == 2  # training and inference
    train = _rows(summary.split("<h4>Training</h4>")[1].split("</table>")[0])
    assert train[0][:4] == ["", "backend", "status", "repeats"] and train[0][-1] == "vs torch"
    by_name = {r[1]: r for r in train[1:]}
    assert set(by_name) == {"numpy", "torch", "torch@fp16"} and by_name["torch@fp16"][2] == "unavailable"
    assert by_name["torch"][-1] == "baseline" and by_name["numpy"][-1].startswith("slower: 0.5")
    assert "fastest correct (*): training torch" in summary


def test_the_verdicts_table_names_the_baseline_and_each_interval(written: tuple[list[Path], str]) -> None:
    _, html = written
    rows = _rows(_section(html, "Verdicts"))
    assert rows[0] == page.VERDICT_HEAD
    numpy = next(r for r in rows[1:] if r[1] == "numpy")
    assert numpy[3] == "torch" and numpy[4] == "slower" and numpy[5].endswith("x")
    assert re.fullmatch(r"\[0\.\d+, 0\.\d+\]", numpy[6]) and numpy[7] == "slower"
    torch = next(r for r in rows[1:] if r[1] == "torch")
    assert torch[4] == "baseline" and torch[5] == ""


def test_warnings_are_a_table(written: tuple[list[Path], str]) -> None:
    _, html = written
    rows = _rows(_section(html, "Warnings"))
    assert rows[0] == ["#", "warning"]
    assert any("fewer than 3 timed repeats" in r[1] or "unavailable" in r[1] for r in rows[1:]), rows


def test_the_environment_has_no_empty_rows_for_cells_that_never_ran(written: tuple[list[Path], str]) -> None:
    _, html = written
    env = _section(html, "Environment")
    rows = _rows(env)
    assert rows[0][:3] == ["backend", "device", "version"]
    names = [r[0] for r in rows[1:]]
    assert names == ["numpy:reference", "torch:eager"]
    for r in rows[1:]:
        assert r[2:5] == ["2.1", "bench-1", "Xeon x16"]
    assert "not run" in env and "torch:eager@fp16 (unavailable)" in env


def test_every_figure_has_a_caption(written: tuple[list[Path], str]) -> None:
    paths, html = written
    pngs = [p for p in paths if p.suffix == ".png"]
    figures = re.findall(r"<figure>(.*?)</figure>", html, re.S)
    assert len(figures) == len(pngs) == 4
    for png, fig in zip(pngs, figures):
        assert f'src="{png.name}"' in fig
        caption = re.search(r"<figcaption>(.*?)</figcaption>", fig, re.S)
        assert caption and len(caption.group(1)) > 80
    epoch = next(f for f in figures if "epoch-time" in f)
    assert "The baseline is torch" in epoch and "95% CI" in epoch


def test_the_baseline_asked_for_ranks_the_page(tmp_path: Path) -> None:
    _write(tmp_path / "r.csv")
    out = compare.run_compare([str(tmp_path / "r.csv")], baseline="numpy")
    html = report.write_report(out.frame, tmp_path / "out", warnings=out.warnings, baseline="numpy")[-1].read_text()
    numpy = next(r for r in _rows(_section(html, "Verdicts"))[1:] if r[1] == "numpy")
    torch = next(r for r in _rows(_section(html, "Verdicts"))[1:] if r[1] == "torch")
    assert numpy[4] == "baseline" and torch[4] == "faster" and torch[3] == "numpy"
    assert "The baseline is numpy" in html


def test_compare_plots_mark_the_baseline_asked_for(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from benchbackend.cli import main

    _write(tmp_path / "r.csv")
    out = CliRunner().invoke(main, ["compare", str(tmp_path / "r.csv"), "--baseline", "numpy",
                                    "--plots", str(tmp_path / "rep")])
    assert out.exit_code == 0, out.output
    assert "The baseline is numpy" in (tmp_path / "rep" / "index.html").read_text()
