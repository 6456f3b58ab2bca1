"""What the terminal says against what the report says (issue 24, items 1, 2, 6 and 7): `run` ends
with the report's warnings before its verdict, `compare` prints every one of them, a failed cell's
reason is its run row's message, one epoch means no steady epoch everywhere, and ``--baseline``
takes any ``BACKEND:MODE`` in the data."""
from __future__ import annotations

import csv
import html
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchbackend import results
from benchbackend.analysis import compare
from benchbackend.cli import main

REASON = "validation accuracy too low: the run row's reason"


def _run(monkeypatch, tmp_path: Path, *args: str, plots: bool = True):
    from support import inprocess

    inprocess.use(monkeypatch)
    out = tmp_path / "r.csv"
    got = CliRunner().invoke(main, ["run", "mnist", "-b", "numpy", "--data", "synthetic", "--limit", "200",
                                    "--quiet", "-o", str(out), *args] + ([] if plots else ["--no-plots"]))
    assert got.exit_code in (0, 1), got.output[-3000:]
    return got, out


def _report_warnings(index: Path) -> list[str]:
    """The report's warnings table (one row per warning: number, text)."""
    text = index.read_text()
    block = text.split("<h2>Warnings</h2>", 1)[1].split("</table>", 1)[0] if "<h2>Warnings</h2>" in text else ""
    return [html.unescape(w) for w in re.findall(r"<tr><td[^>]*>\d+</td><td[^>]*>(.*?)</td></tr>", block, re.S)]


def _stderr_warnings(stderr: str) -> list[str]:
    """The run's warnings about its results: not its look at the machine before it starts (which a
    parallel test run makes busy), a fact about the moment rather than the results."""
    return [line[len("warning: "):] for line in stderr.splitlines()
            if line.startswith("warning: ") and not line.startswith("warning: the machine is busy:")]


@pytest.fixture(scope="module")
def two_precisions(tmp_path_factory):
    """One run of two precisions, two epochs, two repeats, with its report, shared by the tests that
    read it (each such run took 12-22 s); ``compare.report_warnings`` is watched while it runs, so
    the test of who calls it needs no run of its own. (the run's result, its CSV, every list of
    warnings report_warnings returned during the run)."""
    seen: list[list[str]] = []
    real = compare.report_warnings

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "report_warnings", spy)
        got, out = _run(mp, tmp_path_factory.mktemp("two-precisions"), "--precision", "fp32", "--precision", "fp64",
                        "--epochs", "2", "--repeats", "2")
        yield got, out, list(seen)  # the run's calls, not the tests' own compares after it


def test_run_ends_with_the_reports_warnings_before_its_verdict_and_compare_prints_them(two_precisions, tmp_path):
    got, out, _ = two_precisions
    report = _report_warnings(out.with_name("r-plots") / "index.html")
    assert any(w.startswith("fewer than 3 timed repeats") for w in report)
    assert _stderr_warnings(got.stderr) == report
    # The warnings come before the verdict, which is the run's last word (but where its files are).
    lines = got.output.splitlines()
    last_warning = max(i for i, line in enumerate(lines) if line.startswith("warning: "))
    verdict = next(i for i, line in enumerate(lines) if "fastest correct" in line)
    assert last_warning < verdict
    assert all(line.startswith(("note:", "report:", "results:")) for line in lines[verdict + 1:])
    # compare prints every warning its report holds.
    cmp = CliRunner().invoke(main, ["compare", str(out), "--plots", str(tmp_path / "cmp")])
    assert _stderr_warnings(cmp.stderr) == _report_warnings(tmp_path / "cmp" / "index.html") == report


def test_one_function_gives_every_consumer_its_warnings(two_precisions):
    """compare's outcome, run's terminal and the report all take ``compare.report_warnings``."""
    got, out, seen = two_precisions
    assert len(seen) == 1 and _stderr_warnings(got.stderr) == seen[0]
    assert _report_warnings(out.with_name("r-plots") / "index.html") == seen[0]


def test_a_failed_cells_reason_is_its_run_rows_message_everywhere(monkeypatch, tmp_path):
    from benchbackend.backends.numpy.reference import NumpyBackend
    from benchbackend.run import runner

    monkeypatch.setattr(NumpyBackend, "details", lambda self: {"cpu_capability": "AVX512"})
    monkeypatch.setattr(runner.checks, "cell_status", lambda *a, **k: ("chance_accuracy", REASON))
    got, out = _run(monkeypatch, tmp_path, "--epochs", "2", "--repeats", "1")
    assert got.exit_code == 1
    df = results.read(out)
    assert df.loc[df["phase"] == "build", "notes"].tolist() == ["cpu_capability AVX512"]
    terminal = got.output
    assert f"chance_accuracy: {REASON}" in terminal and "AVX512" not in terminal
    report = _report_warnings(out.with_name("r-plots") / "index.html")
    assert f"mnist/cpu/numpy: chance_accuracy: {REASON}" in report and not any("AVX512" in w for w in report)
    outcome = compare.run_compare([str(out)])
    assert outcome.warnings == report


def _old_file(path: Path, rows: list[dict], version: int = 2) -> Path:
    """A file as benchbackend wrote it before schema 3 (build notes in `message`), mode unrecorded."""
    columns = [c for c in results.COLUMNS if c not in ("pass", "cell_order", "notes", *results.DEFINITION_COLUMNS)]
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(columns)
        for row in rows:
            full = {"schema_version": version, "workload": "mnist", "workload_hash": "abc", "device": "cpu",
                    "requested_device": "cpu", "data_source": "synthetic", "precision": "fp32", "status": "ok",
                    "mode": "", **row}
            out.writerow([full.get(c, "") for c in columns])
    return path


def _cell(backend: str, repeat: int, seconds: float, status: str = "ok", reason: str = "",
          note: str = "") -> list[dict]:
    base = {"backend": backend, "repeat": repeat, "run_id": f"{backend}-{repeat}", "status": status}
    rows = [dict(base, phase="build", epoch=0, seconds=0.1, message=note)]
    rows += [dict(base, phase="train_epoch", epoch=e, samples=100, seconds=seconds * (1 + 0.01 * e + 0.001 * repeat),
                  samples_per_s=100 / seconds, loss=1.0, val_accuracy=0.9) for e in (1, 2, 3)]
    rows += [dict(base, phase="inference", epoch=p, samples=50, seconds=seconds / 10 * (1 + 0.001 * repeat))
             for p in (1, 2, 3)]
    return rows + [dict(base, phase="run", epoch=0, message=reason)]


def test_an_old_files_build_note_is_never_a_failed_cells_reason(tmp_path):
    """Before schema 3 a build row's `message` held its notes; a failed cell whose run row says
    nothing must not read "chance_accuracy: cpu_capability AVX512"."""
    rows = [r for rep in (1, 2, 3) for r in _cell("tensorflow", rep, 2.0)]
    rows += [r for rep in (1, 2, 3) for r in _cell("torch", rep, 1.0, status="chance_accuracy",
                                                       note="cpu_capability AVX512")]
    rows += [r for rep in (1, 2, 3) for r in _cell("jax", rep, 1.0, status="timeout",
                                                       reason="worker timed out after 60s",
                                                       note="platform cpu")]
    path = _old_file(tmp_path / "old.csv", rows)
    outcome = compare.run_compare([str(path)])
    assert not any("AVX512" in w or "platform cpu" in w for w in outcome.warnings), outcome.warnings
    assert "mnist/cpu/jax: timeout: worker timed out after 60s" in outcome.warnings
    groups = json.loads(compare.run_compare([str(path)], fmt="json").text)["groups"]
    assert {g["backend"]: g["message"] for g in groups}["torch"] == ""


def test_one_epoch_run_and_compare_both_say_there_is_no_steady_epoch(monkeypatch, tmp_path):
    got, out = _run(monkeypatch, tmp_path, "--precision", "fp32", "--precision", "fp64", "--epochs", "1",
                    "--repeats", "1", plots=False)
    summary = got.stdout.split("summary", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(summary) == 2
    for line in summary:
        assert re.search(r"epoch \d", line) is None, line  # never the warm-up epoch as if steady
        assert "no steady epoch" in line
    said = [w for w in _stderr_warnings(got.stderr) if "no steady epoch" in w]
    assert said and "mnist/cpu/numpy" in said[0]
    cmp = CliRunner().invoke(main, ["compare", str(out)])
    assert said == [w for w in _stderr_warnings(cmp.stderr) if "no steady epoch" in w]
    steady = [line.split() for line in cmp.stdout.splitlines() if line.strip().startswith("numpy")]
    assert steady and all("n/a" in cells for cells in steady)


@pytest.mark.parametrize("baseline", ["torch:eager", "torch", "tensorflow:tf.function"])
def test_baseline_takes_any_mode_in_the_data_and_json_carries_the_mode(tmp_path, baseline):
    rows = [r for rep in (1, 2, 3) for r in _cell("tensorflow", rep, 2.0) + _cell("torch", rep, 1.0)]
    path = _old_file(tmp_path / "old.csv", rows)
    out = json.loads(compare.run_compare([str(path)], baseline=baseline, fmt="json").text)
    modes = {g["backend"]: g["mode"] for g in out["groups"]}
    assert modes == {"tensorflow": "tf.function", "torch": "eager"}
    base = baseline.partition(":")[0]
    assert {g["backend"]: g["train_verdict"] for g in out["groups"]}[base] == "baseline"


def test_baseline_with_a_mode_on_a_fresh_run(two_precisions):
    _, out, _ = two_precisions
    got = CliRunner().invoke(main, ["compare", str(out), "--baseline", "numpy:reference", "--format", "json"])
    assert got.exit_code == 0, got.output
    assert {g["mode"] for g in json.loads(got.stdout)["groups"]} == {"reference"}
